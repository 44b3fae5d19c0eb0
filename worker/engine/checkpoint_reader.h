#ifndef AIDN_WORKER_ENGINE_CHECKPOINT_READER_H_
#define AIDN_WORKER_ENGINE_CHECKPOINT_READER_H_

// Reads a checkpoint directory of either layout (checkpoint.h) by pieces:
// any element range of any whole tensor, however the writers had it split.
// So a sharded checkpoint written by 4 ranks resumes at 2 or 3 ranks, under
// DDP, ZeRO or FSDP, and exports as one safetensors file; and a whole one
// resumes sharded.
//
// Open reads the manifest, state.txt (checked against the manifest) and
// the safetensors headers, and checks that the pieces of every whole tensor
// cover it exactly once. A file's data is checked against the manifest
// (CRC-32C) the first time a Read touches it: a rank reads, and checks, only
// the files that hold its pieces.
//
// Thread-compatible.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checkpoint_manifest.h"
#include "worker/engine/safetensors.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

class CheckpointReader {
 public:
  enum class Part { kModel, kOptimizer };

  // NOT_FOUND when `path` or its manifest is missing; DATA_LOSS naming the
  // file and the problem for anything malformed, missing or inconsistent.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const std::string& path);

  const std::string& path() const { return path_; }
  // The manifest's step.
  int64_t step() const { return manifest_.step; }
  // state.txt's lines.
  const std::map<std::string, std::string>& state() const { return state_; }
  // The ranks whose files it holds; 0 for the whole layout.
  int shards() const { return shards_; }
  // The first model file's safetensors metadata (the shapes left out).
  const std::map<std::string, std::string>& model_metadata() const { return model_metadata_; }

  // The whole tensors of a part and their shapes, in the first file's order.
  const std::vector<std::pair<std::string, std::vector<int64_t>>>& Tensors(Part part) const {
    return index_[static_cast<int>(part)].order;
  }
  // Elements [begin, end) of whole tensor `name`, flat, into `out`.
  // NOT_FOUND for a tensor the part does not hold, INVALID_ARGUMENT for a
  // range beyond it, DATA_LOSS for a file that fails its checksum.
  absl::Status Read(Part part, const std::string& name, size_t begin, size_t end, float* out);
  // The whole of each parameter into its value, checking shapes; all or
  // nothing.
  absl::Status ReadParameters(const std::vector<Parameter*>& params);
  // Every parameter, whole, into one safetensors file at `out` (the
  // model's order, the weights' metadata): what a whole checkpoint's
  // model.safetensors holds. Atomic as SaveSafetensors.
  absl::Status Consolidate(const std::string& out);

 private:
  struct Piece {
    size_t file;       // into files_
    std::string name;  // the tensor's name in the file
    size_t begin = 0, end = 0;
  };
  struct Whole {
    std::vector<int64_t> shape;
    size_t numel = 0;
    std::vector<Piece> pieces;  // by begin
  };
  struct Index {
    std::map<std::string, Whole> by_name;
    std::vector<std::pair<std::string, std::vector<int64_t>>> order;
  };

  CheckpointReader() = default;
  absl::Status AddFile(Part part, const std::string& name, bool sharded);
  absl::Status CheckCoverage();
  absl::Status Verify(size_t file);

  std::string path_;
  Manifest manifest_;
  std::map<std::string, std::string> state_;
  int shards_ = 0;
  std::map<std::string, std::string> model_metadata_;
  std::string order_text_;  // kParametersKey's value
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<const ManifestEntry*> entries_;  // by file: its manifest line
  std::set<size_t> verified_;
  Index index_[2];
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_CHECKPOINT_READER_H_
