#ifndef AIDN_COMMON_CHECKPOINT_CHECK_H_
#define AIDN_COMMON_CHECKPOINT_CHECK_H_

// A committed checkpoint as the coordinator recorded it, checked against
// its directory before anyone reads weights out of it (aidnctl export, the
// web UI's download): the directory reachable from this machine, every file
// its MANIFEST names present with the size and CRC-32C recorded, the
// manifest's step the checkpoint's, and the manifest the very one whose
// SHA-256 the coordinator recorded at commit time (not a later rewrite of
// the same step).

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "aidn/v1/job.pb.h"
#include "common/checkpoint_manifest.h"
#include "common/file.h"
#include "google/protobuf/repeated_ptr_field.h"

namespace aidn {

// The file of a whole model's weights in a checkpoint directory.
inline constexpr char kCheckpointModelFile[] = "model.safetensors";

// Committed and not found invalid.
bool Exportable(const v1::Checkpoint& checkpoint);
// Why a checkpoint is not Exportable: "found invalid: <reason>" or "not
// committed (1/2 ranks reported)".
std::string WhyNotExportable(const v1::Checkpoint& checkpoint);
// "committed, valid steps: 10, 20" or "no checkpoint is committed and
// valid".
std::string ExportableSteps(const google::protobuf::RepeatedPtrField<v1::Checkpoint>& checkpoints);

// Verifies the checkpoint's directory as above. Returns the manifest entry
// of the whole model's weights, or nullopt for a sharded checkpoint (one
// file per rank). FAILED_PRECONDITION without an absolute directory,
// NOT_FOUND when it is not reachable from this machine (saying where
// checkpoints live), DATA_LOSS for a file or manifest that does not match.
absl::StatusOr<std::optional<ManifestEntry>> VerifyCommittedCheckpoint(
    const v1::Checkpoint& checkpoint);

// A committed checkpoint's whole-model weights opened to be sent to
// someone else (the web UI's download), so that no file but those weights
// can be read through it:
// - MANIFEST and the weights are opened without following a symbolic link
//   anywhere in their paths (openat2 RESOLVE_NO_SYMLINKS), and read through
//   the descriptors opened;
// - the MANIFEST's SHA-256 must be the one the coordinator recorded at
//   commit time (FAILED_PRECONDITION when none was recorded), its step the
//   checkpoint's;
// - the weights must be a regular file of the manifest's size whose bytes
//   have its CRC-32C (DATA_LOSS otherwise).
// nullopt for a sharded checkpoint (no whole-model file). The errors of
// VerifyCommittedCheckpoint otherwise; FAILED_PRECONDITION for a path
// through a symbolic link.
struct OpenedWeights {
  std::shared_ptr<ScopedFd> file;
  ManifestEntry entry;
};
absl::StatusOr<std::optional<OpenedWeights>> OpenCommittedWeights(const v1::Checkpoint& checkpoint);

}  // namespace aidn

#endif  // AIDN_COMMON_CHECKPOINT_CHECK_H_
