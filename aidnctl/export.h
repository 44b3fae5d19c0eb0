#ifndef AIDN_AIDNCTL_EXPORT_H_
#define AIDN_AIDNCTL_EXPORT_H_

// `aidnctl export JOB [--step N] -o model.safetensors`: a checkpoint's
// weights as one Hugging Face safetensors file, for PyTorch users: a copy
// of a whole checkpoint's model.safetensors, or a sharded checkpoint's
// pieces put together (engine::CheckpointReader::Consolidate).
//
// The coordinator only knows where a checkpoint is (the absolute directory
// the writing rank reported); the files live on the workers' checkpoint
// storage. So aidnctl reads them itself, which works where that storage is
// mounted at the same path (a shared file system, or the worker's own
// machine), and says so when it is not.
//
// Before anything is written the whole checkpoint directory is verified
// against its MANIFEST (aidn::VerifyCheckpointDir) and the MANIFEST against
// the SHA-256 the coordinator recorded at commit time, and the bytes copied
// are checked again against the manifest's size and CRC-32C while they are
// copied. The copy goes to `<output>.tmp`, is fsync'd and renamed over the
// output, so the output holds either nothing (or its old contents) or the
// whole verified file.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "aidn/v1/job.pb.h"
#include "aidnctl/commands.h"

namespace aidn::ctl {

struct ExportOptions {
  std::string job_id;
  // Unset: the newest committed checkpoint not marked invalid.
  std::optional<int64_t> step;
  // The file to write. Must end in ".safetensors", and its directory must
  // exist.
  std::string output_path;
  // Replace output_path if it exists; without it an existing file is an
  // error (ALREADY_EXISTS) and is left alone.
  bool force = false;
};

// Prints "exported step <n> of <job> (generation <g>, <size>) to <path>" on
// env.out. The global output format does not apply (as for plot).
//
// Errors, each naming what to do about it: an output path that is not
// .safetensors, whose directory is missing, or that exists (without force);
// no committed, valid checkpoint (or none at `step`: NOT_FOUND listing the
// steps there are); a checkpoint directory this machine cannot reach
// (NOT_FOUND, explaining where checkpoints live); a checkpoint that fails
// verification (DATA_LOSS naming the file, nothing written).
absl::Status RunExport(const CommandEnv& env, const ExportOptions& options);

// The checkpoint `RunExport` takes from `checkpoints` (the coordinator's
// list for `job_id`): the newest committed one not marked invalid, or, with
// `step`, the one of that step if committed and not marked invalid.
// NOT_FOUND (or FAILED_PRECONDITION for an uncommitted or invalid one at
// `step`) saying which steps could be exported instead.
absl::StatusOr<v1::Checkpoint> ChooseCheckpoint(
    const google::protobuf::RepeatedPtrField<v1::Checkpoint>& checkpoints,
    const std::string& job_id, std::optional<int64_t> step);

// ChooseCheckpoint over the coordinator's list for `job_id` (errors: the
// call's, as RpcError words them, or ChooseCheckpoint's).
absl::StatusOr<v1::Checkpoint> FetchCheckpoint(const CommandEnv& env, const std::string& job_id,
                                               std::optional<int64_t> step);

// The weights of `checkpoint` as one safetensors file, once its directory
// is reachable from this machine and verifies against its MANIFEST and the
// SHA-256 the coordinator recorded (errors as RunExport's): its
// model.safetensors, or for a sharded checkpoint the ranks' pieces put
// together in a temporary file, removed with the WeightsFile.
class WeightsFile {
 public:
  WeightsFile(std::string path, bool temporary) : path_(std::move(path)), temporary_(temporary) {}
  ~WeightsFile();
  WeightsFile(const WeightsFile&) = delete;
  WeightsFile& operator=(const WeightsFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool temporary_;
};
absl::StatusOr<std::unique_ptr<WeightsFile>> VerifiedWeights(const v1::Checkpoint& checkpoint);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_EXPORT_H_
