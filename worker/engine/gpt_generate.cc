// Generation from a GPT and loading one from safetensors (gpt.h).

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/gpt.h"
#include "worker/engine/safetensors.h"

namespace aidn::engine {

absl::StatusOr<std::vector<int32_t>> Generate(Gpt& gpt, std::vector<int32_t> prompt,
                                              const SampleOptions& options) {
  const GptConfig& c = gpt.config();
  if (prompt.empty()) return absl::InvalidArgumentError("generate: the prompt is empty");
  for (const int32_t t : prompt) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "generate: prompt token ", t, " is outside the vocabulary [0, ", c.vocab_size, ")"));
    }
  }
  if (options.length < 0) return absl::InvalidArgumentError("generate: length must be >= 0");
  if (options.top_k < 0) return absl::InvalidArgumentError("generate: top_k must be >= 0");
  if (!(options.temperature > 0.0)) {
    return absl::InvalidArgumentError("generate: temperature must be > 0");
  }
  std::mt19937_64 rng(options.seed);
  std::vector<int32_t> order(static_cast<size_t>(c.vocab_size));
  std::vector<double> weights(static_cast<size_t>(c.vocab_size));
  for (int64_t n = 0; n < options.length; ++n) {
    const int64_t context = std::min<int64_t>(static_cast<int64_t>(prompt.size()), c.block_size);
    const Tensor& logits = gpt.Logits(prompt.data() + prompt.size() - context, 1, context);
    const float* last = logits.data() + (context - 1) * c.vocab_size;
    for (int32_t v = 0; v < c.vocab_size; ++v) order[static_cast<size_t>(v)] = v;
    // Most likely first; ties by id, so the order is the same everywhere.
    auto before = [last](int32_t a, int32_t b) {
      return last[a] > last[b] || (last[a] == last[b] && a < b);
    };
    int32_t next = 0;
    if (options.greedy) {
      next = *std::min_element(order.begin(), order.end(), before);
    } else {
      const size_t k =
          options.top_k == 0 ? order.size() : std::min(order.size(), size_t(options.top_k));
      std::partial_sort(order.begin(), order.begin() + static_cast<int64_t>(k), order.end(),
                        before);
      const double top = last[order[0]];
      double total = 0.0;
      for (size_t i = 0; i < k; ++i) {
        weights[i] = std::exp((last[order[i]] - top) / options.temperature);
        total += weights[i];
      }
      double u = (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53 * total;
      next = order[k - 1];
      for (size_t i = 0; i < k; ++i) {
        if (u < weights[i]) {
          next = order[i];
          break;
        }
        u -= weights[i];
      }
    }
    prompt.push_back(next);
  }
  return prompt;
}

absl::StatusOr<std::unique_ptr<Gpt>> LoadGpt(const std::string& path) {
  std::map<std::string, std::string> metadata;
  AIDN_ASSIGN_OR_RETURN(const auto tensors, ReadSafetensors(path, &metadata));
  auto it = metadata.find("aidn.gpt");
  if (it == metadata.end()) {
    auto model = metadata.find("aidn.model");
    return absl::InvalidArgumentError(absl::StrCat(
        path, " holds no gpt model (its metadata has no aidn.gpt",
        model != metadata.end() ? absl::StrCat("; aidn.model is ", model->second) : "", ")"));
  }
  absl::StatusOr<GptConfig> config = ParseGptConfig(it->second);
  if (!config.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", config.status().message()));
  }
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Gpt> gpt, Gpt::Create(*config, 0));
  // The tensors already read, by name (one pass over the file).
  for (Parameter* p : gpt->Parameters()) {
    auto t = tensors.find(p->name);
    if (t == tensors.end() || t->second.shape() != p->value.shape()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor ", p->name, t == tensors.end() ? " is missing" : " has shape ",
          t == tensors.end() ? "" : t->second.ShapeString(), " for a model of ", it->second));
    }
    std::memcpy(p->value.data(), t->second.data(),
                sizeof(float) * static_cast<size_t>(p->value.numel()));
  }
  return gpt;
}

}  // namespace aidn::engine
