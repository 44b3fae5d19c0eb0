// End to end on a GPU: a real coordinator, a real aidn-worker-gpu and the
// trainer it starts, training a `device: gpu` job on Debian's Fashion-MNIST
// through the GPU engine. Skips where the worker finds no GPU (it registers
// none), as on the development and CI machines.

#include <signal.h>

#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"
#include "tests/integration/process.h"

namespace aidn::testing {
namespace {

constexpr std::chrono::milliseconds kLong{180'000};
constexpr char kDataset[] = "/usr/share/datasets/fashion-mnist";

class GpuJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(std::string(kDataset) + "/train-images-idx3-ubyte.gz")) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
    }
    dir_ = MakeTempDir("aidn-gpu-job-test");
    absl::StatusOr<CoordinatorHandle> c =
        StartCoordinator(dir_ + "/state", {"--worker-timeout=3s", "--heartbeat-interval=500ms"});
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = std::move(*c);
    coord_ = CoordinatorStub(coordinator_.address);
    absl::StatusOr<std::unique_ptr<Process>> w = StartWorker(
        coordinator_, "g1", dir_ + "/g1",
        {"--checkpoint-root=" + dir_ + "/ckpt", "--stop-grace=1s"}, AIDN_WORKER_GPU_BIN);
    ASSERT_TRUE(w.ok()) << w.status();
    worker_ = std::move(*w);
    v1::ListWorkersResponse workers;
    ASSERT_TRUE(WaitFor(
        [&] {
          workers.Clear();
          return coord_->ListWorkers(Context(admin()).get(), {}, &workers).ok() &&
                 workers.workers_size() == 1;
        },
        std::chrono::seconds(30)))
        << "the GPU worker did not register";
    if (workers.workers(0).info().gpus_size() == 0) {
      GTEST_SKIP() << "aidn-worker-gpu found no GPU on this machine";
    }
    gpu_name_ = workers.workers(0).info().gpus(0).name();
    gpus_ = workers.workers(0).info().gpus_size();
  }

  void TearDown() override {
    if (HasFailure()) {
      std::cerr << "---- worker stderr ----\n" << ReadFileOrEmpty(dir_ + "/g1/worker.err") << "\n";
      if (coordinator_.process != nullptr) {
        std::cerr << "---- coordinator stderr ----\n" << coordinator_.process->Stderr() << "\n";
      }
    }
    worker_.reset();
    coordinator_.process.reset();
    if (!HasFailure() && !dir_.empty()) {
      std::error_code ignored;
      std::filesystem::remove_all(dir_, ignored);
    }
  }

  const std::string& admin() const { return coordinator_.admin_token; }

  std::string dir_;
  std::string gpu_name_;
  int gpus_ = 0;
  CoordinatorHandle coordinator_;
  std::unique_ptr<v1::CoordinatorService::Stub> coord_;
  std::unique_ptr<Process> worker_;
};

// One rank on the GPU: the job succeeds, every step is reported, the loss
// falls and the test accuracy is a trained model's; the rank's log says it
// trained on the GPU the worker registered.
TEST_F(GpuJobTest, OneGpuRankTrainsTheMlpToARealTestAccuracy) {
  v1::JobSpec spec;
  spec.set_name("gpu-job-test");
  spec.set_device(v1::JobSpec::GPU);
  spec.set_world_size(1);
  spec.mutable_model()->set_name("mlp");
  spec.mutable_optimizer()->set_name("sgd");
  spec.mutable_optimizer()->set_lr(0.05);
  spec.mutable_optimizer()->set_momentum(0.9);
  spec.set_batch_size(64);
  spec.set_max_steps(300);
  spec.set_seed(1);
  spec.set_max_restarts(0);
  absl::StatusOr<std::string> id = SubmitJob(coord_.get(), admin(), spec);
  ASSERT_TRUE(id.ok()) << id.status();
  v1::Job job = WaitForJobEnd(coord_.get(), admin(), *id, kLong);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();

  v1::GetMetricsRequest request;
  request.set_job_id(*id);
  v1::GetMetricsResponse response;
  ASSERT_TRUE(coord_->GetMetrics(Context(admin()).get(), request, &response).ok());
  int train = 0;
  double first_loss = 0, last_loss = 0, accuracy = -1;
  for (const v1::StepMetrics& s : response.steps()) {
    if (s.kind() == v1::MetricRecord::EVAL) {
      accuracy = s.test_accuracy();
      continue;
    }
    ++train;
    EXPECT_EQ(s.step(), train);
    if (s.step() == 1) first_loss = s.loss();
    if (s.step() == 300) last_loss = s.loss();
  }
  EXPECT_EQ(train, 300);
  EXPECT_GT(first_loss, 1.5);
  EXPECT_LT(last_loss, 0.9);
  // As the CPU job of training_test: ~0.8 after 300 steps of 64.
  EXPECT_GT(accuracy, 0.72);
  const std::string log =
      ReadFileOrEmpty(absl::StrCat(dir_, "/g1/logs/", *id, "/gen-1/rank-0.log"));
  EXPECT_TRUE(absl::StrContains(log, "training on the GPU")) << log;
  EXPECT_TRUE(absl::StrContains(log, gpu_name_)) << log;
}

// A state.txt line's value ("key value"), or "" if it has none.
std::string StateValue(const std::string& state, const std::string& key) {
  for (absl::string_view line : absl::StrSplit(state, '\n')) {
    if (absl::StartsWith(line, key + " ")) return std::string(line.substr(key.size() + 1));
  }
  return "";
}

// fp16 with dynamic loss scaling, killed mid-run: every checkpoint keeps the
// loss scale, and the next generation continues from the one it resumes
// from instead of starting again at 2^16.
TEST_F(GpuJobTest, AnFp16JobResumesWithItsCheckpointedLossScale) {
  v1::JobSpec spec;
  spec.set_name("gpu-fp16-resume");
  spec.set_device(v1::JobSpec::GPU);
  spec.set_precision(v1::JobSpec::FP16);
  spec.set_world_size(1);
  spec.mutable_model()->set_name("mlp");
  spec.mutable_optimizer()->set_name("adamw");
  spec.mutable_optimizer()->set_lr(1e-3);
  spec.set_batch_size(64);
  spec.set_max_steps(20000);  // long enough on a GPU to be interrupted
  spec.set_seed(3);
  spec.set_max_restarts(2);
  spec.mutable_checkpoint()->set_dir("runs");
  spec.mutable_checkpoint()->set_every_steps(500);
  spec.mutable_checkpoint()->set_keep_last(1000);
  absl::StatusOr<std::string> id = SubmitJob(coord_.get(), admin(), spec);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitFor(
      [&] { return GetJob(coord_.get(), admin(), *id).last_checkpoint_step() >= 500; }, kLong))
      << "no checkpoint committed";
  std::vector<pid_t> trainer = ProcessesWith({dir_, "--job=" + *id + " --generation=1 "});
  ASSERT_EQ(trainer.size(), 1u);
  ASSERT_EQ(::kill(trainer[0], SIGKILL), 0);
  v1::Job job = WaitForJobEnd(coord_.get(), admin(), *id, kLong);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
  EXPECT_EQ(job.restarts(), 1);

  const std::string log =
      ReadFileOrEmpty(absl::StrCat(dir_, "/g1/logs/", *id, "/gen-2/rank-0.log"));
  constexpr std::string_view kResuming = "resuming from a checkpoint step=";
  const size_t at = log.find(kResuming);
  ASSERT_NE(at, std::string::npos) << log;
  const size_t from = at + kResuming.size();
  int64_t resumed = 0;
  ASSERT_TRUE(absl::SimpleAtoi(log.substr(from, log.find(' ', from) - from), &resumed)) << log;
  const std::string state =
      ReadFileOrEmpty(absl::StrFormat("%s/ckpt/runs/%s/step-%08d/state.txt", dir_, *id, resumed));
  const std::string scale = StateValue(state, "loss_scale");
  const std::string tracker = StateValue(state, "loss_scale_growth_tracker");
  double value = 0;
  ASSERT_TRUE(absl::SimpleAtod(scale, &value)) << state;
  EXPECT_GT(value, 0);
  ASSERT_FALSE(tracker.empty()) << state;
  std::ostringstream logged;  // as the trainer's Kv streams a double
  logged << value;
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("fp16 loss scale restored loss_scale=",
                                                  logged.str(), " growth_tracker=", tracker)))
      << log;
  // The last checkpoint keeps one too.
  EXPECT_FALSE(StateValue(ReadFileOrEmpty(absl::StrFormat("%s/ckpt/runs/%s/step-%08d/state.txt",
                                                          dir_, *id, 20000)),
                          "loss_scale")
                   .empty());
}

// While a job holds every GPU, a second GPU job waits: it is not placed on
// the worker's free CPU slot.
TEST_F(GpuJobTest, ASecondGpuJobWaitsForAGpu) {
  v1::JobSpec spec;
  spec.set_name("gpu-hog");
  spec.set_device(v1::JobSpec::GPU);
  spec.set_world_size(gpus_);
  spec.mutable_model()->set_name("mlp");
  spec.mutable_optimizer()->set_name("sgd");
  spec.mutable_optimizer()->set_lr(0.05);
  spec.set_batch_size(64);
  spec.set_max_steps(100000);
  spec.set_max_restarts(0);
  absl::StatusOr<std::string> first = SubmitJob(coord_.get(), admin(), spec);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(
      WaitFor([&] { return GetJob(coord_.get(), admin(), *first).state() == v1::Job::RUNNING; },
              std::chrono::seconds(60)));
  spec.set_name("gpu-waiter");
  spec.set_world_size(1);
  absl::StatusOr<std::string> second = SubmitJob(coord_.get(), admin(), spec);
  ASSERT_TRUE(second.ok()) << second.status();
  std::this_thread::sleep_for(std::chrono::seconds(3));
  EXPECT_EQ(GetJob(coord_.get(), admin(), *second).state(), v1::Job::PENDING);
}

}  // namespace
}  // namespace aidn::testing
