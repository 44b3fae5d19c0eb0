// GpuSession on CUDA: GpuContext + GpuModel + GpuTrainer, and for more than
// one rank an NcclCommunicator whose allreduce runs from the trainer's
// after-backward hook.
//
// Stream order of a step with several ranks: backward is queued on the
// compute stream; an event recorded there makes the NCCL stream wait for
// it, so NCCL reads finished gradients; the host then waits for the NCCL
// stream (Wait polls ncclCommGetAsyncError against the timeout, so a peer
// that died cannot hang us) before the optimizer is queued, so the update
// reads averaged gradients. The host wait is the price of not overlapping
// the allreduce with backward yet.
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
#endif

namespace aidn::engine {
namespace {

class CudaGpuSession final : public GpuSession {
 public:
  ~CudaGpuSession() override {
    if (ready_ != nullptr) cudaEventDestroy(ready_);
  }

  static absl::StatusOr<std::unique_ptr<GpuSession>> Make(const GpuSessionOptions& options,
                                                          const Sequential& model,
                                                          const OptimizerConfig& optimizer) {
    if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gpu session: rank ", options.rank, " is not in a world of size ", options.world_size));
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
                                   " (device ", options.device, ")");
    cuda::GpuContextOptions context;
    context.device = options.device;
    context.allow_tf32 = options.allow_tf32;
    if (options.fast_convolutions) {
      context.allow_transform_convolutions = true;
      context.deterministic_convolutions = false;
    }
    AIDN_ASSIGN_OR_RETURN(s->ctx_, cuda::GpuContext::Create(context));
    AIDN_ASSIGN_OR_RETURN(s->model_, cuda::GpuModel::Create(s->ctx_.get(), model));
    AIDN_ASSIGN_OR_RETURN(s->trainer_,
                          cuda::GpuTrainer::Create(s->ctx_.get(), s->model_.get(), optimizer));
    if (options.world_size > 1) {
#if AIDN_HAVE_NCCL
      NcclOptions nccl;
      nccl.rank = options.rank;
      nccl.world_size = options.world_size;
      nccl.device = options.device;
      nccl.timeout = options.timeout;
      AIDN_ASSIGN_OR_RETURN(s->nccl_, NcclCommunicator::Create(nccl, options.store));
      AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&s->ready_, cudaEventDisableTiming));
      absl::StrAppend(&s->description_, ", NCCL ", options.world_size, " ranks");
      CudaGpuSession* raw = s.get();
      s->trainer_->SetAfterBackward([raw] { return raw->AllReduceGradients(); });
#else
      return absl::UnimplementedError(
          "device: gpu with more than one rank needs NCCL, which this build lacks");
#endif
    }
    return std::unique_ptr<GpuSession>(std::move(s));
  }

  void SetSeed(uint64_t seed) override { model_->SetSeed(seed); }

  absl::StatusOr<double> Step(const Tensor& images, const std::vector<int32_t>& labels,
                              double lr) override {
    allreduce_seconds_ = 0;
    return trainer_->Step(images, labels, lr);
  }

  double last_allreduce_seconds() const override { return allreduce_seconds_; }

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

#if AIDN_HAVE_NCCL
  absl::Status AllReduceGradients() {
    const auto start = std::chrono::steady_clock::now();
    // NCCL reads the gradients only once backward has written them.
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(ready_, ctx_->stream()));
    AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(nccl_->stream(), ready_, 0));
    for (cuda::GpuParameter* p : model_->Parameters()) {
      AIDN_RETURN_IF_ERROR(nccl_->EnqueueAllReduce(
          p->grad.data(), static_cast<size_t>(p->grad.numel()), ReduceOp::kAvg));
    }
    // The optimizer is queued after this returns, so it reads the averages.
    absl::Status s = nccl_->Wait("gradient allreduce");
    allreduce_seconds_ =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return s;
  }
  std::unique_ptr<NcclCommunicator> nccl_;
#endif

  std::unique_ptr<cuda::GpuContext> ctx_;
  std::unique_ptr<cuda::GpuModel> model_;
  std::unique_ptr<cuda::GpuTrainer> trainer_;
  cudaEvent_t ready_ = nullptr;
  double allreduce_seconds_ = 0;
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
