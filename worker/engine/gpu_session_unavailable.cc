// GpuSession in a build without CUDA.
#include "worker/engine/gpu_session.h"

namespace aidn::engine {

bool GpuSessionAvailable() { return false; }

namespace {

absl::Status NoGpuSupport() {
  return absl::UnimplementedError(
      "device: gpu: this trainer binary has no GPU support (run aidn-worker-gpu, built when nvcc "
      "is present, on GPU nodes; or run the job with device: cpu)");
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuSession>> GpuSession::Create(const GpuSessionOptions&,
                                                               const Sequential&,
                                                               const OptimizerConfig&) {
  return NoGpuSupport();
}

absl::StatusOr<std::unique_ptr<GpuSession>> GpuSession::CreateForGpt(const GpuSessionOptions&,
                                                                     const Gpt&,
                                                                     const OptimizerConfig&) {
  return NoGpuSupport();
}

absl::StatusOr<std::unique_ptr<GpuSession>> GpuSession::CreateForGptStage(const GpuSessionOptions&,
                                                                          const Gpt&, int, bool,
                                                                          const OptimizerConfig&) {
  return NoGpuSupport();
}

}  // namespace aidn::engine
