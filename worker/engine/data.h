#ifndef AIDN_WORKER_ENGINE_DATA_H_
#define AIDN_WORKER_ENGINE_DATA_H_

// Datasets in IDX format (MNIST, Fashion-MNIST), the per-rank sampler with
// torch.utils.data.DistributedSampler's semantics, and batch assembly.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

// Fashion-MNIST's training-set pixel statistics after scaling to [0, 1]
// (the values torchvision recipes use with transforms.Normalize).
inline constexpr float kFashionMnistMean = 0.2860f;
inline constexpr float kFashionMnistStd = 0.3530f;
inline constexpr char kFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";

// An image-classification dataset held in memory. Immutable once loaded:
// safe to read from several threads.
struct Dataset {
  int64_t size = 0;
  int rows = 0;
  int cols = 0;
  // size * rows * cols pixels, row-major per image, normalised as
  // torchvision's ToTensor + Normalize: (byte / 255 - mean) / stddev.
  std::vector<float> images;
  // size class indices, each in [0, classes).
  std::vector<int32_t> labels;
  int classes = 0;
};

// Reads an image file (IDX magic 0x00000803: unsigned bytes, dims count,
// rows, cols) and its label file (0x00000801: count), gzip'd or plain (zlib
// reads both). Every problem is an error whose message starts with the
// offending file's path and says what is wrong:
//   NOT_FOUND / PERMISSION_DENIED  the file cannot be opened
//   INVALID_ARGUMENT  not an IDX file of the right kind (magic, type, rank),
//                     absurd dimensions, image and label counts that differ,
//                     a bad mean/stddev or class count
//   DATA_LOSS         truncated or corrupt data (including a broken gzip
//                     stream), trailing bytes, a label >= `classes`
absl::StatusOr<Dataset> LoadIdx(const std::string& images_path, const std::string& labels_path,
                                float mean, float stddev, int classes = 10);

// Start-up cost: inflating Fashion-MNIST's 26 MB of gzip'd training images
// takes ~0.3 s, most of a trainer's start-up. With a cache directory (one
// per worker) a .gz file is inflated once into
// <cache_dir>/<name>-<size>-<mtime_ns>-<inode>.raw and later trainers (the
// next job, a restarted generation) read that instead: LoadIdx reads plain
// IDX as well. Returns the path to read: the cached copy, or `path` itself
// when it is not gzip'd, the cache is off (empty `cache_dir`), or anything
// about caching fails (it is never an error; a damaged .gz is left for
// LoadIdx to report under its own name). Concurrent callers are safe: each
// writes its own temporary file and renames it into place.
std::string DecompressedPath(const std::string& path, const std::string& cache_dir);

// Fashion-MNIST's train (60000) or test (10000) split from `dir`, under the
// standard names (train-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz, ...),
// normalised with kFashionMnistMean/Std.
absl::StatusOr<Dataset> LoadFashionMnist(const std::string& dir, bool train,
                                         const std::string& cache_dir = "");

// Splits a dataset across ranks exactly as torch's DistributedSampler:
// each epoch's order is a permutation drawn from seed + epoch (or 0..n-1
// without shuffling), the same on every rank; it is padded by repeating
// indices from its start to num_samples() * world_size (or truncated to a
// multiple of world_size with drop_last), and rank r takes positions
// r, r + world_size, r + 2 * world_size, ...
//
// The permutation is a Fisher-Yates shuffle driven by std::mt19937_64 with
// an unbiased bounded draw of aidn's own, so it is identical across builds
// and standard libraries (but not torch's randperm order).
//
// Immutable after construction: thread-safe.
class DistributedSampler {
 public:
  // Programmer errors (abort): dataset_size < 0, world_size < 1, rank
  // outside [0, world_size).
  DistributedSampler(int64_t dataset_size, int world_size, int rank, bool shuffle, uint64_t seed,
                     bool drop_last);

  // This rank's num_samples() dataset indices for `epoch`, in order.
  std::vector<int64_t> EpochIndices(int64_t epoch) const;
  // Indices per rank per epoch: ceil(n / world), or floor(n / world) with
  // drop_last.
  int64_t num_samples() const { return num_samples_; }
  int64_t total_size() const { return num_samples_ * world_size_; }

 private:
  int64_t dataset_size_;
  int world_size_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t num_samples_;
};

// The seeded permutation of 0..n-1 the sampler uses (exposed for tests).
std::vector<int64_t> Permutation(int64_t n, uint64_t seed);

// Copies the samples indices[begin, begin + count) into `images` (resized to
// [count, 1, rows, cols]) and `labels` (resized to count). Out-of-range
// positions or dataset indices are programmer errors (abort).
void GatherBatch(const Dataset& dataset, const std::vector<int64_t>& indices, size_t begin,
                 size_t count, Tensor* images, std::vector<int32_t>* labels);

// One micro-batch of an optimizer step, as the GPU engine takes a step's
// batches (gradient accumulation): borrowed images [N, C, H, W] and labels
// [N], and the dropout seed of its forward (Sequential::SetSeed), where it
// gets one of its own. A language model's micro-batch has no images: its
// inputs are `tokens` and its targets `labels`, both [N, seq_len]
// row-major.
struct MicroBatch {
  const Tensor* images = nullptr;
  const std::vector<int32_t>* labels = nullptr;
  std::optional<uint64_t> seed;
  const std::vector<int32_t>* tokens = nullptr;
  int64_t seq_len = 0;
};

// Whether `b` is a well-formed language model's micro-batch: tokens and
// labels of the same size, whole rows of seq_len.
inline bool IsTokenBatch(const MicroBatch& b) {
  return b.tokens != nullptr && b.labels != nullptr && b.seq_len > 0 &&
         b.tokens->size() == b.labels->size() &&
         static_cast<int64_t>(b.tokens->size()) % b.seq_len == 0;
}

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_DATA_H_
