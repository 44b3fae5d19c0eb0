#include "worker/trainer/engine_config.h"

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::trainer {
namespace {

using std::chrono::milliseconds;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(EngineConfig, TakesTheModelAndOptimizerFromTheSpec) {
  v1::JobSpec spec;
  spec.mutable_model()->set_name("mlp");
  spec.mutable_model()->add_hidden_sizes(64);
  spec.mutable_model()->add_hidden_sizes(32);
  spec.mutable_model()->set_dropout(0.25);
  v1::OptimizerSpec* o = spec.mutable_optimizer();
  o->set_name("adamw");
  o->set_lr(0.01);
  o->set_momentum(0.8);
  o->set_nesterov(true);
  o->set_weight_decay(0.1);
  o->set_beta1(0.85);
  o->set_beta2(0.95);
  o->set_eps(1e-6);
  o->set_grad_clip_norm(1.5);

  const engine::ModelConfig model = ModelConfigOf(spec);
  EXPECT_EQ(model.name, "mlp");
  EXPECT_THAT(model.hidden_sizes, ElementsAre(64, 32));
  EXPECT_FLOAT_EQ(model.dropout, 0.25);
  const engine::OptimizerConfig optimizer = OptimizerConfigOf(spec);
  EXPECT_EQ(optimizer.name, "adamw");
  EXPECT_DOUBLE_EQ(optimizer.lr, 0.01);
  EXPECT_DOUBLE_EQ(optimizer.momentum, 0.8);
  EXPECT_TRUE(optimizer.nesterov);
  EXPECT_DOUBLE_EQ(optimizer.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(optimizer.beta1, 0.85);
  EXPECT_DOUBLE_EQ(optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(optimizer.eps, 1e-6);
  EXPECT_DOUBLE_EQ(optimizer.grad_clip_norm, 1.5);
}

TEST(EngineConfig, MapsEveryScheduleKind) {
  v1::JobSpec spec;
  v1::LrScheduleSpec* s = spec.mutable_lr_schedule();
  s->set_warmup_steps(5);
  s->set_step_size(10);
  s->set_gamma(0.5);
  s->set_min_lr(1e-5);
  EXPECT_EQ(ScheduleOf(spec).kind, engine::LrScheduleConfig::Kind::kConstant);
  s->set_kind(v1::LrScheduleSpec::STEP);
  EXPECT_EQ(ScheduleOf(spec).kind, engine::LrScheduleConfig::Kind::kStep);
  s->set_kind(v1::LrScheduleSpec::COSINE);
  const engine::LrScheduleConfig config = ScheduleOf(spec);
  EXPECT_EQ(config.kind, engine::LrScheduleConfig::Kind::kCosine);
  EXPECT_EQ(config.warmup_steps, 5);
  EXPECT_EQ(config.step_size, 10);
  EXPECT_DOUBLE_EQ(config.gamma, 0.5);
  EXPECT_DOUBLE_EQ(config.min_lr, 1e-5);
}

TEST(EngineConfig, DefaultsBucketSizeAndPeerTimeout) {
  v1::JobSpec spec;
  EXPECT_DOUBLE_EQ(BucketMbOf(spec), 25.0);
  spec.set_bucket_mb(0.5);
  EXPECT_DOUBLE_EQ(BucketMbOf(spec), 0.5);
  EXPECT_EQ(PeerTimeoutOf(spec), milliseconds(30'000));  // unset: the floor
  spec.mutable_timeouts()->mutable_rendezvous()->set_seconds(90);
  spec.mutable_timeouts()->mutable_rendezvous()->set_nanos(500'000'000);
  EXPECT_EQ(PeerTimeoutOf(spec), milliseconds(90'500));
  spec.mutable_timeouts()->mutable_rendezvous()->set_seconds(1);
  EXPECT_EQ(PeerTimeoutOf(spec), milliseconds(30'000));
}

TEST(EngineConfig, MapsTransportsAndGpuOptions) {
  v1::JobSpec spec;
  EXPECT_EQ(CpuTransportOf(spec), engine::CpuTransport::kAuto);
  spec.set_comm_backend(v1::JobSpec::GLOO);
  EXPECT_EQ(CpuTransportOf(spec), engine::CpuTransport::kGloo);
  spec.set_comm_backend(v1::JobSpec::SHM);
  EXPECT_EQ(CpuTransportOf(spec), engine::CpuTransport::kShm);

  EXPECT_EQ(GpuSessionOptionsOf(spec, 0, 1).precision, "fp32");
  spec.set_precision(v1::JobSpec::BF16);
  EXPECT_EQ(GpuSessionOptionsOf(spec, 0, 1).precision, "bf16");
  spec.set_precision(v1::JobSpec::FP16);
  spec.set_allow_tf32(true);
  spec.set_cuda_graphs(true);
  spec.set_bucket_mb(4);
  const engine::GpuSessionOptions o = GpuSessionOptionsOf(spec, 1, 2);
  EXPECT_EQ(o.precision, "fp16");
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.world_size, 2);
  EXPECT_TRUE(o.allow_tf32);
  EXPECT_FALSE(o.fast_convolutions);
  EXPECT_TRUE(o.cuda_graphs);
  EXPECT_DOUBLE_EQ(o.bucket_mb, 4);
  EXPECT_EQ(o.timeout, milliseconds(30'000));
  EXPECT_EQ(o.store, nullptr);
}

TEST(EngineConfig, PlacesCheckpointsUnderTheRootByJob) {
  TrainerOptions options;
  options.job_id = "j-7";
  options.work_dir = "/work/jobs/j-7";
  v1::JobSpec spec;
  EXPECT_EQ(CheckpointDirOf(spec, options), "");  // none asked for
  spec.mutable_checkpoint()->set_dir("runs/./a");
  EXPECT_EQ(CheckpointDirOf(spec, options), "/work/jobs/j-7/runs/a/j-7");
  options.checkpoint_root = "/ckpt";
  EXPECT_EQ(CheckpointDirOf(spec, options), "/ckpt/runs/a/j-7");
  spec.mutable_checkpoint()->set_dir("/abs/dir/");
  EXPECT_EQ(CheckpointDirOf(spec, options), "/abs/dir/j-7");
}

TEST(EngineConfig, ADatasetThatIsMissingFailsNamingItsFile) {
  v1::DatasetSpec spec;
  spec.set_kind("idx");
  const std::string missing = absl::StrCat(::testing::TempDir(), "/no-such-", getpid());
  spec.set_train_images(missing + "/train-images");
  spec.set_train_labels(missing + "/train-labels");
  spec.set_test_images(missing + "/test-images");
  spec.set_test_labels(missing + "/test-labels");
  engine::Dataset train, test;
  for (const std::string& cache : std::vector<std::string>{"", missing + "/cache"}) {
    absl::Status s = LoadData(spec, cache, &train, &test);
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(s.message(), HasSubstr(missing + "/train-images"));
  }
  spec.set_kind("fashion-mnist");
  spec.set_dir(missing);
  EXPECT_FALSE(LoadData(spec, "", &train, &test).ok());
}

TEST(EngineConfig, LoadsFashionMnistWhenInstalled) {
  if (!std::filesystem::exists(engine::kFashionMnistDir)) {
    GTEST_SKIP() << engine::kFashionMnistDir << " is not installed";
  }
  v1::DatasetSpec spec;
  spec.set_dir(engine::kFashionMnistDir);
  engine::Dataset train, test;
  ASSERT_TRUE(LoadData(spec, "", &train, &test).ok());
  EXPECT_EQ(train.size, 60000);
  EXPECT_EQ(test.size, 10000);
}

}  // namespace
}  // namespace aidn::trainer

namespace aidn::trainer {
namespace {

TEST(GptConfigOf, TakesTheSizesDropoutAndBias) {
  v1::JobSpec spec;
  v1::ModelSpec* m = spec.mutable_model();
  m->set_name("gpt");
  m->set_n_layer(3);
  m->set_n_head(2);
  m->set_n_embd(48);
  m->set_block_size(64);
  m->set_vocab_size(256);
  m->set_dropout(0.1);
  engine::GptConfig c = GptConfigOf(spec);
  EXPECT_EQ(engine::FormatGptConfig(c),
            "n_layer=3,n_head=2,n_embd=48,block_size=64,vocab_size=256,bias=1");
  EXPECT_DOUBLE_EQ(c.dropout, 0.1);
  m->set_bias(false);
  EXPECT_FALSE(GptConfigOf(spec).bias);
}

}  // namespace
}  // namespace aidn::trainer
