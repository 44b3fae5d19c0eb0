#include "aidnctl/export.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "aidnctl/output.h"
#include "common/checkpoint_check.h"
#include "common/checkpoint_manifest.h"
#include "common/crc32c.h"
#include "common/digest.h"
#include "common/file.h"
#include "common/rpc/client.h"
#include "common/status.h"
#include "grpcpp/client_context.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/checkpoint_reader.h"

namespace aidn::ctl {
namespace {

using engine::kModelFile;
constexpr char kSuffix[] = ".safetensors";
constexpr size_t kCopyChunk = 1 << 20;
// Longest invalid_reason quoted in an error.
constexpr size_t kReasonChars = 120;

// Checked before asking the coordinator anything, so a typo costs no call.
absl::Status CheckOutputPath(const ExportOptions& options) {
  const std::string& path = options.output_path;
  const std::filesystem::path target(path);
  if (!absl::EndsWith(path, kSuffix) || target.filename() == kSuffix) {
    return absl::InvalidArgumentError(
        absl::StrCat("output path \"", path, "\" must name a file ending in ", kSuffix));
  }
  const std::string dir = target.parent_path().empty() ? "." : target.parent_path().string();
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return absl::NotFoundError(
          absl::StrCat("cannot write ", path, ": directory ", dir, " does not exist"));
    }
    return PosixError(absl::StrCat("cannot write ", path, ": ", dir), errno);
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write ", path, ": ", dir, " is not a directory"));
  }
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat("cannot write ", path, ": it is a directory"));
    }
    if (!options.force) {
      return absl::AlreadyExistsError(absl::StrCat(path, " exists; pass --force to replace it"));
    }
  }
  return absl::OkStatus();
}

// The checkpoint verified (checkpoint_check.h), its errors saying nothing
// was written.
absl::StatusOr<std::optional<ManifestEntry>> VerifyCheckpoint(const v1::Checkpoint& checkpoint) {
  absl::StatusOr<std::optional<ManifestEntry>> model = VerifyCommittedCheckpoint(checkpoint);
  if (!model.ok() && model.status().code() != absl::StatusCode::kNotFound) {
    return absl::Status(model.status().code(),
                        absl::StrCat(model.status().message(), "; nothing written"));
  }
  return model;
}

// The weights of sharded checkpoint `dir` put together into `to`, through
// a temporary file renamed as CopyVerified's is.
absl::StatusOr<int64_t> Consolidate(const std::string& dir, const std::string& to, bool replace);

absl::Status Publish(const std::string& temp, const std::string& to, bool replace);

// Copies `from` to `to` through `to`.tmp, checking the bytes against
// `expected` as they pass (the file may change after it was verified), then
// fsync and rename. Without `replace`, a file that appeared at `to` since
// CheckOutputPath is not replaced.
absl::Status CopyVerified(const std::string& from, const ManifestEntry& expected,
                          const std::string& to, bool replace) {
  const ScopedFd in(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
  if (in.get() < 0) return PosixError(from, errno);
  const std::string temp = absl::StrCat(to, ".tmp");
  ScopedFd out(::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
  if (out.get() < 0) return PosixError(absl::StrCat("cannot write ", temp), errno);
  bool renamed = false;
  struct RemoveTemp {
    const std::string& path;
    const bool& renamed;
    ~RemoveTemp() {
      if (!renamed) ::unlink(path.c_str());
    }
  } remove_temp{temp, renamed};

  std::vector<char> buffer(kCopyChunk);
  int64_t bytes = 0;
  uint32_t crc = 0;
  while (true) {
    const ssize_t n = ::read(in.get(), buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PosixError(from, errno);
    if (n == 0) break;
    crc = Crc32c(buffer.data(), static_cast<size_t>(n), crc);
    bytes += n;
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = ::write(out.get(), buffer.data() + done, static_cast<size_t>(n - done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) return PosixError(absl::StrCat("cannot write ", temp), errno);
      done += w;
    }
  }
  if (bytes != expected.bytes || crc != expected.crc32c) {
    return absl::DataLossError(absl::StrFormat(
        "%s changed while it was copied (%d bytes, CRC-32C %08x; the manifest says %d bytes, "
        "%08x); nothing written",
        from, bytes, crc, expected.bytes, expected.crc32c));
  }
  if (::fsync(out.get()) != 0) return PosixError(absl::StrCat("cannot sync ", temp), errno);
  if (out.Close() != 0) return PosixError(absl::StrCat("cannot write ", temp), errno);
  AIDN_RETURN_IF_ERROR(Publish(temp, to, replace));
  renamed = true;
  return absl::OkStatus();
}

// Renames the complete, synced `temp` to `to` (over it only with `replace`)
// and syncs the directory.
absl::Status Publish(const std::string& temp, const std::string& to, bool replace) {
  if (replace) {
    if (::rename(temp.c_str(), to.c_str()) != 0) {
      return PosixError(absl::StrCat("cannot rename ", temp, " to ", to), errno);
    }
  } else if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) != 0) {
    if (errno == EEXIST) {
      return absl::AlreadyExistsError(absl::StrCat(to, " exists; pass --force to replace it"));
    }
    // File systems without RENAME_NOREPLACE (NFS): CheckOutputPath found
    // nothing there a moment ago, which has to do.
    if ((errno != EINVAL && errno != ENOSYS) || ::rename(temp.c_str(), to.c_str()) != 0) {
      return PosixError(absl::StrCat("cannot rename ", temp, " to ", to), errno);
    }
  }
  // The rename itself is durable once the directory is synced. The file is
  // complete either way, so a directory that cannot be synced (some file
  // systems refuse) is no reason to report failure.
  const std::filesystem::path parent = std::filesystem::path(to).parent_path();
  const ScopedFd dir(
      ::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() >= 0) ::fsync(dir.get());
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Consolidate(const std::string& dir, const std::string& to, bool replace) {
  // SaveSafetensors writes <temp>.tmp and renames it to <temp>; <temp> then
  // goes to `to` as a copy would.
  const std::string temp = absl::StrCat(to, ".consolidated");
  struct RemoveTemp {
    const std::string& path;
    ~RemoveTemp() {
      ::unlink(path.c_str());
      ::unlink(absl::StrCat(path, ".tmp").c_str());
    }
  } remove_temp{temp};
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<engine::CheckpointReader> reader,
                        engine::CheckpointReader::Open(dir));
  AIDN_RETURN_IF_ERROR(reader->Consolidate(temp));
  struct stat st;
  if (::stat(temp.c_str(), &st) != 0) return PosixError(temp, errno);
  AIDN_RETURN_IF_ERROR(Publish(temp, to, replace));
  return static_cast<int64_t>(st.st_size);
}

}  // namespace

absl::StatusOr<v1::Checkpoint> ChooseCheckpoint(
    const google::protobuf::RepeatedPtrField<v1::Checkpoint>& checkpoints,
    const std::string& job_id, std::optional<int64_t> step) {
  if (checkpoints.empty()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has no checkpoints"));
  }
  if (step.has_value()) {
    for (const v1::Checkpoint& c : checkpoints) {
      if (c.step() != *step) continue;
      if (Exportable(c)) return c;
      return absl::FailedPreconditionError(absl::StrCat(
          "the checkpoint of job ", job_id, " at step ", *step, " is ",
          OneLine(WhyNotExportable(c), kReasonChars), "; ", ExportableSteps(checkpoints)));
    }
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has no checkpoint at step ", *step,
                                            "; ", ExportableSteps(checkpoints)));
  }
  const v1::Checkpoint* newest = nullptr;
  for (const v1::Checkpoint& c : checkpoints) {
    if (Exportable(c) && (newest == nullptr || c.step() > newest->step())) newest = &c;
  }
  if (newest != nullptr) return *newest;
  std::vector<std::string> why;
  for (const v1::Checkpoint& c : checkpoints) {
    why.push_back(absl::StrCat("step ", c.step(), " ", OneLine(WhyNotExportable(c), kReasonChars)));
  }
  return absl::NotFoundError(absl::StrCat(
      "job ", job_id, " has no committed, valid checkpoint: ", absl::StrJoin(why, "; ")));
}

WeightsFile::~WeightsFile() {
  if (temporary_) {
    std::error_code ignored;
    std::filesystem::remove_all(std::filesystem::path(path_).parent_path(), ignored);
  }
}

absl::StatusOr<std::unique_ptr<WeightsFile>> VerifiedWeights(const v1::Checkpoint& checkpoint) {
  AIDN_ASSIGN_OR_RETURN(const std::optional<ManifestEntry> model, VerifyCheckpoint(checkpoint));
  if (model.has_value()) {
    return std::make_unique<WeightsFile>(absl::StrCat(checkpoint.path(), "/", kModelFile), false);
  }
  std::string scratch = (std::filesystem::temp_directory_path() / "aidnctl-XXXXXX").string();
  if (::mkdtemp(scratch.data()) == nullptr) return PosixError("mkdtemp", errno);
  auto file = std::make_unique<WeightsFile>(absl::StrCat(scratch, "/", kModelFile), true);
  AIDN_RETURN_IF_ERROR(Consolidate(checkpoint.path(), file->path(), /*replace=*/true).status());
  return file;
}

absl::StatusOr<v1::Checkpoint> FetchCheckpoint(const CommandEnv& env, const std::string& job_id,
                                               std::optional<int64_t> step) {
  v1::ListCheckpointsRequest request;
  request.set_job_id(job_id);
  v1::ListCheckpointsResponse response;
  grpc::ClientContext context;
  rpc::PrepareContext(&context, env.options.connection.token, env.options.timeout);
  const grpc::Status status = env.stub->ListCheckpoints(&context, request, &response);
  if (!status.ok()) return RpcError(status, env.options.connection.address, env.options.timeout);
  return ChooseCheckpoint(response.checkpoints(), job_id, step);
}

absl::Status RunExport(const CommandEnv& env, const ExportOptions& options) {
  AIDN_RETURN_IF_ERROR(CheckOutputPath(options));
  AIDN_ASSIGN_OR_RETURN(const v1::Checkpoint checkpoint,
                        FetchCheckpoint(env, options.job_id, options.step));
  AIDN_ASSIGN_OR_RETURN(const std::optional<ManifestEntry> model, VerifyCheckpoint(checkpoint));
  int64_t bytes = 0;
  if (model.has_value()) {
    const std::string source = absl::StrCat(checkpoint.path(), "/", kModelFile);
    std::error_code error;
    if (std::filesystem::equivalent(source, options.output_path, error)) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.output_path, " is the checkpoint's own ", kModelFile));
    }
    AIDN_RETURN_IF_ERROR(CopyVerified(source, *model, options.output_path, options.force));
    bytes = model->bytes;
  } else {
    // Sharded: every rank's pieces of the weights, put together.
    AIDN_ASSIGN_OR_RETURN(bytes,
                          Consolidate(checkpoint.path(), options.output_path, options.force));
  }

  *env.out << "exported step " << checkpoint.step() << " of " << options.job_id << " (generation "
           << checkpoint.generation() << ", " << FormatBytes(bytes) << ") to "
           << options.output_path << "\n";
  env.out->flush();
  return absl::OkStatus();
}

}  // namespace aidn::ctl
