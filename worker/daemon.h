#ifndef AIDN_WORKER_DAEMON_H_
#define AIDN_WORKER_DAEMON_H_

// The worker daemon (`aidn-worker`): registers with the coordinator, keeps
// heartbeating, runs one trainer process per assigned rank and reports how
// each one ended.
//
//   auto daemon = Daemon::Create(options);   // validates, builds the channel
//   (*daemon)->Start();                      // threads run from here on
//   ... sigwait(SIGTERM) ...
//   (*daemon)->Shutdown();                   // trainers stopped, threads joined

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "common/metrics/registry.h"
#include "worker/command_agent.h"
#include "worker/command_launch.h"
#include "worker/coordinator_link.h"
#include "worker/engine/device.h"
#include "worker/launch.h"
#include "worker/log_shipper.h"
#include "worker/metrics.h"
#include "worker/supervisor.h"
#include "worker/work_dir_claim.h"

namespace aidn::worker {

struct DaemonOptions {
  // host:port of the coordinator.
  std::string coordinator = "127.0.0.1:7070";
  // TLS: the CA file that verifies the coordinator (empty: the system's
  // roots), or plaintext with insecure; passed on to trainers and command
  // ranks. Made absolute by Create().
  std::string tls_ca_file;
  bool insecure = false;
  // Mutual TLS: the client certificate and key the daemon presents (a
  // coordinator run with --tls-client-ca asks for them); trainers do not.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Absolute directories whose paths a job may name (checkpoint.dir, its
  // dataset, a command's working directory), besides work_dir and
  // checkpoint_root (path_policy.h).
  std::vector<std::string> allowed_paths = {"/usr/share"};
  // allowed_paths, work_dir and checkpoint_root resolved. Set by Create().
  std::vector<std::string> path_roots;
  // The copy of tls_ca_file the ranks read, <work_dir>/coordinator-ca.pem
  // (world-readable: a command job's ranks run as another user, who may
  // not reach the original). Set by Create().
  std::string rank_tls_ca_file;
  // The worker join token (role worker).
  std::string token;
  // This worker's id, stable across restarts: [a-zA-Z0-9._-]{1,63}.
  std::string worker_id;
  // Reported as WorkerInfo.hostname.
  std::string hostname;
  // The address (no port) peers use to reach trainers on this node; passed
  // to each trainer as --host.
  std::string address = "127.0.0.1";
  int cpu_slots = 1;
  std::vector<engine::GpuDescription> gpus;
  // The worker's own CUDA_VISIBLE_DEVICES ("" when unset): its GPU g is the
  // g-th entry of that list (TrainerVisibleDevice in worker/launch.h).
  std::string cuda_visible_devices;
  // Reported as WorkerInfo.version.
  std::string version;
  // Trainer logs go to <work_dir>/logs/<job>/gen-<g>/rank-<r>.log; a
  // trainer's own directory is <work_dir>/jobs/<job>. Made absolute by
  // Create().
  std::string work_dir = "./aidn-work";
  // Where a job's relative checkpoint.dir is taken from (an absolute one is
  // used as it is). Empty: <work_dir>/checkpoints. Made absolute by Create().
  std::string checkpoint_root;
  // The program each trainer runs, as `aidn-trainer train --coordinator=...
  // --job=... ...` (see LaunchSpecFor).
  std::string trainer_binary = "/proc/self/exe";
  // Passed to trainers as --log-level when not empty.
  std::string trainer_log_level;
  // "K=V" entries added to every trainer's environment (after the daemon's
  // own, replacing the same keys), e.g. engine::BlasCoreOverride().
  std::vector<std::string> trainer_env;
  // SIGTERM → SIGKILL delay for trainers, unless a StopOrder names one.
  std::chrono::milliseconds stop_grace{10'000};
  // Used until the coordinator tells its own (RegisterWorkerResponse).
  std::chrono::milliseconds heartbeat_interval{2'000};
  // Deadline of each RPC (a held heartbeat gets its max_wait on top).
  std::chrono::milliseconds rpc_timeout{5'000};
  // Retry delays while the coordinator is unreachable: doubling from the
  // first to the cap (rpc::BackoffOptions).
  std::chrono::milliseconds backoff_initial{100};
  std::chrono::milliseconds backoff_max{2'000};
  // How often trainers are checked for exits and overdue stops.
  std::chrono::milliseconds supervise_interval{50};
  // Exit reports kept while they cannot be delivered; the oldest is dropped
  // (and logged) beyond this.
  size_t max_pending_reports = 1024;
  // At Shutdown(), how long undelivered exit reports are still retried.
  std::chrono::milliseconds shutdown_report_timeout{3'000};
  // Largest gRPC message sent or received.
  int max_message_bytes = 4 * 1024 * 1024;
  // Run command jobs (JobSpec.command: users' own programs). Off, the
  // worker tells the coordinator so and is given none.
  bool command_jobs = true;
  // The user command ranks run as (set when the daemon runs as root: it
  // never runs them as root unless told so by name).
  std::optional<LaunchOptions::User> command_user;
  // The directory holding the `aidn` Python package, put first on command
  // ranks' PYTHONPATH ("" leaves it alone).
  std::string python_path;
  // Starts a generation's c10d store (see CommandAgentOptions::start_store);
  // unset: PyTorch's TCPStore protocol, served by worker/c10d.
  std::function<absl::StatusOr<std::unique_ptr<GenerationStore>>(const std::string& address)>
      start_store;
  // Where the daemon's Prometheus metrics go (not owned); none when null.
  // The daemon adds a collect hook: stop serving the registry before the
  // daemon is destroyed.
  metrics::Registry* registry = nullptr;
};

// Checks `options` (worker id syntax, token present, cpu_slots >= 0,
// positive durations, ...). INVALID_ARGUMENT naming the field.
absl::Status ValidateDaemonOptions(const DaemonOptions& options);

// One daemon per node: the orchestration of a CoordinatorLink (registration,
// heartbeats, exit reports; worker/coordinator_link.h) and a Supervisor (the
// trainer processes; worker/supervisor.h). Its own supervision thread
// reconciles the latest assignment set from the link with the running
// trainers (start what is missing, stop what is no longer listed, apply stop
// orders with their grace), reaps trainers and queues their exit reports on
// the link. It is the only thread that starts trainers, so their
// PR_SET_PDEATHSIG follows it (see Supervisor). What each trainer process
// gets (argv, environment, log file) is decided by LaunchSpecFor
// (worker/launch.h).
//
// A trainer that exited is not started again for the same (job, generation,
// rank), even while the coordinator still lists it.
//
// Thread-safe. Start() once; Shutdown() (idempotent, also run by the
// destructor) stops heartbeats, then every trainer (SIGTERM, SIGKILL after
// stop_grace), tries to deliver their exit reports for
// shutdown_report_timeout, and joins.
class Daemon {
 public:
  static absl::StatusOr<std::unique_ptr<Daemon>> Create(const DaemonOptions& options);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // FAILED_PRECONDITION if started before or shut down.
  absl::Status Start();
  void Shutdown();

  // The options after Create() filled them in (absolute work_dir).
  const DaemonOptions& options() const { return options_; }

 private:
  // (job, generation, rank): one trainer.
  struct Key {
    std::string job_id;
    int64_t generation = 0;
    int32_t rank = 0;
    friend bool operator<(const Key& a, const Key& b) {
      return std::tie(a.job_id, a.generation, a.rank) < std::tie(b.job_id, b.generation, b.rank);
    }
  };
  struct Trainer {
    Supervisor::ChildId child = 0;
    pid_t pid = 0;
    bool stopping = false;
    // Stopped on the coordinator's order (dropped from the assignment set,
    // or a StopOrder), as opposed to by the daemon's own shutdown.
    bool by_order = false;
    std::string log_path;
    // Command ranks: their TORCHELASTIC_ERROR_FILE, and the user it must
    // belong to (the rank's).
    std::string error_file;
    uid_t error_file_owner = 0;
  };

  Daemon(const DaemonOptions& options, std::unique_ptr<WorkDirClaim> claim);

  // Link callbacks (its heartbeat thread).
  std::vector<v1::TrainerStatus> TrainerStatuses() ABSL_LOCKS_EXCLUDED(mu_);
  void SetAssignments(std::vector<v1::TrainerAssignment> assignments,
                      std::vector<v1::StopOrder> stops) ABSL_LOCKS_EXCLUDED(mu_);

  // Supervision thread.
  void SuperviseLoop();
  void ApplyStops(const std::vector<v1::StopOrder>& stops);
  void Reconcile(const std::vector<v1::TrainerAssignment>& desired);
  void StartTrainer(const v1::TrainerAssignment& assignment);
  // Command ranks: the agent's joins that finished start their programs.
  void StartJoinedCommands();
  void StartCommand(const v1::TrainerAssignment& assignment, const CommandPlacement& placement);
  // Starts a launch (either kind) under the supervisor.
  void Launch(const v1::TrainerAssignment& assignment, const LaunchSpec& launch);
  // Stores of generations no longer assigned here stop.
  void ReleaseStores(const std::set<Key>& wanted);
  // Reports a trainer that could not be started; `permanent` fails the job
  // at once (a command's program that does not exist).
  void NotStarted(const v1::TrainerAssignment& assignment, const absl::Status& why,
                  bool permanent = false);
  void StopTrainer(const Key& key, std::chrono::milliseconds grace, bool by_order);
  void HandleExits(const std::vector<ChildExit>& exits);

  // Registry collect hook: trainers running, their CPU and memory, GPUs.
  void CollectMetrics() ABSL_LOCKS_EXCLUDED(mu_);

  const DaemonOptions options_;
  // The work directory's lock and this worker's instance id, held for the
  // daemon's life.
  const std::unique_ptr<WorkDirClaim> claim_;
  const LaunchOptions launch_options_;
  // Null without options.registry.
  std::unique_ptr<WorkerMetrics> metrics_;
  Supervisor supervisor_;
  std::unique_ptr<CoordinatorLink> link_;
  // Command ranks' rendezvous (its own channel to the coordinator).
  std::shared_ptr<grpc::Channel> agent_channel_;
  std::unique_ptr<v1::ClusterService::Stub> agent_stub_;
  std::unique_ptr<CommandAgent> agent_;
  // Ships each trainer's output file to the coordinator (thread-safe).
  std::unique_ptr<LogShipper> log_shipper_;

  // Serialises Shutdown() calls.
  absl::Mutex shutdown_mu_;
  std::thread supervise_thread_;

  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Handed from the link's heartbeat thread to the supervision thread.
  bool have_desired_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<v1::TrainerAssignment> desired_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::StopOrder> stops_ ABSL_GUARDED_BY(mu_);
  // A command rank's join finished: the supervision thread looks at once.
  bool joins_ready_ ABSL_GUARDED_BY(mu_) = false;
  // Written by the supervision thread, read for heartbeats and metrics.
  std::map<Key, Trainer> trainers_ ABSL_GUARDED_BY(mu_);
  // Supervision thread only: trainers that ended while still assigned (not
  // to be started again).
  std::set<Key> finished_;
  // Supervision thread only: the assignments of the last Reconcile, by key
  // (command ranks start when their join completes, if still assigned).
  std::map<Key, v1::TrainerAssignment> assigned_;
  // Supervision thread only: the newest generation started per job, to
  // count restarts.
  std::map<std::string, int64_t> generation_started_;
};

}  // namespace aidn::worker

#endif  // AIDN_WORKER_DAEMON_H_
