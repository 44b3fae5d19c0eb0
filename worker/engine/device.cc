#include "worker/engine/device.h"

#include <thread>

#include "aidn/config.h"
#if AIDN_HAVE_CUDA
#include "worker/engine/cuda/device_query.h"
#endif

namespace aidn::engine {

DeviceInventory DiscoverDevices() {
  DeviceInventory inventory;
  inventory.cpu_cores = static_cast<int>(std::thread::hardware_concurrency());
  if (inventory.cpu_cores <= 0) inventory.cpu_cores = 1;
#if AIDN_HAVE_CUDA
  inventory.gpus = cuda::QueryGpus(&inventory.gpu_note);
#else
  inventory.gpu_note = "built without CUDA";
#endif
  return inventory;
}

}  // namespace aidn::engine
