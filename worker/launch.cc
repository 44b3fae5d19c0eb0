#include "worker/launch.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace aidn::worker {
namespace {

// A job id becomes a directory name: nothing that could climb out of the
// work dir.
bool SafePathComponent(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find_first_of(std::string("/\0", 2)) == std::string::npos;
}

}  // namespace

absl::Status CheckLaunch(const v1::TrainerAssignment& a, const LaunchOptions& o) {
  if (!SafePathComponent(a.job_id())) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_id: \"", a.job_id(), "\" cannot name a directory"));
  }
  if (a.generation() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("generation: must be >= 1, got ", a.generation()));
  }
  if (a.world_size() < 1 || a.rank() < 0 || a.rank() >= a.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: must be in [0, world_size), got rank ",
                                                   a.rank(), " of world_size ", a.world_size()));
  }
  if (a.trainer_token().empty()) return absl::InvalidArgumentError("trainer_token: empty");
  if (o.work_dir.empty() || o.work_dir.front() != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("work_dir: must be absolute, got \"", o.work_dir, "\""));
  }
  if (o.trainer_binary.find('/') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer_binary: must be a path, got \"", o.trainer_binary, "\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<LaunchSpec> LaunchSpecFor(const v1::TrainerAssignment& a, const LaunchOptions& o) {
  if (absl::Status s = CheckLaunch(a, o); !s.ok()) return s;
  LaunchSpec launch;
  launch.program = o.trainer_binary;
  launch.job_dir = absl::StrCat(o.work_dir, "/jobs/", a.job_id());
  launch.log_path = absl::StrCat(o.work_dir, "/logs/", a.job_id(), "/gen-", a.generation(),
                                 "/rank-", a.rank(), ".log");
  launch.argv = {kTrainerProcessName, "train", "--coordinator=" + o.coordinator,
                 "--job=" + a.job_id(), absl::StrCat("--generation=", a.generation()),
                 absl::StrCat("--rank=", a.rank()), absl::StrCat("--world-size=", a.world_size()),
                 "--worker-id=" + o.worker_id, "--host=" + o.address,
                 absl::StrCat("--slot=", a.slot()),
                 absl::StrCat("--threads=", std::max(1, a.spec().threads_per_rank())),
                 "--work-dir=" + launch.job_dir, "--checkpoint-root=" + o.checkpoint_root,
                 // Datasets are inflated once per worker, not once per trainer.
                 "--cache-dir=" + o.work_dir + "/cache"};
  if (!o.trainer_log_level.empty()) launch.argv.push_back("--log-level=" + o.trainer_log_level);
  if (o.insecure) {
    launch.argv.push_back("--insecure");
  } else if (!o.tls_ca_file.empty()) {
    launch.argv.push_back("--tls-ca=" + o.tls_ca_file);
  }

  launch.env = o.trainer_env;
  if (a.spec().device() == v1::JobSpec::GPU) {
    // One GPU per trainer, which it sees as its device 0.
    absl::StatusOr<std::string> visible =
        TrainerVisibleDevice(a.slot(), o.gpus, o.cuda_visible_devices);
    if (!visible.ok()) return visible.status();
    launch.env.push_back("CUDA_VISIBLE_DEVICES=" + *visible);
  }
  launch.env.push_back(absl::StrCat(kTrainerTokenVariable, "=", a.trainer_token()));
  // Why it failed, in full (the exit report's error), beside its log.
  launch.error_file = absl::StrCat(o.work_dir, "/logs/", a.job_id(), "/gen-", a.generation(),
                                   "/rank-", a.rank(), "-error.json");
  launch.env.push_back("TORCHELASTIC_ERROR_FILE=" + launch.error_file);
  return launch;
}

absl::StatusOr<std::string> TrainerVisibleDevice(int slot,
                                                 const std::vector<engine::GpuDescription>& gpus,
                                                 const std::string& worker_visible_devices) {
  if (slot < 0 || slot >= static_cast<int>(gpus.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU slot ", slot, " does not exist: this worker has ", gpus.size(), " GPUs"));
  }
  if (!worker_visible_devices.empty()) {
    std::vector<std::string> entries = absl::StrSplit(worker_visible_devices, ',');
    if (slot < static_cast<int>(entries.size())) {
      return std::string(absl::StripAsciiWhitespace(entries[static_cast<size_t>(slot)]));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("GPU slot ", slot, " is not in the worker's CUDA_VISIBLE_DEVICES \"",
                     worker_visible_devices, "\""));
  }
  return absl::StrCat(gpus[static_cast<size_t>(slot)].index);
}

std::string TrainerThreadName(const std::string& job_id, int rank) {
  // The kernel keeps 15 bytes (16 with the terminating NUL).
  return absl::StrCat("aidn-r", rank, "-", job_id).substr(0, 15);
}

}  // namespace aidn::worker
