#include "worker/daemon.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/metrics/process_stats.h"
#include "common/rpc/client.h"
#include "common/status.h"
#include "grpcpp/client_context.h"

namespace aidn::worker {
namespace {

using std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

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

// A job id becomes a directory name: nothing that could climb out of the
// work dir.
bool SafePathComponent(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find_first_of(std::string("/\0", 2)) == std::string::npos;
}

milliseconds FromProto(const google::protobuf::Duration& d) {
  return milliseconds(d.seconds() * 1000 + d.nanos() / 1'000'000);
}

google::protobuf::Duration ToProto(milliseconds ms) {
  google::protobuf::Duration d;
  d.set_seconds(ms.count() / 1000);
  d.set_nanos(static_cast<int32_t>(ms.count() % 1000) * 1'000'000);
  return d;
}

std::string Describe(const grpc::Status& status) {
  return absl::StrCat("code ", static_cast<int>(status.error_code()), ": ", status.error_message());
}

std::string KeyText(const std::string& job_id, int64_t generation, int32_t rank) {
  return absl::StrCat(job_id, "/gen-", generation, "/rank-", rank);
}

// ReportTrainerExit failures worth retrying: the coordinator is away, busy
// or restarting. Anything else (unknown job, bad request) will not improve.
bool Retryable(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::UNAUTHENTICATED:
      return true;
    default:
      return false;
  }
}

}  // namespace

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
  resolved.work_dir = std::filesystem::absolute(options.work_dir, error).lexically_normal();
  if (error) {
    return absl::InvalidArgumentError(absl::StrCat("work_dir: ", error.message()));
  }
  if (!resolved.work_dir.empty() && resolved.work_dir.back() == '/') resolved.work_dir.pop_back();
  std::filesystem::create_directories(resolved.work_dir, error);
  if (error) {
    return absl::InternalError(absl::StrCat("mkdir ", resolved.work_dir, ": ", error.message()));
  }
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
  std::unique_ptr<Daemon> daemon(new Daemon(resolved));
  if (options.registry != nullptr) {
    Daemon* raw = daemon.get();
    options.registry->AddCollectHook([raw] { raw->CollectMetrics(); });
  }
  return daemon;
}

Daemon::Daemon(const DaemonOptions& options)
    : options_(options),
      metrics_(options.registry != nullptr ? std::make_unique<WorkerMetrics>(options.registry)
                                           : nullptr),
      channel_(rpc::MakeChannel(
          {.address = options.coordinator, .max_message_bytes = options.max_message_bytes})),
      stub_(v1::ClusterService::NewStub(channel_)) {}

Daemon::~Daemon() { Shutdown(); }

absl::Status Daemon::Start() {
  absl::MutexLock lock(&mu_);
  if (started_ || stopping_) {
    return absl::FailedPreconditionError("the daemon was started before or is shut down");
  }
  started_ = true;
  AIDN_LOG(INFO) << "worker daemon starting" << Kv("worker_id", options_.worker_id)
                 << Kv("coordinator", options_.coordinator) << Kv("work_dir", options_.work_dir);
  supervise_thread_ = std::thread([this] { SuperviseLoop(); });
  report_thread_ = std::thread([this] { ReportLoop(); });
  heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
  return absl::OkStatus();
}

void Daemon::Shutdown() {
  absl::MutexLock shutdown_lock(&shutdown_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_ && started_) AIDN_LOG(INFO) << "worker daemon shutting down";
    stopping_ = true;
    if (heartbeat_call_ != nullptr) heartbeat_call_->TryCancel();
  }
  // New work stops arriving first, then the trainers are stopped (by the
  // supervision thread), then their exit reports get a last chance.
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  if (supervise_thread_.joinable()) supervise_thread_.join();
  if (report_thread_.joinable()) report_thread_.join();
}

// ---------------------------------------------------------------------------
// Heartbeat thread.

bool Daemon::Stopping() const {
  absl::MutexLock lock(&mu_);
  return stopping_;
}

bool Daemon::SleepUnlessStopping(milliseconds delay) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::FromChrono(delay));
  return !stopping_;
}

grpc::Status Daemon::CallCancellable(milliseconds timeout,
                                     const std::function<grpc::Status(grpc::ClientContext*)>& fn) {
  grpc::ClientContext context;
  rpc::PrepareContext(&context, options_.token, timeout);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return grpc::Status(grpc::StatusCode::CANCELLED, "shutting down");
    heartbeat_call_ = &context;
  }
  grpc::Status status = fn(&context);
  absl::MutexLock lock(&mu_);
  heartbeat_call_ = nullptr;
  return status;
}

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

void Daemon::HeartbeatLoop() {
  milliseconds backoff = options_.backoff_initial;
  milliseconds interval = options_.heartbeat_interval;
  bool registered = false;
  int64_t version = 0;
  // The last failure logged, so that an outage is logged once, not every
  // retry.
  std::string problem;
  auto failed = [&](const char* call, const grpc::Status& status) {
    if (Stopping()) return false;  // cancelled by Shutdown(): nothing to log
    if (metrics_ != nullptr) {
      metrics_->coordinator_up.Set(0);
      metrics_->coordinator_call_failures.Add({{"call", call}}).Increment();
    }
    const std::string now = absl::StrCat(call, " ", Describe(status));
    if (now != problem) {
      AIDN_LOG(WARNING) << "coordinator call failed; retrying with backoff" << Kv("call", call)
                        << Kv("coordinator", options_.coordinator)
                        << Kv("code", static_cast<int>(status.error_code()))
                        << Kv("error", status.error_message());
      problem = now;
    }
    rpc::ResetBackoffAfter(status, channel_.get());
    const milliseconds delay = backoff;
    backoff = std::min(backoff * 2, options_.backoff_max);
    return SleepUnlessStopping(delay);
  };
  auto succeeded = [&] {
    if (metrics_ != nullptr) metrics_->coordinator_up.Set(1);
    if (!problem.empty()) {
      AIDN_LOG(INFO) << "coordinator reachable again" << Kv("coordinator", options_.coordinator);
      problem.clear();
    }
    backoff = options_.backoff_initial;
  };

  while (!Stopping()) {
    if (!registered) {
      // Exit reports still queued go first: registering without a trainer
      // that ended while its report waits would read as a lost trainer.
      {
        absl::MutexLock lock(&mu_);
        auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return reports_.empty() || stopping_;
        };
        mu_.AwaitWithTimeout(absl::Condition(&drained), absl::FromChrono(options_.rpc_timeout));
      }
      v1::RegisterWorkerRequest request;
      v1::WorkerInfo* info = request.mutable_info();
      info->set_id(options_.worker_id);
      info->set_hostname(options_.hostname);
      info->set_address(options_.address);
      info->set_cpu_slots(options_.cpu_slots);
      info->set_version(options_.version);
      for (const engine::GpuDescription& gpu : options_.gpus) {
        v1::GpuInfo* g = info->add_gpus();
        g->set_index(gpu.index);
        g->set_name(gpu.name);
        g->set_memory_bytes(gpu.memory_bytes);
        g->set_pci_bus_id(gpu.pci_bus_id);
      }
      for (v1::TrainerStatus& t : TrainerStatuses()) *request.add_trainers() = std::move(t);
      v1::RegisterWorkerResponse response;
      grpc::Status status = CallCancellable(options_.rpc_timeout, [&](grpc::ClientContext* c) {
        return stub_->RegisterWorker(c, request, &response);
      });
      if (!status.ok()) {
        if (!failed("RegisterWorker", status)) return;
        continue;
      }
      succeeded();
      registered = true;
      version = 0;
      if (FromProto(response.heartbeat_interval()).count() > 0) {
        interval = FromProto(response.heartbeat_interval());
      }
      AIDN_LOG(INFO) << "registered with the coordinator" << Kv("worker_id", response.worker_id())
                     << Kv("coordinator", options_.coordinator)
                     << Kv("heartbeat_interval_ms", interval.count())
                     << Kv("worker_timeout_ms", FromProto(response.worker_timeout()).count())
                     << Kv("trainers", request.trainers_size());
      continue;
    }

    v1::HeartbeatRequest request;
    request.set_worker_id(options_.worker_id);
    for (v1::TrainerStatus& t : TrainerStatuses()) *request.add_trainers() = std::move(t);
    *request.mutable_max_wait() = ToProto(interval);
    request.set_assignments_version(version);
    v1::HeartbeatResponse response;
    const SteadyClock::time_point sent = SteadyClock::now();
    grpc::Status status = CallCancellable(
        interval + options_.rpc_timeout,
        [&](grpc::ClientContext* c) { return stub_->Heartbeat(c, request, &response); });
    if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
      AIDN_LOG(WARNING) << "the coordinator does not know this worker; registering again"
                        << Kv("worker_id", options_.worker_id);
      registered = false;
      continue;
    }
    if (!status.ok()) {
      if (!failed("Heartbeat", status)) return;
      continue;
    }
    succeeded();
    const bool changed = response.assignments_version() != version;
    version = response.assignments_version();
    if (FromProto(response.heartbeat_interval()).count() > 0) {
      interval = FromProto(response.heartbeat_interval());
    }
    {
      absl::MutexLock lock(&mu_);
      desired_.assign(response.assignments().begin(), response.assignments().end());
      have_desired_ = true;
      stops_.insert(stops_.end(), response.stops().begin(), response.stops().end());
    }
    if (changed) {
      AIDN_LOG(DEBUG) << "assignments" << Kv("version", version)
                      << Kv("trainers", response.assignments_size())
                      << Kv("stops", response.stops_size());
      continue;
    }
    // The coordinator answered early without news (it did not hold the
    // call): keep to the heartbeat interval rather than spin.
    const auto elapsed = std::chrono::duration_cast<milliseconds>(SteadyClock::now() - sent);
    if (elapsed < interval / 2 && !SleepUnlessStopping(interval - elapsed)) return;
  }
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
        return have_desired_ || !stops_.empty() || stopping_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&news), absl::FromChrono(options_.supervise_interval));
      if (stopping_) break;
      stops.swap(stops_);
      if (have_desired_) {
        desired.swap(desired_);
        have_desired = true;
        have_desired_ = false;
      }
    }
    ApplyStops(stops);
    if (have_desired) Reconcile(desired);
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
  absl::MutexLock lock(&mu_);
  trainers_stopped_ = true;
}

void Daemon::ApplyStops(const std::vector<v1::StopOrder>& stops) {
  for (const v1::StopOrder& order : stops) {
    const milliseconds grace = order.has_grace()
                                   ? std::max(milliseconds(0), FromProto(order.grace()))
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

std::string Daemon::LogPath(const Key& key) const {
  return absl::StrCat(options_.work_dir, "/logs/", key.job_id, "/gen-", key.generation, "/rank-",
                      key.rank, ".log");
}

void Daemon::StartTrainer(const v1::TrainerAssignment& a) {
  const Key key{a.job_id(), a.generation(), a.rank()};
  const std::string name = KeyText(a.job_id(), a.generation(), a.rank());
  auto not_started = [&](const absl::Status& why) {
    AIDN_LOG(ERROR) << "could not start trainer" << Kv("trainer", name) << Kv("error", why);
    finished_.insert(key);
    v1::ReportTrainerExitRequest report;
    report.set_worker_id(options_.worker_id);
    report.set_job_id(a.job_id());
    report.set_generation(a.generation());
    report.set_rank(a.rank());
    report.set_exit_code(kExitNotStarted);
    if (metrics_ != nullptr) metrics_->trainer_exits.Add({{"outcome", "not_started"}}).Increment();
    report.set_stderr_tail(absl::StrCat("worker ", options_.worker_id,
                                        " could not start the trainer: ", why.ToString()));
    QueueReport(std::move(report));
  };
  if (!SafePathComponent(a.job_id())) {
    return not_started(absl::InvalidArgumentError(
        absl::StrCat("job id \"", a.job_id(), "\" cannot name a directory")));
  }
  const std::string job_dir = absl::StrCat(options_.work_dir, "/jobs/", a.job_id());
  std::error_code error;
  std::filesystem::create_directories(job_dir, error);
  if (error) {
    return not_started(absl::InternalError(absl::StrCat("mkdir ", job_dir, ": ", error.message())));
  }

  ChildSpec spec;
  spec.argv = {options_.trainer_binary, "train", "--coordinator=" + options_.coordinator,
               "--job=" + a.job_id(), absl::StrCat("--generation=", a.generation()),
               absl::StrCat("--rank=", a.rank()), absl::StrCat("--world-size=", a.world_size()),
               "--worker-id=" + options_.worker_id, "--host=" + options_.address,
               absl::StrCat("--slot=", a.slot()),
               absl::StrCat("--threads=", std::max(1, a.spec().threads_per_rank())),
               "--work-dir=" + job_dir, "--checkpoint-root=" + options_.checkpoint_root,
               // Datasets are inflated once per worker, not once per trainer.
               "--cache-dir=" + options_.work_dir + "/cache"};
  if (!options_.trainer_log_level.empty()) {
    spec.argv.push_back("--log-level=" + options_.trainer_log_level);
  }
  // The credential travels in the environment: argv is world-readable.
  spec.env = options_.trainer_env;
  if (a.spec().device() == v1::JobSpec::GPU) {
    // One GPU per trainer, which it sees as its device 0.
    absl::StatusOr<std::string> visible =
        TrainerVisibleDevice(a.slot(), options_.gpus, options_.cuda_visible_devices);
    if (!visible.ok()) return not_started(visible.status());
    spec.env.push_back("CUDA_VISIBLE_DEVICES=" + *visible);
  }
  spec.env.push_back("AIDN_TRAINER_TOKEN=" + a.trainer_token());
  spec.log_path = LogPath(key);
  absl::StatusOr<Supervisor::ChildId> child = supervisor_.Start(spec);
  if (!child.ok()) return not_started(child.status());
  pid_t pid = 0;
  for (const ChildStatus& c : supervisor_.Running()) {
    if (c.id == *child) pid = c.pid;
  }
  {
    absl::MutexLock lock(&mu_);
    trainers_[key] = Trainer{.child = *child, .pid = pid};
  }
  auto [seen, first] = generation_started_.try_emplace(a.job_id(), a.generation());
  if (metrics_ != nullptr) {
    metrics_->trainers_started.Increment();
    if (!first && a.generation() > seen->second) metrics_->trainer_restarts.Increment();
  }
  seen->second = std::max(seen->second, a.generation());
  AIDN_LOG(INFO) << "trainer started" << Kv("trainer", name) << Kv("pid", pid)
                 << Kv("world_size", a.world_size()) << Kv("slot", a.slot())
                 << Kv("log", spec.log_path);
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
    bool found = false;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = trainers_.begin(); it != trainers_.end(); ++it) {
        if (it->second.child != exit.id) continue;
        key = it->first;
        by_order = it->second.by_order;
        trainers_.erase(it);
        found = true;
        break;
      }
    }
    if (!found) continue;  // not a trainer of ours (cannot happen)
    finished_.insert(key);
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
                        << Kv("how", how) << Kv("stopped", exit.stopped) << Kv("log", LogPath(key));
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
    QueueReport(std::move(report));
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

void Daemon::QueueReport(v1::ReportTrainerExitRequest report) {
  absl::MutexLock lock(&mu_);
  if (reports_.size() >= options_.max_pending_reports) {
    const v1::ReportTrainerExitRequest& dropped = reports_.front().second;
    AIDN_LOG(ERROR) << "too many undelivered exit reports; dropping the oldest"
                    << Kv("trainer",
                          KeyText(dropped.job_id(), dropped.generation(), dropped.rank()));
    reports_.pop_front();
  }
  reports_.emplace_back(next_report_seq_++, std::move(report));
}

// ---------------------------------------------------------------------------
// Report thread.

void Daemon::ReportLoop() {
  milliseconds backoff = options_.backoff_initial;
  std::optional<SteadyClock::time_point> give_up_at;
  // The last failure logged, so that an outage is logged once.
  std::string problem;
  while (true) {
    uint64_t seq = 0;
    v1::ReportTrainerExitRequest report;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !reports_.empty() || trainers_stopped_;
      };
      mu_.Await(absl::Condition(&ready));
      if (trainers_stopped_ && !give_up_at.has_value()) {
        give_up_at = SteadyClock::now() + options_.shutdown_report_timeout;
      }
      if (reports_.empty()) return;  // shut down, all delivered
      seq = reports_.front().first;
      report = reports_.front().second;
    }
    milliseconds timeout = options_.rpc_timeout;
    if (give_up_at.has_value()) {
      const auto left = std::chrono::duration_cast<milliseconds>(*give_up_at - SteadyClock::now());
      if (left.count() <= 0) {
        absl::MutexLock lock(&mu_);
        AIDN_LOG(ERROR) << "shutting down with undelivered exit reports"
                        << Kv("count", reports_.size());
        return;
      }
      timeout = std::min(timeout, left);
    }
    grpc::ClientContext context;
    rpc::PrepareContext(&context, options_.token, timeout);
    v1::ReportTrainerExitResponse response;
    const grpc::Status status = stub_->ReportTrainerExit(&context, report, &response);
    const std::string name = KeyText(report.job_id(), report.generation(), report.rank());
    if (status.ok() || !Retryable(status.error_code())) {
      if (status.ok()) {
        AIDN_LOG(DEBUG) << "exit reported" << Kv("trainer", name);
        if (!problem.empty()) AIDN_LOG(INFO) << "exit reports are delivered again";
        problem.clear();
      } else {
        AIDN_LOG(WARNING) << "the coordinator refused an exit report; dropping it"
                          << Kv("trainer", name)
                          << Kv("code", static_cast<int>(status.error_code()))
                          << Kv("error", status.error_message());
      }
      backoff = options_.backoff_initial;
      absl::MutexLock lock(&mu_);
      if (!reports_.empty() && reports_.front().first == seq) reports_.pop_front();
      continue;
    }
    if (Describe(status) != problem) {
      problem = Describe(status);
      AIDN_LOG(WARNING) << "could not deliver an exit report; retrying with backoff"
                        << Kv("trainer", name) << Kv("code", static_cast<int>(status.error_code()))
                        << Kv("error", status.error_message());
    }
    rpc::ResetBackoffAfter(status, channel_.get());
    milliseconds delay = backoff;
    if (give_up_at.has_value()) {
      delay = std::min(delay,
                       std::chrono::duration_cast<milliseconds>(*give_up_at - SteadyClock::now()));
    }
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    backoff = std::min(backoff * 2, options_.backoff_max);
  }
}

}  // namespace aidn::worker
