// GpuSession for a GPT decoder: GpuGpt + GpuOptimizer, and for more than
// one rank the NCCL communicator and DDP reducer of session_setup.h, fed
// from the decoder's grad-ready reports during the last micro-batch's
// backward (the stream order is gpu_session.cc's).
//
// A step: gradients zeroed; per micro-batch its seed, the tokens uploaded,
// forward, the loss copied into the step's slot, backward scaled by 1/k
// (times the loss scale in fp16); the reducer's allreduces waited for on
// the device; in fp16 the gradients unscaled and checked (a host wait) and
// an overflowed step's update skipped; the update; the losses copied into
// pinned memory; one host wait at the end.
#include <cuda_runtime.h>

#include <algorithm>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/gpu_gpt.h"
#include "worker/engine/cuda/gpu_optimizer.h"
#include "worker/engine/cuda/session_setup.h"
#include "worker/engine/cuda/status.h"
#include "worker/engine/gpu_session.h"

namespace aidn::engine {
namespace {

class CudaGptSession final : public GpuSession {
 public:
  using GpuSession::Step;

  static absl::StatusOr<std::unique_ptr<GpuSession>> Make(const GpuSessionOptions& options,
                                                          const Gpt& model,
                                                          const OptimizerConfig& optimizer) {
    if (options.cuda_graphs) {
      return absl::UnimplementedError(
          "cuda_graphs: not for model gpt yet (mlp, cnn and resnet steps are captured)");
    }
    AIDN_ASSIGN_OR_RETURN(cuda::SessionDevice device, cuda::SetUpSessionDevice(options));
    std::unique_ptr<CudaGptSession> s(new CudaGptSession());
    s->ctx_ = std::move(device.ctx);
    s->description_ = std::move(device.description);
    AIDN_ASSIGN_OR_RETURN(s->model_, cuda::GpuGpt::Create(s->ctx_.get(), model));
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&s->done_, cudaEventDisableTiming));
    AIDN_RETURN_IF_ERROR(cuda::SetUpSessionDdp(options, s->ctx_.get(), s->model_->Parameters(),
                                               &s->ddp_, &s->description_));
    // ZeRO-2 and FSDP: the blocks gathered and reduce-scattered from the
    // decoder's unit hooks.
    AIDN_RETURN_IF_ERROR(s->model_->SetUnitHooks(s->ddp_.unit_hooks()));
    // ZeRO: the optimizer steps this rank's shards only (its state never
    // whole on the device), clipping by the whole gradient's norm.
    const std::vector<cuda::GpuParameter*>* shards = s->ddp_.shards();
    AIDN_ASSIGN_OR_RETURN(
        s->optimizer_,
        cuda::GpuOptimizer::Create(s->ctx_.get(), optimizer,
                                   shards != nullptr ? *shards : s->model_->Parameters()));
    if (shards != nullptr) s->optimizer_->SetNormAllReduce(s->ddp_.NormAllReduce(s->ctx_.get()));
    if (options.precision == "fp16") {
      // Dynamic loss scaling with GradScaler's defaults, as GpuTrainer's.
      AIDN_ASSIGN_OR_RETURN(DynamicLossScaler scaler,
                            DynamicLossScaler::Create(LossScaleOptions()));
      s->scaler_ = scaler;
      AIDN_ASSIGN_OR_RETURN(s->found_, s->ctx_->allocator().Allocate(sizeof(int32_t)));
      AIDN_RETURN_IF_CUDA_ERROR(
          cudaMallocHost(reinterpret_cast<void**>(&s->host_found_), sizeof(int32_t)));
    }
    return std::unique_ptr<GpuSession>(std::move(s));
  }

  ~CudaGptSession() override {
    if (done_ != nullptr) {
      cudaEventSynchronize(done_);
      cudaEventDestroy(done_);
    }
    if (host_losses_ != nullptr) cudaFreeHost(host_losses_);
    if (host_found_ != nullptr) cudaFreeHost(host_found_);
  }

  void SetSeed(uint64_t seed) override { model_->SetSeed(seed); }

  absl::StatusOr<double> Step(const std::vector<MicroBatch>& micro, double lr) override {
    if (micro.empty()) return absl::InvalidArgumentError("a step needs at least one micro-batch");
    for (size_t i = 0; i < micro.size(); ++i) {
      const MicroBatch& b = micro[i];
      if (!IsTokenBatch(b)) {
        return absl::InvalidArgumentError(
            absl::StrCat("micro-batch ", i, " needs tokens and targets of [N, seq_len] each"));
      }
    }
    const int64_t k = static_cast<int64_t>(micro.size());
    AIDN_RETURN_IF_ERROR(ReserveLossSlots(k));
    double* slots = static_cast<double*>(device_losses_.data());
    cudaStream_t stream = ctx_->stream();
    // fp16: the loss gradient times the loss scale.
    const double loss_scale = scaler_ ? scaler_->scale() : 1.0;
    const double grad_scale = loss_scale / static_cast<double>(k);
    last_skipped_ = false;
    AIDN_RETURN_IF_ERROR(model_->ZeroGrad());
    AIDN_RETURN_IF_ERROR(ddp_.BeginStep({}));
    const cuda::GpuGpt::GradReadyFn on_ready = ddp_.GradReady();
    // Which parameters some forward of the step used (stochastic depth
    // skips blocks), as GpuTrainer::Step tracks them.
    const std::vector<cuda::GpuParameter*> params = model_->Parameters();
    std::vector<bool> used(params.size(), false);
    for (int64_t i = 0; i < k; ++i) {
      const MicroBatch& b = micro[static_cast<size_t>(i)];
      if (b.seed.has_value()) model_->SetSeed(*b.seed);
      const int64_t rows = static_cast<int64_t>(b.tokens->size()) / b.seq_len;
      AIDN_RETURN_IF_ERROR(
          model_->Forward(b.tokens->data(), b.labels->data(), rows, b.seq_len, true));
      AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(slots + i, model_->device_loss(), sizeof(double),
                                                cudaMemcpyDeviceToDevice, stream));
      const std::vector<cuda::GpuParameter*> unused = model_->UnusedParameters();
      for (size_t j = 0; j < params.size(); ++j) {
        if (std::find(unused.begin(), unused.end(), params[j]) == unused.end()) used[j] = true;
      }
      const bool last = i == k - 1;
      if (last) AIDN_RETURN_IF_ERROR(ddp_.BeginBackward(used, unused));
      AIDN_RETURN_IF_ERROR(model_->Backward(grad_scale, last ? on_ready : nullptr));
    }
    // One rank: what no forward of the step used is left alone (with more:
    // the reducer decides from every rank's flags).
    if (!ddp_.active()) {
      for (size_t j = 0; j < params.size(); ++j) params[j]->no_grad = !used[j];
    }
    AIDN_RETURN_IF_ERROR(ddp_.AfterBackward());
    if (scaler_) {
      // Unscaled and checked after the averages; a step whose gradients
      // overflowed is skipped and the scale backed off (a second host wait).
      // ZeRO: each rank checks its shards, the flag goes over the ranks.
      const bool sharded = ddp_.shards() != nullptr;
      AIDN_ASSIGN_OR_RETURN(const bool overflow,
                            cuda::UnscaleAndCheckGradients(
                                ctx_.get(), optimizer_->parameters(), loss_scale,
                                static_cast<int32_t*>(found_.data()), host_found_,
                                [this] { return WaitForStream(/*end_of_step=*/false); },
                                sharded ? ddp_.OverflowAllReduce(ctx_.get()) : nullptr));
      last_skipped_ = !scaler_->Update(overflow);
    }
    if (!last_skipped_) AIDN_RETURN_IF_ERROR(optimizer_->Step(lr));
    AIDN_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(host_losses_, slots, sizeof(double) * k, cudaMemcpyDeviceToHost, stream));
    AIDN_RETURN_IF_ERROR(WaitForStream(/*end_of_step=*/true));
    // As the CPU trainer: the mean of the micro-batches' losses.
    double loss = 0;
    for (int64_t i = 0; i < k; ++i) loss += host_losses_[i] / static_cast<double>(k);
    return loss;
  }

  absl::StatusOr<EvalResult> Evaluate(const MicroBatch& b) override {
    if (!IsTokenBatch(b)) {
      return absl::InvalidArgumentError(
          "an evaluation batch needs tokens and targets of [N, "
          "seq_len] each");
    }
    const int64_t rows = static_cast<int64_t>(b.tokens->size()) / b.seq_len;
    AIDN_RETURN_IF_ERROR(
        model_->Forward(b.tokens->data(), b.labels->data(), rows, b.seq_len, /*training=*/false));
    EvalResult r;
    AIDN_ASSIGN_OR_RETURN(r.mean_loss, model_->ReadLoss());
    AIDN_ASSIGN_OR_RETURN(r.correct, cuda::CountCorrectOnDevice(ctx_.get(), model_->logits(),
                                                                *b.labels, &eval_scratch_));
    return r;
  }

  double last_allreduce_seconds() const override { return ddp_.allreduce_seconds(); }
  double last_allreduce_wait_seconds() const override { return ddp_.exposed_seconds(); }

  int64_t last_bytes_sent() const override { return ddp_.bytes_sent(); }
  int64_t last_bytes_uncompressed() const override { return ddp_.bytes_uncompressed(); }
  bool last_step_skipped() const override { return last_skipped_; }
  std::optional<LossScaleState> loss_scale_state() const override {
    if (!scaler_) return std::nullopt;
    return scaler_->state();
  }
  absl::Status RestoreLossScale(const LossScaleState& state) override {
    if (!scaler_) {
      return absl::FailedPreconditionError("no loss scale to restore: only fp16 training has one");
    }
    return scaler_->Restore(state);
  }
  int64_t collective_sequence() const override { return ddp_.collective_sequence(); }

  absl::Status CopyParametersTo(const std::vector<Parameter*>& cpu) override {
    // ZeRO-2 and FSDP: every unit whole for the copy.
    AIDN_RETURN_IF_ERROR(ddp_.GatherFullParameters());
    absl::Status s = model_->CopyWeightsTo(cpu);
    ddp_.ReleaseFullParameters();
    return s;
  }

  absl::Status CopyShardsTo(const std::vector<Parameter*>& shards) override {
    return ddp_.CopyShardsTo(ctx_.get(), shards);
  }

  absl::Status GatherFullParameters() override { return ddp_.GatherFullParameters(); }
  void ReleaseFullParameters() override { ddp_.ReleaseFullParameters(); }

  absl::Status CopyBuffersTo(const std::vector<Parameter*>& cpu) override {
    if (!cpu.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("a GPT has no buffers; asked for ", cpu.size()));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> OptimizerState() override {
    return optimizer_->StateToHost();
  }
  int64_t optimizer_steps() const override { return optimizer_->steps(); }
  absl::Status LoadOptimizerState(const std::vector<std::pair<std::string, const Tensor*>>& state,
                                  int64_t steps) override {
    return optimizer_->LoadStateFromHost(state, steps);
  }

  std::string Describe() const override { return description_; }

  StateMemory memory() const override {
    return ddp_.Memory(model_->Parameters(), {}, optimizer_->state_bytes());
  }

  int64_t device_peak_bytes() const override {
    return static_cast<int64_t>(ctx_->allocator().stats().peak_bytes_in_use);
  }

 private:
  CudaGptSession() = default;

  // Room for k losses on the device and in pinned host memory.
  absl::Status ReserveLossSlots(int64_t k) {
    if (k <= slots_) return absl::OkStatus();
    if (host_losses_ != nullptr) {
      AIDN_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(done_));
      cudaFreeHost(host_losses_);
      host_losses_ = nullptr;
    }
    AIDN_RETURN_IF_CUDA_ERROR(
        cudaMallocHost(reinterpret_cast<void**>(&host_losses_), sizeof(double) * k));
    device_losses_.Release();
    AIDN_ASSIGN_OR_RETURN(device_losses_, ctx_->allocator().Allocate(sizeof(double) * k));
    slots_ = k;
    return absl::OkStatus();
  }

  // Waits for what the stream queued so far (polling NCCL with DDP: a dead
  // peer would leave the event pending forever); at the end of a step
  // through the reducer's Wait (timings, ZeRO-1's all-gathers).
  absl::Status WaitForStream(bool end_of_step) {
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(done_, ctx_->stream()));
    return end_of_step ? ddp_.Wait(done_) : ddp_.WaitForCheck(done_);
  }

  // Destroyed in reverse: the reducer and communicator first, the context
  // last.
  std::unique_ptr<cuda::GpuContext> ctx_;
  std::unique_ptr<cuda::GpuGpt> model_;
  std::unique_ptr<cuda::GpuOptimizer> optimizer_;
  cuda::DeviceBuffer device_losses_;
  double* host_losses_ = nullptr;
  int64_t slots_ = 0;
  cudaEvent_t done_ = nullptr;
  cuda::SessionDdp ddp_;
  cuda::EvalScratch eval_scratch_;
  std::string description_;
  // fp16: the loss scaler, and the overflow flag on the device and pinned.
  std::optional<DynamicLossScaler> scaler_;
  cuda::DeviceBuffer found_;
  int32_t* host_found_ = nullptr;
  bool last_skipped_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GpuSession>> GpuSession::CreateForGpt(
    const GpuSessionOptions& options, const Gpt& model, const OptimizerConfig& optimizer) {
  return CudaGptSession::Make(options, model, optimizer);
}

}  // namespace aidn::engine
