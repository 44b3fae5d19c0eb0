#ifndef AIDN_WORKER_ENGINE_TOKEN_POSITIONS_H_
#define AIDN_WORKER_ENGINE_TOKEN_POSITIONS_H_

// The positions of a batch grouped by token, for an embedding's gradient
// without atomics (the GPU decoder's, cuda/gpt_kernels.h): row t of the
// gradient sums the output gradients at the positions holding token t, in
// ascending order, as the CPU's loop over positions adds them. Pure.

#include <cstdint>
#include <vector>

namespace aidn::engine {

struct TokenPositions {
  // The distinct tokens, ascending.
  std::vector<int32_t> tokens;
  // tokens.size() + 1 entries: token u's positions are
  // positions[offsets[u] .. offsets[u + 1]).
  std::vector<int32_t> offsets;
  // Every position 0..n-1 once, grouped by token, ascending in each group.
  std::vector<int32_t> positions;
};

// A counting sort of `n` tokens in [0, vocab) (the caller has checked the
// range; n below 2^31).
TokenPositions GroupPositionsByToken(const int32_t* tokens, int64_t n, int32_t vocab);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_TOKEN_POSITIONS_H_
