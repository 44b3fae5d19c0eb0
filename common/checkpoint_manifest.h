#ifndef AIDN_COMMON_CHECKPOINT_MANIFEST_H_
#define AIDN_COMMON_CHECKPOINT_MANIFEST_H_

// The manifest of a checkpoint directory: the file written last, naming
// every other file with its size and CRC-32C. A directory whose manifest is
// missing, unreadable or disagrees with any file is not a checkpoint. Shared
// by the trainer (which writes and verifies) and aidnctl (which verifies
// before exporting), so it lives here and not in the engine.
//
// Text, one record per line:
//   aidn-checkpoint 1
//   step 40
//   file model.safetensors 1086784 3f1a09c2
//   file optimizer.safetensors 2173512 9b0e51d7
//   file state.txt 215 0c44e2a1

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace aidn {

inline constexpr char kManifestName[] = "MANIFEST";

struct ManifestEntry {
  std::string name;
  int64_t bytes = 0;
  uint32_t crc32c = 0;
};

struct Manifest {
  int64_t step = 0;
  std::vector<ManifestEntry> files;
};

std::string FormatManifest(const Manifest& manifest);

// Strict: the header line, one step line, at least one file line, plain
// file names (no '/', no leading '.'), no duplicates. DATA_LOSS otherwise.
absl::StatusOr<Manifest> ParseManifest(absl::string_view text);

// Reads and parses `dir`/MANIFEST: NOT_FOUND when the directory or the
// manifest is missing, DATA_LOSS when it is malformed.
absl::StatusOr<Manifest> ReadManifest(const std::string& dir);

// Checks one file of `dir` against its manifest line: DATA_LOSS naming the
// file when it is missing, of another size or another CRC-32C.
absl::Status VerifyManifestFile(const std::string& dir, const ManifestEntry& entry);

// Reads `dir`/MANIFEST and checks every file it names: present, the size
// recorded, the CRC-32C recorded. DATA_LOSS naming the file and what is
// wrong ("model.safetensors: 1024 bytes, the manifest says 1086784"), or
// NOT_FOUND when the directory or its manifest is missing.
absl::StatusOr<Manifest> VerifyCheckpointDir(const std::string& dir);

}  // namespace aidn

#endif  // AIDN_COMMON_CHECKPOINT_MANIFEST_H_
