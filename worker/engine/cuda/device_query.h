#ifndef AIDN_WORKER_ENGINE_CUDA_DEVICE_QUERY_H_
#define AIDN_WORKER_ENGINE_CUDA_DEVICE_QUERY_H_

// Built only with CUDA. Plain C++ interface so callers need no CUDA headers.

#include <string>
#include <vector>

#include "worker/engine/device.h"

namespace aidn::engine::cuda {

// The GPUs the driver shows; on any CUDA error an empty list and the error
// text in *note.
std::vector<GpuDescription> QueryGpus(std::string* note);

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_DEVICE_QUERY_H_
