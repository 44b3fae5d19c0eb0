#include "common/checkpoint_check.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/crc32c.h"
#include "common/digest.h"
#include "common/file.h"
#include "common/status.h"

namespace aidn {
namespace {

constexpr size_t kReadChunk = 1 << 20;

// `path` opened for reading with no symbolic link followed in any of its
// components.
absl::StatusOr<std::shared_ptr<ScopedFd>> OpenWithoutLinks(const std::string& path) {
  open_how how{};
  how.flags = O_RDONLY | O_CLOEXEC;
  how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  const int fd =
      static_cast<int>(::syscall(SYS_openat2, AT_FDCWD, path.c_str(), &how, sizeof(how)));
  if (fd >= 0) return std::make_shared<ScopedFd>(fd);
  if (errno == ELOOP || errno == EXDEV) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " goes through a symbolic link: not sent"));
  }
  if (errno == ENOENT || errno == ENOTDIR) {
    return absl::NotFoundError(absl::StrCat(
        path,
        " is not reachable from this machine: checkpoints live on the workers' checkpoint "
        "storage, mounted here at the same path or not at all"));
  }
  return PosixError(absl::StrCat("cannot open ", path), errno);
}

// All of `fd`'s bytes, at most `limit`.
absl::StatusOr<std::string> ReadAll(int fd, const std::string& path, size_t limit) {
  std::string text;
  char buffer[4096];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PosixError(absl::StrCat("cannot read ", path), errno);
    if (n == 0) return text;
    text.append(buffer, static_cast<size_t>(n));
    if (text.size() > limit) return absl::DataLossError(absl::StrCat(path, " is too large"));
  }
}

// "checkpoint of step N", for messages.
std::string What(const v1::Checkpoint& checkpoint) {
  return absl::StrCat("checkpoint of step ", checkpoint.step());
}

// FAILED_PRECONDITION unless the coordinator holds an absolute directory.
absl::Status CheckAbsoluteDir(const v1::Checkpoint& checkpoint) {
  const std::string& dir = checkpoint.path();
  if (!dir.empty() && dir[0] == '/') return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the coordinator holds no absolute directory for the ", What(checkpoint),
                   " (path \"", dir, "\")"));
}

// DATA_LOSS unless the manifest names the checkpoint's step.
absl::Status CheckStep(const v1::Checkpoint& checkpoint, const Manifest& manifest) {
  if (manifest.step == checkpoint.step()) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("the ", What(checkpoint), " at ", checkpoint.path(),
                                          " holds step ", manifest.step, " by its ",
                                          kManifestName));
}

// DATA_LOSS unless the MANIFEST `text` is the one committed (its SHA-256
// the recorded one). A manifest that verifies may still be another write of
// the same step (a later generation's, or another job's sharing the
// directory): the digest tells.
absl::Status CheckDigest(const v1::Checkpoint& checkpoint, const std::string& text) {
  const std::string digest = Sha256Hex(text);
  if (digest == checkpoint.manifest_sha256()) return absl::OkStatus();
  return absl::DataLossError(
      absl::StrCat(kManifestName, " in ", checkpoint.path(), " is not the one committed for step ",
                   checkpoint.step(), " (SHA-256 ", digest, ", the coordinator recorded ",
                   checkpoint.manifest_sha256(), "): the directory was rewritten"));
}

// The manifest's whole-model weights, or null (a sharded checkpoint).
const ManifestEntry* ModelEntry(const Manifest& manifest) {
  for (const ManifestEntry& entry : manifest.files) {
    if (entry.name == kCheckpointModelFile) return &entry;
  }
  return nullptr;
}

}  // namespace

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
  AIDN_RETURN_IF_ERROR(CheckAbsoluteDir(checkpoint));
  const std::string& dir = checkpoint.path();
  const std::string what = What(checkpoint);
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
  AIDN_RETURN_IF_ERROR(CheckStep(checkpoint, *manifest));
  // Without a recorded digest (older commits) the step is all it is held to.
  if (!checkpoint.manifest_sha256().empty()) {
    AIDN_ASSIGN_OR_RETURN(const std::string text,
                          ReadFileToString(absl::StrCat(dir, "/", kManifestName)));
    AIDN_RETURN_IF_ERROR(CheckDigest(checkpoint, text));
  }
  const ManifestEntry* model = ModelEntry(*manifest);
  if (model == nullptr) return std::nullopt;
  return *model;
}

absl::StatusOr<std::optional<OpenedWeights>> OpenCommittedWeights(
    const v1::Checkpoint& checkpoint) {
  AIDN_RETURN_IF_ERROR(CheckAbsoluteDir(checkpoint));
  const std::string& dir = checkpoint.path();
  if (checkpoint.manifest_sha256().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the coordinator recorded no MANIFEST digest for the ", What(checkpoint),
                     ": only aidnctl export, where the storage is mounted, reads it"));
  }
  const std::string manifest_path = absl::StrCat(dir, "/", kManifestName);
  AIDN_ASSIGN_OR_RETURN(const std::shared_ptr<ScopedFd> manifest_file,
                        OpenWithoutLinks(manifest_path));
  AIDN_ASSIGN_OR_RETURN(const std::string text,
                        ReadAll(manifest_file->get(), manifest_path, size_t{1} << 20));
  AIDN_RETURN_IF_ERROR(CheckDigest(checkpoint, text));
  AIDN_ASSIGN_OR_RETURN(const Manifest manifest, ParseManifest(text));
  AIDN_RETURN_IF_ERROR(CheckStep(checkpoint, manifest));
  const ManifestEntry* model = ModelEntry(manifest);
  if (model == nullptr) return std::nullopt;
  const std::string path = absl::StrCat(dir, "/", kCheckpointModelFile);
  OpenedWeights weights{.entry = *model};
  AIDN_ASSIGN_OR_RETURN(weights.file, OpenWithoutLinks(path));
  struct stat st;
  if (::fstat(weights.file->get(), &st) != 0) return PosixError(path, errno);
  if (!S_ISREG(st.st_mode) || st.st_size != model->bytes) {
    return absl::DataLossError(absl::StrCat(path, ": not a regular file of ", model->bytes,
                                            " bytes, as the manifest says"));
  }
  // The bytes through the descriptor that will send them.
  std::vector<char> buffer(kReadChunk);
  uint32_t crc = 0;
  for (int64_t offset = 0; offset < model->bytes;) {
    const ssize_t n = ::pread(weights.file->get(), buffer.data(), buffer.size(), offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PosixError(absl::StrCat("cannot read ", path), errno);
    if (n == 0) return absl::DataLossError(absl::StrCat(path, " ended early"));
    crc = Crc32c(buffer.data(), static_cast<size_t>(n), crc);
    offset += n;
  }
  if (crc != model->crc32c) {
    return absl::DataLossError(
        absl::StrCat(path, ": its CRC-32C is not the manifest's (the file changed)"));
  }
  return weights;
}

}  // namespace aidn
