// End to end: a ResNet-18 job on two real workers (DDP over Gloo, rank 0's
// BatchNorm statistics broadcast before each forward) writes its running
// statistics into its checkpoints (DDP's, FSDP's sharded ones and a
// pipeline's stages'),
// evaluates on the first test samples with them, and a job resumed from
// its middle checkpoint ends with the same weights and statistics, bit
// for bit.

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/support/files.h"

namespace aidn::testing {
namespace {

constexpr std::chrono::milliseconds kLong{300'000};
constexpr int64_t kSteps = 6;

class ResNetJobTest : public ClusterFixture {
 protected:
  ResNetJobTest() : ClusterFixture("aidn-resnet-job-test") {}

  void SetUp() override {
    if (!FashionMnistInstalled()) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
    }
    ClusterFixture::SetUp();
    ASSERT_TRUE(cluster().StartCoordinator({}).ok());
    ASSERT_TRUE(cluster().StartWorkers({"w1", "w2"}));
  }

  static v1::JobSpec Spec() {
    v1::JobSpec spec;
    spec.set_name("resnet-job-test");
    spec.set_world_size(2);
    spec.mutable_model()->set_name("resnet18");
    spec.mutable_optimizer()->set_name("sgd");
    spec.mutable_optimizer()->set_lr(0.05);
    spec.mutable_optimizer()->set_momentum(0.9);
    spec.set_batch_size(4);
    spec.set_max_steps(kSteps);
    spec.set_seed(3);
    spec.set_max_restarts(0);
    spec.set_eval_max_samples(32);
    spec.mutable_checkpoint()->set_dir("runs");
    spec.mutable_checkpoint()->set_every_steps(3);
    return spec;
  }

  std::string Run(const v1::JobSpec& spec) {
    absl::StatusOr<std::string> id = cluster().Submit(spec);
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return "";
    const v1::Job job = cluster().WaitForEnd(*id, kLong);
    EXPECT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
    return *id;
  }

  // The exported weights of `id` at `step`: the whole file.
  std::string Export(const std::string& id, int64_t step) {
    const std::string out = cluster().Path(absl::StrCat(id, "-", step, ".safetensors"));
    CommandResult exported =
        cluster().Aidnctl({"export", id, "--step", absl::StrCat(step), "-o", out, "--force"});
    EXPECT_EQ(exported.exit_code, 0) << exported.err;
    return out;
  }

  // `reference` (a succeeded run of `spec`) exported at its last step holds
  // tensors of every one of `names`; `spec` resumed from its middle
  // checkpoint ends with the same bytes, weights and running statistics.
  void ExpectExportedAndResumedBitwise(const v1::JobSpec& spec, const std::string& reference,
                                       const std::vector<std::string>& names) {
    const std::string file = Export(reference, kSteps);
    const std::string all = ReadFileOrEmpty(file);
    for (const std::string& name : names) {
      EXPECT_TRUE(absl::StrContains(all, absl::StrCat("\"", name, "\""))) << name;
    }
    v1::JobSpec resumed = spec;
    resumed.mutable_checkpoint()->mutable_resume_from()->set_job(reference);
    resumed.mutable_checkpoint()->mutable_resume_from()->set_step(kSteps / 2);
    const std::string id = Run(resumed);
    ASSERT_FALSE(id.empty());
    const std::string a = TensorBytes(file);
    ASSERT_FALSE(a.empty());
    EXPECT_TRUE(a == TensorBytes(Export(id, kSteps)))
        << "weights or running statistics differ from the uninterrupted run's";
  }
};

TEST_F(ResNetJobTest, BatchNormStatisticsAreCheckpointedAndAResumedJobEndsBitwiseEqual) {
  // One rank first: the baseline of the 2-rank runs' scaling efficiency.
  v1::JobSpec one = Spec();
  one.set_world_size(1);
  one.set_max_steps(4);
  one.clear_checkpoint();
  const std::string single = Run(one);
  ASSERT_FALSE(single.empty());
  const v1::Throughput base = cluster().GetJob(single).throughput();
  EXPECT_EQ(base.steps(), 3) << "the first step is left out";
  EXPECT_GT(base.samples_per_second(), 0);
  EXPECT_TRUE(base.baseline_job().empty());

  const std::string reference = Run(Spec());
  ASSERT_FALSE(reference.empty());
  const v1::Throughput t = cluster().GetJob(reference).throughput();
  EXPECT_EQ(t.world_size(), 2);
  EXPECT_EQ(t.baseline_job(), single);
  EXPECT_NEAR(t.scaling_efficiency(), t.samples_per_second() / (2 * base.samples_per_second()),
              1e-9);
  CommandResult described = cluster().Aidnctl({"describe", reference});
  EXPECT_THAT(described.out, ::testing::HasSubstr("efficiency ")) << described.out;
  EXPECT_THAT(described.out, ::testing::HasSubstr(absl::StrCat("against ", single)))
      << described.out;
  EXPECT_FALSE(cluster().EventMessages(reference, "job.throughput").empty());
  int evals = 0;
  for (const v1::StepMetrics& s : cluster().Metrics(reference)) {
    if (s.kind() != v1::MetricRecord::EVAL) continue;
    ++evals;
    EXPECT_GE(s.test_accuracy(), 0.0);
    EXPECT_LE(s.test_accuracy(), 1.0);
    EXPECT_GT(s.test_loss(), 0.0);
  }
  EXPECT_EQ(evals, 1);
  // torchvision's names, the statistics among them.
  ExpectExportedAndResumedBitwise(
      Spec(), reference,
      {"conv1.weight", "layer1.0.bn1.running_mean", "layer4.1.bn2.running_var",
       "layer2.0.downsample.1.weight", "fc.bias"});
}

// Stochastic depth: each rank skips its own residual branches. Without
// ddp.find_unused_parameters the job fails at once, naming what got no
// gradient, and uses no restart on it; with it the job trains.
TEST_F(ResNetJobTest, StochasticDepthNeedsFindUnusedParameters) {
  v1::JobSpec spec = Spec();
  spec.clear_checkpoint();
  spec.set_max_steps(4);
  spec.set_max_restarts(2);
  spec.mutable_model()->set_stochastic_depth(0.5);
  absl::StatusOr<std::string> refused = cluster().Submit(spec);
  ASSERT_TRUE(refused.ok()) << refused.status();
  const v1::Job failed = cluster().WaitForEnd(*refused, kLong);
  EXPECT_EQ(failed.state(), v1::Job::FAILED);
  EXPECT_EQ(failed.restarts(), 0);
  EXPECT_THAT(failed.message(), ::testing::HasSubstr("got no gradient this step (layer"));
  EXPECT_THAT(failed.message(), ::testing::HasSubstr("find_unused_parameters"));

  spec.mutable_ddp()->set_find_unused_parameters(true);
  EXPECT_FALSE(Run(spec).empty());
}

// The GPT's stochastic depth skips whole blocks, each rank its own: the
// same failure naming the skipped blocks' parameters without
// find_unused_parameters, and training with it.
TEST_F(ResNetJobTest, AGptSkippingWholeBlocksNeedsFindUnusedParameters) {
  const std::string corpus = cluster().Path("corpus.txt");
  {
    std::ofstream out(corpus);
    for (int i = 0; i < 400; ++i) out << "Every morning the old man walked to the river. ";
  }
  v1::JobSpec spec = Spec();
  spec.clear_checkpoint();
  spec.clear_eval_max_samples();
  spec.set_max_steps(4);
  spec.mutable_model()->Clear();
  spec.mutable_model()->set_name("gpt");
  spec.mutable_model()->set_config("gpt-nano");
  spec.mutable_model()->set_stochastic_depth(0.5);
  spec.mutable_dataset()->set_kind("text");
  spec.mutable_dataset()->add_files(corpus);
  spec.mutable_dataset()->set_eval_windows(4);
  absl::StatusOr<std::string> refused = cluster().Submit(spec);
  ASSERT_TRUE(refused.ok()) << refused.status();
  const v1::Job failed = cluster().WaitForEnd(*refused, kLong);
  EXPECT_EQ(failed.state(), v1::Job::FAILED);
  EXPECT_THAT(failed.message(), ::testing::HasSubstr("got no gradient this step (transformer.h."));

  spec.mutable_ddp()->set_find_unused_parameters(true);
  EXPECT_FALSE(Run(spec).empty());
  // ZeRO-1 takes the same option.
  v1::JobSpec zero1 = spec;
  zero1.set_strategy(v1::JobSpec::ZERO1);
  EXPECT_FALSE(Run(zero1).empty()) << "zero1";
  // With compressed buckets too (PowerSGD from the first step).
  for (const auto compression : {v1::DdpSpec::BF16, v1::DdpSpec::POWERSGD}) {
    spec.mutable_ddp()->set_compression(compression);
    if (compression == v1::DdpSpec::POWERSGD) spec.mutable_ddp()->set_powersgd_start_step(0);
    EXPECT_FALSE(Run(spec).empty()) << v1::DdpSpec::Compression_Name(compression);
  }
}

// FSDP (full_shard) with stochastic depth and gradient accumulation: every
// rank writes its shard, rank 0 the running statistics whole; the export
// holds them, and a job resumed from the middle checkpoint ends bitwise
// where the uninterrupted one ended (which blocks each rank skipped
// included).
TEST_F(ResNetJobTest, ShardedCheckpointsCarryTheStatisticsAndResumeBitwise) {
  v1::JobSpec spec = Spec();
  spec.set_strategy(v1::JobSpec::FSDP);
  spec.mutable_fsdp()->set_sharding(v1::FsdpSpec::FULL_SHARD);
  spec.mutable_model()->set_stochastic_depth(0.3);
  // Two micro-batches a step: the buffers' copy must not meet the units'
  // reduce-scatters of the first.
  spec.set_grad_accum_steps(2);
  // Every rank writes there: one directory both workers see.
  spec.mutable_checkpoint()->set_dir(cluster().Path("shared-runs"));
  const std::string reference = Run(spec);
  ASSERT_FALSE(reference.empty());
  ExpectExportedAndResumedBitwise(
      spec, reference, {"conv1.weight", "bn1.running_mean", "layer4.1.bn2.running_var", "fc.bias"});
}

// Two pipeline stages (1F1B): each writes its own layers' weights and
// running statistics; evaluation gathers both; the export holds them all,
// and a job resumed from the middle checkpoint ends bitwise where the
// uninterrupted one ended.
TEST_F(ResNetJobTest, PipelineStagesCheckpointTheirStatisticsAndResumeBitwise) {
  v1::JobSpec spec = Spec();
  spec.mutable_parallel()->set_pipeline(2);
  spec.mutable_checkpoint()->set_dir(cluster().Path("staged-runs"));
  const std::string reference = Run(spec);
  ASSERT_FALSE(reference.empty());
  int evals = 0;
  for (const v1::StepMetrics& s : cluster().Metrics(reference)) {
    if (s.kind() != v1::MetricRecord::EVAL) continue;
    ++evals;
    EXPECT_GT(s.test_loss(), 0.0);
  }
  EXPECT_EQ(evals, 1);
  // bn1 on the first stage, layer4 on the second.
  ExpectExportedAndResumedBitwise(
      spec, reference,
      {"bn1.running_mean", "layer4.1.bn2.running_var", "layer4.1.bn2.weight", "fc.bias"});
}

// ddp.sync_batchnorm: the BatchNorm layers' statistics go over a second
// communicator of the ranks, beside the gradients' (here ZeRO-1's; DDP's
// path sets it up the same way).
TEST_F(ResNetJobTest, SyncBatchNormTrainsOverACommunicatorOfItsOwn) {
  v1::JobSpec spec = Spec();
  spec.set_strategy(v1::JobSpec::ZERO1);
  spec.clear_checkpoint();
  spec.set_max_steps(3);
  spec.mutable_ddp()->set_sync_batchnorm(true);
  spec.mutable_ddp()->set_broadcast_buffers(false);
  const std::string id = Run(spec);
  ASSERT_FALSE(id.empty());
  std::string logs;
  for (const char* w : {"w1", "w2"}) {
    for (int rank : {0, 1}) {
      logs += ReadFileOrEmpty(
          absl::StrCat(cluster().WorkDir(w), "/logs/", id, "/gen-1/rank-", rank, ".log"));
    }
  }
  int ranks = 0;
  const std::string line = "sync batchnorm: statistics over every rank's batch";
  for (size_t at = logs.find(line); at != std::string::npos; at = logs.find(line, at + 1)) ++ranks;
  EXPECT_EQ(ranks, 2) << logs;
}

}  // namespace
}  // namespace aidn::testing
