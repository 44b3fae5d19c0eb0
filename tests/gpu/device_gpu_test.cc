#include <cctype>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "worker/engine/device.h"

namespace aidn::engine {
namespace {

// dddd:bb:dd.0 in lowercase hex, as nvidia-smi and sysfs write it.
bool IsPciBusId(const std::string& id) {
  if (id.size() != 12) return false;
  for (size_t i = 0; i < id.size(); ++i) {
    char c = id[i];
    if (i == 4 || i == 7) {
      if (c != ':') return false;
    } else if (i == 10) {
      if (c != '.') return false;
    } else if (i == 11) {
      if (c != '0') return false;
    } else if (!std::isxdigit(static_cast<unsigned char>(c)) ||
               std::isupper(static_cast<unsigned char>(c))) {
      return false;
    }
  }
  return true;
}

TEST(IsPciBusId, AcceptsOnlyTheDomainBusDeviceFunctionForm) {
  EXPECT_TRUE(IsPciBusId("0000:3b:00.0"));
  EXPECT_FALSE(IsPciBusId("00000000:3B:00.0"));
  EXPECT_FALSE(IsPciBusId("0000:3b:00"));
  EXPECT_FALSE(IsPciBusId("0000-3b-00.0"));
  EXPECT_FALSE(IsPciBusId("0000:3g:00.0"));
}

TEST(DiscoverDevicesGpu, DescribesEveryGpu) {
  DeviceInventory inventory = DiscoverDevices();
  if (inventory.gpus.empty()) GTEST_SKIP() << "no CUDA device: " << inventory.gpu_note;
  std::set<std::string> bus_ids;
  for (size_t i = 0; i < inventory.gpus.size(); ++i) {
    const GpuDescription& gpu = inventory.gpus[i];
    SCOPED_TRACE("gpu " + std::to_string(i) + " " + gpu.name + " " + gpu.pci_bus_id);
    EXPECT_GE(gpu.index, static_cast<int>(i)) << "indices are CUDA ordinals, increasing";
    EXPECT_FALSE(gpu.name.empty());
    EXPECT_GT(gpu.memory_bytes, 0);
    EXPECT_TRUE(IsPciBusId(gpu.pci_bus_id)) << gpu.pci_bus_id;
    EXPECT_TRUE(bus_ids.insert(gpu.pci_bus_id).second) << "duplicate bus id";
  }
}

}  // namespace
}  // namespace aidn::engine
