#ifndef AIDN_WORKER_ENGINE_CHECKPOINT_H_
#define AIDN_WORKER_ENGINE_CHECKPOINT_H_

// Checkpoint directories: what a rank that owns state writes every
// checkpoint.every_steps steps, and what a new generation resumes from.
//
//   <dir>/step-00000040/
//     model.safetensors      the weights, Hugging Face layout, torch's names
//     optimizer.safetensors  momentum / Adam moments, by "<param>.<buffer>"
//     state.txt              "key value" lines: step, epoch, seed, ...
//     MANIFEST               sizes and CRC-32C of the files above; last
//
// Written atomically: everything goes to <dir>/.tmp-step-00000040-<pid>,
// each file fsync'd, the manifest last, the directory fsync'd, renamed to
// step-00000040, and <dir> fsync'd. A reader that finds step-N with a
// manifest that verifies sees the whole checkpoint; anything else is not
// one. A writer killed half way leaves only a .tmp-* directory, which
// RemoveTemporaries() clears.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/safetensors.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

inline constexpr char kModelFile[] = "model.safetensors";
inline constexpr char kOptimizerFile[] = "optimizer.safetensors";
inline constexpr char kStateFile[] = "state.txt";

// "step-00000040".
std::string CheckpointDirName(int64_t step);

struct CheckpointContents {
  std::vector<const Parameter*> model;
  // Safetensors metadata of model.safetensors ("format": "pt" is added).
  std::map<std::string, std::string> model_metadata;
  std::vector<NamedTensor> optimizer_state;
  // Keys [a-z0-9_]+, values one line each.
  std::map<std::string, std::string> state;
};

struct WrittenCheckpoint {
  // <dir>/step-NNNNNNNN.
  std::string path;
  // All files, the manifest included.
  int64_t bytes = 0;
  // The manifest's text.
  std::string manifest;
};

// Writes the checkpoint of `step` under `dir` (created if missing). An
// existing step-N directory of the same step (from a generation that failed
// before committing it) is replaced.
absl::StatusOr<WrittenCheckpoint> WriteCheckpoint(const std::string& dir, int64_t step,
                                                  const CheckpointContents& contents);

struct LoadedCheckpoint {
  int64_t step = 0;
  std::map<std::string, std::string> state;
  std::map<std::string, Tensor> optimizer_state;
};

// Verifies `path` against its manifest (DATA_LOSS naming the bad file, or
// NOT_FOUND), then fills the model's parameters from model.safetensors and
// returns the rest. All or nothing for the parameters.
absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const std::string& path,
                                                const std::vector<Parameter*>& model);

// Removes the .tmp-* directories writers left in `dir` (a missing `dir` is
// fine). Call only while no writer is at work there.
absl::Status RemoveTemporaries(const std::string& dir);

// Removes <dir>/step-NNNNNNNN, if present.
absl::Status RemoveCheckpoint(const std::string& dir, int64_t step);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_CHECKPOINT_H_
