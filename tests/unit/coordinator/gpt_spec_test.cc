#include "coordinator/gpt_spec.h"

#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "coordinator/spec.h"

namespace aidn::coordinator {
namespace {

using v1::JobSpec;

// A language-model job as a user writes it, defaults applied.
JobSpec GptSpec(const std::function<void(JobSpec*)>& edit = nullptr) {
  JobSpec spec;
  spec.set_world_size(2);
  spec.mutable_model()->set_name("gpt");
  spec.set_max_steps(100);
  if (edit) edit(&spec);
  ApplyJobSpecDefaults(SpecLimits{}, &spec);
  return spec;
}

TEST(GptSpec, DefaultsAreTheCharacterModelOnFortunes) {
  const JobSpec spec = GptSpec();
  const v1::ModelSpec& m = spec.model();
  EXPECT_EQ(m.config(), "gpt-char");
  EXPECT_EQ(m.n_layer(), 6);
  EXPECT_EQ(m.n_head(), 6);
  EXPECT_EQ(m.n_embd(), 384);
  EXPECT_EQ(m.block_size(), 256);
  EXPECT_EQ(m.vocab_size(), 256);
  EXPECT_TRUE(m.has_bias() && m.bias());
  EXPECT_EQ(spec.dataset().kind(), "text");
  ASSERT_EQ(spec.dataset().files_size(), 1);
  EXPECT_EQ(spec.dataset().files(0), kDefaultTextCorpus);
  EXPECT_DOUBLE_EQ(spec.dataset().val_fraction(), 0.1);
  EXPECT_EQ(spec.dataset().eval_windows(), 64);
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, spec).ok()) << ValidateJobSpec(SpecLimits{}, spec);
}

TEST(GptSpec, ANamedConfigFillsOnlyTheSizesLeftUnset) {
  const JobSpec spec = GptSpec([](JobSpec* s) {
    s->mutable_model()->set_config("gpt2");
    s->mutable_model()->set_n_layer(2);
    s->mutable_model()->set_block_size(64);
    s->mutable_model()->set_bias(false);
  });
  EXPECT_EQ(spec.model().n_layer(), 2);
  EXPECT_EQ(spec.model().n_head(), 12);
  EXPECT_EQ(spec.model().n_embd(), 768);
  EXPECT_EQ(spec.model().block_size(), 64);
  EXPECT_EQ(spec.model().vocab_size(), 50257);
  EXPECT_FALSE(spec.model().bias());
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, spec).ok());
}

TEST(GptSpec, BadFieldsAreNamed) {
  struct Case {
    std::function<void(JobSpec*)> edit;
    std::string message;
  };
  const Case cases[] = {
      {[](JobSpec* s) { s->mutable_model()->set_config("gpt5"); },
       "model.config: unknown gpt configuration \"gpt5\" (known: gpt-char, gpt-mini, gpt-nano, "
       "gpt2, gpt2-medium)"},
      {[](JobSpec* s) { s->mutable_model()->set_n_head(5); },
       "model.n_embd: must be a multiple of model.n_head (5), got 384"},
      {[](JobSpec* s) { s->mutable_model()->set_n_layer(-1); },
       "model.n_layer: must be between 1 and 1024, got -1"},
      {[](JobSpec* s) { s->mutable_model()->set_vocab_size(100); },
       "model.vocab_size: must be at least 256 for byte-level text, got 100"},
      {[](JobSpec* s) {
         s->mutable_model()->set_n_head(1);
         s->mutable_model()->set_n_embd(65536);
       },
       "model.n_embd: max(vocab_size, 4 n_embd) x n_embd must be at most 2^31, got 17179869184"},
      {[](JobSpec* s) { s->mutable_model()->add_hidden_sizes(8); },
       "model.hidden_sizes: only applies to mlp (gpt's widths are n_embd)"},
      {[](JobSpec* s) { s->mutable_model()->set_dropout(1.0); },
       "model.dropout: must be a finite number in [0, 1), got 1"},
      {[](JobSpec* s) {
         s->mutable_dataset()->Clear();
         s->mutable_dataset()->set_kind("fashion-mnist");
         s->mutable_dataset()->set_dir("/usr/share/datasets/fashion-mnist");
       },
       "dataset.kind: model gpt trains on dataset.kind \"text\", got \"fashion-mnist\""},
      {[](JobSpec* s) {
         s->set_device(JobSpec::GPU);
         s->mutable_model()->set_activation_checkpointing(true);
       },
       "model.activation_checkpointing: runs on device: cpu for now"},
      {[](JobSpec* s) {
         s->set_device(JobSpec::GPU);
         s->set_cuda_graphs(true);
       },
       "cuda_graphs: not for model gpt yet (mlp, cnn and resnet steps are captured)"},
      {[](JobSpec* s) { s->mutable_dataset()->set_val_fraction(0.7); },
       "dataset.val_fraction: must be in (0, 0.5], got 0.7"},
      {[](JobSpec* s) { s->mutable_dataset()->set_val_fraction(0); },
       "dataset.val_fraction: must be in (0, 0.5], got 0"},
      {[](JobSpec* s) { s->mutable_dataset()->set_eval_windows(-3); },
       "dataset.eval_windows: must be between 1 and 1000000, got -3"},
      {[](JobSpec* s) { s->mutable_dataset()->add_files("corpus/../../etc/shadow"); },
       "dataset.files[1]: path must not contain \"..\""},
      {[](JobSpec* s) { s->mutable_dataset()->set_dir("/tmp"); },
       "dataset.dir: does not apply to dataset.kind text (use files)"},
      {[](JobSpec* s) { s->set_eval_every_steps(-1); },
       "eval_every_steps: must be between 0 and 1000000000000, got -1"},
  };
  for (const Case& c : cases) {
    JobSpec spec = GptSpec();
    c.edit(&spec);
    const absl::Status s = ValidateJobSpec(SpecLimits{}, spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(std::string(s.message()), c.message);
  }
}

TEST(GptSpec, TrainsOnAGpuInEveryPrecision) {
  for (const JobSpec::Precision precision : {JobSpec::FP32, JobSpec::BF16, JobSpec::FP16}) {
    JobSpec spec = GptSpec();
    spec.set_device(JobSpec::GPU);
    spec.set_precision(precision);
    spec.set_world_size(2);
    EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, spec).ok())
        << JobSpec::Precision_Name(precision) << ": " << ValidateJobSpec(SpecLimits{}, spec);
    // ZeRO-1: the optimizer's state sharded over the GPUs.
    JobSpec zero1 = spec;
    zero1.set_strategy(JobSpec::ZERO1);
    EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, zero1).ok()) << ValidateJobSpec(SpecLimits{}, zero1);
    // ZeRO-2 and FSDP: gradients, and the weights, sharded too.
    for (const JobSpec::Strategy strategy : {JobSpec::ZERO2, JobSpec::FSDP}) {
      JobSpec sharded = spec;
      sharded.set_strategy(strategy);
      if (strategy == JobSpec::FSDP) sharded.mutable_fsdp()->set_sharding(v1::FsdpSpec::FULL_SHARD);
      sharded.mutable_model()->set_stochastic_depth(0.1);
      EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, sharded).ok())
          << ValidateJobSpec(SpecLimits{}, sharded);
    }
    // Blocks skipped by stochastic depth, their parameters left alone.
    spec.mutable_model()->set_stochastic_depth(0.1);
    spec.mutable_ddp()->set_find_unused_parameters(true);
    spec.mutable_ddp()->set_compression(v1::DdpSpec::NONE);
    EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, spec).ok()) << ValidateJobSpec(SpecLimits{}, spec);
    spec.set_strategy(JobSpec::ZERO1);
    EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, spec).ok()) << ValidateJobSpec(SpecLimits{}, spec);
  }
}

TEST(GptSpec, TextFieldsAndGptFieldsBelongTogether) {
  JobSpec mlp;
  mlp.set_world_size(1);
  mlp.mutable_model()->set_name("mlp");
  mlp.mutable_model()->set_n_layer(4);
  ApplyJobSpecDefaults(SpecLimits{}, &mlp);
  EXPECT_EQ(ValidateJobSpec(SpecLimits{}, mlp).message(),
            "model.n_layer: only applies to model gpt");

  JobSpec checkpointed;
  checkpointed.set_world_size(1);
  checkpointed.mutable_model()->set_name("cnn");
  checkpointed.mutable_model()->set_activation_checkpointing(true);
  ApplyJobSpecDefaults(SpecLimits{}, &checkpointed);
  EXPECT_EQ(ValidateJobSpec(SpecLimits{}, checkpointed).message(),
            "model.activation_checkpointing: only applies to model gpt");

  JobSpec files;
  files.set_world_size(1);
  files.mutable_model()->set_name("mlp");
  files.mutable_dataset()->add_files("/usr/share/games/fortunes");
  ApplyJobSpecDefaults(SpecLimits{}, &files);
  EXPECT_EQ(ValidateJobSpec(SpecLimits{}, files).message(),
            "dataset.files: only applies to dataset.kind text");

  JobSpec text;
  text.set_world_size(1);
  text.mutable_model()->set_name("cnn");
  text.mutable_dataset()->set_kind("text");
  ApplyJobSpecDefaults(SpecLimits{}, &text);
  EXPECT_EQ(ValidateJobSpec(SpecLimits{}, text).message(),
            "model.name: dataset.kind text trains model gpt, got \"cnn\"");
}

TEST(GptSpec, CommandJobsLeaveEvaluationToTheirProgram) {
  JobSpec spec;
  spec.set_world_size(1);
  spec.mutable_command()->add_argv("python3");
  spec.set_eval_every_steps(10);
  ApplyJobSpecDefaults(SpecLimits{}, &spec);
  const absl::Status s = ValidateJobSpec(SpecLimits{}, spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(s.message(), "eval_every_steps: configures the built-in trainer"))
      << s.message();
}

}  // namespace
}  // namespace aidn::coordinator
