#ifndef AIDN_COMMON_GPT_SHAPES_H_
#define AIDN_COMMON_GPT_SHAPES_H_

// The named GPT configurations a job spec may ask for (model.config): the
// coordinator fills a spec's sizes from them, the engine builds the model
// from those sizes (worker/engine/gpt.h's NamedGptConfig reads this table
// too), so both always mean the same model by a name.

#include <string_view>

namespace aidn {

struct GptShape {
  const char* name;
  int n_layer;
  int n_head;
  int n_embd;
  int block_size;
  int vocab_size;
};

// GPT-2 (124M) and GPT-2 medium (350M) with their BPE vocabulary; nanoGPT's
// character-level model (10.8M) and two small ones for tests, over bytes.
inline constexpr GptShape kGptShapes[] = {
    {"gpt-char", 6, 6, 384, 256, 256},
    {"gpt-mini", 4, 4, 128, 128, 256},
    {"gpt-nano", 2, 2, 32, 32, 256},
    {"gpt2", 12, 12, 768, 1024, 50257},
    {"gpt2-medium", 24, 16, 1024, 1024, 50257},
};

// Null for an unknown name.
inline const GptShape* FindGptShape(std::string_view name) {
  for (const GptShape& s : kGptShapes) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

// "gpt-char, gpt-mini, ..." for messages.
inline constexpr char kGptShapeNames[] = "gpt-char, gpt-mini, gpt-nano, gpt2, gpt2-medium";

}  // namespace aidn

#endif  // AIDN_COMMON_GPT_SHAPES_H_
