// End to end on a GPU: a real coordinator, a real aidn-worker-gpu and the
// trainer it starts, training a `device: gpu` job on Debian's Fashion-MNIST
// through the GPU engine. Skips where the worker finds no GPU (it registers
// none), as on the development and CI machines.

#include <signal.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"

namespace aidn::testing {
namespace {

constexpr std::chrono::milliseconds kLong{180'000};

// The step a trainer's log says it resumed from ("resuming from a checkpoint
// job=... step=N ..."), or 0 if it did not resume.
int64_t ResumedStep(const std::string& log) {
  const size_t line = log.find("resuming from a checkpoint");
  if (line == std::string::npos) return 0;
  const size_t at = log.find(" step=", line);
  if (at == std::string::npos) return 0;
  const size_t from = at + 6;
  int64_t step = 0;
  if (!absl::SimpleAtoi(log.substr(from, log.find(' ', from) - from), &step)) return 0;
  return step;
}

class GpuJobTest : public ClusterFixture {
 protected:
  GpuJobTest() : ClusterFixture("aidn-gpu-job-test") {}

  void SetUp() override {
    if (!FashionMnistInstalled()) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
    }
    ClusterFixture::SetUp();
    ASSERT_TRUE(
        cluster().StartCoordinator({"--worker-timeout=3s", "--heartbeat-interval=500ms"}).ok());
    ASSERT_TRUE(cluster().StartWorkers(
        {"g1"}, {.args = {"--checkpoint-root=" + cluster().Path("ckpt"), "--stop-grace=1s"},
                 .binary = AIDN_WORKER_GPU_BIN}));
    const std::map<std::string, v1::Worker> workers = cluster().Workers();
    ASSERT_EQ(workers.size(), 1u);
    const v1::WorkerInfo& info = workers.begin()->second.info();
    if (info.gpus_size() == 0) GTEST_SKIP() << "aidn-worker-gpu found no GPU on this machine";
    gpu_name_ = info.gpus(0).name();
    gpus_ = info.gpus_size();
  }

  std::string Submit(const v1::JobSpec& spec) {
    absl::StatusOr<std::string> id = cluster().Submit(spec);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }
  std::string TrainerLog(const std::string& id, int generation, int rank = 0) {
    return ReadFileOrEmpty(absl::StrCat(cluster().WorkDir("g1"), "/logs/", id, "/gen-", generation,
                                        "/rank-", rank, ".log"));
  }
  std::string StateFile(const std::string& id, int64_t step) {
    return ReadFileOrEmpty(
        absl::StrFormat("%s/runs/%s/step-%08d/state.txt", cluster().Path("ckpt"), id, step));
  }

  // The GPT example's model on Debian's fortunes, one GPU rank in bf16
  // (AdamW, 32 windows a step); nullopt where the fortunes are missing.
  std::optional<v1::JobSpec> FortunesGpt(const std::string& name) const {
    const char* kFortunes = "/usr/share/games/fortunes";
    if (ReadFileOrEmpty(std::string(kFortunes) + "/fortunes").empty()) return std::nullopt;
    v1::JobSpec spec;
    spec.set_name(name);
    spec.set_device(v1::JobSpec::GPU);
    spec.set_precision(v1::JobSpec::BF16);
    spec.set_world_size(1);
    spec.mutable_model()->set_name("gpt");
    spec.mutable_model()->set_config("gpt-mini");
    spec.mutable_dataset()->set_kind("text");
    spec.mutable_dataset()->add_files(kFortunes);
    spec.mutable_dataset()->set_val_fraction(0.1);
    spec.mutable_dataset()->set_eval_windows(64);
    spec.mutable_optimizer()->set_name("adamw");
    spec.mutable_optimizer()->set_lr(3e-3);
    spec.mutable_optimizer()->set_weight_decay(0.1);
    spec.mutable_optimizer()->set_beta2(0.99);
    spec.mutable_optimizer()->set_grad_clip_norm(1.0);
    spec.set_batch_size(32);
    spec.set_seed(1);
    spec.set_max_restarts(0);
    return spec;
  }

  // Kills job `id`'s (one-rank) first generation once it has committed a
  // checkpoint of `step` or later; the job then goes on in a second.
  void KillFirstGenerationAfterCheckpoint(const std::string& id, int64_t step) {
    ASSERT_TRUE(cluster().WaitForJob(
        id, [step](const v1::Job& j) { return j.last_checkpoint_step() >= step; },
        "committing a checkpoint", kLong));
    std::vector<pid_t> trainer =
        ProcessesWith({cluster().dir(), "--job=" + id + " --generation=1 "});
    ASSERT_EQ(trainer.size(), 1u);
    ASSERT_EQ(::kill(trainer[0], SIGKILL), 0);
  }

  // One GPU rank training `model` on Fashion-MNIST (below).
  void ExpectAClassifierTrains(const std::string& model, uint64_t seed, int64_t eval_max_samples,
                               double stochastic_depth = 0);

  std::string gpu_name_;
  int gpus_ = 0;
};

// One GPU rank training `model` on Fashion-MNIST for 300 SGD steps of 64:
// the job succeeds, every step is reported, the loss falls and the test
// accuracy is a trained model's (as the CPU job of training_test: ~0.8);
// the rank's log says it trained on the GPU the worker registered.
void GpuJobTest::ExpectAClassifierTrains(const std::string& model, uint64_t seed,
                                         int64_t eval_max_samples, double stochastic_depth) {
  v1::JobSpec spec;
  spec.set_name("gpu-" + model);
  spec.set_device(v1::JobSpec::GPU);
  spec.set_world_size(1);
  spec.mutable_model()->set_name(model);
  spec.mutable_model()->set_stochastic_depth(stochastic_depth);
  spec.mutable_optimizer()->set_name("sgd");
  spec.mutable_optimizer()->set_lr(0.05);
  spec.mutable_optimizer()->set_momentum(0.9);
  spec.set_batch_size(64);
  spec.set_max_steps(300);
  spec.set_eval_max_samples(eval_max_samples);
  spec.set_seed(seed);
  spec.set_max_restarts(0);
  const std::string id = Submit(spec);
  ASSERT_FALSE(id.empty());
  v1::Job job = cluster().WaitForEnd(id, kLong);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();

  int train = 0;
  double first_loss = 0, last_loss = 0, accuracy = -1;
  int64_t device_peak = 0;
  for (const v1::StepMetrics& s : cluster().Metrics(id)) {
    if (s.kind() == v1::MetricRecord::EVAL) {
      accuracy = s.test_accuracy();
      continue;
    }
    ++train;
    EXPECT_EQ(s.step(), train);
    device_peak = std::max(device_peak, s.device_peak_memory_bytes());
    if (s.step() == 1) first_loss = s.loss();
    if (s.step() == 300) last_loss = s.loss();
  }
  EXPECT_EQ(train, 300);
  EXPECT_GT(first_loss, 1.5);
  EXPECT_LT(last_loss, 0.9);
  EXPECT_GT(accuracy, 0.72);
  EXPECT_GT(device_peak, 0) << "the GPU's peak memory in the step records";
  const std::string log = TrainerLog(id, 1);
  EXPECT_TRUE(absl::StrContains(log, "training on the GPU")) << log;
  EXPECT_TRUE(absl::StrContains(log, gpu_name_)) << log;
}

TEST_F(GpuJobTest, OneGpuRankTrainsTheMlpToARealTestAccuracy) {
  ExpectAClassifierTrains("mlp", 1, /*eval_max_samples=*/0);
}

// A ResNet-18: BatchNorm through cuDNN, its running statistics copied down
// for the evaluation and the checkpoint; stochastic depth skips blocks,
// whose parameters the step then leaves alone.
TEST_F(GpuJobTest, AResNetWithStochasticDepthTrainsOnOneGpu) {
  ExpectAClassifierTrains("resnet18", 2, /*eval_max_samples=*/2000, /*stochastic_depth=*/0.1);
}

// The GPT example's model on Debian's fortunes, one GPU rank in bf16 with
// the CPU example's 32 windows a step: the job succeeds and the validation
// loss is a trained model's (the 2-rank CPU example reaches 2.00 nats per
// byte after 600 steps; a uniform guess is ln 256 = 5.55).
TEST_F(GpuJobTest, AGptLearnsFortunesOnOneGpuInBf16) {
  std::optional<v1::JobSpec> fortunes = FortunesGpt("gpu-gpt");
  if (!fortunes.has_value()) {
    GTEST_SKIP() << "Debian's fortunes are not installed (scripts/setup.sh)";
  }
  v1::JobSpec& spec = *fortunes;
  spec.set_max_steps(600);
  spec.set_eval_every_steps(300);
  const std::string id = Submit(spec);
  ASSERT_FALSE(id.empty());
  v1::Job job = cluster().WaitForEnd(id, kLong);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
  int train = 0;
  double first_loss = 0, val_loss = -1;
  int64_t device_peak = 0;
  for (const v1::StepMetrics& s : cluster().Metrics(id)) {
    if (s.kind() == v1::MetricRecord::EVAL) {
      val_loss = s.test_loss();
      continue;
    }
    device_peak = std::max(device_peak, s.device_peak_memory_bytes());
    ++train;
    if (s.step() == 1) first_loss = s.loss();
  }
  EXPECT_EQ(train, 600);
  EXPECT_GT(first_loss, 5.0);
  EXPECT_GT(device_peak, int64_t{1} << 20) << "the GPU's peak memory in the step records";
  EXPECT_GT(val_loss, 0.0);
  EXPECT_LT(val_loss, 2.5);
  const std::string log = TrainerLog(id, 1);
  EXPECT_TRUE(absl::StrContains(log, "training on the GPU")) << log;
  EXPECT_TRUE(absl::StrContains(log, "bf16")) << log;
}

// FSDP (full_shard) on one GPU, as a CPU job shards over one rank: the
// decoder's blocks gathered and reduce-scattered over NCCL unit by unit,
// evaluation on the gathered weights, checkpoints written as shards; killed
// after its first checkpoint, the next generation resumes from the shards
// (weights, the shards' AdamW state) and the job learns as the unsharded
// one does.
TEST_F(GpuJobTest, AGptTrainsUnderFsdpOnOneGpuAndResumesFromItsShards) {
  std::optional<v1::JobSpec> fortunes = FortunesGpt("gpu-gpt-fsdp");
  if (!fortunes.has_value()) {
    GTEST_SKIP() << "Debian's fortunes are not installed (scripts/setup.sh)";
  }
  v1::JobSpec& spec = *fortunes;
  spec.set_strategy(v1::JobSpec::FSDP);
  spec.mutable_fsdp()->set_sharding(v1::FsdpSpec::FULL_SHARD);
  spec.set_max_steps(2000);  // long enough on a GPU to be interrupted
  spec.set_eval_every_steps(1000);
  spec.set_max_restarts(1);
  spec.mutable_checkpoint()->set_dir("runs");
  spec.mutable_checkpoint()->set_every_steps(200);
  const std::string id = Submit(spec);
  ASSERT_FALSE(id.empty());
  KillFirstGenerationAfterCheckpoint(id, 200);
  if (HasFatalFailure()) return;
  v1::Job job = cluster().WaitForEnd(id, kLong);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
  EXPECT_EQ(job.restarts(), 1);
  const std::string resumed = TrainerLog(id, 2);
  EXPECT_GT(ResumedStep(resumed), 0) << resumed;
  EXPECT_TRUE(absl::StrContains(resumed, "FSDP full_shard over")) << resumed;
  double val_loss = -1;
  int64_t comm_bytes = 0;
  for (const v1::StepMetrics& s : cluster().Metrics(id)) {
    if (s.kind() == v1::MetricRecord::EVAL) {
      val_loss = s.test_loss();
    } else {
      comm_bytes = s.gradient_comm_bytes();
    }
  }
  EXPECT_GT(val_loss, 0.0);
  EXPECT_LT(val_loss, 3.0);
  EXPECT_GT(comm_bytes, 0) << "the units' gathers and reduce-scatters";
  EXPECT_EQ(job.last_checkpoint_step(), 2000);
  EXPECT_FALSE(StateFile(id, 2000).empty());
  const std::string log = TrainerLog(id, 1);
  EXPECT_TRUE(absl::StrContains(log, "FSDP full_shard over")) << log;
  EXPECT_TRUE(absl::StrContains(log, "model state sharded")) << log;
}

// A GPT cut into two pipeline stages, one GPU each (1F1B over NCCL):
// the job trains, evaluates through the CPU copies and checkpoints each
// stage's pieces. Needs two GPUs.
TEST_F(GpuJobTest, AGptPipelineOfTwoStagesTrainsOnTwoGpus) {
  if (gpus_ < 2) {
    GTEST_SKIP() << "a pipeline of two stages needs two GPUs; this worker has " << gpus_;
  }
  std::optional<v1::JobSpec> fortunes = FortunesGpt("gpu-gpt-pipeline");
  if (!fortunes.has_value()) {
    GTEST_SKIP() << "Debian's fortunes are not installed (scripts/setup.sh)";
  }
  v1::JobSpec& spec = *fortunes;
  spec.set_world_size(2);
  spec.mutable_parallel()->set_pipeline(2);
  spec.set_max_steps(400);
  spec.set_eval_every_steps(200);
  spec.mutable_checkpoint()->set_dir("runs");
  spec.mutable_checkpoint()->set_every_steps(200);
  const std::string id = Submit(spec);
  ASSERT_FALSE(id.empty());
  v1::Job job = cluster().WaitForEnd(id, kLong);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
  double val_loss = -1;
  for (const v1::StepMetrics& s : cluster().Metrics(id)) {
    if (s.kind() == v1::MetricRecord::EVAL) val_loss = s.test_loss();
  }
  EXPECT_GT(val_loss, 0.0);
  EXPECT_LT(val_loss, 3.0);
  EXPECT_EQ(job.last_checkpoint_step(), 400);
  for (int rank = 0; rank < 2; ++rank) {
    const std::string log = TrainerLog(id, 1, rank);
    EXPECT_TRUE(absl::StrContains(log, "pipeline stage")) << log;
  }
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
  const std::string id = Submit(spec);
  ASSERT_FALSE(id.empty());
  KillFirstGenerationAfterCheckpoint(id, 500);
  if (HasFatalFailure()) return;
  v1::Job job = cluster().WaitForEnd(id, kLong);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
  EXPECT_EQ(job.restarts(), 1);

  const std::string log = TrainerLog(id, 2);
  const int64_t resumed = ResumedStep(log);
  ASSERT_GT(resumed, 0) << log;
  const std::string state = StateFile(id, resumed);
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
  EXPECT_FALSE(StateValue(StateFile(id, 20000), "loss_scale").empty());
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
  const std::string first = Submit(spec);
  ASSERT_TRUE(cluster().WaitForState(first, v1::Job::RUNNING, std::chrono::seconds(60)));
  spec.set_name("gpu-waiter");
  spec.set_world_size(1);
  const std::string second = Submit(spec);
  ASSERT_FALSE(second.empty());
  // The scheduler looked at it and found no room: it says so with an event,
  // and the job stays PENDING (not placed on the free CPU slot).
  ASSERT_TRUE(cluster().WaitForEvent("job.waiting", second, std::chrono::seconds(60)));
  EXPECT_EQ(cluster().GetJob(second).state(), v1::Job::PENDING);
  EXPECT_EQ(cluster().GetJob(second).generation(), 0);
}

}  // namespace
}  // namespace aidn::testing
