#ifndef AIDN_WORKER_ENGINE_TEXT_DATA_H_
#define AIDN_WORKER_ENGINE_TEXT_DATA_H_

// Text corpora for language models, as byte-level tokens (vocabulary 256:
// no tokenizer to download): loading, the train/validation split by
// position, and the windows a step trains on.
//
// Windows: an epoch's training text is cut into windows of block_size + 1
// tokens (inputs and, one token later, targets) that start `shift`, `shift`
// + block_size, `shift` + 2 block_size, ... where the shift in [0,
// block_size) is drawn from seed + epoch, so every epoch sees the text cut
// at other places. The windows are the items of a DistributedSampler
// (data.h: a permutation per seed + epoch, one shard per rank), so a
// resumed run draws the same windows at the same positions. Their count,
// (tokens - block_size) / block_size, is the same for every shift.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace aidn::engine {

inline constexpr int kByteVocabSize = 256;

// The bytes of every path in order, a directory standing for its regular
// files (not links, not hidden) in name order that hold no NUL byte (so
// binary indexes beside text, as fortune's .dat files, are left out).
// NOT_FOUND / PERMISSION_DENIED naming the path; INVALID_ARGUMENT for no
// paths, a named file with a NUL byte (not text) or a corpus of no bytes.
absl::StatusOr<std::string> LoadText(const std::vector<std::string>& paths);

// The training and validation parts of a corpus: the validation part is
// the last `val_fraction` of the bytes (in [0, 1)), as nanoGPT splits.
struct TextSplit {
  std::string train;
  std::string val;
};
TextSplit SplitText(std::string text, double val_fraction);

// The windows of `tokens` bytes for `block_size`: 0 when the text is
// shorter than two windows' worth.
int64_t TextWindowCount(int64_t tokens, int block_size);
// The epoch's shift of the window starts, in [0, block_size).
int64_t TextWindowShift(uint64_t seed, int64_t epoch, int block_size);

// Copies windows indices[begin, begin + count) of `text` (cut at `shift`)
// into x and y (each [count, block_size], row-major): x the window's first
// block_size bytes, y the same one byte later. Programmer errors (abort):
// a window index beyond TextWindowCount or positions beyond `indices`.
void GatherTextWindows(const std::string& text, int64_t shift, int block_size,
                       const std::vector<int64_t>& indices, size_t begin, size_t count, int32_t* x,
                       int32_t* y);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_TEXT_DATA_H_
