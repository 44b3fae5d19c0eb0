#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_MODEL_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_MODEL_H_

// The GPU training engine's top level (fp32):
//
//   GpuModel       a Sequential on the GPU, mirrored layer by layer from a
//                  CPU Sequential (BuildModel's mlp or cnn, or any stack of
//                  the layers in layers.h), with a copy of its weights, so
//                  both start from the same parameters; parameters and
//                  gradients copy back into CPU tensors (checkpoints,
//                  comparisons).
//   GpuCrossEntropy  softmax cross-entropy, mean over the batch, as
//                  engine::SoftmaxCrossEntropy.
//   GpuTrainer     one training step: zero the gradients; per micro-batch
//                  upload, forward, loss, backward (accumulating); the
//                  optimizer step; all queued on the context's stream; the
//                  host waits once, for the losses.
//
// Structure: GpuContext (stream, cuBLAS, cuDNN, caching allocator) <-
// GpuTensor <- kernels / GpuLayer <- GpuModel, GpuOptimizer <- GpuTrainer.
// The CPU engine does not depend on any of this.
//
// Not thread-safe: one model per trainer thread, on its context's stream.
// As on the CPU, Forward keeps pointers into its input until Backward.

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/cuda/allocator.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_layers.h"
#include "worker/engine/cuda/gpu_optimizer.h"
#include "worker/engine/cuda/gpu_tensor.h"
#include "worker/engine/cuda/gpu_units.h"
#include "worker/engine/data.h"
#include "worker/engine/loss_scale.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"

namespace aidn::engine::cuda {

class GpuModel {
 public:
  // Mirrors `cpu` (layers, fusion, parameter names) and copies its
  // parameter values; gradients start at zero. UNIMPLEMENTED for a layer
  // type the GPU engine lacks.
  static absl::StatusOr<std::unique_ptr<GpuModel>> Create(GpuContext* ctx, const Sequential& cpu);
  // BuildModel(config, seed) mirrored onto the GPU: the same weights as the
  // CPU model that BuildModel gives for this seed.
  static absl::StatusOr<std::unique_ptr<GpuModel>> Build(GpuContext* ctx, const ModelConfig& config,
                                                         uint64_t seed);

  // Called by Backward once a layer's backward is queued, with that layer's
  // parameters, whose gradients are then complete in the stream's order;
  // last layer first (DDP launches a bucket when its last gradient is in).
  // An error stops Backward.
  using GradReadyFn = std::function<absl::Status(const std::vector<GpuParameter*>&)>;

  // As Sequential::Forward / Backward. `input` (and `logits`) must stay
  // alive and unchanged until Backward.
  absl::Status Forward(const GpuTensor& input, GpuTensor* logits, bool training);
  absl::Status Backward(const GpuTensor& grad_logits, const GradReadyFn& on_ready = nullptr);
  // Zeroes the gradients (with unit hooks set: none, the hooks own the
  // gradients' memory).
  absl::Status ZeroGrad();
  // As Sequential::SetUnitHooks (gpu_units.h): unit u > 0 is the u-th layer
  // with parameters, the root (0) is empty. Null: none. Not owned.
  void SetUnitHooks(GpuUnitHooks* hooks) { hooks_ = hooks; }
  // As Sequential::SetSeed (the same per-layer seeds; GPU dropout masks are
  // still not the CPU's, see dropout_mask.h).
  void SetSeed(uint64_t seed);
  // As Sequential::SetBatchNormSync: every BatchNorm layer's statistics
  // over every rank's batch, through `sync` (GpuLayer::SetBatchNormSync).
  void SetBatchNormSync(StreamCollectives* sync);

  const std::vector<GpuParameter*>& Parameters() const { return parameters_; }
  // The layers' buffers (BatchNorm's running statistics), in
  // Sequential::Buffers() order with its names.
  const std::vector<GpuParameter*>& Buffers() const { return buffers_; }
  // Whether a layer draws on the host at each forward (dropout with p > 0,
  // stochastic depth), so that a CUDA graph would replay one draw.
  bool DrawsOnTheHost() const;
  // As Sequential::UnusedParameters: what the last Forward did not use.
  std::vector<GpuParameter*> UnusedParameters() const;
  int64_t ParameterCount() const;
  // Sequential::Describe()'s text.
  std::string Describe() const;

  // Parameter values or gradients from / to CPU parameters in the same
  // order with the same names and shapes (Sequential::Parameters()).
  // INVALID_ARGUMENT on any mismatch, before anything is copied.
  absl::Status CopyParametersFrom(const std::vector<Parameter*>& cpu);
  absl::Status CopyParametersTo(const std::vector<Parameter*>& cpu) const;
  absl::Status CopyGradientsTo(const std::vector<Parameter*>& cpu) const;
  // Buffer values to CPU buffers in Buffers() order, likewise.
  absl::Status CopyBuffersTo(const std::vector<Parameter*>& cpu) const;

 private:
  explicit GpuModel(GpuContext* ctx) : ctx_(ctx) {}
  absl::Status Matches(const std::vector<Parameter*>& cpu) const;

  GpuContext* ctx_;
  std::vector<std::unique_ptr<GpuLayer>> layers_;
  std::vector<bool> fused_;
  std::vector<GpuParameter*> parameters_;
  std::vector<GpuParameter*> buffers_;
  // Per layer, its parameters (empty for most).
  std::vector<std::vector<GpuParameter*>> layer_parameters_;
  // Per layer, its unit (0: none, a layer without parameters).
  std::vector<int> unit_;
  GpuUnitHooks* hooks_ = nullptr;
  int first_trainable_ = -1;
  std::vector<GpuTensor> activations_;
  std::vector<GpuTensor> grads_;
};

class GpuCrossEntropy {
 public:
  explicit GpuCrossEntropy(GpuContext* ctx) : ctx_(ctx) {}
  // Queues the mean loss and, if grad_logits is not null, dL/dlogits scaled
  // by grad_scale. Labels are checked on the host (INVALID_ARGUMENT outside
  // [0, classes) or a count that is not the batch size) and uploaded.
  absl::Status Compute(const GpuTensor& logits, const std::vector<int32_t>& labels,
                       GpuTensor* grad_logits, double grad_scale = 1.0);
  // The loss of the last Compute into slot 0; waits for the stream.
  absl::StatusOr<double> Loss() const;

  // Room for `slots` losses on the device (one per micro-batch of a step),
  // kept until a larger reservation; Compute(..., slot) writes slot `slot`.
  absl::Status ReserveSlots(int slots);
  absl::Status Compute(const GpuTensor& logits, const std::vector<int32_t>& labels,
                       GpuTensor* grad_logits, double grad_scale, int slot);
  // As Compute, with `n` labels already in device memory (queued before;
  // not checked: the caller checked them on the host).
  absl::Status ComputeOnDevice(const GpuTensor& logits, const int32_t* labels, int64_t n,
                               GpuTensor* grad_logits, double grad_scale, int slot);
  // The slots (device doubles), valid until the next ReserveSlots.
  const double* device_losses() const { return static_cast<const double*>(loss_.data()); }

 private:
  GpuContext* ctx_;
  DeviceBuffer labels_;
  DeviceBuffer row_loss_;
  DeviceBuffer loss_;
  int slots_ = 0;
};

class GpuTrainer {
 public:
  // `model` must outlive the trainer. The optimizer steps the model's
  // parameters, or `optimized` (ZeRO-1: this rank's shards, which must
  // outlive the trainer too).
  static absl::StatusOr<std::unique_ptr<GpuTrainer>> Create(
      GpuContext* ctx, GpuModel* model, const OptimizerConfig& optimizer,
      const std::vector<GpuParameter*>* optimized = nullptr);
  ~GpuTrainer();
  GpuTrainer(const GpuTrainer&) = delete;
  GpuTrainer& operator=(const GpuTrainer&) = delete;

  // One step on a batch (images [N, C, H, W] on the host, labels [N]) with
  // learning rate `lr`; returns the batch's mean loss before the update.
  absl::StatusOr<double> Step(const Tensor& images, const std::vector<int32_t>& labels, double lr);
  // One optimizer step over k micro-batches (gradient accumulation, as the
  // CPU trainer does it): the gradients are zeroed once, each micro-batch's
  // loss gradient is scaled by 1/k and backward adds it in, then one update.
  // Returns the sum over the micro-batches of loss_i / k, in order (the
  // CPU trainer's sum). A micro-batch with a seed sets the model's dropout
  // seed before its forward. INVALID_ARGUMENT for no micro-batches or a
  // null pointer in one.
  absl::StatusOr<double> Step(const std::vector<MicroBatch>& micro, double lr);

  // During the last micro-batch's backward, after each layer with
  // parameters (GpuModel::GradReadyFn): DDP starts a bucket's allreduce.
  void SetGradReady(GpuModel::GradReadyFn hook) { grad_ready_ = std::move(hook); }
  // Runs between backward and the optimizer step of every Step (DDP: the
  // gradient allreduce, which must leave the averaged gradients ordered
  // before the context's stream continues). An error fails the Step before
  // the update.
  void SetAfterBackward(std::function<absl::Status()> hook) { after_backward_ = std::move(hook); }
  // How the host waits for the end of a step: `done` is recorded on the
  // context's stream after the update and the loss's copy to the host. By
  // default cudaEventSynchronize; DDP polls NCCL for errors meanwhile, since
  // a dead peer would leave `done` pending forever.
  void SetWait(std::function<absl::Status(cudaEvent_t done)> wait) { wait_ = std::move(wait); }
  // How the host waits mid-step, for fp16's overflow check after DDP's
  // averages (the reducer's WaitForCheck: no end-of-step work such as
  // ZeRO-1's all-gathers); unset, as at the end of a step.
  void SetCheckWait(std::function<absl::Status(cudaEvent_t event)> wait) {
    check_wait_ = std::move(wait);
  }
  // Runs once per Step before the first micro-batch's forward (DDP's
  // broadcast_buffers: rank 0's running statistics to every rank, as torch
  // broadcasts them before a step's first forward). An error fails the Step.
  void SetBeforeForward(std::function<absl::Status()> hook) { before_forward_ = std::move(hook); }
  // Runs before the last micro-batch's backward with, in registration
  // order, whether any forward of the step used each parameter, and what
  // the last forward left unused (DDP's find_unused_parameters, as the CPU
  // reducer's BeginBackward). Without a grad-ready hook (one rank) the
  // trainer itself marks what no forward of the step used no_grad, so the
  // optimizer leaves it alone (torch's "grad is None").
  using UsedFn = std::function<absl::Status(const std::vector<bool>& used,
                                            const std::vector<GpuParameter*>& unused_now)>;
  void SetBeforeLastBackward(UsedFn hook) { before_last_backward_ = std::move(hook); }

  // Precision::kFp16 contexts: dynamic loss scaling (loss_scale.h), with
  // torch GradScaler's defaults from Create or these options. Each step's
  // loss gradient is multiplied by the scale; after backward (and the
  // after-backward hook: DDP's averages) the gradients are divided by it
  // and checked, and a step with an inf or a NaN is skipped (no update)
  // and the scale backed off. The check costs the step a second host
  // wait, as GradScaler's does. FAILED_PRECONDITION in other precisions.
  absl::Status SetLossScale(const LossScaleOptions& options);
  // Null unless the context computes in fp16.
  const DynamicLossScaler* loss_scaler() const { return scaler_ ? &*scaler_ : nullptr; }
  // A resume: the scaler continues from a checkpoint's state.
  // FAILED_PRECONDITION without a scaler (fp32 / bf16).
  absl::Status RestoreLossScale(const LossScaleState& state);
  // Whether the last Step skipped its update (fp16 overflow).
  bool last_step_skipped() const { return last_skipped_; }

  // CUDA graphs (off by default). When on, a step that needs no host work
  // between its kernels (no hooks, no fp16 loss scaling, no dropout) runs
  // from pinned staging buffers; the first step of a given shape runs
  // eagerly (cuDNN's algorithm search, allocations), the next is captured
  // into a graph and launched, and later ones replay it. A step of another
  // shape (micro-batch count, batch size) discards the graph and starts
  // over. A capture that fails leaves graphs off, with the reason in
  // graph_note(), and the step runs eagerly.
  void SetCudaGraphs(bool on);
  // Steps run by launching a graph (captured or replayed).
  int64_t graph_steps() const { return graph_steps_; }
  // Why the last step did not run from a graph ("" when it did).
  const std::string& graph_note() const { return graph_note_; }
  // Forgets the graph: call after anything but Step ran the model (its
  // buffers may have moved).
  void InvalidateGraph();

  GpuOptimizer& optimizer() { return *optimizer_; }
  // fp16 with ZeRO-1: the overflow flag (one device int32) combined over
  // the ranks in the stream's order, since each rank checks its shards.
  void SetOverflowAllReduce(std::function<absl::Status(int32_t*)> hook) {
    overflow_allreduce_ = std::move(hook);
  }

  // The last step's logits (of its last micro-batch; valid until the next
  // step).
  const GpuTensor& logits() const { return logits_; }

 private:
  GpuTrainer(GpuContext* ctx, GpuModel* model) : ctx_(ctx), model_(model), loss_(ctx) {}
  // Records `done_` on the stream and waits for it (wait_, or the event).
  absl::Status WaitFor();
  // fp16: divides every gradient by `scale`; whether any is inf or NaN.
  absl::StatusOr<bool> UnscaleAndCheck(double scale);
  // Why a step cannot run from a graph ("" if it can).
  std::string GraphBlocker() const;
  // Graph steps: copies the micro-batches into the pinned staging buffers
  // (checking labels), and queues the step from them.
  absl::Status Stage(const std::vector<MicroBatch>& micro);
  absl::Status QueueStaged(const std::vector<MicroBatch>& micro, double grad_scale);
  absl::Status GraphStep(const std::vector<MicroBatch>& micro, double lr, double grad_scale);
  absl::Status GraphStepPrepared(const std::vector<MicroBatch>& micro, double grad_scale);
  GpuContext* ctx_;
  GpuModel* model_;
  std::unique_ptr<GpuOptimizer> optimizer_;
  std::function<absl::Status(int32_t*)> overflow_allreduce_;
  GpuCrossEntropy loss_;
  GpuTensor input_;
  GpuTensor logits_;
  GpuTensor grad_logits_;
  GpuModel::GradReadyFn grad_ready_;
  std::function<absl::Status()> after_backward_;
  std::function<absl::Status(cudaEvent_t)> wait_;
  std::function<absl::Status(cudaEvent_t)> check_wait_;
  std::function<absl::Status()> before_forward_;
  UsedFn before_last_backward_;
  // The step's losses, copied here (pinned) before `done_`.
  double* host_losses_ = nullptr;
  size_t host_slots_ = 0;
  cudaEvent_t done_ = nullptr;
  // fp16: the scaler, and the overflow flag on the device and (pinned) here.
  std::optional<DynamicLossScaler> scaler_;
  DeviceBuffer found_;
  int32_t* host_found_ = nullptr;
  bool last_skipped_ = false;
  // CUDA graphs: staging (pinned), the labels on the device, the graph and
  // the step shape it was captured for, the shape of the last eager step.
  bool graphs_ = false;
  bool graphs_failed_ = false;
  std::string graph_note_ = "CUDA graphs off";
  float* staged_images_ = nullptr;
  size_t staged_image_floats_ = 0;
  int32_t* staged_labels_ = nullptr;
  size_t staged_label_count_ = 0;
  DeviceBuffer device_labels_;
  int64_t classes_ = 0;  // the logits' width, once a step has run
  cudaGraphExec_t graph_exec_ = nullptr;
  std::vector<int64_t> graph_key_;
  std::vector<int64_t> warm_key_;
  uint64_t graph_workspace_ = 0;  // the context's workspace generation it baked in
  int64_t graph_steps_ = 0;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_MODEL_H_
