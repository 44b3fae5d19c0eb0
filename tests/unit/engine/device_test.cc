#include "worker/engine/device.h"

#include <thread>

#include <gtest/gtest.h>

namespace aidn::engine {
namespace {

TEST(DiscoverDevices, ReportsAtLeastOneCpuCore) {
  DeviceInventory inventory = DiscoverDevices();
  EXPECT_GE(inventory.cpu_cores, 1);
  unsigned hw = std::thread::hardware_concurrency();
  if (hw > 0) {
    EXPECT_EQ(inventory.cpu_cores, static_cast<int>(hw));
  }
}

TEST(DiscoverDevices, ExplainsWhyNoGpuIsListed) {
  DeviceInventory inventory = DiscoverDevices();
  if (inventory.gpus.empty()) {
    EXPECT_FALSE(inventory.gpu_note.empty());
  } else {
    // Indices are CUDA ordinals: distinct and increasing.
    int prev = -1;
    for (const GpuDescription& gpu : inventory.gpus) {
      EXPECT_GT(gpu.index, prev);
      prev = gpu.index;
    }
  }
}

TEST(DiscoverDevices, GivesTheSameAnswerTwice) {
  DeviceInventory a = DiscoverDevices();
  DeviceInventory b = DiscoverDevices();
  EXPECT_EQ(a.cpu_cores, b.cpu_cores);
  EXPECT_EQ(a.gpus.size(), b.gpus.size());
}

}  // namespace
}  // namespace aidn::engine
