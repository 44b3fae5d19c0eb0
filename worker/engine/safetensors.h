#ifndef AIDN_WORKER_ENGINE_SAFETENSORS_H_
#define AIDN_WORKER_ENGINE_SAFETENSORS_H_

// Weights in the safetensors format (huggingface/safetensors), so PyTorch
// and aidn exchange them: the torch oracle test loads torch's initial weights
// through it, and checkpoints export weights that torch can load.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {"key": "value", ...},
//    "<name>": {"dtype": "F32", "shape": [d0, ...], "data_offsets": [begin, end]}, ...}
// padded with spaces to a multiple of 8 bytes, then the raw little-endian
// data; offsets are relative to the end of the header.
//
// Reading is strict: the header must be well-formed UTF-8 JSON of that shape
// (no duplicate keys, no unknown fields, at most 100 MiB), every tensor's byte
// range must match its dtype and shape, and the ranges must cover the data
// exactly (no overlap, no gap, nothing after the last tensor), as the
// reference implementation requires.
//
// Only F32 tensors are read and written. Errors name the file and the problem:
// DATA_LOSS for a truncated or malformed file, INVALID_ARGUMENT for a file
// that does not fit the parameters (a missing tensor, a shape or dtype
// mismatch), the errno's code (NOT_FOUND, ...) for I/O failures.
//
// Thread-compatible: the functions keep no state; callers must not write a
// parameter while it is being saved or loaded.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/tensor.h"

namespace aidn {
class ScopedFd;
}

namespace aidn::engine {

// Writes the parameters' values under their names, in the given order, with
// `metadata` as "__metadata__" (omitted when empty). Atomic: writes
// "<path>.tmp", fsyncs it, renames it over `path` and fsyncs the directory,
// so `path` holds either the old file or the complete new one.
// INVALID_ARGUMENT for a null parameter, an empty or duplicate name, or the
// reserved name "__metadata__"; UNIMPLEMENTED for a non-CPU tensor.
absl::Status SaveSafetensors(const std::string& path, const std::vector<const Parameter*>& params,
                             const std::map<std::string, std::string>& metadata = {});

// The same for tensors that are not parameters (optimizer state, say).
using NamedTensor = std::pair<std::string, const Tensor*>;
absl::Status SaveTensorsSafetensors(const std::string& path,
                                    const std::vector<NamedTensor>& tensors,
                                    const std::map<std::string, std::string>& metadata = {});

// Fills each parameter's value (same shape, storage kept) from the tensor of
// the same name. Tensors in the file that no parameter names are ignored.
// All or nothing: on any error no parameter has changed.
absl::Status LoadSafetensors(const std::string& path, const std::vector<Parameter*>& params);

// Every tensor of the file by name (all must be F32), and its
// "__metadata__" into *metadata when that is not null (empty if absent).
absl::StatusOr<std::map<std::string, Tensor>> ReadSafetensors(
    const std::string& path, std::map<std::string, std::string>* metadata = nullptr);

// An open safetensors file read piece by piece: the header validated at
// Open (as above), then any range of elements of any F32 tensor read with
// pread, so a reader of one slice of a large file reads that slice only.
// Thread-compatible.
class SafetensorsFile {
 public:
  struct Entry {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    int64_t numel = 0;
  };
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // In header order.
  const std::vector<Entry>& tensors() const { return tensors_; }
  // Elements [first, first + count) of F32 tensor `name`, flat, into `out`.
  // INVALID_ARGUMENT for an unknown name, another dtype or a range outside
  // the tensor; the file's path is in every error.
  absl::Status ReadFloats(const std::string& name, size_t first, size_t count, float* out) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  std::unique_ptr<ScopedFd> fd_;
  std::map<std::string, std::string> metadata_;
  std::vector<Entry> tensors_;
  std::map<std::string, uint64_t> offsets_;  // by name: the data's file offset
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_SAFETENSORS_H_
