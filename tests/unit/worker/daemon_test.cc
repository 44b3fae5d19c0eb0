// Pure helpers of the worker daemon.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/daemon.h"

namespace aidn::worker {
namespace {

using ::testing::HasSubstr;

std::vector<engine::GpuDescription> Gpus(std::vector<int> indices) {
  std::vector<engine::GpuDescription> gpus;
  for (int index : indices) {
    engine::GpuDescription g;
    g.index = index;
    g.name = "test gpu";
    gpus.push_back(g);
  }
  return gpus;
}

TEST(TrainerVisibleDevice, IsTheGpusIndexWhenTheWorkerSeesEveryGpu) {
  EXPECT_EQ(*TrainerVisibleDevice(0, Gpus({0, 1, 2}), ""), "0");
  EXPECT_EQ(*TrainerVisibleDevice(2, Gpus({0, 1, 2}), ""), "2");
}

TEST(TrainerVisibleDevice, MapsThroughTheWorkersOwnList) {
  // The worker runs with CUDA_VISIBLE_DEVICES=3,1: its GPU 0 is physical 3.
  EXPECT_EQ(*TrainerVisibleDevice(0, Gpus({0, 1}), "3,1"), "3");
  EXPECT_EQ(*TrainerVisibleDevice(1, Gpus({0, 1}), "3, 1"), "1");
  EXPECT_EQ(*TrainerVisibleDevice(1, Gpus({0, 1}), "GPU-aaaa,GPU-bbbb"), "GPU-bbbb");
}

TEST(TrainerVisibleDevice, RefusesASlotTheWorkerDoesNotHave) {
  absl::StatusOr<std::string> none = TrainerVisibleDevice(0, {}, "");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("has 0 GPUs"));
  EXPECT_FALSE(TrainerVisibleDevice(-1, Gpus({0}), "").ok());
  absl::StatusOr<std::string> short_list = TrainerVisibleDevice(1, Gpus({0, 1}), "5");
  ASSERT_FALSE(short_list.ok());
  EXPECT_THAT(short_list.status().message(), HasSubstr("CUDA_VISIBLE_DEVICES \"5\""));
}

}  // namespace
}  // namespace aidn::worker
