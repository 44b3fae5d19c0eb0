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
#include "worker/engine/cuda/status.h"
#include "worker/engine/device.h"
#if AIDN_HAVE_NCCL
#include "worker/engine/comm/nccl_communicator.h"
#include "worker/engine/cuda/gpu_ddp.h"
#endif

namespace aidn::engine {
namespace {

class CudaGpuSession final : public GpuSession {
 public:
  using GpuSession::Step;

  static absl::StatusOr<std::unique_ptr<GpuSession>> Make(const GpuSessionOptions& options,
                                                          const Sequential& model,
                                                          const OptimizerConfig& optimizer) {
    if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gpu session: rank ", options.rank, " is not in a world of size ", options.world_size));
    }
    cuda::Precision precision = cuda::Precision::kFp32;
    if (options.precision == "bf16") {
      precision = cuda::Precision::kBf16;
    } else if (options.precision == "fp16") {
      precision = cuda::Precision::kFp16;
    } else if (options.precision != "fp32") {
      return absl::InvalidArgumentError(absl::StrCat("gpu session: precision \"", options.precision,
                                                     "\" (known: fp32, bf16, fp16)"));
    }
    if (options.world_size > 1 && options.store == nullptr) {
      return absl::InvalidArgumentError("gpu session: more than one rank needs a store for NCCL");
    }
    DeviceInventory inventory = DiscoverDevices();
    if (inventory.gpus.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("device: gpu: no CUDA device here (", inventory.gpu_note, ")"));
    }
    if (options.device < 0 || options.device >= static_cast<int>(inventory.gpus.size())) {
      return absl::FailedPreconditionError(absl::StrCat("device: gpu: device ", options.device,
                                                        " not found; this process sees ",
                                                        inventory.gpus.size()));
    }
    std::unique_ptr<CudaGpuSession> s(new CudaGpuSession());
    s->description_ = absl::StrCat(inventory.gpus[static_cast<size_t>(options.device)].name,
                                   " (device ", options.device, "), ", options.precision);
    cuda::GpuContextOptions context;
    context.device = options.device;
    context.allow_tf32 = options.allow_tf32;
    context.precision = precision;
    if (options.fast_convolutions) {
      context.allow_transform_convolutions = true;
      context.deterministic_convolutions = false;
    }
    AIDN_ASSIGN_OR_RETURN(s->ctx_, cuda::GpuContext::Create(context));
    if (precision == cuda::Precision::kBf16) {
      int major = 0;
      AIDN_RETURN_IF_CUDA_ERROR(
          cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, options.device));
      if (major < 8) {
        return absl::FailedPreconditionError(absl::StrCat(
            "precision: bf16 needs a GPU of compute capability 8.0 or newer (Ampere); ",
            s->description_, " is ", major, ".x (use fp16 or fp32)"));
      }
    }
    AIDN_ASSIGN_OR_RETURN(s->model_, cuda::GpuModel::Create(s->ctx_.get(), model));
    AIDN_ASSIGN_OR_RETURN(s->trainer_,
                          cuda::GpuTrainer::Create(s->ctx_.get(), s->model_.get(), optimizer));
    if (options.cuda_graphs && options.world_size == 1) {
      s->trainer_->SetCudaGraphs(true);
      absl::StrAppend(&s->description_, ", CUDA graphs");
    } else if (options.cuda_graphs) {
      absl::StrAppend(&s->description_, ", CUDA graphs not used (not with NCCL yet)");
    }
    if (options.world_size > 1) {
#if AIDN_HAVE_NCCL
      NcclOptions nccl;
      nccl.rank = options.rank;
      nccl.world_size = options.world_size;
      nccl.device = options.device;
      nccl.timeout = options.timeout;
      AIDN_ASSIGN_OR_RETURN(s->nccl_, NcclCommunicator::Create(nccl, options.store));
      AIDN_ASSIGN_OR_RETURN(s->reducer_, cuda::GpuDdpReducer::Create(
                                             s->ctx_.get(), s->model_->Parameters(), s->nccl_.get(),
                                             DdpOptions{.bucket_mb = options.bucket_mb}));
      absl::StrAppend(&s->description_, ", NCCL ", options.world_size, " ranks, ",
                      s->reducer_->num_buckets(), " gradient buckets");
      cuda::GpuDdpReducer* reducer = s->reducer_.get();
      s->trainer_->SetGradReady(
          [reducer](const std::vector<cuda::GpuParameter*>& p) { return reducer->OnGradReady(p); });
      s->trainer_->SetAfterBackward([reducer] { return reducer->AfterBackward(); });
      s->trainer_->SetWait([reducer](cudaEvent_t done) { return reducer->Wait(done); });
#else
      return absl::UnimplementedError(
          "device: gpu with more than one rank needs NCCL, which this build lacks");
#endif
    }
    return std::unique_ptr<GpuSession>(std::move(s));
  }

  void SetSeed(uint64_t seed) override { model_->SetSeed(seed); }

  absl::StatusOr<double> Step(const std::vector<MicroBatch>& micro, double lr) override {
    return trainer_->Step(micro, lr);
  }

  double last_allreduce_seconds() const override {
#if AIDN_HAVE_NCCL
    if (reducer_ != nullptr) return reducer_->last_allreduce_seconds();
#endif
    return 0;
  }

  double last_allreduce_wait_seconds() const override {
#if AIDN_HAVE_NCCL
    if (reducer_ != nullptr) return reducer_->last_exposed_seconds();
#endif
    return 0;
  }

  bool last_step_skipped() const override { return trainer_->last_step_skipped(); }

  std::optional<LossScaleState> loss_scale_state() const override {
    const DynamicLossScaler* scaler = trainer_->loss_scaler();
    if (scaler == nullptr) return std::nullopt;
    return scaler->state();
  }

  absl::Status RestoreLossScale(const LossScaleState& state) override {
    return trainer_->RestoreLossScale(state);
  }

  int64_t collective_sequence() const override {
#if AIDN_HAVE_NCCL
    if (nccl_ != nullptr) return nccl_->sequence();
#endif
    return 0;
  }

  absl::Status CopyParametersTo(const std::vector<Parameter*>& cpu) override {
    return model_->CopyParametersTo(cpu);
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

 private:
  CudaGpuSession() = default;

  // Destroyed in reverse: the reducer first (it gives the model's
  // gradients their own storage back and synchronises both streams), then
  // the communicator, the trainer, the model, and the context last.
  std::unique_ptr<cuda::GpuContext> ctx_;
  std::unique_ptr<cuda::GpuModel> model_;
  std::unique_ptr<cuda::GpuTrainer> trainer_;
#if AIDN_HAVE_NCCL
  std::unique_ptr<NcclCommunicator> nccl_;
  std::unique_ptr<cuda::GpuDdpReducer> reducer_;
#endif
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
