#ifndef AIDN_WORKER_ENGINE_DEVICE_H_
#define AIDN_WORKER_ENGINE_DEVICE_H_

// What compute a node has: CPU cores and, in a CUDA build on a machine with a
// driver, its GPUs. The worker reports this at registration.

#include <cstdint>
#include <string>
#include <vector>

namespace aidn::engine {

struct GpuDescription {
  int index = 0;
  std::string name;
  int64_t memory_bytes = 0;
  std::string pci_bus_id;
};

struct DeviceInventory {
  int cpu_cores = 0;
  std::vector<GpuDescription> gpus;
  // Why no GPU is listed ("built without CUDA", "no CUDA driver", ...);
  // empty when GPUs were found.
  std::string gpu_note;
};

// Never fails: any CUDA error means "no GPU" and is put in gpu_note.
DeviceInventory DiscoverDevices();

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_DEVICE_H_
