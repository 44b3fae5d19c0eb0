// GpuSession in a build without CUDA.
#include "worker/engine/gpu_session.h"

namespace aidn::engine {

absl::StatusOr<std::unique_ptr<GpuSession>> GpuSession::Create(const GpuSessionOptions&,
                                                                const Sequential&,
                                                                const OptimizerConfig&) {
  return absl::UnimplementedError(
      "device: gpu: this worker was built without CUDA (rebuild with nvcc present, or run the job "
      "with device: cpu)");
}

}  // namespace aidn::engine
