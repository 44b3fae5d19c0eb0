#include "worker/engine/token_positions.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace aidn::engine {

TokenPositions GroupPositionsByToken(const int32_t* tokens, int64_t n, int32_t vocab) {
  TokenPositions out;
  // count[t + 1]: occurrences of token t; then, summed, where t's group starts.
  std::vector<int32_t> start(static_cast<size_t>(vocab) + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++start[static_cast<size_t>(tokens[i]) + 1];
  out.offsets.push_back(0);
  for (int32_t t = 0; t < vocab; ++t) {
    const int32_t count = start[static_cast<size_t>(t) + 1];
    if (count == 0) continue;
    out.tokens.push_back(t);
    out.offsets.push_back(out.offsets.back() + count);
  }
  for (int32_t t = 0; t < vocab; ++t)
    start[static_cast<size_t>(t) + 1] += start[static_cast<size_t>(t)];
  out.positions.assign(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    int32_t& next = start[static_cast<size_t>(tokens[i])];
    out.positions[static_cast<size_t>(next++)] = static_cast<int32_t>(i);
  }
  return out;
}

}  // namespace aidn::engine
