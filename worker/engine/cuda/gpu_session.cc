// GpuSession on CUDA: GpuContext + GpuModel + GpuTrainer, and for more than
// one rank an NcclCommunicator and a GpuDdpReducer wired into the trainer's
// hooks.
//
// Stream order of a step with several ranks: backward is queued on the
// compute stream; as each bucket's last gradient is queued, the NCCL stream
// waits for an event there and reduces the bucket while the compute stream
// goes on with the earlier layers' backward; the compute stream then waits
// for the NCCL stream's last event before the optimizer. The host waits
// once, for the step's end, polling NCCL (a dead peer fails the step).
#include "worker/engine/gpu_session.h"

#include <cuda_runtime.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_model.h"
#include "worker/engine/cuda/session_setup.h"

namespace aidn::engine {
namespace {

class CudaGpuSession final : public GpuSession {
 public:
  using GpuSession::Step;

  static absl::StatusOr<std::unique_ptr<GpuSession>> Make(const GpuSessionOptions& options,
                                                          const Sequential& model,
                                                          const OptimizerConfig& optimizer) {
    AIDN_ASSIGN_OR_RETURN(cuda::SessionDevice device, cuda::SetUpSessionDevice(options));
    std::unique_ptr<CudaGpuSession> s(new CudaGpuSession());
    s->ctx_ = std::move(device.ctx);
    s->description_ = std::move(device.description);
    AIDN_ASSIGN_OR_RETURN(s->model_, cuda::GpuModel::Create(s->ctx_.get(), model));
    AIDN_RETURN_IF_ERROR(cuda::SetUpSessionDdp(options, s->ctx_.get(), s->model_->Parameters(),
                                               &s->ddp_, &s->description_));
    // ZeRO-1: the optimizer steps this rank's shards only (its state never
    // whole on the device).
    const std::vector<cuda::GpuParameter*>* shards = s->ddp_.shards();
    AIDN_ASSIGN_OR_RETURN(
        s->trainer_, cuda::GpuTrainer::Create(s->ctx_.get(), s->model_.get(), optimizer, shards));
    if (shards != nullptr) {
      // Clipping by the whole gradient's norm; fp16's overflow by every
      // rank's shards.
      s->trainer_->optimizer().SetNormAllReduce(s->ddp_.NormAllReduce(s->ctx_.get()));
      s->trainer_->SetOverflowAllReduce(s->ddp_.OverflowAllReduce(s->ctx_.get()));
    }
    if (options.cuda_graphs && !s->ddp_.active()) {
      s->trainer_->SetCudaGraphs(true);
      absl::StrAppend(&s->description_, ", CUDA graphs");
    } else if (options.cuda_graphs) {
      absl::StrAppend(&s->description_, ", CUDA graphs not used (not with NCCL yet)");
    }
    if (s->ddp_.active()) {
      cuda::SessionDdp* ddp = &s->ddp_;
      cuda::GpuModel* gpu_model = s->model_.get();
      // DDP: buckets launched from the grad-ready reports; ZeRO-2 and FSDP:
      // units gathered and reduce-scattered from the model's unit hooks.
      if (auto ready = ddp->GradReady(); ready) s->trainer_->SetGradReady(std::move(ready));
      gpu_model->SetUnitHooks(ddp->unit_hooks());
      s->trainer_->SetBeforeForward(
          [ddp, gpu_model] { return ddp->BeginStep(gpu_model->Buffers()); });
      s->trainer_->SetBeforeLastBackward(
          [ddp](const std::vector<bool>& used, const std::vector<cuda::GpuParameter*>& unused_now) {
            return ddp->BeginBackward(used, unused_now);
          });
      s->trainer_->SetAfterBackward([ddp] { return ddp->AfterBackward(); });
      s->trainer_->SetWait([ddp](cudaEvent_t done) { return ddp->Wait(done); });
      s->trainer_->SetCheckWait([ddp](cudaEvent_t event) { return ddp->WaitForCheck(event); });
#if AIDN_HAVE_NCCL
      if (options.sync_batchnorm) {
        // The statistics' collectives on the reducer's communicator's stream.
        gpu_model->SetBatchNormSync(s->ddp_.nccl.get());
        absl::StrAppend(&s->description_, ", SyncBatchNorm");
      }
#endif
    }
    return std::unique_ptr<GpuSession>(std::move(s));
  }

  void SetSeed(uint64_t seed) override { model_->SetSeed(seed); }

  absl::StatusOr<double> Step(const std::vector<MicroBatch>& micro, double lr) override {
    return trainer_->Step(micro, lr);
  }

  absl::StatusOr<EvalResult> Evaluate(const MicroBatch& b) override {
    if (b.images == nullptr || b.labels == nullptr) {
      return absl::InvalidArgumentError("an evaluation batch needs images and labels");
    }
    // The layers' buffers may move (another batch size): a captured step
    // would read the old ones.
    trainer_->InvalidateGraph();
    AIDN_RETURN_IF_ERROR(eval_input_.CopyFromHost(ctx_.get(), *b.images));
    AIDN_RETURN_IF_ERROR(model_->Forward(eval_input_, &eval_logits_, /*training=*/false));
    cuda::GpuCrossEntropy xent(ctx_.get());
    AIDN_RETURN_IF_ERROR(xent.Compute(eval_logits_, *b.labels, /*grad_logits=*/nullptr));
    EvalResult r;
    AIDN_ASSIGN_OR_RETURN(r.mean_loss, xent.Loss());
    AIDN_ASSIGN_OR_RETURN(
        r.correct, cuda::CountCorrectOnDevice(ctx_.get(), eval_logits_, *b.labels, &eval_scratch_));
    return r;
  }

  double last_allreduce_seconds() const override { return ddp_.allreduce_seconds(); }

  double last_allreduce_wait_seconds() const override { return ddp_.exposed_seconds(); }

  int64_t last_bytes_sent() const override { return ddp_.bytes_sent(); }
  int64_t last_bytes_uncompressed() const override { return ddp_.bytes_uncompressed(); }

  bool last_step_skipped() const override { return trainer_->last_step_skipped(); }

  std::optional<LossScaleState> loss_scale_state() const override {
    const DynamicLossScaler* scaler = trainer_->loss_scaler();
    if (scaler == nullptr) return std::nullopt;
    return scaler->state();
  }

  absl::Status RestoreLossScale(const LossScaleState& state) override {
    return trainer_->RestoreLossScale(state);
  }

  int64_t collective_sequence() const override { return ddp_.collective_sequence(); }

  absl::Status CopyParametersTo(const std::vector<Parameter*>& cpu) override {
    // ZeRO-2 and FSDP: every unit whole for the copy.
    AIDN_RETURN_IF_ERROR(ddp_.GatherFullParameters());
    absl::Status s = model_->CopyParametersTo(cpu);
    ddp_.ReleaseFullParameters();
    return s;
  }

  absl::Status CopyShardsTo(const std::vector<Parameter*>& shards) override {
    return ddp_.CopyShardsTo(ctx_.get(), shards);
  }

  absl::Status GatherFullParameters() override {
    trainer_->InvalidateGraph();
    return ddp_.GatherFullParameters();
  }
  void ReleaseFullParameters() override { ddp_.ReleaseFullParameters(); }

  absl::Status CopyBuffersTo(const std::vector<Parameter*>& cpu) override {
    return model_->CopyBuffersTo(cpu);
  }

  absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> OptimizerState() override {
    return trainer_->optimizer().StateToHost();
  }

  int64_t optimizer_steps() const override { return trainer_->optimizer().steps(); }

  absl::Status LoadOptimizerState(const std::vector<std::pair<std::string, const Tensor*>>& state,
                                  int64_t steps) override {
    return trainer_->optimizer().LoadStateFromHost(state, steps);
  }

  std::string Describe() const override { return description_; }

  StateMemory memory() const override {
    return ddp_.Memory(model_->Parameters(), model_->Buffers(),
                       trainer_->optimizer().state_bytes());
  }

  int64_t device_peak_bytes() const override {
    return static_cast<int64_t>(ctx_->allocator().stats().peak_bytes_in_use);
  }

 private:
  CudaGpuSession() = default;

  // Destroyed in reverse: the reducer first (it gives the model's
  // gradients their own storage back and synchronises both streams), then
  // the communicator, the trainer, the model, and the context last.
  std::unique_ptr<cuda::GpuContext> ctx_;
  std::unique_ptr<cuda::GpuModel> model_;
  std::unique_ptr<cuda::GpuTrainer> trainer_;
  cuda::SessionDdp ddp_;
  // Evaluate's input, logits and scratch.
  cuda::GpuTensor eval_input_, eval_logits_;
  cuda::EvalScratch eval_scratch_;
  std::string description_;
};

}  // namespace

bool GpuSessionAvailable() { return true; }

absl::StatusOr<std::unique_ptr<GpuSession>> GpuSession::Create(const GpuSessionOptions& options,
                                                               const Sequential& model,
                                                               const OptimizerConfig& optimizer) {
  return CudaGpuSession::Make(options, model, optimizer);
}

}  // namespace aidn::engine
