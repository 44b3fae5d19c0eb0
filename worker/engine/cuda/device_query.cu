// Device discovery. A machine without a driver makes cudaGetDeviceCount fail
// ("CUDA driver version is insufficient" here); that is "no GPU", not an
// error, so the worker still starts and offers its CPU slots.
#include <cuda_runtime.h>

#include <cstdio>

#include "worker/engine/cuda/device_query.h"

namespace aidn::engine::cuda {

std::vector<GpuDescription> QueryGpus(std::string* note) {
  std::vector<GpuDescription> gpus;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    *note = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error for later calls
    return gpus;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    err = cudaGetDeviceProperties(&prop, i);
    if (err != cudaSuccess) {
      *note = std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(err);
      continue;
    }
    GpuDescription gpu;
    gpu.index = i;
    gpu.name = prop.name;
    gpu.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
    char bus[32];
    std::snprintf(bus, sizeof(bus), "%04x:%02x:%02x.0", prop.pciDomainID, prop.pciBusID,
                  prop.pciDeviceID);
    gpu.pci_bus_id = bus;
    gpus.push_back(gpu);
  }
  if (count == 0) *note = "no CUDA device";
  return gpus;
}

}  // namespace aidn::engine::cuda
