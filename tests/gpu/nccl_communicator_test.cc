// NcclCommunicator on a real device: the communicator conformance suite
// (tests/unit/engine/communicator_conformance.h) at world size 1, one rank
// per GPU, with device buffers; world size 1 collectives through the KV
// rendezvous, an init whose peer never comes aborted at its deadline, and
// an aborted communicator refusing calls. Skips without a device.
#include <stdlib.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/engine/communicator_conformance.h"
#include "worker/engine/comm/kv_store.h"
#include "worker/engine/comm/nccl_communicator.h"
#include "worker/engine/device.h"

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;

#define SKIP_WITHOUT_GPU()                                                                \
  do {                                                                                    \
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);                                                \
    DeviceInventory inventory = DiscoverDevices();                                        \
    if (inventory.gpus.empty()) GTEST_SKIP() << "no CUDA device: " << inventory.gpu_note; \
  } while (false)

std::vector<float> Download(const float* device, size_t count) {
  std::vector<float> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

float* Upload(const std::vector<float>& host) {
  float* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, host.size() * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  return device;
}

std::string NoGpu() {
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  DeviceInventory inventory = DiscoverDevices();
  return inventory.gpus.empty() ? "no CUDA device: " + inventory.gpu_note : std::string();
}

CommBackend Nccl() {
  CommBackend backend;
  backend.name = "nccl";
  backend.unavailable = NoGpu;
  // One rank per device, and this process drives one.
  backend.max_world = 1;
  backend.create = [](int rank, int world_size, std::chrono::milliseconds timeout,
                      KeyValueStore& store) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    NcclOptions options;
    options.rank = rank;
    options.world_size = world_size;
    options.timeout = timeout;
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
        NcclCommunicator::Create(options, &store);
    if (!comm.ok()) return comm.status();
    return std::unique_ptr<Communicator>(*std::move(comm));
  };
  backend.allocate = [](size_t count) -> float* {
    float* device = nullptr;
    if (count > 0) {
      EXPECT_EQ(cudaMalloc(&device, count * sizeof(float)), cudaSuccess);
    }
    return device;
  };
  backend.release = [](float* device) { cudaFree(device); };
  backend.upload = [](float* device, const float* host, size_t count) {
    if (count == 0) return;
    EXPECT_EQ(cudaMemcpy(device, host, count * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  };
  backend.download = [](float* host, const float* device, size_t count) {
    if (count == 0) return;
    EXPECT_EQ(cudaMemcpy(host, device, count * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  };
  return backend;
}

INSTANTIATE_TEST_SUITE_P(Nccl, CommunicatorConformanceTest,
                         ::testing::Combine(::testing::Values(Nccl()), ::testing::Values(1),
                                            ::testing::ValuesIn(ConformanceCounts())),
                         ConformanceName);
INSTANTIATE_TEST_SUITE_P(Nccl, CommunicatorBackendTest, ::testing::Values(Nccl()), BackendName);

TEST(NcclCommunicator, WorldSizeOneCollectivesThroughTheKvRendezvous) {
  SKIP_WITHOUT_GPU();
  InMemoryKeyValueStore store;
  NcclOptions options;
  options.timeout = std::chrono::seconds(60);
  auto comm = NcclCommunicator::Create(options, &store);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_TRUE(store.Get("nccl/id", std::chrono::milliseconds(0)).ok()) << "rank 0 published";

  std::vector<float> values(1001);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) + 1.0f;
  float* data = Upload(values);
  ASSERT_TRUE((*comm)->AllReduce(data, values.size(), ReduceOp::kSum).ok());
  EXPECT_EQ(Download(data, values.size()), values);
  ASSERT_TRUE((*comm)->AllReduce(data, values.size(), ReduceOp::kAvg).ok());
  EXPECT_EQ(Download(data, values.size()), values);
  ASSERT_TRUE((*comm)->Broadcast(data, values.size(), 0).ok());
  EXPECT_EQ(Download(data, values.size()), values);
  float* out = Upload(std::vector<float>(values.size(), -1.0f));
  ASSERT_TRUE((*comm)->AllGather(data, values.size(), out).ok());
  EXPECT_EQ(Download(out, values.size()), values);
  ASSERT_TRUE((*comm)->ReduceScatter(data, values.size(), out, ReduceOp::kSum).ok());
  EXPECT_EQ(Download(out, values.size()), values);
  ASSERT_TRUE((*comm)->Barrier().ok());
  ASSERT_TRUE((*comm)->AllReduce(data, 0, ReduceOp::kSum).ok());
  EXPECT_EQ((*comm)->sequence(), 7);
  EXPECT_EQ((*comm)->Broadcast(data, 1, 1).code(), absl::StatusCode::kInvalidArgument);

  // Queued without waiting, then waited for.
  ASSERT_TRUE((*comm)->EnqueueAllReduce(data, values.size(), ReduceOp::kSum).ok());
  ASSERT_TRUE((*comm)->Wait("queued allreduce").ok());
  EXPECT_EQ(Download(data, values.size()), values);
  // Several buffers' broadcasts in one group (BatchNorm statistics), an
  // empty one among them; a root outside the world refused.
  ASSERT_TRUE((*comm)
                  ->EnqueueBroadcasts({{data, 500}, {out, 0}, {data + 500, values.size() - 500}}, 0)
                  .ok());
  ASSERT_TRUE((*comm)->Wait("queued broadcasts").ok());
  EXPECT_EQ(Download(data, values.size()), values);
  EXPECT_EQ((*comm)->EnqueueBroadcasts({{data, 1}}, 1).code(), absl::StatusCode::kInvalidArgument);
  // A split (a process grid's group): of one rank, a communicator of its
  // own that reduces as the parent does; a negative color refused.
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> group = (*comm)->Split(0, 0);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ((*group)->rank(), 0);
  EXPECT_EQ((*group)->world_size(), 1);
  ASSERT_TRUE((*group)->AllReduce(data, values.size(), ReduceOp::kSum).ok());
  EXPECT_EQ(Download(data, values.size()), values);
  EXPECT_EQ((*comm)->Split(-1, 0).status().code(), absl::StatusCode::kInvalidArgument);
  group->reset();
  // Point to point with itself (a pipeline's stages on one GPU): sends and
  // receives in one group arrive as sent; one direction alone too; a peer
  // outside the world and a null buffer refused.
  float* back = Upload(std::vector<float>(values.size(), -1.0f));
  ASSERT_TRUE((*comm)->Exchange(0, data, values.size(), back, values.size()).ok());
  EXPECT_EQ(Download(back, values.size()), values);
  ASSERT_TRUE((*comm)->EnqueueExchange(0, data + 1, 10, back + 20, 10).ok());
  ASSERT_TRUE((*comm)->Wait("queued send/recv").ok());
  EXPECT_EQ(Download(back + 20, 10), std::vector<float>(values.begin() + 1, values.begin() + 11));
  EXPECT_EQ((*comm)->Exchange(1, data, 1, back, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*comm)->Exchange(0, nullptr, 1, back, 1).code(), absl::StatusCode::kInvalidArgument);
  cudaFree(back);
  cudaFree(out);
  cudaFree(data);
}

TEST(NcclCommunicator, AnInitWhosePeerNeverComesIsAbortedAtItsDeadline) {
  SKIP_WITHOUT_GPU();
  InMemoryKeyValueStore store;
  NcclOptions options;
  options.world_size = 2;  // rank 1 never starts
  options.timeout = std::chrono::seconds(3);
  const auto start = std::chrono::steady_clock::now();
  auto comm = NcclCommunicator::Create(options, &store);
  const auto took = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_THAT(comm.status().message(), HasSubstr("rank 0 of 2"));
  EXPECT_THAT(comm.status().message(), HasSubstr("aborted"));
  EXPECT_LT(took, std::chrono::seconds(20)) << "the abort itself must not hang";
}

TEST(NcclCommunicator, AnAbortedCommunicatorRefusesEveryCall) {
  SKIP_WITHOUT_GPU();
  InMemoryKeyValueStore store;
  auto comm = NcclCommunicator::Create(NcclOptions(), &store);
  ASSERT_TRUE(comm.ok()) << comm.status();
  (*comm)->Abort("injected by the test");
  float* data = Upload({1.0f, 2.0f});
  absl::Status s = (*comm)->AllReduce(data, 2, ReduceOp::kSum);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("injected by the test"));
  EXPECT_EQ((*comm)->Barrier().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*comm)->sequence(), 0);
  cudaFree(data);
}

}  // namespace
}  // namespace aidn::engine
