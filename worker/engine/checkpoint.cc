#include "worker/engine/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/checkpoint_manifest.h"
#include "common/crc32c.h"
#include "common/status.h"

namespace aidn::engine {
namespace {

namespace fs = std::filesystem;

absl::Status FsError(const std::string& what, const std::error_code& error) {
  return absl::InternalError(absl::StrCat(what, ": ", error.message()));
}

absl::Status Fsync(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return PosixError(absl::StrCat("open ", path), errno);
  absl::Status status;
  if (::fsync(fd) != 0) status = PosixError(absl::StrCat("fsync ", path), errno);
  ::close(fd);
  return status;
}

absl::Status WriteDurably(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return PosixError(absl::StrCat("create ", path), errno);
  const char* p = text.data();
  size_t left = text.size();
  absl::Status status;
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      status = PosixError(absl::StrCat("write ", path), errno);
      break;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (status.ok() && ::fsync(fd) != 0) status = PosixError(absl::StrCat("fsync ", path), errno);
  if (::close(fd) != 0 && status.ok()) status = PosixError(absl::StrCat("close ", path), errno);
  return status;
}

absl::Status CheckState(const std::map<std::string, std::string>& state) {
  for (const auto& [key, value] : state) {
    if (key.empty()) return absl::InvalidArgumentError("state: empty key");
    for (char c : key) {
      if (!absl::ascii_isdigit(c) && !absl::ascii_islower(c) && c != '_') {
        return absl::InvalidArgumentError(absl::StrCat("state: bad key \"", key, "\""));
      }
    }
    if (value.find('\n') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("state: value of ", key, " has a newline"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, std::string>> ReadState(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return PosixError(absl::StrCat("open ", path), errno);
  std::map<std::string, std::string> state;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    const size_t space = line.find(' ');
    if (space == std::string::npos || space == 0) {
      return absl::DataLossError(absl::StrCat(kStateFile, " line ", n, ": expected \"key value\""));
    }
    state[line.substr(0, space)] = line.substr(space + 1);
  }
  return state;
}

}  // namespace

std::string CheckpointDirName(int64_t step) { return absl::StrFormat("step-%08d", step); }

absl::StatusOr<WrittenCheckpoint> WriteCheckpoint(const std::string& dir, int64_t step,
                                                  const CheckpointContents& contents) {
  if (step < 0) return absl::InvalidArgumentError("step: must be >= 0");
  AIDN_RETURN_IF_ERROR(CheckState(contents.state));
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) return FsError(absl::StrCat("mkdir ", dir), error);
  const std::string final_path = absl::StrCat(dir, "/", CheckpointDirName(step));
  const std::string tmp =
      absl::StrCat(dir, "/.tmp-", CheckpointDirName(step), "-", static_cast<int64_t>(::getpid()));
  fs::remove_all(tmp, error);
  fs::create_directory(tmp, error);
  if (error) return FsError(absl::StrCat("mkdir ", tmp), error);
  auto fail = [&tmp](const absl::Status& status) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    return status;
  };

  std::map<std::string, std::string> metadata = contents.model_metadata;
  metadata["format"] = "pt";
  // SaveSafetensors writes each file durably (fsync, rename, fsync dir).
  if (absl::Status s =
          SaveSafetensors(absl::StrCat(tmp, "/", kModelFile), contents.model, metadata);
      !s.ok()) {
    return fail(s);
  }
  if (absl::Status s =
          SaveTensorsSafetensors(absl::StrCat(tmp, "/", kOptimizerFile), contents.optimizer_state);
      !s.ok()) {
    return fail(s);
  }
  std::string state_text;
  for (const auto& [key, value] : contents.state)
    absl::StrAppend(&state_text, key, " ", value, "\n");
  if (absl::Status s = WriteDurably(absl::StrCat(tmp, "/", kStateFile), state_text); !s.ok()) {
    return fail(s);
  }

  Manifest manifest;
  manifest.step = step;
  WrittenCheckpoint written;
  for (const char* name : {kModelFile, kOptimizerFile, kStateFile}) {
    absl::StatusOr<FileChecksum> sum = ChecksumFile(absl::StrCat(tmp, "/", name));
    if (!sum.ok()) return fail(sum.status());
    manifest.files.push_back({name, sum->bytes, sum->crc32c});
    written.bytes += sum->bytes;
  }
  written.manifest = FormatManifest(manifest);
  written.bytes += static_cast<int64_t>(written.manifest.size());
  if (absl::Status s = WriteDurably(absl::StrCat(tmp, "/", kManifestName), written.manifest);
      !s.ok()) {
    return fail(s);
  }
  if (absl::Status s = Fsync(tmp, /*directory=*/true); !s.ok()) return fail(s);

  // A directory of the same step from an earlier, failed generation goes
  // first: rename() does not replace a non-empty directory.
  if (fs::exists(final_path, error)) {
    const std::string old = absl::StrCat(tmp, ".old");
    fs::rename(final_path, old, error);
    if (error) return fail(FsError(absl::StrCat("rename ", final_path), error));
    fs::remove_all(old, error);
  }
  fs::rename(tmp, final_path, error);
  if (error) return fail(FsError(absl::StrCat("rename ", tmp, " to ", final_path), error));
  AIDN_RETURN_IF_ERROR(Fsync(dir, /*directory=*/true));
  written.path = final_path;
  return written;
}

absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const std::string& path,
                                                const std::vector<Parameter*>& model) {
  AIDN_ASSIGN_OR_RETURN(Manifest manifest, VerifyCheckpointDir(path));
  LoadedCheckpoint loaded;
  loaded.step = manifest.step;
  AIDN_ASSIGN_OR_RETURN(loaded.state, ReadState(absl::StrCat(path, "/", kStateFile)));
  AIDN_ASSIGN_OR_RETURN(loaded.optimizer_state,
                        ReadSafetensors(absl::StrCat(path, "/", kOptimizerFile)));
  AIDN_RETURN_IF_ERROR(LoadSafetensors(absl::StrCat(path, "/", kModelFile), model));
  return loaded;
}

absl::Status RemoveTemporaries(const std::string& dir) {
  std::error_code error;
  if (!fs::exists(dir, error)) return absl::OkStatus();
  for (const fs::directory_entry& e : fs::directory_iterator(dir, error)) {
    if (absl::StartsWith(e.path().filename().string(), ".tmp-")) {
      std::error_code remove_error;
      fs::remove_all(e.path(), remove_error);
      if (remove_error) return FsError(absl::StrCat("remove ", e.path().string()), remove_error);
    }
  }
  if (error) return FsError(absl::StrCat("list ", dir), error);
  return absl::OkStatus();
}

absl::Status RemoveCheckpoint(const std::string& dir, int64_t step) {
  std::error_code error;
  fs::remove_all(absl::StrCat(dir, "/", CheckpointDirName(step)), error);
  if (error) return FsError(absl::StrCat("remove checkpoint of step ", step, " in ", dir), error);
  return absl::OkStatus();
}

}  // namespace aidn::engine
