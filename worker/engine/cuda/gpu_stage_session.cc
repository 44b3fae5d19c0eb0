// GpuSession::CreateForGptStage: a GPT pipeline stage on this rank's GPU,
// GpuPipelineSession over NCCL (one communicator of the job: the stages'
// neighbours linked by NcclDeviceLink, the pipeline's loss and clipping
// norm over all of it, wte's gradient over a split of the first and last
// stages).
#include <cuda_runtime.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/gpu_gpt.h"
#include "worker/engine/cuda/gpu_pipeline.h"
#include "worker/engine/cuda/session_setup.h"
#include "worker/engine/gpu_session.h"
#if AIDN_HAVE_NCCL
#include "worker/engine/comm/nccl_communicator.h"
#include "worker/engine/cuda/nccl_steps.h"
#endif

namespace aidn::engine {
namespace {

#if AIDN_HAVE_NCCL

class CudaGptStageSession final : public GpuSession {
 public:
  using GpuSession::Step;

  static absl::StatusOr<std::unique_ptr<GpuSession>> Make(const GpuSessionOptions& options,
                                                          const Gpt& model, int stages, bool gpipe,
                                                          const OptimizerConfig& optimizer) {
    const int layers = model.config().n_layer;
    if (stages < 2 || layers % stages != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpu pipeline: ", stages, " stages of ", layers, " blocks"));
    }
    if (options.world_size != stages) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gpu pipeline: one replica of ", stages, " stages, not ", options.world_size, " ranks"));
    }
    if (options.precision == "fp16" || options.cuda_graphs || options.sharding != Sharding::kNone) {
      return absl::InvalidArgumentError("gpu pipeline: fp32 or bf16, without CUDA graphs or ZeRO");
    }
    AIDN_ASSIGN_OR_RETURN(cuda::SessionDevice device, cuda::SetUpSessionDevice(options));
    std::unique_ptr<CudaGptStageSession> s(new CudaGptStageSession());
    s->ctx_ = std::move(device.ctx);
    s->description_ = std::move(device.description);
    const int stage = options.rank;
    NcclOptions nccl;
    nccl.rank = options.rank;
    nccl.world_size = options.world_size;
    nccl.device = options.device;
    nccl.timeout = options.timeout;
    AIDN_ASSIGN_OR_RETURN(s->nccl_, NcclCommunicator::Create(nccl, options.store));
    // The ends' group (the middle stages make one of their own, unused:
    // every rank takes part in a split).
    const bool end = stage == 0 || stage == stages - 1;
    AIDN_ASSIGN_OR_RETURN(s->ends_, s->nccl_->Split(end ? 0 : 1, stage));
    AIDN_ASSIGN_OR_RETURN(s->model_, cuda::GpuGpt::Create(s->ctx_.get(), model));
    const int per = layers / stages;
    AIDN_RETURN_IF_ERROR(s->model_->SetStage(stage * per, (stage + 1) * per));
    if (stage > 0) s->prev_ = std::make_unique<cuda::NcclDeviceLink>(s->nccl_.get(), stage - 1);
    if (stage + 1 < stages) {
      s->next_ = std::make_unique<cuda::NcclDeviceLink>(s->nccl_.get(), stage + 1);
    }
    cuda::GpuPipelineOptions o;
    o.schedule = gpipe ? PipelineSchedule::kGPipe : PipelineSchedule::k1F1B;
    o.stage = stage;
    o.stages = stages;
    o.prev = s->prev_.get();
    o.next = s->next_.get();
    o.pipeline = s->nccl_.get();
    o.tied = end ? s->ends_.get() : nullptr;
    AIDN_ASSIGN_OR_RETURN(s->session_, cuda::GpuPipelineSession::Create(
                                           s->ctx_.get(), s->model_.get(), optimizer, o));
    absl::StrAppend(&s->description_, ", pipeline stage ", stage, " of ", stages, " (blocks ",
                    stage * per, "-", (stage + 1) * per - 1, ", ", gpipe ? "GPipe" : "1F1B",
                    ") over NCCL");
    return std::unique_ptr<GpuSession>(std::move(s));
  }

  void SetSeed(uint64_t seed) override { model_->SetSeed(seed); }

  absl::StatusOr<double> Step(const std::vector<MicroBatch>& micro, double lr) override {
    return session_->Step(micro, lr);
  }

  absl::StatusOr<EvalResult> Evaluate(const MicroBatch&) override {
    return absl::UnimplementedError("a pipeline stage evaluates through the CPU copy");
  }

  double last_allreduce_seconds() const override { return 0; }
  double last_allreduce_wait_seconds() const override { return 0; }
  int64_t last_bytes_sent() const override { return 0; }
  int64_t last_bytes_uncompressed() const override { return 0; }
  bool last_step_skipped() const override { return false; }
  std::optional<LossScaleState> loss_scale_state() const override { return std::nullopt; }
  absl::Status RestoreLossScale(const LossScaleState&) override {
    return absl::FailedPreconditionError("no loss scale to restore: only fp16 training has one");
  }
  int64_t collective_sequence() const override { return nccl_->sequence(); }

  absl::Status CopyParametersTo(const std::vector<Parameter*>& cpu) override {
    // What the stage does not hold is left alone.
    return model_->CopyWeightsTo(cpu);
  }
  absl::Status CopyShardsTo(const std::vector<Parameter*>&) override {
    return absl::FailedPreconditionError("gpu session: no shards (a pipeline stage)");
  }
  absl::Status GatherFullParameters() override { return absl::OkStatus(); }
  void ReleaseFullParameters() override {}
  absl::Status CopyBuffersTo(const std::vector<Parameter*>& cpu) override {
    if (!cpu.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("a GPT has no buffers; asked for ", cpu.size()));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> OptimizerState() override {
    return session_->optimizer().StateToHost();
  }
  int64_t optimizer_steps() const override { return session_->optimizer().steps(); }
  absl::Status LoadOptimizerState(const std::vector<std::pair<std::string, const Tensor*>>& state,
                                  int64_t steps) override {
    return session_->optimizer().LoadStateFromHost(state, steps);
  }

  StateMemory memory() const override {
    StateMemory m;
    for (const cuda::GpuParameter* p : model_->StageParameters()) {
      m.parameters += 4 * p->value.numel();
      m.gradients += 4 * p->grad.numel();
    }
    m.optimizer_state = session_->optimizer().state_bytes();
    return m;
  }
  int64_t device_peak_bytes() const override {
    return static_cast<int64_t>(ctx_->allocator().stats().peak_bytes_in_use);
  }
  std::string Describe() const override { return description_; }

 private:
  CudaGptStageSession() = default;

  // Destroyed in reverse: the session, the links, the model, the
  // communicators, the context last.
  std::unique_ptr<cuda::GpuContext> ctx_;
  std::unique_ptr<NcclCommunicator> nccl_;
  std::unique_ptr<NcclCommunicator> ends_;
  std::unique_ptr<cuda::GpuGpt> model_;
  std::unique_ptr<cuda::NcclDeviceLink> prev_, next_;
  std::unique_ptr<cuda::GpuPipelineSession> session_;
  std::string description_;
};

#endif  // AIDN_HAVE_NCCL

}  // namespace

absl::StatusOr<std::unique_ptr<GpuSession>> GpuSession::CreateForGptStage(
    const GpuSessionOptions& options, const Gpt& model, int stages, bool gpipe,
    const OptimizerConfig& optimizer) {
#if AIDN_HAVE_NCCL
  return CudaGptStageSession::Make(options, model, stages, gpipe, optimizer);
#else
  (void)options;
  (void)model;
  (void)stages;
  (void)gpipe;
  (void)optimizer;
  return absl::UnimplementedError("device: gpu pipelines need NCCL, which this build lacks");
#endif
}

}  // namespace aidn::engine
