#ifndef AIDN_WORKER_ENGINE_LOSS_H_
#define AIDN_WORKER_ENGINE_LOSS_H_

// The training loss and the accuracy count on the CPU (loss.cc); the GPU
// engine computes the same loss in cuda/kernels.h's
// LaunchSoftmaxCrossEntropy. Thread-compatible: no state.

#include <cstdint>
#include <vector>

#include "worker/engine/tensor.h"

namespace aidn::engine {

// Softmax cross-entropy averaged over the batch, as
// torch.nn.functional.cross_entropy. Returns the mean loss and writes
// dL/dlogits into `grad_logits` (null: the loss only, for evaluation),
// scaled by `grad_scale` (1/accum_steps with gradient accumulation). Labels
// are class indices in [0, classes).
double SoftmaxCrossEntropy(const Tensor& logits, const std::vector<int32_t>& labels,
                           Tensor* grad_logits, double grad_scale = 1.0);
// How many rows' argmax equals their label.
int64_t CountCorrect(const Tensor& logits, const std::vector<int32_t>& labels);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_LOSS_H_
