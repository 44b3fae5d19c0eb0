// GpuSession in a build without CUDA.
#include "worker/engine/gpu_session.h"

namespace aidn::engine {

bool GpuSessionAvailable() { return false; }

absl::StatusOr<std::unique_ptr<GpuSession>> GpuSession::Create(const GpuSessionOptions&,
                                                               const Sequential&,
                                                               const OptimizerConfig&) {
  return absl::UnimplementedError(
      "device: gpu: this trainer binary has no GPU support (run aidn-worker-gpu, built when nvcc "
      "is present, on GPU nodes; or run the job with device: cpu)");
}

}  // namespace aidn::engine
