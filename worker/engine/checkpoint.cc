#include "worker/engine/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string_view>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/checkpoint_manifest.h"
#include "common/crc32c.h"
#include "common/status.h"
#include "worker/engine/checkpoint_reader.h"

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

absl::Status WriteState(const std::string& dir, const std::map<std::string, std::string>& state) {
  std::string text;
  for (const auto& [key, value] : state) absl::StrAppend(&text, key, " ", value, "\n");
  return WriteDurably(absl::StrCat(dir, "/", kStateFile), text);
}

// The "generation" of the state.txt in `checkpoint` (a directory); 0 when
// it says none or cannot be read.
int64_t GenerationIn(const std::string& checkpoint) {
  std::ifstream in(absl::StrCat(checkpoint, "/", kStateFile));
  std::string line;
  int64_t generation = 0;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "generation ") && absl::SimpleAtoi(line.substr(11), &generation)) {
      return generation;
    }
  }
  return 0;
}

// Writes `manifest` into `tmp` (the checkpoint's other files are there,
// durable), then makes `tmp` the step's directory: fsync, an older
// directory of the step out of the way, rename, fsync of `dir`. A directory
// of the step that a later generation wrote stays: this writer belongs to a
// generation that was superseded and has not heard yet (a partition), and
// what it wrote must not take the place of what the later one committed.
absl::Status Publish(const std::string& dir, const std::string& tmp, int64_t step,
                     const Manifest& manifest, WrittenCheckpoint* written) {
  written->manifest = FormatManifest(manifest);
  written->bytes += static_cast<int64_t>(written->manifest.size());
  AIDN_RETURN_IF_ERROR(WriteDurably(absl::StrCat(tmp, "/", kManifestName), written->manifest));
  AIDN_RETURN_IF_ERROR(Fsync(tmp, /*directory=*/true));
  // A directory of the same step from an earlier, failed generation goes
  // first: rename() does not replace a non-empty directory.
  const std::string final_path = absl::StrCat(dir, "/", CheckpointDirName(step));
  std::error_code error;
  if (fs::exists(final_path, error)) {
    const int64_t theirs = GenerationIn(final_path), mine = GenerationIn(tmp);
    if (theirs > mine) {
      return absl::AbortedError(absl::StrCat(CheckpointDirName(step), " was written by generation ",
                                             theirs, ", later than this one (", mine,
                                             "): this generation is superseded"));
    }
    const std::string old = absl::StrCat(tmp, ".old");
    fs::rename(final_path, old, error);
    if (error) return FsError(absl::StrCat("rename ", final_path), error);
    fs::remove_all(old, error);
  }
  fs::rename(tmp, final_path, error);
  if (error) return FsError(absl::StrCat("rename ", tmp, " to ", final_path), error);
  AIDN_RETURN_IF_ERROR(Fsync(dir, /*directory=*/true));
  written->path = final_path;
  return absl::OkStatus();
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
  if (absl::Status s = WriteState(tmp, contents.state); !s.ok()) return fail(s);

  Manifest manifest;
  manifest.step = step;
  WrittenCheckpoint written;
  for (const char* name : {kModelFile, kOptimizerFile, kStateFile}) {
    absl::StatusOr<FileChecksum> sum = ChecksumFile(absl::StrCat(tmp, "/", name));
    if (!sum.ok()) return fail(sum.status());
    manifest.files.push_back({name, sum->bytes, sum->crc32c});
    written.bytes += sum->bytes;
  }
  if (absl::Status s = Publish(dir, tmp, step, manifest, &written); !s.ok()) return fail(s);
  return written;
}

std::string ShardFileName(const char* part, int rank, int world_size) {
  return absl::StrFormat("%s-%05d-of-%05d.safetensors", part, rank, world_size);
}

namespace {

// One rank's pieces as a safetensors file: tensors "<whole>[begin:end]",
// and "shape:<whole>" metadata for each whole tensor.
absl::Status SavePieces(const std::string& path, const std::vector<ShardMap::Piece>& pieces,
                        std::map<std::string, std::string> metadata) {
  std::vector<NamedTensor> tensors;
  for (const ShardMap::Piece& p : pieces) {
    if (p.tensor == nullptr || p.tensor->numel() != static_cast<int64_t>(p.end - p.begin)) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint: piece ", p.whole, "[", p.begin,
                                                     ":", p.end, "] has no or misshapen values"));
    }
    tensors.emplace_back(absl::StrCat(p.whole, "[", p.begin, ":", p.end, "]"), p.tensor);
    metadata[absl::StrCat(kShapeKeyPrefix, p.whole)] = absl::StrJoin(p.whole_shape, ",");
  }
  return SaveTensorsSafetensors(path, tensors, metadata);
}

// What a rank tells rank 0 of its two files: bytes and CRC-32C of each, or
// bytes -1 when it could not write them. int64s through a float all-gather:
// the bits travel unchanged (it copies, never adds).
constexpr size_t kRecordInts = 4;
constexpr size_t kRecordFloats = kRecordInts * 2;

}  // namespace

absl::StatusOr<WrittenCheckpoint> WriteShardedCheckpoint(const std::string& dir, int64_t step,
                                                         const std::string& tag,
                                                         const ShardContents& contents,
                                                         Communicator* communicator) {
  const int rank = communicator->rank(), world = communicator->world_size();
  const std::string tmp = absl::StrCat(dir, "/.tmp-", CheckpointDirName(step), "-", tag);
  const std::string model_file = ShardFileName("model", rank, world);
  const std::string optimizer_file = ShardFileName("optimizer", rank, world);
  std::array<int64_t, kRecordInts> mine = {-1, 0, -1, 0};
  absl::Status own = [&]() -> absl::Status {
    if (step < 0) return absl::InvalidArgumentError("step: must be >= 0");
    if (rank == 0) AIDN_RETURN_IF_ERROR(CheckState(contents.state));
    std::error_code error;
    fs::create_directories(tmp, error);
    if (error) return FsError(absl::StrCat("mkdir ", tmp), error);
    std::map<std::string, std::string> metadata = contents.model_metadata;
    metadata["format"] = "pt";
    metadata[kParametersKey] = absl::StrJoin(contents.parameters, ",");
    AIDN_RETURN_IF_ERROR(
        SavePieces(absl::StrCat(tmp, "/", model_file), contents.weights, std::move(metadata)));
    AIDN_RETURN_IF_ERROR(
        SavePieces(absl::StrCat(tmp, "/", optimizer_file), contents.optimizer_state, {}));
    size_t i = 0;
    for (const std::string& name : {model_file, optimizer_file}) {
      AIDN_ASSIGN_OR_RETURN(const FileChecksum sum, ChecksumFile(absl::StrCat(tmp, "/", name)));
      mine[i++] = sum.bytes;
      mine[i++] = sum.crc32c;
    }
    return absl::OkStatus();
  }();
  if (!own.ok()) mine = {-1, 0, -1, 0};
  std::vector<float> records(kRecordFloats * static_cast<size_t>(world));
  std::memcpy(records.data() + kRecordFloats * static_cast<size_t>(rank), mine.data(),
              sizeof(mine));
  if (absl::Status s =
          communicator->AllGather(records.data() + kRecordFloats * static_cast<size_t>(rank),
                                  kRecordFloats, records.data());
      !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("checkpoint: gathering the shards' checksums: ", s.message()));
  }
  std::vector<std::array<int64_t, kRecordInts>> all(static_cast<size_t>(world));
  std::memcpy(all.data(), records.data(), records.size() * sizeof(float));
  std::vector<int> failed;
  for (int r = 0; r < world; ++r) {
    if (all[static_cast<size_t>(r)][0] < 0 || all[static_cast<size_t>(r)][2] < 0)
      failed.push_back(r);
  }
  auto fail = [&](const absl::Status& status) {
    if (rank == 0) {
      std::error_code ignored;
      fs::remove_all(tmp, ignored);
    }
    return status;
  };
  if (!own.ok()) return fail(own);
  if (!failed.empty()) {
    return fail(absl::AbortedError(absl::StrCat("checkpoint: rank(s) ", absl::StrJoin(failed, ", "),
                                                " could not write their shards")));
  }
  WrittenCheckpoint written;
  written.bytes = mine[0] + mine[2];
  if (rank != 0) {
    written.path = absl::StrCat(dir, "/", CheckpointDirName(step));
    return written;
  }
  Manifest manifest;
  manifest.step = step;
  for (const char* part : {"model", "optimizer"}) {
    const size_t at = std::string_view(part) == "model" ? 0 : 2;
    for (int r = 0; r < world; ++r) {
      const std::string name = ShardFileName(part, r, world);
      const auto& record = all[static_cast<size_t>(r)];
      // Each rank wrote into its own view of `dir`: rank 0 sees the file
      // only where they share storage.
      std::error_code error;
      const uintmax_t size = fs::file_size(absl::StrCat(tmp, "/", name), error);
      if (error || static_cast<int64_t>(size) != record[at]) {
        return fail(absl::FailedPreconditionError(absl::StrCat(
            "checkpoint: rank ", r, " wrote ", name, " (", record[at], " bytes), but rank 0 ",
            error ? absl::StrCat("cannot see it (", error.message(), ")")
                  : absl::StrCat("sees ", size, " bytes"),
            " in ", tmp, ": a sharded checkpoint needs a checkpoint directory every rank shares")));
      }
      manifest.files.push_back({name, record[at], static_cast<uint32_t>(record[at + 1])});
    }
  }
  if (absl::Status s = WriteState(tmp, contents.state); !s.ok()) return fail(s);
  absl::StatusOr<FileChecksum> sum = ChecksumFile(absl::StrCat(tmp, "/", kStateFile));
  if (!sum.ok()) return fail(sum.status());
  manifest.files.push_back({kStateFile, sum->bytes, sum->crc32c});
  written.bytes += sum->bytes;
  if (absl::Status s = Publish(dir, tmp, step, manifest, &written); !s.ok()) return fail(s);
  return written;
}

absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const std::string& path,
                                                const std::vector<Parameter*>& model) {
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(path));
  LoadedCheckpoint loaded;
  loaded.step = reader->step();
  loaded.state = reader->state();
  for (const auto& [name, shape] : reader->Tensors(CheckpointReader::Part::kOptimizer)) {
    Tensor t(shape);
    AIDN_RETURN_IF_ERROR(reader->Read(CheckpointReader::Part::kOptimizer, name, 0,
                                      static_cast<size_t>(t.numel()), t.data()));
    loaded.optimizer_state.emplace(name, std::move(t));
  }
  AIDN_RETURN_IF_ERROR(reader->ReadParameters(model));
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

absl::StatusOr<std::vector<int64_t>> RemoveCheckpointsNotHeld(const std::string& dir, int64_t below,
                                                              const std::vector<int64_t>& held) {
  std::error_code error;
  std::vector<int64_t> removed;
  if (!fs::exists(dir, error)) return removed;
  const std::set<int64_t> keep(held.begin(), held.end());
  std::vector<int64_t> doomed;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, error)) {
    const std::string name = e.path().filename().string();
    int64_t step = 0;
    // Exactly the names CheckpointDirName makes.
    if (!absl::StartsWith(name, "step-") || !absl::SimpleAtoi(name.substr(5), &step) ||
        CheckpointDirName(step) != name) {
      continue;
    }
    if (step < below && !keep.contains(step)) doomed.push_back(step);
  }
  if (error) return FsError(absl::StrCat("list ", dir), error);
  std::sort(doomed.begin(), doomed.end());
  for (int64_t step : doomed) {
    AIDN_RETURN_IF_ERROR(RemoveCheckpoint(dir, step));
    removed.push_back(step);
  }
  return removed;
}

}  // namespace aidn::engine
