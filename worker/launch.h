#ifndef AIDN_WORKER_LAUNCH_H_
#define AIDN_WORKER_LAUNCH_H_

// What a rank process gets from the worker: the program it runs, its argv,
// its environment, where its output goes and its own directory. One pure
// function decides all of it from the coordinator's assignment and the
// daemon's settings; the daemon makes the directory and hands the rest to
// the Supervisor (worker/supervisor.h).
//
//   AIDN_ASSIGN_OR_RETURN(LaunchSpec launch, LaunchSpecFor(assignment, options));
//   // launch.argv: {"aidn-trainer", "train", "--coordinator=...", "--job=job-3", ...}
//   // launch.env:  {..., "AIDN_TRAINER_TOKEN=<token>"}
//
// The trainer's credential travels only in the environment: argv is
// world-readable in /proc and `ps`.

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "aidn/v1/cluster.pb.h"
#include "worker/engine/device.h"

namespace aidn::worker {

// How a trainer appears in `ps` (its argv[0]).
inline constexpr char kTrainerProcessName[] = "aidn-trainer";
// The environment variable that carries a trainer's token.
inline constexpr char kTrainerTokenVariable[] = "AIDN_TRAINER_TOKEN";

// The daemon's settings that shape every launch (see DaemonOptions).
struct LaunchOptions {
  // host:port of the coordinator, passed as --coordinator; with the CA
  // file that verifies it (--tls-ca; AIDN_TLS_CA for command ranks) or
  // plaintext (--insecure; AIDN_INSECURE=1).
  std::string coordinator;
  std::string tls_ca_file;
  bool insecure = false;
  // This worker's id, passed as --worker-id.
  std::string worker_id;
  // The address peers use to reach trainers on this node, passed as --host.
  std::string address;
  // The daemon's directory; must be absolute. Logs go to
  // <work_dir>/logs/<job>/gen-<g>/rank-<r>.log, a job's directory is
  // <work_dir>/jobs/<job>, the dataset cache <work_dir>/cache.
  std::string work_dir;
  // Passed as --checkpoint-root.
  std::string checkpoint_root;
  // The file executed: a path (no $PATH search). /proc/self/exe is the
  // worker's own binary, whose `train` mode is the trainer.
  std::string trainer_binary = "/proc/self/exe";
  // Passed as --log-level when not empty.
  std::string trainer_log_level;
  // "K=V" entries for every trainer's environment.
  std::vector<std::string> trainer_env;
  // The worker's GPUs and its own CUDA_VISIBLE_DEVICES (see
  // TrainerVisibleDevice).
  std::vector<engine::GpuDescription> gpus;
  std::string cuda_visible_devices;
  // Command jobs: the directory holding the `aidn` Python package, put first
  // on PYTHONPATH ("" leaves PYTHONPATH alone).
  std::string python_path;
  // Command jobs: the user they run as (the daemon is root), or none (they
  // run as the daemon's user).
  struct User {
    std::string name;
    uid_t uid = 0;
    gid_t gid = 0;
    std::string home;
  };
  std::optional<User> command_user;
};

// One rank process, ready to start.
struct LaunchSpec {
  // The file executed (LaunchOptions::trainer_binary).
  std::string program;
  // argv[0] is kTrainerProcessName, then `train` and the flags; --job and
  // --rank come early, so `ps -ef | grep aidn-trainer` says which rank of
  // which job each process is.
  std::vector<std::string> argv;
  // "K=V" entries added to (or replacing those in) the daemon's
  // environment: trainer_env, CUDA_VISIBLE_DEVICES for a GPU job, and the
  // token. Later entries win over earlier ones with the same key.
  std::vector<std::string> env;
  // stdout and stderr are appended here.
  std::string log_path;
  // The rank's own directory (<work_dir>/jobs/<job>), passed as --work-dir;
  // the caller creates it. The process starts in the daemon's current
  // directory, so a spec's relative dataset paths mean what they meant.
  std::string job_dir;
  // Command jobs: the process's current directory, the user it runs as
  // (the caller gives job_dir to that user), the directories the process
  // creates as that user before it starts (the error file's, the
  // checkpoints').
  std::string cwd;
  std::optional<LaunchOptions::User> run_as;
  std::vector<std::string> make_dirs;
  // TORCHELASTIC_ERROR_FILE: where the rank writes why it failed (torch
  // elastic's format), read into its exit report.
  std::string error_file;
};

// LaunchSpecFor's checks of an assignment and the options, for every kind
// of rank.
absl::Status CheckLaunch(const v1::TrainerAssignment& assignment, const LaunchOptions& options);

// The launch of `assignment` on this worker. INVALID_ARGUMENT, naming the
// field, for a job id that cannot name a directory, a generation < 1, a rank
// outside [0, world_size), an empty trainer token, a GPU slot the worker
// does not have, a relative work_dir or a trainer_binary that is not a path.
absl::StatusOr<LaunchSpec> LaunchSpecFor(const v1::TrainerAssignment& assignment,
                                         const LaunchOptions& options);

// The CUDA_VISIBLE_DEVICES of a trainer given the worker's GPU `slot`, so
// that it sees exactly that GPU, as its device 0: the slot-th entry of the
// worker's own CUDA_VISIBLE_DEVICES when that is set (the worker sees only
// those, in that order), else the GPU's index. INVALID_ARGUMENT for a slot
// the worker does not have.
absl::StatusOr<std::string> TrainerVisibleDevice(int slot,
                                                 const std::vector<engine::GpuDescription>& gpus,
                                                 const std::string& worker_visible_devices);

// The name the trainer process gives itself (prctl PR_SET_NAME, shown by
// `ps -e`, `top` and /proc/<pid>/comm): "aidn-r<rank>-<job>", cut to the 15
// bytes the kernel keeps.
std::string TrainerThreadName(const std::string& job_id, int rank);

}  // namespace aidn::worker

#endif  // AIDN_WORKER_LAUNCH_H_
