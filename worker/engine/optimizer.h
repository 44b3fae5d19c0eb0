#ifndef AIDN_WORKER_ENGINE_OPTIMIZER_H_
#define AIDN_WORKER_ENGINE_OPTIMIZER_H_

// Optimizers with PyTorch's exact update rules (torch 1.13, single-tensor
// path), so a run can be checked against torch.optim step for step:
//
//   sgd    torch.optim.SGD, dampening 0:
//            g = grad + wd * p
//            momentum > 0:  buf = g on the first step, else buf = momentum * buf + g
//                           g = nesterov ? g + momentum * buf : buf
//            p -= lr * g
//   adamw  torch.optim.AdamW (amsgrad off), t = step number from 1:
//            p *= 1 - lr * wd
//            m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g^2
//            p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//
// Arithmetic is float32 per element in torch's operation order, with the
// scalar coefficients computed in double as Python does. Each parameter is
// updated in one fused pass over p, grad and its state.
//
// Not thread-safe. The parameters must outlive the optimizer and keep their
// shapes. CPU tensors only (the GPU engine's optimizer is
// cuda/gpu_optimizer.h).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

struct OptimizerConfig {
  // "sgd" or "adamw".
  std::string name = "sgd";
  // Base learning rate. Step() takes the scheduled rate; this one is only
  // validated here and is what the schedule starts from.
  double lr = 0.01;
  // sgd only: momentum factor (0: plain SGD) and Nesterov momentum (needs
  // momentum > 0, as torch requires).
  double momentum = 0.0;
  bool nesterov = false;
  // sgd: L2 penalty added to the gradient; adamw: decoupled decay of the
  // weights (torch's AdamW default is 0.01; aidn's default is 0 for both).
  double weight_decay = 0.0;
  // Decay only parameters of two or more dimensions (matrices and
  // embeddings), none of the biases and normalisation weights, as nanoGPT
  // and most transformer recipes group them.
  bool decay_matrices_only = false;
  // adamw only.
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  // When > 0, Step() first scales the gradients as
  // torch.nn.utils.clip_grad_norm_(params, grad_clip_norm) would (see
  // ClipGradNorm); 0 disables clipping.
  double grad_clip_norm = 0.0;
};

// Checks names and ranges; INVALID_ARGUMENT naming the field otherwise.
absl::Status ValidateOptimizerConfig(const OptimizerConfig& config);

class Optimizer {
 public:
  // One entry of the optimizer state, as State() lists it and LoadState()
  // takes it: "<parameter name>.<buffer>" with buffer "momentum_buffer"
  // (sgd with momentum) or "exp_avg" / "exp_avg_sq" (adamw).
  using StateEntry = std::pair<std::string, const Tensor*>;

  // INVALID_ARGUMENT for a bad config, an empty or null parameter list,
  // duplicate parameter names or a gradient whose shape differs from its
  // value's; UNIMPLEMENTED for non-CPU tensors. State buffers are allocated
  // here, once.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(const OptimizerConfig& config,
                                                           const std::vector<Parameter*>& params);

  virtual ~Optimizer() = default;

  // Updates every parameter (but those marked no_grad) from its current
  // gradient with learning rate `lr` (the scheduled rate for this step) and
  // counts the step. AdamW's bias correction counts the optimizer's steps,
  // also for a parameter that skipped some (torch counts each parameter's
  // own). With grad_clip_norm > 0 the clipping coefficient is folded into
  // the update:
  // the result equals clip_grad_norm_ followed by step, but the gradients
  // themselves are left as they were. INVALID_ARGUMENT for a negative or
  // non-finite lr, FAILED_PRECONDITION if a parameter's shape changed.
  virtual absl::Status Step(double lr) = 0;

  // Steps taken so far (torch's state['step']); restored by LoadState.
  int64_t steps() const { return steps_; }
  // The gradient norm Step() measured for clipping on its last call (before
  // clipping); 0 when clipping is off or before the first step.
  double last_grad_norm() const { return last_grad_norm_; }
  const OptimizerConfig& config() const { return config_; }

  // An optimizer over shards of the parameters (ZeRO) clips by the norm of
  // the whole gradient: `reduce` turns this rank's sum of squares into the
  // sum over every rank (an allreduce). Its error fails the Step.
  using SumOfSquaresReduction = std::function<absl::StatusOr<double>(double)>;
  void SetSumOfSquaresReduction(SumOfSquaresReduction reduce) { reduce_ = std::move(reduce); }

  // The state buffers, in parameter order; pointers stay valid for the
  // optimizer's lifetime. Empty for plain SGD.
  virtual std::vector<StateEntry> State() const = 0;
  // Replaces the state with a checkpoint's: `state` must name exactly the
  // entries State() lists (any order), each with the same shape.
  // INVALID_ARGUMENT (naming the entry) otherwise, and then nothing changes.
  absl::Status LoadState(const std::vector<StateEntry>& state, int64_t steps);

 protected:
  Optimizer(const OptimizerConfig& config, std::vector<Parameter*> params)
      : config_(config), params_(std::move(params)) {
    for (const Parameter* p : params_) shapes_.push_back(p->value.shape());
  }

  // The coefficient Step() applies to the gradients: 1, or the clipping
  // factor when clipping is on and needed. Records last_grad_norm_.
  absl::StatusOr<float> ClipCoefficient();
  // Whether the weight decay applies to `p` (decay_matrices_only; a shard
  // as its whole parameter).
  bool Decays(const Parameter& p) const {
    const size_t rank =
        p.whole_shape.empty() ? static_cast<size_t>(p.value.rank()) : p.whole_shape.size();
    return !config_.decay_matrices_only || rank >= 2;
  }
  absl::Status CheckStep(double lr) const;

  OptimizerConfig config_;
  std::vector<Parameter*> params_;
  // Each parameter's shape at Create; the state buffers are sized by it.
  std::vector<std::vector<int64_t>> shapes_;
  int64_t steps_ = 0;
  double last_grad_norm_ = 0.0;
  SumOfSquaresReduction reduce_;

 private:
  virtual std::vector<Tensor*> MutableState() = 0;
};

// The total L2 norm of all the gradients taken together (accumulated in
// double), returned as it was before clipping. If max_norm / (total + 1e-6)
// is below 1, every gradient is multiplied by that coefficient, as
// torch.nn.utils.clip_grad_norm_ does. A non-finite total is returned and
// the gradients are left alone.
double ClipGradNorm(const std::vector<Parameter*>& params, double max_norm);

// The sum of the squares of `t`'s elements, in double, as the clipping norm
// adds them up.
double SumOfSquares(const Tensor& t);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_OPTIMIZER_H_
