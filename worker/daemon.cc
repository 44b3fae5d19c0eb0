#include "worker/daemon.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/file.h"
#include "common/log.h"
#include "common/metrics/process_stats.h"
#include "common/rpc/client.h"
#include "common/status.h"
#include "common/tls.h"
#include "google/protobuf/util/time_util.h"
#include "worker/c10d/store_server.h"
#include "worker/path_policy.h"

namespace aidn::worker {
namespace {

using std::chrono::milliseconds;

// EX_CONFIG: the trainer failed for a reason no restart can cure.
constexpr int kExitPermanent = 78;
// What a trainer that could not even be started is reported with.
constexpr int kExitNotStarted = 127;

bool ValidWorkerId(const std::string& id) {
  if (id.empty() || id.size() > 63) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
}

std::string KeyText(const std::string& job_id, int64_t generation, int32_t rank) {
  return absl::StrCat(job_id, "/gen-", generation, "/rank-", rank);
}

v1::WorkerInfo WorkerInfoOf(const DaemonOptions& o, const std::string& instance) {
  v1::WorkerInfo info;
  info.set_id(o.worker_id);
  info.set_instance(instance);
  info.set_hostname(o.hostname);
  info.set_address(o.address);
  info.set_cpu_slots(o.cpu_slots);
  info.set_version(o.version);
  info.set_runs_commands(o.command_jobs);
  for (const std::string& root : o.path_roots) info.add_path_roots(root);
  for (const engine::GpuDescription& gpu : o.gpus) {
    v1::GpuInfo* g = info.add_gpus();
    g->set_index(gpu.index);
    g->set_name(gpu.name);
    g->set_memory_bytes(gpu.memory_bytes);
    g->set_pci_bus_id(gpu.pci_bus_id);
  }
  return info;
}

rpc::ChannelOptions ChannelOf(const DaemonOptions& o) {
  return {.address = o.coordinator,
          .max_message_bytes = o.max_message_bytes,
          .tls_ca_file = o.tls_ca_file,
          .insecure = o.insecure,
          .tls_cert_file = o.tls_cert_file,
          .tls_key_file = o.tls_key_file};
}

LaunchOptions LaunchOptionsOf(const DaemonOptions& o) {
  return {.coordinator = o.coordinator,
          .tls_ca_file = o.rank_tls_ca_file,
          .insecure = o.insecure,
          .worker_id = o.worker_id,
          .address = o.address,
          .work_dir = o.work_dir,
          .checkpoint_root = o.checkpoint_root,
          .trainer_binary = o.trainer_binary,
          .trainer_log_level = o.trainer_log_level,
          .trainer_env = o.trainer_env,
          .gpus = o.gpus,
          .cuda_visible_devices = o.cuda_visible_devices,
          .python_path = o.python_path,
          .command_user = o.command_user};
}

// A generation's c10d store: PyTorch's TCPStore protocol (worker/c10d).
class C10dStore final : public GenerationStore {
 public:
  explicit C10dStore(std::unique_ptr<c10d::StoreServer> server) : server_(std::move(server)) {}
  int port() const override { return server_->port(); }
  void AllowPeers(const std::set<std::string>& addresses,
                  const std::set<uid_t>& local_users) override {
    server_->AllowPeers({.addresses = addresses, .local_users = local_users});
  }

 private:
  std::unique_ptr<c10d::StoreServer> server_;
};

absl::StatusOr<std::unique_ptr<GenerationStore>> StartC10dStore(const std::string& address) {
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<c10d::StoreServer> server,
                        c10d::StoreServer::Start({.bind_address = address,
                                                  .port = 0,
                                                  // Nobody until the rendezvous names the hosts.
                                                  .refuse_until_peers_set = true}));
  return std::unique_ptr<GenerationStore>(new C10dStore(std::move(server)));
}

// Who the ranks of command jobs run as: the --command-user, else the
// daemon's own user.
std::set<uid_t> LocalUsers(const DaemonOptions& o) {
  std::set<uid_t> users = {geteuid()};
  if (o.command_user.has_value()) users.insert(o.command_user->uid);
  return users;
}

// The job's directory, made by the daemon under its own <work_dir>/jobs and
// given to `user`: never through a link (the user owns what is inside and
// could have put one in place of the directory in an earlier generation).
absl::Status MakeJobDir(const std::string& dir, const std::optional<LaunchOptions::User>& user) {
  std::error_code error;
  std::filesystem::create_directories(std::filesystem::path(dir).parent_path(), error);
  if (error) return absl::InternalError(absl::StrCat("mkdir ", dir, ": ", error.message()));
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return PosixError("mkdir " + dir, errno);
  if (!user.has_value()) return absl::OkStatus();
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return PosixError(dir + " (must be a directory, not a link)", errno);
  absl::Status status = absl::OkStatus();
  if (fchown(fd, user->uid, user->gid) != 0) status = PosixError("chown " + dir, errno);
  close(fd);
  return status;
}

}  // namespace

absl::Status ValidateDaemonOptions(const DaemonOptions& o) {
  if (o.coordinator.empty()) return absl::InvalidArgumentError("coordinator: empty");
  if (o.token.empty()) {
    return absl::InvalidArgumentError("token: empty (pass --token-file or --token)");
  }
  if (!ValidWorkerId(o.worker_id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_id: must match [a-zA-Z0-9._-]{1,63}, got \"", o.worker_id, "\""));
  }
  if (o.address.empty()) return absl::InvalidArgumentError("address: empty");
  if (o.cpu_slots < 0 || o.cpu_slots > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu_slots: must be in [0, 4096], got ", o.cpu_slots));
  }
  if (o.work_dir.empty()) return absl::InvalidArgumentError("work_dir: empty");
  if (o.trainer_binary.find('/') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer_binary: must be a path, got \"", o.trainer_binary, "\""));
  }
  if (o.stop_grace.count() < 0) return absl::InvalidArgumentError("stop_grace: negative");
  if (o.heartbeat_interval.count() <= 0 || o.rpc_timeout.count() <= 0 ||
      o.backoff_initial.count() <= 0 || o.backoff_max < o.backoff_initial ||
      o.supervise_interval.count() <= 0 || o.shutdown_report_timeout.count() < 0) {
    return absl::InvalidArgumentError(
        "durations: need heartbeat_interval, rpc_timeout, backoff_initial, supervise_interval > 0 "
        "and backoff_max >= backoff_initial");
  }
  if (o.max_pending_reports < 1) return absl::InvalidArgumentError("max_pending_reports: < 1");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Create(const DaemonOptions& options) {
  AIDN_RETURN_IF_ERROR(ValidateDaemonOptions(options));
  DaemonOptions resolved = options;
  std::error_code error;
  if (!options.tls_ca_file.empty()) {
    // Trainers and command ranks run elsewhere: they get the absolute path.
    resolved.tls_ca_file = std::filesystem::absolute(options.tls_ca_file, error).lexically_normal();
  }
  AIDN_RETURN_IF_ERROR(rpc::CheckChannelOptions(ChannelOf(resolved)));
  resolved.work_dir = std::filesystem::absolute(options.work_dir, error).lexically_normal();
  if (error) {
    return absl::InvalidArgumentError(absl::StrCat("work_dir: ", error.message()));
  }
  if (!resolved.work_dir.empty() && resolved.work_dir.back() == '/') resolved.work_dir.pop_back();
  std::filesystem::create_directories(resolved.work_dir, error);
  if (error) {
    return absl::InternalError(absl::StrCat("mkdir ", resolved.work_dir, ": ", error.message()));
  }
  // Before anything is written there: one worker a directory.
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<WorkDirClaim> claim, WorkDirClaim::Take(resolved.work_dir));
  resolved.checkpoint_root =
      options.checkpoint_root.empty()
          ? absl::StrCat(resolved.work_dir, "/checkpoints")
          : std::filesystem::absolute(options.checkpoint_root, error).lexically_normal().string();
  if (error) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint_root: ", error.message()));
  }
  while (resolved.checkpoint_root.size() > 1 && resolved.checkpoint_root.back() == '/') {
    resolved.checkpoint_root.pop_back();
  }
  if (access(resolved.trainer_binary.c_str(), X_OK) != 0) {
    return Annotate(PosixError(resolved.trainer_binary, errno), "trainer_binary");
  }
  if (!resolved.start_store) resolved.start_store = StartC10dStore;
  std::vector<std::string> roots = options.allowed_paths;
  roots.push_back(resolved.work_dir);
  roots.push_back(resolved.checkpoint_root);
  AIDN_ASSIGN_OR_RETURN(resolved.path_roots, ResolveRoots(roots));
  if (!resolved.insecure && !resolved.tls_ca_file.empty()) {
    AIDN_ASSIGN_OR_RETURN(const std::string ca, ReadCaFile(resolved.tls_ca_file));
    resolved.rank_tls_ca_file = absl::StrCat(resolved.work_dir, "/coordinator-ca.pem");
    AIDN_RETURN_IF_ERROR(WriteFileAtomically(resolved.rank_tls_ca_file, ca));
    ::chmod(resolved.rank_tls_ca_file.c_str(), 0644);
  }
  std::unique_ptr<Daemon> daemon(new Daemon(resolved, std::move(claim)));
  if (options.registry != nullptr) {
    Daemon* raw = daemon.get();
    options.registry->AddCollectHook([raw] { raw->CollectMetrics(); });
  }
  return daemon;
}

Daemon::Daemon(const DaemonOptions& options, std::unique_ptr<WorkDirClaim> claim)
    : options_(options),
      claim_(std::move(claim)),
      launch_options_(LaunchOptionsOf(options)),
      metrics_(options.registry != nullptr ? std::make_unique<WorkerMetrics>(options.registry)
                                           : nullptr) {
  link_ = std::make_unique<CoordinatorLink>(
      CoordinatorLinkOptions{
          .coordinator = ChannelOf(options_),
          .token = options_.token,
          .info = WorkerInfoOf(options_, claim_->instance()),
          .heartbeat_interval = options_.heartbeat_interval,
          .rpc_timeout = options_.rpc_timeout,
          .backoff = {.initial = options_.backoff_initial, .max = options_.backoff_max},
          .max_pending_reports = options_.max_pending_reports,
          .max_message_bytes = options_.max_message_bytes,
          .metrics = metrics_.get()},
      CoordinatorLinkCallbacks{.trainers = [this] { return TrainerStatuses(); },
                               .on_assignments =
                                   [this](std::vector<v1::TrainerAssignment> assignments,
                                          std::vector<v1::StopOrder> stops) {
                                     SetAssignments(std::move(assignments), std::move(stops));
                                   }});
  agent_channel_ = rpc::MakeChannel(ChannelOf(options_));
  agent_stub_ = v1::ClusterService::NewStub(agent_channel_);
  agent_ = std::make_unique<CommandAgent>(CommandAgentOptions{.worker_id = options_.worker_id,
                                                              .address = options_.address,
                                                              .start_store = options_.start_store,
                                                              .local_users = LocalUsers(options_),
                                                              .on_ready =
                                                                  [this] {
                                                                    absl::MutexLock lock(&mu_);
                                                                    joins_ready_ = true;
                                                                  }},
                                          agent_channel_.get(), agent_stub_.get());
  log_shipper_ = std::make_unique<LogShipper>(
      LogShipperOptions{.worker_id = options_.worker_id},
      MakeGrpcLogSink(ChannelOf(options_), options_.token, options_.rpc_timeout));
}

Daemon::~Daemon() { Shutdown(); }

absl::Status Daemon::Start() {
  {
    absl::MutexLock lock(&mu_);
    if (started_ || stopping_) {
      return absl::FailedPreconditionError("the daemon was started before or is shut down");
    }
    started_ = true;
    AIDN_LOG(INFO) << "worker daemon starting" << Kv("worker_id", options_.worker_id)
                   << Kv("instance", claim_->instance()) << Kv("coordinator", options_.coordinator)
                   << Kv("work_dir", options_.work_dir);
    supervise_thread_ = std::thread([this] { SuperviseLoop(); });
  }
  link_->Start();
  log_shipper_->Start();
  return absl::OkStatus();
}

void Daemon::Shutdown() {
  absl::MutexLock shutdown_lock(&shutdown_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_ && started_) AIDN_LOG(INFO) << "worker daemon shutting down";
    stopping_ = true;
  }
  // New work stops arriving first, then the trainers are stopped (by the
  // supervision thread), then their exit reports get a last chance.
  link_->StopHeartbeats();
  if (supervise_thread_.joinable()) supervise_thread_.join();
  // Pending joins are cancelled, stores stop.
  agent_.reset();
  link_->FinishReports(options_.shutdown_report_timeout);
  // The trainers' last lines too.
  log_shipper_->Stop(options_.shutdown_report_timeout);
}

// ---------------------------------------------------------------------------
// Link callbacks.

std::vector<v1::TrainerStatus> Daemon::TrainerStatuses() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::TrainerStatus> statuses;
  statuses.reserve(trainers_.size());
  for (const auto& [key, trainer] : trainers_) {
    v1::TrainerStatus& t = statuses.emplace_back();
    t.set_job_id(key.job_id);
    t.set_generation(key.generation);
    t.set_rank(key.rank);
    t.set_pid(trainer.pid);
  }
  return statuses;
}

void Daemon::SetAssignments(std::vector<v1::TrainerAssignment> assignments,
                            std::vector<v1::StopOrder> stops) {
  absl::MutexLock lock(&mu_);
  desired_ = std::move(assignments);
  have_desired_ = true;
  stops_.insert(stops_.end(), std::make_move_iterator(stops.begin()),
                std::make_move_iterator(stops.end()));
}

// ---------------------------------------------------------------------------
// Supervision thread.

void Daemon::SuperviseLoop() {
  while (true) {
    std::vector<v1::StopOrder> stops;
    std::vector<v1::TrainerAssignment> desired;
    bool have_desired = false;
    {
      absl::MutexLock lock(&mu_);
      auto news = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return have_desired_ || !stops_.empty() || stopping_ || joins_ready_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&news), absl::FromChrono(options_.supervise_interval));
      if (stopping_) break;
      joins_ready_ = false;
      stops.swap(stops_);
      if (have_desired_) {
        desired.swap(desired_);
        have_desired = true;
        have_desired_ = false;
      }
    }
    ApplyStops(stops);
    if (have_desired) Reconcile(desired);
    StartJoinedCommands();
    HandleExits(supervisor_.Reap());
  }

  // Shutdown: every trainer goes, whatever the coordinator wants.
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, trainer] : trainers_) trainer.stopping = true;
    if (!trainers_.empty()) {
      AIDN_LOG(INFO) << "stopping trainers" << Kv("count", trainers_.size())
                     << Kv("grace_ms", options_.stop_grace.count());
    }
  }
  HandleExits(supervisor_.StopAllAndWait(options_.stop_grace));
}

void Daemon::ApplyStops(const std::vector<v1::StopOrder>& stops) {
  for (const v1::StopOrder& order : stops) {
    const milliseconds grace =
        order.has_grace()
            ? std::max(milliseconds(0),
                       milliseconds(
                           google::protobuf::util::TimeUtil::DurationToMilliseconds(order.grace())))
            : options_.stop_grace;
    std::vector<Key> matching;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [key, trainer] : trainers_) {
        if (key.job_id != order.job_id() || key.generation != order.generation()) continue;
        if (order.ranks_size() > 0 && std::find(order.ranks().begin(), order.ranks().end(),
                                                key.rank) == order.ranks().end()) {
          continue;
        }
        matching.push_back(key);
      }
    }
    for (const Key& key : matching) {
      AIDN_LOG(INFO) << "stop order" << Kv("trainer", KeyText(key.job_id, key.generation, key.rank))
                     << Kv("reason", order.reason()) << Kv("grace_ms", grace.count());
      StopTrainer(key, grace, /*by_order=*/true);
    }
  }
}

void Daemon::Reconcile(const std::vector<v1::TrainerAssignment>& desired) {
  std::set<Key> wanted;
  for (const v1::TrainerAssignment& a : desired) {
    wanted.insert({a.job_id(), a.generation(), a.rank()});
  }
  // Command ranks still joining whose assignment is gone.
  for (const auto& [key, a] : assigned_) {
    if (!wanted.contains(key)) agent_->Cancel(key.job_id, key.generation, key.rank);
  }
  assigned_.clear();
  for (const v1::TrainerAssignment& a : desired)
    assigned_[{a.job_id(), a.generation(), a.rank()}] = a;
  std::vector<Key> unwanted;
  std::vector<const v1::TrainerAssignment*> missing;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, trainer] : trainers_) {
      if (!trainer.stopping && !wanted.contains(key)) unwanted.push_back(key);
    }
    for (const v1::TrainerAssignment& a : desired) {
      const Key key{a.job_id(), a.generation(), a.rank()};
      if (!trainers_.contains(key) && !finished_.contains(key)) missing.push_back(&a);
    }
  }
  // Ended trainers need remembering only while they are still listed.
  for (auto it = finished_.begin(); it != finished_.end();) {
    it = wanted.contains(*it) ? std::next(it) : finished_.erase(it);
  }
  for (const Key& key : unwanted) {
    AIDN_LOG(INFO) << "trainer no longer assigned; stopping it"
                   << Kv("trainer", KeyText(key.job_id, key.generation, key.rank))
                   << Kv("grace_ms", options_.stop_grace.count());
    StopTrainer(key, options_.stop_grace, /*by_order=*/true);
  }
  for (const v1::TrainerAssignment* a : missing) StartTrainer(*a);
}

void Daemon::ReleaseStores(const std::set<Key>& wanted) {
  for (const auto& [job_id, generation] : agent_->StoreGenerations()) {
    // The store lives while the generation is assigned here: a rank that
    // exited early may leave peers that still talk to it.
    auto it = wanted.lower_bound(Key{job_id, generation, 0});
    if (it == wanted.end() || it->job_id != job_id || it->generation != generation) {
      agent_->EndGeneration(job_id, generation);
    }
  }
}

void Daemon::StartJoinedCommands() {
  for (CommandAgent::Ready& ready : agent_->TakeReady()) {
    const v1::TrainerAssignment& a = ready.assignment;
    const Key key{a.job_id(), a.generation(), a.rank()};
    if (!assigned_.contains(key)) continue;  // dropped while joining
    if (!ready.placement.ok()) {
      const absl::StatusCode code = ready.placement.status().code();
      // Cancelled while assigned again: the next Reconcile joins anew.
      if (code == absl::StatusCode::kCancelled) continue;
      if (code == absl::StatusCode::kFailedPrecondition ||
          code == absl::StatusCode::kDeadlineExceeded || code == absl::StatusCode::kAborted) {
        // The generation ended or timed out: the coordinator knows.
        AIDN_LOG(INFO) << "command rank not started"
                       << Kv("trainer", KeyText(a.job_id(), a.generation(), a.rank()))
                       << Kv("why", ready.placement.status());
        finished_.insert(key);
        continue;
      }
      NotStarted(a, ready.placement.status());
      continue;
    }
    CommandPlacement placement = *std::move(ready.placement);
    // This job's ranks here (assigned_ is ordered by rank), for their GPUs.
    for (const auto& [other, assignment] : assigned_) {
      if (other.job_id == key.job_id && other.generation == key.generation) {
        placement.local_gpu_slots.push_back(assignment.slot());
      }
    }
    StartCommand(a, placement);
  }
  // Stores of generations no longer assigned here go, as does one started
  // by a join cancelled meanwhile.
  std::set<Key> wanted;
  for (const auto& [key, a] : assigned_) wanted.insert(key);
  ReleaseStores(wanted);
}

void Daemon::StartCommand(const v1::TrainerAssignment& a, const CommandPlacement& placement) {
  absl::StatusOr<LaunchSpec> launch = CommandLaunchSpecFor(a, placement, launch_options_);
  if (!launch.ok()) return NotStarted(a, launch.status(), /*permanent=*/true);
  if (absl::Status s = MakeJobDir(launch->job_dir, launch->run_as); !s.ok()) {
    return NotStarted(a, s);
  }
  Launch(a, *launch);
}

void Daemon::NotStarted(const v1::TrainerAssignment& a, const absl::Status& why, bool permanent) {
  AIDN_LOG(ERROR) << "could not start trainer"
                  << Kv("trainer", KeyText(a.job_id(), a.generation(), a.rank()))
                  << Kv("error", why);
  finished_.insert({a.job_id(), a.generation(), a.rank()});
  if (metrics_ != nullptr) metrics_->trainer_exits.Add({{"outcome", "not_started"}}).Increment();
  v1::ReportTrainerExitRequest report;
  report.set_worker_id(options_.worker_id);
  report.set_job_id(a.job_id());
  report.set_generation(a.generation());
  report.set_rank(a.rank());
  report.set_exit_code(kExitNotStarted);
  report.set_stderr_tail(absl::StrCat("worker ", options_.worker_id,
                                      " could not start the trainer: ", why.ToString()));
  report.set_permanent(permanent);
  *report.mutable_exited_at() = google::protobuf::util::TimeUtil::GetCurrentTime();
  link_->QueueReport(std::move(report));
}

void Daemon::StartTrainer(const v1::TrainerAssignment& a) {
  // Before anything of the job is read or made here.
  if (absl::Status s = CheckJobPaths(a.spec(), options_.path_roots); !s.ok()) {
    return NotStarted(a, s, /*permanent=*/true);
  }
  if (a.spec().has_command()) {
    if (!options_.command_jobs) {
      return NotStarted(
          a,
          absl::FailedPreconditionError(
              "this worker does not run command jobs (started with --no-command-jobs)"),
          /*permanent=*/true);
    }
    // The program starts once the agents' rendezvous says where the store
    // and the other ranks are (StartJoinedCommands).
    agent_->Begin(a);
    return;
  }
  absl::StatusOr<LaunchSpec> launch = LaunchSpecFor(a, launch_options_);
  if (!launch.ok()) return NotStarted(a, launch.status());
  std::error_code error;
  std::filesystem::create_directories(launch->job_dir, error);
  if (error) {
    return NotStarted(
        a, absl::InternalError(absl::StrCat("mkdir ", launch->job_dir, ": ", error.message())));
  }
  Launch(a, *launch);
}

void Daemon::Launch(const v1::TrainerAssignment& a, const LaunchSpec& launch_spec) {
  const LaunchSpec* launch = &launch_spec;
  std::optional<ChildSpec::RunAs> run_as;
  if (launch->run_as.has_value()) {
    run_as = ChildSpec::RunAs{.uid = launch->run_as->uid, .gid = launch->run_as->gid};
  }
  absl::StatusOr<Supervisor::ChildId> child =
      supervisor_.Start({.program = launch->program,
                         .argv = launch->argv,
                         .env = launch->env,
                         .log_path = launch->log_path,
                         .cwd = launch->cwd,
                         .run_as = run_as,
                         .make_dirs = launch->make_dirs,
                         // A file left by an earlier run of this rank must not
                         // pass for this one's.
                         .remove_file = launch->error_file});
  // A command's program that cannot be started will not start on a retry.
  if (!child.ok()) return NotStarted(a, child.status(), /*permanent=*/a.spec().has_command());
  pid_t pid = 0;
  for (const ChildStatus& c : supervisor_.Running()) {
    if (c.id == *child) pid = c.pid;
  }
  {
    absl::MutexLock lock(&mu_);
    trainers_[{a.job_id(), a.generation(), a.rank()}] =
        Trainer{.child = *child,
                .pid = pid,
                .log_path = launch->log_path,
                .error_file = launch->error_file,
                .error_file_owner = run_as.has_value() ? run_as->uid : geteuid()};
  }
  log_shipper_->Follow({a.job_id(), a.generation(), a.rank()}, launch->log_path);
  auto [seen, first] = generation_started_.try_emplace(a.job_id(), a.generation());
  if (metrics_ != nullptr) {
    metrics_->trainers_started.Increment();
    if (!first && a.generation() > seen->second) metrics_->trainer_restarts.Increment();
  }
  seen->second = std::max(seen->second, a.generation());
  AIDN_LOG(INFO) << "trainer started"
                 << Kv("trainer", KeyText(a.job_id(), a.generation(), a.rank())) << Kv("pid", pid)
                 << Kv("world_size", a.world_size()) << Kv("slot", a.slot())
                 << Kv("log", launch->log_path);
}

void Daemon::StopTrainer(const Key& key, milliseconds grace, bool by_order) {
  Supervisor::ChildId child = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = trainers_.find(key);
    if (it == trainers_.end()) return;
    it->second.stopping = true;
    it->second.by_order = it->second.by_order || by_order;
    child = it->second.child;
  }
  // NOT_FOUND: it ended meanwhile; Reap() reports it.
  supervisor_.Stop(child, grace).IgnoreError();
}

void Daemon::HandleExits(const std::vector<ChildExit>& exits) {
  for (const ChildExit& exit : exits) {
    Key key;
    bool by_order = false;
    std::string log_path;
    std::string error_file;
    uid_t error_file_owner = 0;
    bool found = false;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = trainers_.begin(); it != trainers_.end(); ++it) {
        if (it->second.child != exit.id) continue;
        key = it->first;
        by_order = it->second.by_order;
        log_path = it->second.log_path;
        error_file = it->second.error_file;
        error_file_owner = it->second.error_file_owner;
        trainers_.erase(it);
        found = true;
        break;
      }
    }
    if (!found) continue;  // not a trainer of ours (cannot happen)
    finished_.insert(key);
    log_shipper_->Ended({key.job_id, key.generation, key.rank});
    const std::string how = exit.signal != 0 ? absl::StrCat("signal ", exit.signal)
                                             : absl::StrCat("code ", exit.exit_code);
    const bool clean = exit.signal == 0 && exit.exit_code == 0;
    if (metrics_ != nullptr) {
      const char* outcome = clean                        ? "ok"
                            : (exit.stopped && by_order) ? "stopped"
                            : exit.signal != 0           ? "killed"
                                                         : "failed";
      metrics_->trainer_exits.Add({{"outcome", outcome}}).Increment();
    }
    if (clean || (exit.stopped && by_order)) {
      AIDN_LOG(INFO) << "trainer exited"
                     << Kv("trainer", KeyText(key.job_id, key.generation, key.rank))
                     << Kv("how", how) << Kv("stopped_by_order", by_order);
    } else {
      AIDN_LOG(WARNING) << "trainer exited"
                        << Kv("trainer", KeyText(key.job_id, key.generation, key.rank))
                        << Kv("how", how) << Kv("stopped", exit.stopped) << Kv("log", log_path);
    }
    v1::ReportTrainerExitRequest report;
    report.set_worker_id(options_.worker_id);
    report.set_job_id(key.job_id);
    report.set_generation(key.generation);
    report.set_rank(key.rank);
    report.set_exit_code(exit.exit_code);
    report.set_signal(exit.signal);
    report.set_stderr_tail(exit.log_tail);
    report.set_permanent(exit.signal == 0 && exit.exit_code == kExitPermanent);
    report.set_stopped_by_order(by_order);
    *report.mutable_exited_at() = google::protobuf::util::TimeUtil::GetCurrentTime();
    if (!clean && !error_file.empty())
      report.set_error(ReadErrorFile(error_file, error_file_owner));
    link_->QueueReport(std::move(report));
  }
}

void Daemon::CollectMetrics() {
  std::vector<std::pair<Key, pid_t>> running;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, trainer] : trainers_) running.emplace_back(key, trainer.pid);
  }
  metrics_->trainers_running.Set(static_cast<double>(running.size()));
  // Only trainers running now have series.
  metrics_->trainer_cpu_seconds.RemoveMatching({});
  metrics_->trainer_resident_memory_bytes.RemoveMatching({});
  for (const auto& [key, pid] : running) {
    absl::StatusOr<metrics::ProcessStats> stats = metrics::ReadProcessStats(pid);
    if (!stats.ok()) continue;  // it just ended
    const metrics::Labels labels{{"job_id", key.job_id}, {"rank", absl::StrCat(key.rank)}};
    // A fresh series (all were removed above): the increment is the total.
    metrics_->trainer_cpu_seconds.Add(labels).Increment(stats->cpu_seconds);
    metrics_->trainer_resident_memory_bytes.Add(labels).Set(
        static_cast<double>(stats->resident_bytes));
  }
  for (const GpuMemory& gpu : ReadGpuMemory()) {
    const metrics::Labels labels{{"gpu", absl::StrCat(gpu.index)}};
    metrics_->gpu_memory_used_bytes.Add(labels).Set(static_cast<double>(gpu.used_bytes));
    metrics_->gpu_memory_total_bytes.Add(labels).Set(static_cast<double>(gpu.total_bytes));
  }
}

}  // namespace aidn::worker
