#include "coordinator/parallel_spec.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "coordinator/spec_checks.h"

namespace aidn::coordinator {
namespace {

constexpr int32_t kMaxMicroBatches = 1024;

// The layers with parameters a Sequential model of the spec has (its
// pipeline units): an mlp's hidden layers and its output, a cnn's two
// convolutions and two linear layers.
int LayersWithParameters(const v1::ModelSpec& model) {
  if (model.name() == "mlp") return model.hidden_sizes_size() + 1;
  if (model.name() == "cnn") return 4;
  // conv1, bn1, the residual blocks, fc.
  if (model.name() == "resnet18") return 3 + 8;
  if (model.name() == "resnet50") return 3 + 16;
  return 0;
}

}  // namespace

void ApplyParallelDefaults(v1::JobSpec* spec) {
  if (!spec->has_parallel()) return;
  v1::ParallelSpec* p = spec->mutable_parallel();
  if (p->tensor() == 0) p->set_tensor(1);
  if (p->pipeline() == 0) p->set_pipeline(1);
  if (p->pipeline() > 1) {
    if (p->micro_batches() == 0) p->set_micro_batches(p->pipeline());
    if (p->schedule() == v1::ParallelSpec::SCHEDULE_UNSPECIFIED) {
      p->set_schedule(v1::ParallelSpec::ONE_F_ONE_B);
    }
  }
}

int64_t DataReplicas(const v1::JobSpec& spec) {
  const int64_t model_ranks =
      int64_t{std::max(1, spec.parallel().tensor())} * std::max(1, spec.parallel().pipeline());
  return std::max<int64_t>(1, spec.world_size() / model_ranks);
}

absl::Status ValidateParallel(const v1::JobSpec& spec) {
  if (!spec.has_parallel()) return absl::OkStatus();
  const v1::ParallelSpec& p = spec.parallel();
  AIDN_RETURN_IF_ERROR(CheckIntRange("parallel.tensor", p.tensor(), 1, spec.world_size()));
  AIDN_RETURN_IF_ERROR(CheckIntRange("parallel.pipeline", p.pipeline(), 1, spec.world_size()));
  const int64_t model_ranks = int64_t{p.tensor()} * p.pipeline();
  if (spec.world_size() % model_ranks != 0) {
    return Invalid("world_size", absl::StrCat(spec.world_size(),
                                              " is not a multiple of parallel.tensor x "
                                              "parallel.pipeline = ",
                                              p.tensor(), " x ", p.pipeline(),
                                              " (world_size = data-parallel "
                                              "replicas x tensor x pipeline)"));
  }
  if (model_ranks > 1) {
    const char* field = p.tensor() > 1 ? "parallel.tensor" : "parallel.pipeline";
    if (spec.device() == v1::JobSpec::GPU) {
      // GPUs run a GPT's pipeline, one replica of it, for now.
      if (p.tensor() > 1) return Invalid("parallel.tensor", "runs on device: cpu for now");
      if (spec.model().name() != "gpt") {
        return Invalid("parallel.pipeline",
                       absl::StrCat("on device: gpu cuts a GPT for now (model ",
                                    spec.model().name(), " runs its pipeline on device: cpu)"));
      }
      if (spec.world_size() != p.pipeline()) {
        return Invalid("world_size", absl::StrCat(spec.world_size(),
                                                  ": a GPU pipeline runs one replica for now "
                                                  "(world_size = parallel.pipeline = ",
                                                  p.pipeline(), ")"));
      }
      if (spec.precision() == v1::JobSpec::FP16) {
        return Invalid("precision", "FP16 is not for GPU pipelines yet (fp32 or bf16)");
      }
    }
    // ZeRO-1 shards each stage's (or tensor rank's) optimizer state over
    // its replicas.
    const bool zero1 = spec.strategy() == v1::JobSpec::ZERO1 && spec.device() == v1::JobSpec::CPU;
    if (spec.strategy() != v1::JobSpec::DDP && !zero1) {
      return Invalid(field, absl::StrCat("combines with strategy: ddp, or zero1 on device: cpu "
                                         "(this job's strategy is ",
                                         v1::JobSpec::Strategy_Name(spec.strategy()), ")"));
    }
  }
  if (p.tensor() > 1) {
    const v1::ModelSpec& model = spec.model();
    if (model.name() != "gpt") {
      return Invalid("parallel.tensor",
                     absl::StrCat("splits a GPT's heads, MLP and vocabulary; model ", model.name(),
                                  " has none (use parallel.pipeline)"));
    }
    if (model.n_head() % p.tensor() != 0) {
      return Invalid("parallel.tensor",
                     absl::StrCat(p.tensor(), " does not divide model.n_head ", model.n_head(),
                                  " (each rank takes as many "
                                  "heads)"));
    }
    if (model.vocab_size() % p.tensor() != 0) {
      return Invalid(
          "parallel.tensor",
          absl::StrCat(p.tensor(), " does not divide model.vocab_size ", model.vocab_size(),
                       " (each rank takes as much of the "
                       "vocabulary)"));
    }
  }
  if (p.pipeline() == 1) {
    if (p.micro_batches() != 0) {
      return Invalid("parallel.micro_batches",
                     "applies with parallel.pipeline > 1 (to accumulate gradients over "
                     "micro-steps without a pipeline, set grad_accum_steps)");
    }
    if (p.schedule() != v1::ParallelSpec::SCHEDULE_UNSPECIFIED) {
      return Invalid("parallel.schedule", "applies with parallel.pipeline > 1");
    }
    return absl::OkStatus();
  }
  const v1::ModelSpec& model = spec.model();
  if (model.name() == "gpt") {
    if (model.n_layer() % p.pipeline() != 0) {
      return Invalid("parallel.pipeline",
                     absl::StrCat(p.pipeline(), " stages do not divide model.n_layer ",
                                  model.n_layer(), " (every stage runs as many blocks)"));
    }
  } else if (const int layers = LayersWithParameters(model); layers < p.pipeline()) {
    return Invalid("parallel.pipeline",
                   absl::StrCat(p.pipeline(), " stages, but model ", model.name(), " has ", layers,
                                " layers with parameters to give them"));
  }
  AIDN_RETURN_IF_ERROR(
      CheckIntRange("parallel.micro_batches", p.micro_batches(), 1, kMaxMicroBatches));
  if (spec.batch_size() % p.micro_batches() != 0) {
    return Invalid(
        "parallel.micro_batches",
        absl::StrCat(p.micro_batches(), " does not divide batch_size ", spec.batch_size(),
                     " (each micro-batch is batch_size / "
                     "micro_batches samples; micro_batches defaults to "
                     "parallel.pipeline)"));
  }
  switch (p.schedule()) {
    case v1::ParallelSpec::GPIPE:
    case v1::ParallelSpec::ONE_F_ONE_B:
      return absl::OkStatus();
    case v1::ParallelSpec::SCHEDULE_UNSPECIFIED:
      return Invalid("parallel.schedule", "not set (defaults were not applied)");
    default:
      return Invalid("parallel.schedule",
                     absl::StrCat("unknown value ", static_cast<int>(p.schedule()),
                                  " (known: gpipe, one_f_one_b)"));
  }
}

}  // namespace aidn::coordinator
