#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_UNITS_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_UNITS_H_

// units.h's protocol on the GPU: a model with hooks set calls them around
// each unit's work, with the CPU model's unit numbering (unit 0 the root;
// a Sequential's layers with parameters, a GPT's blocks, in forward
// order), in the same order as the CPU model does. The calls come as the
// host queues the unit's kernels on the compute stream: a hook orders what
// it does against them with events (cuda/gpu_fsdp.h), and may move the
// unit's parameter values and gradients (GpuParameter::value and grad
// become views into other device memory) between its calls. A hook's error
// stops the forward or backward that called it.

#include "absl/status/status.h"

namespace aidn::engine::cuda {

class GpuUnitHooks {
 public:
  virtual ~GpuUnitHooks() = default;
  virtual absl::Status BeforeForward(int unit) = 0;
  virtual absl::Status AfterForward(int unit) = 0;
  virtual absl::Status BeforeBackward(int unit) = 0;
  virtual absl::Status AfterBackward(int unit) = 0;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_UNITS_H_
