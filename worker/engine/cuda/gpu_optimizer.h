#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_OPTIMIZER_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_OPTIMIZER_H_

// SGD (momentum, Nesterov, weight decay) and AdamW on device parameters,
// with optimizer.h's formulas and operation order: one fused kernel per
// parameter, float arithmetic rounded exactly as the CPU's (kernels.cu), the
// scalar coefficients computed in double on the host as the CPU does. Given
// the same gradients, a step gives the CPU's parameters bit for bit.
//
// Gradient clipping (grad_clip_norm > 0) runs on the device: per-parameter
// sums of squares in double, then the torch coefficient, which the update
// kernels read from device memory, so Step never waits for the GPU.
//
// Not thread-safe. The parameters must outlive the optimizer and keep their
// shapes; everything is queued on the context's stream.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/cuda/allocator.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_layers.h"
#include "worker/engine/cuda/gpu_tensor.h"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/optimizer.h"

namespace aidn::engine::cuda {

// fp16 loss scaling's check, between backward (and DDP's averages) and the
// update: every gradient of `parameters` divided by `scale` and checked for
// an inf or a NaN on the context's stream, the flag (`device_flag`, one
// int32) combined over the ranks by `reduce_flag` if given (ZeRO-1: each
// rank checks its shards only), then read back into pinned `host_flag`
// once `wait` has waited for the stream. Whether a gradient overflowed.
absl::StatusOr<bool> UnscaleAndCheckGradients(
    GpuContext* ctx, const std::vector<GpuParameter*>& parameters, double scale,
    int32_t* device_flag, int32_t* host_flag, const std::function<absl::Status()>& wait,
    const std::function<absl::Status(int32_t*)>& reduce_flag = nullptr);

class GpuOptimizer {
 public:
  // INVALID_ARGUMENT as Optimizer::Create: a bad config (ValidateOptimizerConfig),
  // an empty or null parameter list, duplicate names, a gradient whose shape
  // differs from its value's, a parameter without memory (released by a
  // pipeline stage).
  static absl::StatusOr<std::unique_ptr<GpuOptimizer>> Create(
      GpuContext* ctx, const OptimizerConfig& config, const std::vector<GpuParameter*>& params);

  ~GpuOptimizer();
  GpuOptimizer(const GpuOptimizer&) = delete;
  GpuOptimizer& operator=(const GpuOptimizer&) = delete;

  // Queues one update of every parameter (but those marked no_grad) with learning rate `lr`:
  // Prepare, then Queue(false). INVALID_ARGUMENT for a negative or non-finite lr,
  // FAILED_PRECONDITION if a parameter changed shape.
  absl::Status Step(double lr);

  // Step in two halves, for CUDA graphs. Prepare (host only): checks, the
  // step's coefficients (learning rate, AdamW's bias corrections, SGD's
  // first step), the step counted; with arguments in memory it also writes
  // them to pinned host memory. Queue: the update's kernels, each step's
  // coefficients passed by value, or (args_in_memory) copied from that
  // pinned memory to the device by a copy queued first, so that a graph
  // that captured one Queue replays it with each step's Prepare. One
  // Prepare before each Queue (FAILED_PRECONDITION otherwise); the pinned
  // arguments must not be rewritten before the step's copy has run.
  absl::Status Prepare(double lr);
  absl::Status Queue(bool args_in_memory);
  // Allocates the pinned and device copies of the arguments (once).
  absl::Status EnableArgsInMemory();
  // The last Queue's work was discarded unrun (a failed graph capture):
  // the prepared step may be queued again.
  void Unqueue() { prepared_ = true; }
  // The prepared step ran as the replay of a graph that captured an
  // earlier Queue: it is used up, as if queued.
  void Replayed() { prepared_ = false; }
  // The prepared step will not run at all (its step failed before its
  // update was queued): it is not counted.
  void Unprepare() {
    if (prepared_) --steps_;
    prepared_ = false;
  }
  // Whether the next Queue's kernels treat this as the first step (SGD's
  // momentum buffer starts as the gradient): a different kernel, so a
  // graph captured with one cannot replay the other.
  bool prepared_first_step() const { return config_.name == "sgd" && args_.sgd.first_step; }

  int64_t steps() const { return steps_; }
  // The parameters it steps (the model's, or ZeRO-1's shards).
  const std::vector<GpuParameter*>& parameters() const { return params_; }
  // Clipping over parameters that are each rank's shards (ZeRO-1): the
  // hook sums one device double, this rank's squared norm, over the ranks
  // in the stream's order, so that every rank clips by the whole
  // gradient's norm.
  void SetNormAllReduce(std::function<absl::Status(double* total)> hook) {
    norm_allreduce_ = std::move(hook);
  }
  // Leaves `p` (one of the parameters) out of the clipping norm this rank
  // contributes: another rank counts it (a pipeline's last stage's copy of
  // the tied embedding, which the first stage counts). It is still
  // clipped and stepped.
  void ExcludeFromNorm(const GpuParameter* p) { norm_excluded_ = p; }
  // Bytes of optimizer state on the device (momentum buffers; AdamW's two
  // moments), the trainer's memory figure.
  int64_t state_bytes() const {
    int64_t n = 0;
    for (const auto* list : {&momentum_, &exp_avg_, &exp_avg_sq_}) {
      for (const GpuTensor& t : *list) n += 4 * t.numel();
    }
    return n;
  }
  const OptimizerConfig& config() const { return config_; }
  // The gradient norm the last Step measured for clipping (0 when clipping
  // is off or before the first step). Waits for the stream.
  absl::StatusOr<double> LastGradNorm() const;
  // The state as CPU tensors, named as Optimizer::State() names them
  // ("<param>.momentum_buffer", "<param>.exp_avg", "<param>.exp_avg_sq").
  // Waits for the stream.
  absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> StateToHost() const;
  // Restores state as StateToHost or the CPU Optimizer::State() list it (a
  // checkpoint's optimizer.safetensors), in any order, and the number of
  // steps taken (torch's state['step']; SGD's first step copies the
  // gradient into the momentum buffer, AdamW's bias corrections use it).
  // INVALID_ARGUMENT naming the entry for a missing, unexpected, duplicate
  // or wrongly shaped one, before anything is copied.
  absl::Status LoadStateFromHost(const std::vector<std::pair<std::string, const Tensor*>>& state,
                                 int64_t steps);

 private:
  GpuOptimizer(GpuContext* ctx, const OptimizerConfig& config, std::vector<GpuParameter*> params)
      : ctx_(ctx), config_(config), params_(std::move(params)) {}

  // Whether the weight decay applies to `p`: always, or with
  // decay_matrices_only to matrices and embeddings (as Optimizer::Decays).
  bool Decays(const GpuParameter& p) const {
    const size_t rank =
        p.whole_shape.empty() ? static_cast<size_t>(p.value.rank()) : p.whole_shape.size();
    return !config_.decay_matrices_only || rank >= 2;
  }

  GpuContext* ctx_;
  OptimizerConfig config_;
  std::vector<GpuParameter*> params_;
  std::vector<std::vector<int64_t>> shapes_;
  // sgd with momentum: one buffer per parameter; adamw: m and v.
  std::vector<GpuTensor> momentum_;
  std::vector<GpuTensor> exp_avg_;
  std::vector<GpuTensor> exp_avg_sq_;
  // Clipping: per-parameter sums of squares (double), the norm (double) and
  // the coefficient (float).
  DeviceBuffer sum_sq_;
  DeviceBuffer sum_sq_scratch_;  // LaunchSumOfSquares's partial sums
  DeviceBuffer norm_;
  DeviceBuffer coef_;
  bool measured_norm_ = false;
  std::function<absl::Status(double* total)> norm_allreduce_;
  const GpuParameter* norm_excluded_ = nullptr;
  DeviceBuffer norm_total_;  // the hook's double
  int64_t steps_ = 0;
  // The prepared step's coefficients; pinned and device copies for Queue
  // with arguments in memory.
  struct Args {
    SgdArgs sgd;
    AdamWArgs adamw;
  };
  Args args_;
  bool prepared_ = false;
  Args* host_args_ = nullptr;
  DeviceBuffer device_args_;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_OPTIMIZER_H_
