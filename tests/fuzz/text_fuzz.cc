// Text corpora: read, split into training and validation text, cut into
// windows (what a GPT job's ranks do with a user's files).
#include <cstdint>
#include <vector>

#include "tests/fuzz/fuzz_input.h"
#include "worker/engine/text_data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  aidn::fuzz::InputFile file(data, size);
  auto text = aidn::engine::LoadText({file.path()});
  if (!text.ok()) return 0;
  const aidn::engine::TextSplit split = aidn::engine::SplitText(*text, 0.1);
  // Every window of the training text, at a shift the seed picks.
  constexpr int kBlock = 8;
  const int64_t windows =
      aidn::engine::TextWindowCount(static_cast<int64_t>(split.train.size()), kBlock);
  if (windows <= 0) return 0;
  const int64_t shift = aidn::engine::TextWindowShift(size, 1, kBlock);
  std::vector<int64_t> indices;
  for (int64_t w = 0; w < windows && w < 64; ++w) indices.push_back(w);
  std::vector<int32_t> x(indices.size() * kBlock), y(indices.size() * kBlock);
  aidn::engine::GatherTextWindows(split.train, shift, kBlock, indices, 0, indices.size(), x.data(),
                                  y.data());
  return 0;
}
