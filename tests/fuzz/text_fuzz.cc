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
  auto split = aidn::engine::SplitText(*text, 0.1);
  (void)split;
  return 0;
}
