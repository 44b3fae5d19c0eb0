// Safetensors files from anyone (a user's weights, a checkpoint on shared
// storage): the strict header parser and the range reads behind them.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "tests/fuzz/fuzz_input.h"
#include "worker/engine/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  aidn::fuzz::InputFile file(data, size);
  auto opened = aidn::engine::SafetensorsFile::Open(file.path());
  if (opened.ok()) {
    std::vector<float> buffer;
    for (const auto& t : (*opened)->tensors()) {
      // The header was checked against the file's size: a tensor's floats
      // are there. Read a bounded slice of each, and past its end (refused).
      const size_t n = std::min<size_t>(static_cast<size_t>(t.numel), 4096);
      buffer.resize(n + 1);
      (void)(*opened)->ReadFloats(t.name, 0, n, buffer.data());
      (void)(*opened)->ReadFloats(t.name, static_cast<size_t>(t.numel), 1, buffer.data());
    }
  }
  // The whole-file reader too, for files small enough to hold.
  if (size < (1 << 20)) (void)aidn::engine::ReadSafetensors(file.path());
  return 0;
}
