#include "common/checkpoint_check.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/digest.h"
#include "common/file.h"
#include "common/status.h"

namespace aidn {

bool Exportable(const v1::Checkpoint& c) { return c.committed() && c.invalid_reason().empty(); }

std::string WhyNotExportable(const v1::Checkpoint& c) {
  if (!c.invalid_reason().empty()) return absl::StrCat("found invalid: ", c.invalid_reason());
  return absl::StrCat("not committed (", c.ranks_reported_size(), "/", c.ranks_expected_size(),
                      " ranks reported)");
}

std::string ExportableSteps(const google::protobuf::RepeatedPtrField<v1::Checkpoint>& checkpoints) {
  std::vector<int64_t> steps;
  for (const v1::Checkpoint& c : checkpoints) {
    if (Exportable(c)) steps.push_back(c.step());
  }
  if (steps.empty()) return "no checkpoint is committed and valid";
  std::sort(steps.begin(), steps.end());
  return absl::StrCat("committed, valid steps: ", absl::StrJoin(steps, ", "));
}

absl::StatusOr<std::optional<ManifestEntry>> VerifyCommittedCheckpoint(
    const v1::Checkpoint& checkpoint) {
  const std::string& dir = checkpoint.path();
  const std::string what = absl::StrCat("checkpoint of step ", checkpoint.step());
  if (dir.empty() || dir[0] != '/') {
    return absl::FailedPreconditionError(absl::StrCat(
        "the coordinator holds no absolute directory for the ", what, " (path \"", dir, "\")"));
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat(
          "the ", what, " is at ", dir,
          ", which is not reachable from this machine: checkpoints live on the workers' "
          "checkpoint storage (the workers' --checkpoint-root, or the job's absolute "
          "checkpoint.dir); read it where that storage is mounted at the same path"));
    }
    return PosixError(absl::StrCat("cannot read the ", what, " at ", dir), errno);
  }
  absl::StatusOr<Manifest> manifest = VerifyCheckpointDir(dir);
  if (!manifest.ok()) {
    return absl::Status(manifest.status().code(),
                        absl::StrCat("the ", what, " at ", dir,
                                     " fails verification: ", manifest.status().message()));
  }
  if (manifest->step != checkpoint.step()) {
    return absl::DataLossError(absl::StrCat("the ", what, " at ", dir, " holds step ",
                                            manifest->step, " by its ", kManifestName));
  }
  // The manifest verified, but it may be another write of the same step
  // than the one the coordinator committed (a later generation's, or
  // another job's sharing the directory): the digest tells.
  if (!checkpoint.manifest_sha256().empty()) {
    AIDN_ASSIGN_OR_RETURN(const std::string text,
                          ReadFileToString(absl::StrCat(dir, "/", kManifestName)));
    const std::string digest = Sha256Hex(text);
    if (digest != checkpoint.manifest_sha256()) {
      return absl::DataLossError(
          absl::StrCat(kManifestName, " in ", dir, " is not the one committed for step ",
                       checkpoint.step(), " (SHA-256 ", digest, ", the coordinator recorded ",
                       checkpoint.manifest_sha256(), "): the directory was rewritten"));
    }
  }
  for (const ManifestEntry& entry : manifest->files) {
    if (entry.name == kCheckpointModelFile) return entry;
  }
  return std::nullopt;
}

}  // namespace aidn
