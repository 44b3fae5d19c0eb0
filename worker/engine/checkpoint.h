#ifndef AIDN_WORKER_ENGINE_CHECKPOINT_H_
#define AIDN_WORKER_ENGINE_CHECKPOINT_H_

// Checkpoint directories: what the ranks that own state write every
// checkpoint.every_steps steps, and what a new generation resumes from.
// Two layouts. Whole (DDP: rank 0 holds everything and writes it):
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
//
// Sharded (ZeRO and FSDP: every rank writes the pieces it holds, so no rank
// ever holds the whole state):
//
//   <dir>/step-00000040/
//     model-00000-of-00002.safetensors      rank 0's pieces of the weights,
//                                           "fc1.weight[0:96]": flat elements
//     optimizer-00000-of-00002.safetensors  its pieces of the optimizer state,
//                                           "fc1.weight.exp_avg[0:96]"
//     model-00001-of-00002.safetensors      rank 1's, ...
//     optimizer-00001-of-00002.safetensors
//     state.txt, MANIFEST                   rank 0's; the manifest names every
//                                           rank's files
//
// Each file's metadata gives the whole shape of every tensor it holds a
// piece of ("shape:fc1.weight": "128,784"), and each model file the
// model's parameter names in order ("aidn.parameters": "fc1.weight,..."),
// which a consolidated file keeps. The ranks write into one
// .tmp-step-00000040-<tag> directory; rank 0 writes the manifest once every
// rank's files are durable, and renames. checkpoint_reader.h reads both
// layouts, at any world size.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/safetensors.h"
#include "worker/engine/shard_map.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

inline constexpr char kModelFile[] = "model.safetensors";
inline constexpr char kOptimizerFile[] = "optimizer.safetensors";
inline constexpr char kStateFile[] = "state.txt";

// "step-00000040".
std::string CheckpointDirName(int64_t step);
// "model-00001-of-00004.safetensors" (part "model" or "optimizer").
std::string ShardFileName(const char* part, int rank, int world_size);
// The metadata key of a whole tensor's shape in a sharded file, before its
// name.
inline constexpr char kShapeKeyPrefix[] = "shape:";
// The metadata key of the parameters' order in a sharded model file.
inline constexpr char kParametersKey[] = "aidn.parameters";

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
// before committing it) is replaced, unless its state.txt names a later
// "generation" than `contents.state` does: ABORTED then, and nothing
// changes (this writer's generation was superseded).
absl::StatusOr<WrittenCheckpoint> WriteCheckpoint(const std::string& dir, int64_t step,
                                                  const CheckpointContents& contents);

struct ShardContents {
  // This rank's pieces (ShardMap::Piece: whole name, element range, values).
  std::vector<ShardMap::Piece> weights;
  std::vector<ShardMap::Piece> optimizer_state;
  // Every whole parameter's name in the model's order: the order a
  // consolidated file lists them in.
  std::vector<std::string> parameters;
  // Safetensors metadata of the rank's model file ("format": "pt" and the
  // shapes are added).
  std::map<std::string, std::string> model_metadata;
  // Rank 0's becomes state.txt; the others' is not used.
  std::map<std::string, std::string> state;
};

// Writes this rank's part of the sharded checkpoint of `step` under `dir`.
// A collective: every rank calls it at the same point, with the same `tag`
// (new for every writer of the step: the generation). Each rank writes its
// two files durably and sends their sizes and checksums to rank 0 (an
// all-gather), which checks that it sees them (FAILED_PRECONDITION naming
// the rank when not: `dir` must be storage every rank shares), writes
// state.txt and the manifest, and publishes the directory as
// WriteCheckpoint does. A rank that fails to write fails the call on every
// rank (ABORTED on the others, naming it). Every rank gets the path and the
// bytes it wrote; rank 0 also the manifest. A call that fails on rank 0
// after the all-gather leaves the other ranks' calls succeeded: the
// checkpoint is not there until rank 0 commits it.
absl::StatusOr<WrittenCheckpoint> WriteShardedCheckpoint(const std::string& dir, int64_t step,
                                                         const std::string& tag,
                                                         const ShardContents& contents,
                                                         Communicator* communicator);

struct LoadedCheckpoint {
  int64_t step = 0;
  std::map<std::string, std::string> state;
  std::map<std::string, Tensor> optimizer_state;
};

// Reads `path`, of either layout, whole (checkpoint_reader.h): the model's
// parameters from its weights, and the rest returned. Every file is checked
// against the manifest (DATA_LOSS naming the bad file, or NOT_FOUND). All
// or nothing for the parameters.
absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const std::string& path,
                                                const std::vector<Parameter*>& model);

// Removes the .tmp-* directories writers left in `dir` (a missing `dir` is
// fine). Call only while no writer is at work there.
absl::Status RemoveTemporaries(const std::string& dir);

// Removes <dir>/step-NNNNNNNN, if present.
absl::Status RemoveCheckpoint(const std::string& dir, int64_t step);

// Removes the step-N directories of `dir` with N below `below` that are not
// in `held` (the steps the coordinator's registry holds for the job):
// retired ones whose removal was never asked for, or never reported. Later
// steps are left alone (a writer may be at work on one). Returns the steps
// removed, ascending; a missing `dir` is fine.
absl::StatusOr<std::vector<int64_t>> RemoveCheckpointsNotHeld(const std::string& dir, int64_t below,
                                                              const std::vector<int64_t>& held);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_CHECKPOINT_H_
