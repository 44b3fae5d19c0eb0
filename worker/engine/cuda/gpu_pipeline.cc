#include "worker/engine/cuda/gpu_pipeline.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {

absl::StatusOr<std::unique_ptr<GpuPipelineSession>> GpuPipelineSession::Create(
    GpuContext* ctx, GpuGpt* model, const OptimizerConfig& config,
    const GpuPipelineOptions& options) {
  if (ctx == nullptr || model == nullptr) {
    return absl::InvalidArgumentError("gpu pipeline: needs a context and a model");
  }
  const int stages = options.stages;
  const int stage = options.stage;
  if (stages < 1 || stage < 0 || stage >= stages) {
    return absl::InvalidArgumentError(absl::StrCat("gpu pipeline: stage ", stage, " of ", stages));
  }
  const bool first = stage == 0;
  const bool last = stage == stages - 1;
  if (model->embeds() != first || model->has_head() != last) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu pipeline: the model is not set up as stage ", stage, " of ", stages, " (SetStage)"));
  }
  if ((!first && options.prev == nullptr) || (!last && options.next == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("gpu pipeline stage ", stage, " of ", stages,
                                                   ": needs a link to each neighbour"));
  }
  if (stages > 1 && (options.pipeline == nullptr || options.pipeline->world_size() != stages)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu pipeline: needs a group of the ", stages, " stages"));
  }
  if (stages > 1 && (first || last) &&
      (options.tied == nullptr || options.tied->world_size() != 2)) {
    return absl::InvalidArgumentError(
        "gpu pipeline: the first and last stages share wte and need a group of the two");
  }
  std::unique_ptr<GpuPipelineSession> s(new GpuPipelineSession(ctx, model, options));
  s->params_ = model->StageParameters();
  for (GpuParameter* p : s->params_) {
    if (p->name == "transformer.wte.weight") s->wte_ = p;
  }
  AIDN_ASSIGN_OR_RETURN(s->optimizer_, GpuOptimizer::Create(ctx, config, s->params_));
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&s->done_, cudaEventDisableTiming));
  if (stages > 1) {
    // The whole model's norm: every stage's squares summed, wte's once
    // (the first stage's copy).
    StreamCollectives* pipeline = options.pipeline;
    s->optimizer_->SetNormAllReduce([pipeline, ctx](double* total) {
      return pipeline->AllReduceDoubleSumOn(ctx->stream(), total, 1);
    });
    if (!first && s->wte_ != nullptr) s->optimizer_->ExcludeFromNorm(s->wte_);
  }
  return s;
}

GpuPipelineSession::~GpuPipelineSession() {
  cudaStreamSynchronize(ctx_->stream());
  if (done_ != nullptr) cudaEventDestroy(done_);
}

absl::Status GpuPipelineSession::Forward(const std::vector<MicroBatch>& micro, int mb) {
  const MicroBatch& b = micro[static_cast<size_t>(mb)];
  // The same seed for a forward run again: the same masks and draws (a
  // micro-batch without one: its index, mixed with the step's).
  const uint64_t fallback = static_cast<uint64_t>(optimizer_->steps()) * 0x9e3779b97f4a7c15ULL +
                            static_cast<uint64_t>(mb);
  model_->SetSeed(b.seed.value_or(fallback));
  const int64_t rows = static_cast<int64_t>(b.tokens->size()) / b.seq_len;
  const float* input = first() ? nullptr : inputs_[static_cast<size_t>(mb)].data();
  AIDN_RETURN_IF_ERROR(model_->ForwardStage(first() ? b.tokens->data() : nullptr, input,
                                            last() ? b.labels->data() : nullptr, rows, b.seq_len,
                                            /*training=*/true));
  if (last()) {
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(static_cast<double*>(losses_.data()) + mb,
                                              model_->device_loss(), sizeof(double),
                                              cudaMemcpyDeviceToDevice, ctx_->stream()));
  }
  resident_ = mb;
  return absl::OkStatus();
}

absl::Status GpuPipelineSession::RunSchedule(const std::vector<MicroBatch>& micro) {
  const int m = static_cast<int>(micro.size());
  AIDN_ASSIGN_OR_RETURN(const std::vector<PipelineAction> actions,
                        StageActions(options_.schedule, options_.stages, options_.stage, m));
  stats_.peak_in_flight = PeakInFlight(actions);
  const double scale = 1.0 / static_cast<double>(m);
  std::vector<bool> counted(micro.size(), false);
  auto input = [this](int mb) { return inputs_[static_cast<size_t>(mb)].data(); };
  for (const PipelineAction& a : actions) {
    switch (a.kind) {
      case PipelineAction::kRecvActivation:
        AIDN_RETURN_IF_ERROR(Transfer(a, options_.prev, nullptr, input(a.micro_batch)));
        break;
      case PipelineAction::kForward: {
        AIDN_RETURN_IF_ERROR(Forward(micro, a.micro_batch));
        // Which parameters a forward of the step used (stochastic depth):
        // counted once per micro-batch, not for a recomputation.
        if (!counted[static_cast<size_t>(a.micro_batch)]) {
          counted[static_cast<size_t>(a.micro_batch)] = true;
          const std::vector<GpuParameter*> unused = model_->UnusedParameters();
          for (size_t k = 0; k < params_.size(); ++k) {
            if (std::find(unused.begin(), unused.end(), params_[k]) == unused.end()) {
              used_[k] = true;
            }
          }
        }
        break;
      }
      case PipelineAction::kSendActivation:
        AIDN_RETURN_IF_ERROR(Transfer(a, options_.next, model_->stage_output().data(), nullptr));
        break;
      case PipelineAction::kRecvGradient:
        AIDN_RETURN_IF_ERROR(Transfer(a, options_.next, nullptr, grad_output_.data()));
        break;
      case PipelineAction::kBackward:
        if (resident_ != a.micro_batch) {
          AIDN_RETURN_IF_ERROR(Forward(micro, a.micro_batch));
          ++stats_.recomputed;
        }
        AIDN_RETURN_IF_ERROR(model_->BackwardStage(last() ? nullptr : grad_output_.data(),
                                                   first() ? nullptr : &grad_input_, scale));
        resident_ = -1;
        break;
      case PipelineAction::kSendGradient:
        AIDN_RETURN_IF_ERROR(Transfer(a, options_.prev, grad_input_.data(), nullptr));
        break;
      case PipelineAction::kSendActivationRecvGradient:
        AIDN_RETURN_IF_ERROR(
            Transfer(a, options_.next, model_->stage_output().data(), grad_output_.data()));
        break;
      case PipelineAction::kSendGradientRecvActivation:
        AIDN_RETURN_IF_ERROR(Transfer(a, options_.prev, grad_input_.data(), input(a.other)));
        break;
    }
  }
  return absl::OkStatus();
}

absl::Status GpuPipelineSession::Transfer(const PipelineAction& a, DeviceLink* link,
                                          const float* send, float* recv) {
  const size_t n = static_cast<size_t>(floats_);
  const absl::Status s = link->ExchangeOn(ctx_->stream(), send, send != nullptr ? n : 0, recv,
                                          recv != nullptr ? n : 0);
  if (s.ok()) return s;
  // Named only when it failed: the step's hot path builds no strings.
  const char* what = "";
  switch (a.kind) {
    case PipelineAction::kRecvActivation:
      what = "receiving the activation of micro-batch ";
      break;
    case PipelineAction::kSendActivation:
    case PipelineAction::kSendActivationRecvGradient:
      what = "sending the activation of micro-batch ";
      break;
    case PipelineAction::kRecvGradient:
      what = "receiving the gradient of micro-batch ";
      break;
    default:
      what = "sending the gradient of micro-batch ";
      break;
  }
  return Annotate(s, absl::StrCat(what, a.micro_batch,
                                  a.other >= 0 ? absl::StrCat(" (and receiving for ", a.other, ")")
                                               : std::string()));
}

absl::Status GpuPipelineSession::WaitForStream(const char* what) {
  if (options_.stages == 1) return ctx_->Synchronize();
  // Bounded: the stream waits on the links and groups, whose peers may be
  // gone.
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(done_, ctx_->stream()));
  return options_.pipeline->WaitForEvent(done_, what);
}

absl::StatusOr<double> GpuPipelineSession::MeanLoss(int micro_batches) {
  cudaStream_t stream = ctx_->stream();
  double mean = 0;
  if (last()) {
    std::vector<double> losses(static_cast<size_t>(micro_batches));
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(losses.data(), losses_.data(),
                                              sizeof(double) * losses.size(),
                                              cudaMemcpyDeviceToHost, stream));
    AIDN_RETURN_IF_ERROR(WaitForStream("the pipeline step"));
    // As the one-rank trainer: the micro-batches' losses over m, in order.
    for (const double l : losses) mean += l / static_cast<double>(micro_batches);
  }
  if (options_.stages == 1) return mean;
  // To every stage: the last stage's mean, the others' zeros, summed.
  float share = static_cast<float>(mean);
  float* device = static_cast<float*>(mean_.data());
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(device, &share, sizeof(float), cudaMemcpyHostToDevice, stream));
  AIDN_RETURN_IF_ERROR(
      Annotate(options_.pipeline->AllReduceSumOn(stream, device, 1), "the step's loss"));
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(&share, device, sizeof(float), cudaMemcpyDeviceToHost, stream));
  AIDN_RETURN_IF_ERROR(WaitForStream("the step's loss"));
  return static_cast<double>(share);
}

absl::StatusOr<double> GpuPipelineSession::Step(const std::vector<MicroBatch>& micro, double lr) {
  if (micro.empty()) return absl::InvalidArgumentError("gpu pipeline: a step needs a micro-batch");
  const int64_t c = model_->config().n_embd;
  int64_t floats = -1;
  for (size_t i = 0; i < micro.size(); ++i) {
    const MicroBatch& b = micro[i];
    if (!IsTokenBatch(b)) {
      return absl::InvalidArgumentError(
          absl::StrCat("micro-batch ", i, " needs tokens and targets of [N, seq_len] each"));
    }
    const int64_t f = static_cast<int64_t>(b.tokens->size()) * c;
    if (floats >= 0 && f != floats) {
      return absl::InvalidArgumentError(
          "gpu pipeline: every micro-batch of a step has the same size (the activations' "
          "transfers)");
    }
    floats = f;
  }
  const int m = static_cast<int>(micro.size());
  stats_ = Stats();
  floats_ = floats;
  if (!first()) {
    inputs_.resize(micro.size());
    for (GpuTensor& t : inputs_) AIDN_RETURN_IF_ERROR(t.Resize(ctx_, {floats}));
  }
  if (!last()) AIDN_RETURN_IF_ERROR(grad_output_.Resize(ctx_, {floats}));
  if (m > slots_) {
    losses_.Release();
    AIDN_ASSIGN_OR_RETURN(losses_, ctx_->allocator().Allocate(sizeof(double) * micro.size()));
    slots_ = m;
  }
  if (mean_.data() == nullptr) {
    AIDN_ASSIGN_OR_RETURN(mean_, ctx_->allocator().Allocate(sizeof(float)));
  }
  used_.assign(params_.size(), false);
  resident_ = -1;
  AIDN_RETURN_IF_ERROR(model_->ZeroGrad());
  AIDN_RETURN_IF_ERROR(RunSchedule(micro));
  if (options_.stages > 1 && wte_ != nullptr) {
    // The tied embedding: the first stage's gradient (the tokens') and the
    // last's (the head's) summed on both, which then step it alike.
    AIDN_RETURN_IF_ERROR(
        Annotate(options_.tied->AllReduceSumOn(ctx_->stream(), wte_->grad.data(),
                                               static_cast<size_t>(wte_->grad.numel())),
                 "the tied wte's gradient"));
  }
  // What no forward of the step used is left alone (torch's "grad is
  // None"); wte and the stages' ends are always used.
  for (size_t k = 0; k < params_.size(); ++k) params_[k]->no_grad = !used_[k];
  AIDN_RETURN_IF_ERROR(Annotate(optimizer_->Step(lr), "optimizer"));
  return MeanLoss(m);
}

}  // namespace aidn::engine::cuda
