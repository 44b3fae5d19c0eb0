// IDX files (Fashion-MNIST's format, or a user's): the first byte splits
// the input into an images file and a labels file, both gzip'd or not.
#include <cstdint>

#include "tests/fuzz/fuzz_input.h"
#include "worker/engine/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t cut = std::min<size_t>(size - 1, static_cast<size_t>(data[0]) * 8);
  aidn::fuzz::InputFile images(data + 1, cut);
  aidn::fuzz::InputFile labels(data + 1 + cut, size - 1 - cut);
  (void)aidn::engine::LoadIdx(images.path(), labels.path(), 0.5f, 0.25f, 10);
  return 0;
}
