#include "coordinator/spec.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include <gmock/gmock.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace aidn::coordinator {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using v1::JobSpec;
using v1::LrScheduleSpec;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// What a user minimally writes: a world size and a model.
JobSpec MinimalSpec() {
  JobSpec spec;
  spec.set_world_size(2);
  spec.mutable_model()->set_name("mlp");
  return spec;
}

// MinimalSpec with defaults applied: the base every bad case changes one
// field of.
JobSpec ValidSpec() {
  JobSpec spec = MinimalSpec();
  ApplyJobSpecDefaults(SpecLimits(), &spec);
  return spec;
}

// Turns a defaulted sgd spec into a valid adamw one.
void UseAdamW(JobSpec* spec) {
  v1::OptimizerSpec* opt = spec->mutable_optimizer();
  opt->Clear();
  opt->set_name("adamw");
  ApplyJobSpecDefaults(SpecLimits(), spec);
}

void UseIdx(JobSpec* spec) {
  v1::DatasetSpec* d = spec->mutable_dataset();
  d->set_kind("idx");
  d->clear_dir();
  d->set_train_images("data/train-images-idx3-ubyte");
  d->set_train_labels("data/train-labels-idx1-ubyte");
  d->set_test_images("data/t10k-images-idx3-ubyte");
  d->set_test_labels("data/t10k-labels-idx1-ubyte");
}

google::protobuf::Duration Seconds(int64_t s, int32_t nanos = 0) {
  google::protobuf::Duration d;
  d.set_seconds(s);
  d.set_nanos(nanos);
  return d;
}

TEST(ValidateJobSpec, AcceptsMinimalSpecAfterDefaults) {
  EXPECT_TRUE(ValidateJobSpec(SpecLimits(), ValidSpec()).ok())
      << ValidateJobSpec(SpecLimits(), ValidSpec());
}

TEST(ValidateJobSpec, RefusesMinimalSpecWithoutDefaults) {
  absl::Status status = ValidateJobSpec(SpecLimits(), MinimalSpec());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
}

TEST(ValidateJobSpec, MessagesSayFieldProblemAndValue) {
  const SpecLimits limits;
  struct Expect {
    std::function<void(JobSpec*)> mutate;
    std::string message;
  };
  const Expect cases[] = {
      {[](JobSpec* s) { s->set_world_size(0); }, "world_size: must be between 1 and 1024, got 0"},
      {[](JobSpec* s) { s->mutable_model()->set_name("resnet"); },
       "model.name: unknown model \"resnet\" (known: mlp, cnn, resnet18, resnet50, gpt)"},
      {[](JobSpec* s) { s->mutable_optimizer()->set_lr(-1); },
       "optimizer.lr: must be a finite number > 0, got -1"},
      {[](JobSpec* s) {
         UseIdx(s);
         s->mutable_dataset()->set_train_images("../etc/passwd");
       },
       "dataset.train_images: path must not contain \"..\""},
      {[](JobSpec* s) { s->mutable_fsdp()->set_sharding(v1::FsdpSpec::SHARD_GRAD_OP); },
       "fsdp: applies to strategy: fsdp only (this job's is DDP)"},
      {[](JobSpec* s) {
         s->set_strategy(JobSpec::FSDP);
         s->mutable_fsdp()->set_sharding(static_cast<v1::FsdpSpec::Sharding>(7));
       },
       "fsdp.sharding: unknown value 7 (known: full_shard, shard_grad_op)"},
      {[](JobSpec* s) {
         s->set_strategy(JobSpec::FSDP);
         s->mutable_fsdp()->set_sharding(v1::FsdpSpec::FULL_SHARD);
         s->mutable_fsdp()->set_param_dtype(JobSpec::BF16);
       },
       "fsdp.param_dtype: BF16 is for device: gpu (CPU jobs gather and reduce in fp32)"},
      {[](JobSpec* s) {
         s->set_device(JobSpec::GPU);
         s->set_strategy(JobSpec::FSDP);
         s->mutable_fsdp()->set_sharding(v1::FsdpSpec::FULL_SHARD);
         s->mutable_fsdp()->set_reduce_dtype(JobSpec::FP16);
       },
       "fsdp.reduce_dtype: FP16 is not offered (known: fp32, bf16)"},
      {[](JobSpec* s) { s->set_precision(JobSpec::BF16); },
       "precision: BF16 is for device: gpu (CPU jobs compute in fp32)"},
      {[](JobSpec* s) { s->set_precision(JobSpec::FP16); },
       "precision: FP16 is for device: gpu (CPU jobs compute in fp32)"},
      {[](JobSpec* s) {
         s->set_device(JobSpec::GPU);
         s->set_comm_backend(JobSpec::SHM);
       },
       "comm_backend: SHM is for CPU jobs (GPU jobs use NCCL): leave it unset or auto"},
      {[](JobSpec* s) { s->set_allow_tf32(true); },
       "allow_tf32: is for device: gpu (CPU jobs compute in fp32)"},
      {[](JobSpec* s) { s->set_fast_convolutions(true); },
       "fast_convolutions: is for device: gpu (cuDNN's convolution algorithms)"},
      {[](JobSpec* s) { s->set_cuda_graphs(true); },
       "cuda_graphs: is for device: gpu (CPU steps launch no kernels)"},
      {[](JobSpec* s) { *s->mutable_timeouts()->mutable_worker() = Seconds(86400, 1); },
       "timeouts.worker: must be at most 24h (86400s), got 86400.000000001s"},
      {[](JobSpec* s) { (*s->mutable_labels())["bad key"] = "v"; },
       "labels: key \"bad key\" must match [a-zA-Z0-9._/-]{1,63}"},
  };
  for (const Expect& c : cases) {
    JobSpec spec = ValidSpec();
    c.mutate(&spec);
    absl::Status status = ValidateJobSpec(limits, spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message(), c.message);
  }
}

TEST(ValidateJobSpec, WorldSizeLimitComesFromSpecLimits) {
  SpecLimits limits;
  limits.max_world_size = 8;
  JobSpec spec = ValidSpec();
  spec.set_world_size(8);
  EXPECT_TRUE(ValidateJobSpec(limits, spec).ok());
  spec.set_world_size(9);
  absl::Status status = ValidateJobSpec(limits, spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "world_size: must be between 1 and 8, got 9");
}

TEST(ValidateJobSpec, LabelErrorsDoNotDependOnMapOrder) {
  JobSpec spec = ValidSpec();
  for (int i = 0; i < 20; ++i) (*spec.mutable_labels())[absl::StrCat("bad key ", i)] = "v";
  absl::Status first = ValidateJobSpec(SpecLimits(), spec);
  EXPECT_THAT(std::string(first.message()), StartsWith("labels: key \"bad key 0\""));
}

// ---------------------------------------------------------------------------
// One bad field per case.

struct BadCase {
  std::string name;
  std::function<void(JobSpec*)> mutate;
  // The message must start with this followed by ':'.
  std::string field;
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

class BadSpecTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadSpecTest, IsRefusedNamingTheField) {
  JobSpec spec = ValidSpec();
  GetParam().mutate(&spec);
  absl::Status status = ValidateJobSpec(SpecLimits(), spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), StartsWith(GetParam().field + ":"));
}

std::string Repeat(char c, size_t n) { return std::string(n, c); }

const BadCase kBadCases[] = {
    // name
    {"NameTooLong", [](JobSpec* s) { s->set_name(Repeat('a', 129)); }, "name"},
    {"NameWithNewline", [](JobSpec* s) { s->set_name("a\nb"); }, "name"},
    {"NameWithDel", [](JobSpec* s) { s->set_name("a\x7f"); }, "name"},
    {"NameWithC1Control", [](JobSpec* s) { s->set_name("a\xc2\x85"); }, "name"},
    {"NameInvalidUtf8", [](JobSpec* s) { s->set_name("a\xff"); }, "name"},
    {"NameTruncatedUtf8", [](JobSpec* s) { s->set_name("a\xe6\x9d"); }, "name"},
    // world_size, threads, device
    {"WorldSizeZero", [](JobSpec* s) { s->set_world_size(0); }, "world_size"},
    {"WorldSizeNegative", [](JobSpec* s) { s->set_world_size(-4); }, "world_size"},
    {"WorldSizeAboveLimit", [](JobSpec* s) { s->set_world_size(1025); }, "world_size"},
    {"WorldSizeHuge", [](JobSpec* s) { s->set_world_size(2'000'000'000); }, "world_size"},
    {"ThreadsPerRankZero", [](JobSpec* s) { s->set_threads_per_rank(0); }, "threads_per_rank"},
    {"ThreadsPerRankTooMany", [](JobSpec* s) { s->set_threads_per_rank(257); }, "threads_per_rank"},
    {"DeviceUnknown", [](JobSpec* s) { s->set_device(static_cast<JobSpec::Device>(99)); },
     "device"},
    {"DeviceUnspecified", [](JobSpec* s) { s->set_device(JobSpec::DEVICE_UNSPECIFIED); }, "device"},
    // model
    {"ModelUnknown", [](JobSpec* s) { s->mutable_model()->set_name("resnet"); }, "model.name"},
    {"ModelMissing", [](JobSpec* s) { s->mutable_model()->clear_name(); }, "model.name"},
    {"ModelNameWrongCase", [](JobSpec* s) { s->mutable_model()->set_name("MLP"); }, "model.name"},
    {"MlpWithoutHiddenLayers", [](JobSpec* s) { s->mutable_model()->clear_hidden_sizes(); },
     "model.hidden_sizes"},
    {"MlpWithSeventeenHiddenLayers",
     [](JobSpec* s) {
       for (int i = 0; i < 15; ++i) s->mutable_model()->add_hidden_sizes(8);
     },
     "model.hidden_sizes"},
    {"MlpHiddenSizeZero", [](JobSpec* s) { s->mutable_model()->set_hidden_sizes(1, 0); },
     "model.hidden_sizes[1]"},
    {"MlpHiddenSizeNegative", [](JobSpec* s) { s->mutable_model()->set_hidden_sizes(0, -3); },
     "model.hidden_sizes[0]"},
    {"MlpHiddenSizeTooWide", [](JobSpec* s) { s->mutable_model()->set_hidden_sizes(1, 65537); },
     "model.hidden_sizes[1]"},
    {"CnnWithHiddenSizes", [](JobSpec* s) { s->mutable_model()->set_name("cnn"); },
     "model.hidden_sizes"},
    {"DropoutOne", [](JobSpec* s) { s->mutable_model()->set_dropout(1.0); }, "model.dropout"},
    {"DropoutNegative", [](JobSpec* s) { s->mutable_model()->set_dropout(-0.1); }, "model.dropout"},
    {"DropoutNaN", [](JobSpec* s) { s->mutable_model()->set_dropout(kNaN); }, "model.dropout"},
    // dataset
    {"DatasetKindUnknown", [](JobSpec* s) { s->mutable_dataset()->set_kind("cifar10"); },
     "dataset.kind"},
    {"DatasetKindEmpty", [](JobSpec* s) { s->mutable_dataset()->clear_kind(); }, "dataset.kind"},
    {"FashionMnistDirEmpty", [](JobSpec* s) { s->mutable_dataset()->clear_dir(); }, "dataset.dir"},
    {"FashionMnistDirDotDot", [](JobSpec* s) { s->mutable_dataset()->set_dir("/data/../etc"); },
     "dataset.dir"},
    {"FashionMnistDirControlChar", [](JobSpec* s) { s->mutable_dataset()->set_dir("/data\t1"); },
     "dataset.dir"},
    {"FashionMnistDirTooLong",
     [](JobSpec* s) { s->mutable_dataset()->set_dir("/" + Repeat('d', 4096)); }, "dataset.dir"},
    {"FashionMnistWithIdxFile",
     [](JobSpec* s) { s->mutable_dataset()->set_train_images("/data/train"); },
     "dataset.train_images"},
    {"IdxWithDir",
     [](JobSpec* s) {
       UseIdx(s);
       s->mutable_dataset()->set_dir("/data");
     },
     "dataset.dir"},
    {"IdxMissingTrainImages",
     [](JobSpec* s) {
       UseIdx(s);
       s->mutable_dataset()->clear_train_images();
     },
     "dataset.train_images"},
    {"IdxMissingTrainLabels",
     [](JobSpec* s) {
       UseIdx(s);
       s->mutable_dataset()->clear_train_labels();
     },
     "dataset.train_labels"},
    {"IdxMissingTestImages",
     [](JobSpec* s) {
       UseIdx(s);
       s->mutable_dataset()->clear_test_images();
     },
     "dataset.test_images"},
    {"IdxMissingTestLabels",
     [](JobSpec* s) {
       UseIdx(s);
       s->mutable_dataset()->clear_test_labels();
     },
     "dataset.test_labels"},
    {"IdxTrainImagesDotDot",
     [](JobSpec* s) {
       UseIdx(s);
       s->mutable_dataset()->set_train_images("../x");
     },
     "dataset.train_images"},
    {"IdxTrainLabelsDotDot",
     [](JobSpec* s) {
       UseIdx(s);
       s->mutable_dataset()->set_train_labels("x/../y");
     },
     "dataset.train_labels"},
    {"IdxTestImagesDotDot",
     [](JobSpec* s) {
       UseIdx(s);
       s->mutable_dataset()->set_test_images("x/..");
     },
     "dataset.test_images"},
    {"IdxTestLabelsDotDot",
     [](JobSpec* s) {
       UseIdx(s);
       s->mutable_dataset()->set_test_labels("/data/../../t10k");
     },
     "dataset.test_labels"},
    {"IdxPathWithNul",
     [](JobSpec* s) {
       UseIdx(s);
       s->mutable_dataset()->set_test_labels(std::string("a\0b", 3));
     },
     "dataset.test_labels"},
    // optimizer
    {"OptimizerUnknown", [](JobSpec* s) { s->mutable_optimizer()->set_name("adam"); },
     "optimizer.name"},
    {"OptimizerEmpty", [](JobSpec* s) { s->mutable_optimizer()->clear_name(); }, "optimizer.name"},
    {"LrNegative", [](JobSpec* s) { s->mutable_optimizer()->set_lr(-0.1); }, "optimizer.lr"},
    {"LrZero", [](JobSpec* s) { s->mutable_optimizer()->set_lr(0); }, "optimizer.lr"},
    {"LrNaN", [](JobSpec* s) { s->mutable_optimizer()->set_lr(kNaN); }, "optimizer.lr"},
    {"LrInf", [](JobSpec* s) { s->mutable_optimizer()->set_lr(kInf); }, "optimizer.lr"},
    {"LrTooLarge", [](JobSpec* s) { s->mutable_optimizer()->set_lr(10.5); }, "optimizer.lr"},
    {"LrUnset", [](JobSpec* s) { s->mutable_optimizer()->clear_lr(); }, "optimizer.lr"},
    {"MomentumOne", [](JobSpec* s) { s->mutable_optimizer()->set_momentum(1.0); },
     "optimizer.momentum"},
    {"MomentumNegative", [](JobSpec* s) { s->mutable_optimizer()->set_momentum(-0.5); },
     "optimizer.momentum"},
    {"MomentumNaN", [](JobSpec* s) { s->mutable_optimizer()->set_momentum(kNaN); },
     "optimizer.momentum"},
    {"NesterovWithoutMomentum", [](JobSpec* s) { s->mutable_optimizer()->set_nesterov(true); },
     "optimizer.nesterov"},
    {"WeightDecayNegative", [](JobSpec* s) { s->mutable_optimizer()->set_weight_decay(-1e-4); },
     "optimizer.weight_decay"},
    {"WeightDecayAboveOne", [](JobSpec* s) { s->mutable_optimizer()->set_weight_decay(1.5); },
     "optimizer.weight_decay"},
    {"WeightDecayInf", [](JobSpec* s) { s->mutable_optimizer()->set_weight_decay(kInf); },
     "optimizer.weight_decay"},
    {"GradClipNegative", [](JobSpec* s) { s->mutable_optimizer()->set_grad_clip_norm(-1); },
     "optimizer.grad_clip_norm"},
    {"GradClipNaN", [](JobSpec* s) { s->mutable_optimizer()->set_grad_clip_norm(kNaN); },
     "optimizer.grad_clip_norm"},
    {"SgdWithBeta1", [](JobSpec* s) { s->mutable_optimizer()->set_beta1(0.9); }, "optimizer.beta1"},
    {"AdamWBeta1One",
     [](JobSpec* s) {
       UseAdamW(s);
       s->mutable_optimizer()->set_beta1(1.0);
     },
     "optimizer.beta1"},
    {"AdamWBeta2NaN",
     [](JobSpec* s) {
       UseAdamW(s);
       s->mutable_optimizer()->set_beta2(kNaN);
     },
     "optimizer.beta2"},
    {"AdamWBeta2Negative",
     [](JobSpec* s) {
       UseAdamW(s);
       s->mutable_optimizer()->set_beta2(-0.9);
     },
     "optimizer.beta2"},
    {"AdamWEpsZero",
     [](JobSpec* s) {
       UseAdamW(s);
       s->mutable_optimizer()->set_eps(0);
     },
     "optimizer.eps"},
    {"AdamWEpsInf",
     [](JobSpec* s) {
       UseAdamW(s);
       s->mutable_optimizer()->set_eps(kInf);
     },
     "optimizer.eps"},
    {"AdamWLrNegative",
     [](JobSpec* s) {
       UseAdamW(s);
       s->mutable_optimizer()->set_lr(-1e-3);
     },
     "optimizer.lr"},
    {"AdamWWithMomentum",
     [](JobSpec* s) {
       UseAdamW(s);
       s->mutable_optimizer()->set_momentum(0.9);
     },
     "optimizer.momentum"},
    // lr_schedule
    {"WarmupNegative", [](JobSpec* s) { s->mutable_lr_schedule()->set_warmup_steps(-1); },
     "lr_schedule.warmup_steps"},
    {"WarmupHuge", [](JobSpec* s) { s->mutable_lr_schedule()->set_warmup_steps(1'000'000'001); },
     "lr_schedule.warmup_steps"},
    {"ScheduleKindUnknown",
     [](JobSpec* s) { s->mutable_lr_schedule()->set_kind(static_cast<LrScheduleSpec::Kind>(99)); },
     "lr_schedule.kind"},
    {"StepWithoutStepSize",
     [](JobSpec* s) {
       s->mutable_lr_schedule()->set_kind(LrScheduleSpec::STEP);
       s->mutable_lr_schedule()->set_gamma(0.5);
     },
     "lr_schedule.step_size"},
    {"StepGammaZero",
     [](JobSpec* s) {
       s->mutable_lr_schedule()->set_kind(LrScheduleSpec::STEP);
       s->mutable_lr_schedule()->set_step_size(100);
     },
     "lr_schedule.gamma"},
    {"StepGammaAboveOne",
     [](JobSpec* s) {
       s->mutable_lr_schedule()->set_kind(LrScheduleSpec::STEP);
       s->mutable_lr_schedule()->set_step_size(100);
       s->mutable_lr_schedule()->set_gamma(1.5);
     },
     "lr_schedule.gamma"},
    {"StepGammaNaN",
     [](JobSpec* s) {
       s->mutable_lr_schedule()->set_kind(LrScheduleSpec::STEP);
       s->mutable_lr_schedule()->set_step_size(100);
       s->mutable_lr_schedule()->set_gamma(kNaN);
     },
     "lr_schedule.gamma"},
    {"CosineMinLrAboveLr",
     [](JobSpec* s) {
       s->mutable_lr_schedule()->set_kind(LrScheduleSpec::COSINE);
       s->mutable_lr_schedule()->set_min_lr(0.02);  // lr is 0.01
     },
     "lr_schedule.min_lr"},
    {"CosineMinLrNegative",
     [](JobSpec* s) {
       s->mutable_lr_schedule()->set_kind(LrScheduleSpec::COSINE);
       s->mutable_lr_schedule()->set_min_lr(-1e-5);
     },
     "lr_schedule.min_lr"},
    {"CosineMinLrNaN",
     [](JobSpec* s) {
       s->mutable_lr_schedule()->set_kind(LrScheduleSpec::COSINE);
       s->mutable_lr_schedule()->set_min_lr(kNaN);
     },
     "lr_schedule.min_lr"},
    {"ConstantWithGamma", [](JobSpec* s) { s->mutable_lr_schedule()->set_gamma(0.5); },
     "lr_schedule.gamma"},
    // sizes and steps
    {"BatchSizeZero", [](JobSpec* s) { s->set_batch_size(0); }, "batch_size"},
    {"BatchSizeNegative", [](JobSpec* s) { s->set_batch_size(-64); }, "batch_size"},
    {"BatchSizeTooLarge", [](JobSpec* s) { s->set_batch_size(65537); }, "batch_size"},
    {"EpochsNegative", [](JobSpec* s) { s->set_epochs(-1); }, "epochs"},
    {"EpochsTooMany", [](JobSpec* s) { s->set_epochs(100001); }, "epochs"},
    {"MaxStepsNegative", [](JobSpec* s) { s->set_max_steps(-1); }, "max_steps"},
    {"MaxStepsTooMany", [](JobSpec* s) { s->set_max_steps(1'000'000'000'001); }, "max_steps"},
    {"NeitherEpochsNorMaxSteps", [](JobSpec* s) { s->set_epochs(0); }, "epochs"},
    // strategy, buckets, precision
    {"FsdpOptionsWithZero1",
     [](JobSpec* s) {
       s->set_strategy(JobSpec::ZERO1);
       s->mutable_fsdp();
     },
     "fsdp"},
    {"StrategyUnknown", [](JobSpec* s) { s->set_strategy(static_cast<JobSpec::Strategy>(99)); },
     "strategy"},
    {"BucketMbZero", [](JobSpec* s) { s->set_bucket_mb(0); }, "bucket_mb"},
    {"BucketMbNegative", [](JobSpec* s) { s->set_bucket_mb(-25); }, "bucket_mb"},
    {"BucketMbNaN", [](JobSpec* s) { s->set_bucket_mb(kNaN); }, "bucket_mb"},
    {"BucketMbInf", [](JobSpec* s) { s->set_bucket_mb(kInf); }, "bucket_mb"},
    {"BucketMbTooLarge", [](JobSpec* s) { s->set_bucket_mb(1024.5); }, "bucket_mb"},
    {"BucketMbUnset", [](JobSpec* s) { s->clear_bucket_mb(); }, "bucket_mb"},
    {"GradAccumZero", [](JobSpec* s) { s->set_grad_accum_steps(0); }, "grad_accum_steps"},
    {"GradAccumTooMany", [](JobSpec* s) { s->set_grad_accum_steps(1025); }, "grad_accum_steps"},
    {"PrecisionBf16", [](JobSpec* s) { s->set_precision(JobSpec::BF16); }, "precision"},
    {"PrecisionFp16", [](JobSpec* s) { s->set_precision(JobSpec::FP16); }, "precision"},
    {"PrecisionUnknown", [](JobSpec* s) { s->set_precision(static_cast<JobSpec::Precision>(99)); },
     "precision"},
    {"CommBackendUnknown",
     [](JobSpec* s) { s->set_comm_backend(static_cast<JobSpec::CommBackend>(99)); },
     "comm_backend"},
    {"CommBackendGlooOnGpu",
     [](JobSpec* s) {
       s->set_device(JobSpec::GPU);
       s->set_comm_backend(JobSpec::GLOO);
     },
     "comm_backend"},
    // checkpoint
    {"CheckpointDirDotDot", [](JobSpec* s) { s->mutable_checkpoint()->set_dir("../ckpt"); },
     "checkpoint.dir"},
    {"CheckpointDirTrailingDotDot", [](JobSpec* s) { s->mutable_checkpoint()->set_dir("ckpt/.."); },
     "checkpoint.dir"},
    {"CheckpointDirControlChar", [](JobSpec* s) { s->mutable_checkpoint()->set_dir("ck\rpt"); },
     "checkpoint.dir"},
    {"CheckpointEveryStepsNegative",
     [](JobSpec* s) {
       s->mutable_checkpoint()->set_dir("ckpt");
       s->mutable_checkpoint()->set_every_steps(-1);
     },
     "checkpoint.every_steps"},
    {"CheckpointEveryStepsWithoutDir",
     [](JobSpec* s) { s->mutable_checkpoint()->set_every_steps(100); }, "checkpoint.every_steps"},
    {"KeepLastZero", [](JobSpec* s) { s->mutable_checkpoint()->set_keep_last(0); },
     "checkpoint.keep_last"},
    {"KeepLastTooMany", [](JobSpec* s) { s->mutable_checkpoint()->set_keep_last(1001); },
     "checkpoint.keep_last"},
    {"ResumeFromWithoutJob",
     [](JobSpec* s) { s->mutable_checkpoint()->mutable_resume_from()->set_step(40); },
     "checkpoint.resume_from.job"},
    {"ResumeFromNegativeStep",
     [](JobSpec* s) {
       s->mutable_checkpoint()->mutable_resume_from()->set_job("job-1");
       s->mutable_checkpoint()->mutable_resume_from()->set_step(-1);
     },
     "checkpoint.resume_from.step"},
    // restarts and priority
    {"MaxRestartsNegative", [](JobSpec* s) { s->set_max_restarts(-1); }, "max_restarts"},
    {"MaxRestartsTooMany", [](JobSpec* s) { s->set_max_restarts(101); }, "max_restarts"},
    {"MaxRestartsUnset", [](JobSpec* s) { s->clear_max_restarts(); }, "max_restarts"},
    {"PriorityTooHigh", [](JobSpec* s) { s->set_priority(1001); }, "priority"},
    {"PriorityTooLow", [](JobSpec* s) { s->set_priority(-1001); }, "priority"},
    // timeouts
    {"RendezvousTimeoutZero",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_rendezvous() = Seconds(0); },
     "timeouts.rendezvous"},
    {"RendezvousTimeoutUnset", [](JobSpec* s) { s->mutable_timeouts()->clear_rendezvous(); },
     "timeouts.rendezvous"},
    {"WorkerTimeoutNegative",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_worker() = Seconds(-5); }, "timeouts.worker"},
    {"WorkerTimeoutOverADay",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_worker() = Seconds(86400, 1); },
     "timeouts.worker"},
    {"WorkerTimeoutNanosOutOfRange",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_worker() = Seconds(1, 1'000'000'000); },
     "timeouts.worker"},
    {"ProgressTimeoutZero",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_progress() = Seconds(0); },
     "timeouts.progress"},
    {"ProgressTimeoutTwoDays",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_progress() = Seconds(2 * 86400); },
     "timeouts.progress"},
    {"ProgressTimeoutNegativeNanos",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_progress() = Seconds(0, -1); },
     "timeouts.progress"},
    {"RestartBackoffZero",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_restart_backoff() = Seconds(0); },
     "timeouts.restart_backoff"},
    {"RestartBackoffNegative",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_restart_backoff() = Seconds(-1); },
     "timeouts.restart_backoff"},
    {"RestartBackoffOverFiveMinutes",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_restart_backoff() = Seconds(300, 1); },
     "timeouts.restart_backoff"},
    {"RestartBackoffOfADay",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_restart_backoff() = Seconds(86400); },
     "timeouts.restart_backoff"},
    {"RestartBackoffUnset", [](JobSpec* s) { s->mutable_timeouts()->clear_restart_backoff(); },
     "timeouts.restart_backoff"},
    // labels
    {"TooManyLabels",
     [](JobSpec* s) {
       for (int i = 0; i < 65; ++i) (*s->mutable_labels())[absl::StrCat("k", i)] = "v";
     },
     "labels"},
    {"LabelKeyEmpty", [](JobSpec* s) { (*s->mutable_labels())[""] = "v"; }, "labels"},
    {"LabelKeyWithSpace", [](JobSpec* s) { (*s->mutable_labels())["my team"] = "v"; }, "labels"},
    {"LabelKeyWithColon", [](JobSpec* s) { (*s->mutable_labels())["a:b"] = "v"; }, "labels"},
    {"LabelKeyTooLong", [](JobSpec* s) { (*s->mutable_labels())[Repeat('k', 64)] = "v"; },
     "labels"},
    {"LabelValueTooLong", [](JobSpec* s) { (*s->mutable_labels())["team"] = Repeat('v', 257); },
     "labels"},
    {"LabelValueControlChar", [](JobSpec* s) { (*s->mutable_labels())["team"] = "a\x1b[31m"; },
     "labels"},
};

INSTANTIATE_TEST_SUITE_P(OneBadField, BadSpecTest, ::testing::ValuesIn(kBadCases),
                         [](const ::testing::TestParamInfo<BadCase>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------------------
// Values at the edges of every range are accepted.

struct GoodCase {
  std::string name;
  std::function<void(JobSpec*)> mutate;
};

void PrintTo(const GoodCase& c, std::ostream* os) { *os << c.name; }

class GoodSpecTest : public ::testing::TestWithParam<GoodCase> {};

TEST_P(GoodSpecTest, IsAccepted) {
  JobSpec spec = ValidSpec();
  GetParam().mutate(&spec);
  absl::Status status = ValidateJobSpec(SpecLimits(), spec);
  EXPECT_TRUE(status.ok()) << status;
}

const GoodCase kGoodCases[] = {
    {"NameOf128Bytes", [](JobSpec* s) { s->set_name(Repeat('n', 128)); }},
    {"NameInUtf8", [](JobSpec* s) { s->set_name("Übung – 東京 🚀"); }},
    {"WorldSizeOne", [](JobSpec* s) { s->set_world_size(1); }},
    {"WorldSizeAtLimit", [](JobSpec* s) { s->set_world_size(1024); }},
    {"ThreadsPerRank256", [](JobSpec* s) { s->set_threads_per_rank(256); }},
    {"Gpu", [](JobSpec* s) { s->set_device(JobSpec::GPU); }},
    {"Zero1OnCpu", [](JobSpec* s) { s->set_strategy(JobSpec::ZERO1); }},
    {"Zero2OnCpu", [](JobSpec* s) { s->set_strategy(JobSpec::ZERO2); }},
    {"FsdpFullShard",
     [](JobSpec* s) {
       s->set_strategy(JobSpec::FSDP);
       s->mutable_fsdp()->set_sharding(v1::FsdpSpec::FULL_SHARD);
     }},
    {"FsdpShardGradOp",
     [](JobSpec* s) {
       s->set_strategy(JobSpec::FSDP);
       s->mutable_fsdp()->set_sharding(v1::FsdpSpec::SHARD_GRAD_OP);
     }},
    {"Zero2OnGpu",
     [](JobSpec* s) {
       s->set_device(JobSpec::GPU);
       s->set_strategy(JobSpec::ZERO2);
     }},
    {"FsdpOnGpuInBf16",
     [](JobSpec* s) {
       s->set_device(JobSpec::GPU);
       s->set_precision(JobSpec::BF16);
       s->set_strategy(JobSpec::FSDP);
       s->mutable_fsdp()->set_sharding(v1::FsdpSpec::SHARD_GRAD_OP);
       s->mutable_fsdp()->set_param_dtype(JobSpec::BF16);
       s->mutable_fsdp()->set_reduce_dtype(JobSpec::BF16);
     }},
    {"GpuBf16",
     [](JobSpec* s) {
       s->set_device(JobSpec::GPU);
       s->set_precision(JobSpec::BF16);
     }},
    {"GpuFp16",
     [](JobSpec* s) {
       s->set_device(JobSpec::GPU);
       s->set_precision(JobSpec::FP16);
     }},
    {"GpuCudaGraphs",
     [](JobSpec* s) {
       s->set_device(JobSpec::GPU);
       s->set_cuda_graphs(true);
     }},
    {"MlpSixteenWideLayers",
     [](JobSpec* s) {
       s->mutable_model()->clear_hidden_sizes();
       for (int i = 0; i < 16; ++i) s->mutable_model()->add_hidden_sizes(65536);
     }},
    {"MlpOneNarrowLayer",
     [](JobSpec* s) {
       s->mutable_model()->clear_hidden_sizes();
       s->mutable_model()->add_hidden_sizes(1);
     }},
    {"Cnn",
     [](JobSpec* s) {
       s->mutable_model()->set_name("cnn");
       s->mutable_model()->clear_hidden_sizes();
     }},
    {"DropoutJustBelowOne", [](JobSpec* s) { s->mutable_model()->set_dropout(0.999); }},
    {"IdxDataset", UseIdx},
    {"DotsInsideNamesAreFine",
     [](JobSpec* s) { s->mutable_dataset()->set_dir("/data/a..b/...cache/.x/..y"); }},
    {"AdamW", UseAdamW},
    {"AdamWZeroWeightDecay",
     [](JobSpec* s) {
       UseAdamW(s);
       s->mutable_optimizer()->set_weight_decay(0);
     }},
    {"NesterovWithMomentum",
     [](JobSpec* s) {
       s->mutable_optimizer()->set_momentum(0.9);
       s->mutable_optimizer()->set_nesterov(true);
     }},
    {"LrAtMaximum", [](JobSpec* s) { s->mutable_optimizer()->set_lr(10); }},
    {"WeightDecayOne", [](JobSpec* s) { s->mutable_optimizer()->set_weight_decay(1); }},
    {"GradClip", [](JobSpec* s) { s->mutable_optimizer()->set_grad_clip_norm(1.0); }},
    {"StepSchedule",
     [](JobSpec* s) {
       s->mutable_lr_schedule()->set_kind(LrScheduleSpec::STEP);
       s->mutable_lr_schedule()->set_step_size(1);
       s->mutable_lr_schedule()->set_gamma(1);
       s->mutable_lr_schedule()->set_warmup_steps(1'000'000'000);
     }},
    {"CosineDownToLr",
     [](JobSpec* s) {
       s->mutable_lr_schedule()->set_kind(LrScheduleSpec::COSINE);
       s->mutable_lr_schedule()->set_min_lr(0.01);
     }},
    {"CosineDownToZero",
     [](JobSpec* s) { s->mutable_lr_schedule()->set_kind(LrScheduleSpec::COSINE); }},
    {"BatchSizeAtMaximum", [](JobSpec* s) { s->set_batch_size(65536); }},
    {"OnlyMaxSteps",
     [](JobSpec* s) {
       s->set_epochs(0);
       s->set_max_steps(1'000'000'000'000);
     }},
    {"EpochsAtMaximum", [](JobSpec* s) { s->set_epochs(100000); }},
    {"BucketMbAtMaximum", [](JobSpec* s) { s->set_bucket_mb(1024); }},
    {"TinyBucket", [](JobSpec* s) { s->set_bucket_mb(0.001); }},
    {"GradAccumAtMaximum", [](JobSpec* s) { s->set_grad_accum_steps(1024); }},
    {"Checkpoints",
     [](JobSpec* s) {
       s->mutable_checkpoint()->set_dir("/var/lib/aidn/ckpt");
       s->mutable_checkpoint()->set_every_steps(500);
       s->mutable_checkpoint()->set_keep_last(1000);
     }},
    {"NoRestarts", [](JobSpec* s) { s->set_max_restarts(0); }},
    {"MaxRestartsAtMaximum", [](JobSpec* s) { s->set_max_restarts(100); }},
    {"PriorityExtremes", [](JobSpec* s) { s->set_priority(-1000); }},
    {"TimeoutsOfADay",
     [](JobSpec* s) {
       *s->mutable_timeouts()->mutable_rendezvous() = Seconds(86400);
       *s->mutable_timeouts()->mutable_worker() = Seconds(0, 1);
       *s->mutable_timeouts()->mutable_progress() = Seconds(86399, 999'999'999);
     }},
    {"RestartBackoffOfFiveMinutes",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_restart_backoff() = Seconds(300); }},
    {"RestartBackoffOfANanosecond",
     [](JobSpec* s) { *s->mutable_timeouts()->mutable_restart_backoff() = Seconds(0, 1); }},
    {"SixtyFourLabels",
     [](JobSpec* s) {
       for (int i = 0; i < 64; ++i) {
         (*s->mutable_labels())[absl::StrCat(Repeat('k', 60), i)] = Repeat('v', 256);
       }
     }},
    {"LabelKeyWithAllowedPunctuation",
     [](JobSpec* s) { (*s->mutable_labels())["aidn.dev/team_name-1"] = "Équipe démo"; }},
    {"EmptyLabelValue", [](JobSpec* s) { (*s->mutable_labels())["k"] = ""; }},
};

INSTANTIATE_TEST_SUITE_P(EdgeValues, GoodSpecTest, ::testing::ValuesIn(kGoodCases),
                         [](const ::testing::TestParamInfo<GoodCase>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------------------
// Defaults.

TEST(ApplyJobSpecDefaults, FillsEveryDocumentedDefault) {
  SpecLimits limits;
  limits.default_max_restarts = 5;
  limits.default_rendezvous_timeout = std::chrono::milliseconds(120'500);
  limits.default_worker_timeout = std::chrono::milliseconds(7'000);
  JobSpec spec = MinimalSpec();
  ApplyJobSpecDefaults(limits, &spec);

  EXPECT_EQ(spec.device(), JobSpec::CPU);
  EXPECT_EQ(spec.threads_per_rank(), 1);
  EXPECT_THAT(spec.model().hidden_sizes(), ::testing::ElementsAre(256, 256));
  EXPECT_EQ(spec.model().dropout(), 0);
  EXPECT_EQ(spec.dataset().kind(), "fashion-mnist");
  EXPECT_EQ(spec.dataset().dir(), "/usr/share/datasets/fashion-mnist");
  ASSERT_TRUE(spec.dataset().has_shuffle());
  EXPECT_TRUE(spec.dataset().shuffle());
  EXPECT_EQ(spec.optimizer().name(), "sgd");
  ASSERT_TRUE(spec.optimizer().has_lr());
  EXPECT_DOUBLE_EQ(spec.optimizer().lr(), 0.01);
  ASSERT_TRUE(spec.optimizer().has_weight_decay());
  EXPECT_EQ(spec.optimizer().weight_decay(), 0);
  EXPECT_EQ(spec.optimizer().beta1(), 0) << "adamw defaults leak into sgd";
  EXPECT_EQ(spec.lr_schedule().kind(), LrScheduleSpec::CONSTANT);
  EXPECT_EQ(spec.lr_schedule().gamma(), 0);
  EXPECT_EQ(spec.batch_size(), 64);
  EXPECT_EQ(spec.epochs(), 1);
  EXPECT_EQ(spec.max_steps(), 0);
  EXPECT_EQ(spec.strategy(), JobSpec::DDP);
  ASSERT_TRUE(spec.has_bucket_mb());
  EXPECT_EQ(spec.bucket_mb(), 25);
  EXPECT_EQ(spec.grad_accum_steps(), 1);
  EXPECT_EQ(spec.precision(), JobSpec::FP32);
  EXPECT_EQ(spec.checkpoint().keep_last(), 3);
  EXPECT_EQ(spec.checkpoint().dir(), "");
  ASSERT_TRUE(spec.has_max_restarts());
  EXPECT_EQ(spec.max_restarts(), 5);
  EXPECT_EQ(spec.timeouts().rendezvous().seconds(), 120);
  EXPECT_EQ(spec.timeouts().rendezvous().nanos(), 500'000'000);
  EXPECT_EQ(spec.timeouts().worker().seconds(), 7);
  EXPECT_EQ(spec.timeouts().worker().nanos(), 0);
  EXPECT_FALSE(spec.timeouts().has_progress()) << "progress must stay unset (automatic)";
  EXPECT_EQ(spec.timeouts().restart_backoff().seconds(), 1);
  EXPECT_EQ(spec.timeouts().restart_backoff().nanos(), 0);
  EXPECT_EQ(spec.world_size(), 2);
  EXPECT_EQ(spec.model().name(), "mlp");
}

TEST(ApplyJobSpecDefaults, UsesSpecLimitsDefaultsOutOfTheBox) {
  JobSpec spec = ValidSpec();
  EXPECT_EQ(spec.max_restarts(), 3);
  EXPECT_EQ(spec.timeouts().rendezvous().seconds(), 300);
  EXPECT_EQ(spec.timeouts().worker().seconds(), 10);
}

TEST(ApplyJobSpecDefaults, GivesAdamWItsOwnDefaults) {
  JobSpec spec = MinimalSpec();
  spec.mutable_optimizer()->set_name("adamw");
  ApplyJobSpecDefaults(SpecLimits(), &spec);
  EXPECT_DOUBLE_EQ(spec.optimizer().lr(), 0.001);
  EXPECT_DOUBLE_EQ(spec.optimizer().weight_decay(), 0.01);
  EXPECT_DOUBLE_EQ(spec.optimizer().beta1(), 0.9);
  EXPECT_DOUBLE_EQ(spec.optimizer().beta2(), 0.999);
  EXPECT_DOUBLE_EQ(spec.optimizer().eps(), 1e-8);
  EXPECT_TRUE(ValidateJobSpec(SpecLimits(), spec).ok());
}

TEST(ApplyJobSpecDefaults, GivesStepScheduleItsGamma) {
  JobSpec spec = MinimalSpec();
  spec.mutable_lr_schedule()->set_kind(LrScheduleSpec::STEP);
  spec.mutable_lr_schedule()->set_step_size(1000);
  ApplyJobSpecDefaults(SpecLimits(), &spec);
  EXPECT_DOUBLE_EQ(spec.lr_schedule().gamma(), 0.1);
  EXPECT_TRUE(ValidateJobSpec(SpecLimits(), spec).ok());
}

TEST(ApplyJobSpecDefaults, GivesFsdpFullShardAndOtherStrategiesNoFsdpOptions) {
  JobSpec spec = MinimalSpec();
  spec.set_strategy(JobSpec::FSDP);
  ApplyJobSpecDefaults(SpecLimits(), &spec);
  EXPECT_EQ(spec.fsdp().sharding(), v1::FsdpSpec::FULL_SHARD);
  EXPECT_TRUE(ValidateJobSpec(SpecLimits(), spec).ok());
  JobSpec zero2 = MinimalSpec();
  zero2.set_strategy(JobSpec::ZERO2);
  ApplyJobSpecDefaults(SpecLimits(), &zero2);
  EXPECT_FALSE(zero2.has_fsdp());
  EXPECT_TRUE(ValidateJobSpec(SpecLimits(), zero2).ok());
}

TEST(ApplyJobSpecDefaults, LeavesCnnAndIdxWithoutMlpOrFashionMnistDefaults) {
  JobSpec spec = MinimalSpec();
  spec.mutable_model()->set_name("cnn");
  UseIdx(&spec);
  ApplyJobSpecDefaults(SpecLimits(), &spec);
  EXPECT_EQ(spec.model().hidden_sizes_size(), 0);
  EXPECT_EQ(spec.dataset().dir(), "");
  EXPECT_TRUE(ValidateJobSpec(SpecLimits(), spec).ok());
}

TEST(ApplyJobSpecDefaults, DoesNotSetEpochsWhenMaxStepsIsGiven) {
  JobSpec spec = MinimalSpec();
  spec.set_max_steps(200);
  ApplyJobSpecDefaults(SpecLimits(), &spec);
  EXPECT_EQ(spec.epochs(), 0);
  EXPECT_EQ(spec.max_steps(), 200);
}

TEST(ApplyJobSpecDefaults, GivesAnUnknownOptimizerNoLearningRate) {
  JobSpec spec = MinimalSpec();
  spec.mutable_optimizer()->set_name("lion");
  ApplyJobSpecDefaults(SpecLimits(), &spec);
  EXPECT_FALSE(spec.optimizer().has_lr());
  absl::Status status = ValidateJobSpec(SpecLimits(), spec);
  EXPECT_THAT(std::string(status.message()), StartsWith("optimizer.name:"));
}

TEST(ApplyJobSpecDefaults, DoesNotOverwriteValuesTheUserSet) {
  JobSpec user;
  user.set_name("mine");
  user.set_world_size(4);
  user.set_device(JobSpec::GPU);
  user.set_threads_per_rank(8);
  user.mutable_model()->set_name("mlp");
  user.mutable_model()->add_hidden_sizes(32);
  user.mutable_dataset()->set_kind("fashion-mnist");
  user.mutable_dataset()->set_dir("/srv/fmnist");
  user.mutable_dataset()->set_shuffle(false);  // explicit false survives
  user.mutable_optimizer()->set_name("adamw");
  user.mutable_optimizer()->set_lr(0.003);
  user.mutable_optimizer()->set_weight_decay(0);  // explicit 0 survives
  user.mutable_optimizer()->set_beta1(0.8);
  user.mutable_optimizer()->set_beta2(0.95);
  user.mutable_optimizer()->set_eps(1e-6);
  user.mutable_lr_schedule()->set_kind(LrScheduleSpec::STEP);
  user.mutable_lr_schedule()->set_step_size(10);
  user.mutable_lr_schedule()->set_gamma(0.5);
  user.set_batch_size(128);
  user.set_epochs(7);
  user.set_strategy(JobSpec::DDP);
  user.set_bucket_mb(4);
  user.set_grad_accum_steps(2);
  user.set_precision(JobSpec::FP32);
  user.set_comm_backend(JobSpec::AUTO);
  user.mutable_checkpoint()->set_keep_last(9);
  user.set_max_restarts(0);  // explicit 0 survives
  *user.mutable_timeouts()->mutable_rendezvous() = Seconds(42);
  *user.mutable_timeouts()->mutable_worker() = Seconds(0);  // refused later, but kept
  *user.mutable_timeouts()->mutable_progress() = Seconds(600);
  *user.mutable_timeouts()->mutable_restart_backoff() = Seconds(0, 250'000'000);

  JobSpec spec = user;
  ApplyJobSpecDefaults(SpecLimits(), &spec);
  std::string diff;
  MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differencer.Compare(user, spec)) << diff;
}

TEST(ApplyJobSpecDefaults, DoesNotTurnInvalidValuesIntoValidOnes) {
  JobSpec spec = MinimalSpec();
  spec.set_batch_size(-1);
  spec.mutable_optimizer()->set_lr(0);
  spec.set_bucket_mb(0);
  ApplyJobSpecDefaults(SpecLimits(), &spec);
  EXPECT_EQ(spec.batch_size(), -1);
  EXPECT_EQ(spec.optimizer().lr(), 0);
  EXPECT_EQ(spec.bucket_mb(), 0);
  EXPECT_FALSE(ValidateJobSpec(SpecLimits(), spec).ok());
}

TEST(ApplyJobSpecDefaults, IsIdempotent) {
  std::vector<JobSpec> specs(5, MinimalSpec());
  specs[1].mutable_optimizer()->set_name("adamw");
  specs[2].mutable_lr_schedule()->set_kind(LrScheduleSpec::STEP);
  specs[3].mutable_model()->set_name("cnn");
  UseIdx(&specs[3]);
  specs[4].set_max_steps(10);
  specs[4].mutable_model()->clear_name();
  for (size_t i = 0; i < specs.size(); ++i) {
    JobSpec once = specs[i];
    ApplyJobSpecDefaults(SpecLimits(), &once);
    JobSpec twice = once;
    ApplyJobSpecDefaults(SpecLimits(), &twice);
    std::string diff;
    MessageDifferencer differencer;
    differencer.ReportDifferencesToString(&diff);
    EXPECT_TRUE(differencer.Compare(once, twice)) << "spec " << i << ": " << diff;
    EXPECT_FALSE(MessageDifferencer::Equals(specs[i], once)) << "spec " << i << " got no defaults";
  }
}

// ---------------------------------------------------------------------------
// ValidateSpecPath.

TEST(ValidateSpecPath, AcceptsOrdinaryPaths) {
  for (const char* path :
       {"/usr/share/datasets/fashion-mnist", "relative/dir", "a..b", "...", "..a", "a..", ".hidden",
        "./x", "x//y", "/", "x/./y", "/data/sp ace/ünïcode"}) {
    EXPECT_TRUE(ValidateSpecPath("f", path).ok()) << path;
  }
}

TEST(ValidateSpecPath, RefusesDotDotComponents) {
  for (const char* path :
       {"..", "../x", "x/../y", "x/..", "/..", "/../", "a/b/../../c", "x//..//y"}) {
    absl::Status status = ValidateSpecPath("checkpoint.dir", path);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_EQ(status.message(), "checkpoint.dir: path must not contain \"..\"") << path;
  }
}

TEST(ValidateSpecPath, RefusesEmptyPath) {
  absl::Status status = ValidateSpecPath("dataset.dir", "");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), StartsWith("dataset.dir: "));
  EXPECT_THAT(std::string(status.message()), HasSubstr("empty"));
}

TEST(ValidateSpecPath, AllowsExactly4096Bytes) {
  EXPECT_TRUE(ValidateSpecPath("f", std::string(4096, 'p')).ok());
  absl::Status status = ValidateSpecPath("f", std::string(4097, 'p'));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), StartsWith("f: "));
}

TEST(ValidateSpecPath, RefusesNulAndControlCharacters) {
  for (const std::string& path : {std::string("a\0b", 3), std::string("\0", 1), std::string("a\nb"),
                                  std::string("a\tb"), std::string("\x1b"), std::string("a\x7f")}) {
    absl::Status status = ValidateSpecPath("dataset.dir", path);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << absl::CEscape(path);
    EXPECT_THAT(std::string(status.message()), StartsWith("dataset.dir: "));
    // The message quotes the path escaped, never the raw control byte.
    EXPECT_EQ(status.message().find('\n'), absl::string_view::npos);
    EXPECT_EQ(status.message().find('\0'), absl::string_view::npos);
  }
}

}  // namespace
}  // namespace aidn::coordinator
