// The coordinator's construction, loading and ticking, the job lifecycle
// (state changes, generations started, failed and released), scheduling and
// the time-driven checks. The service calls are in coordinator_jobs.cc
// (CoordinatorService) and coordinator_cluster.cc (ClusterService).

#include "coordinator/coordinator.h"

#include <algorithm>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status.h"
#include "common/token.h"
#include "coordinator/job_entry.h"
#include "coordinator/job_state.h"
#include "coordinator/time_util.h"

namespace aidn::coordinator {
namespace {

using std::chrono::milliseconds;
using v1::Job;

std::string Lower(const std::string& s) { return absl::AsciiStrToLower(s); }

bool Waiting(const Job& job) {
  return job.state() == Job::PENDING || job.state() == Job::RESTARTING;
}

// The longest restart backoff, and the default for specs stored before
// timeouts.restart_backoff existed.
constexpr milliseconds kMaxRestartBackoff{5 * 60 * 1000};
constexpr milliseconds kDefaultRestartBackoff{1000};

}  // namespace

// ---------------------------------------------------------------------------
// Construction, loading, ticking.

Coordinator::Coordinator(const CoordinatorOptions& options, std::unique_ptr<Store> store,
                         Authenticator* auth)
    : options_(options),
      clock_(options.clock != nullptr ? options.clock : Clock::Real()),
      auth_(auth),
      own_registry_(options.registry == nullptr ? std::make_unique<metrics::Registry>() : nullptr),
      metrics_(options.registry != nullptr ? options.registry : own_registry_.get()),
      store_(std::move(store)),
      failures_({.worker_timeout = options.worker_timeout,
                 .trainer_beat_interval = options.trainer_beat_interval}),
      checkpoints_(store_.get(), clock_),
      ingest_({.step_log = options.step_log, .metrics_retention = options.metrics_retention},
              &metrics_, store_.get(), clock_),
      watch_(store_.get()),
      logs_(options.logs, store_.get()) {}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(const CoordinatorOptions& options,
                                                                 std::unique_ptr<Store> store,
                                                                 Authenticator* auth) {
  if (store == nullptr || auth == nullptr) {
    return absl::InvalidArgumentError("coordinator needs a store and an authenticator");
  }
  std::unique_ptr<Coordinator> c(new Coordinator(options, std::move(store), auth));
  AIDN_ASSIGN_OR_RETURN(c->incarnation_, RandomHex(8));
  {
    absl::MutexLock lock(&c->mu_);
    AIDN_RETURN_IF_ERROR(c->Load());
  }
  // The hook calls into the coordinator: whoever serves the registry stops
  // before the coordinator goes (see main.cc).
  Coordinator* raw = c.get();
  c->metrics_.registry->AddCollectHook([raw] { raw->CollectMetrics(); });
  return c;
}

Coordinator::~Coordinator() { StopTicker(); }

absl::Status Coordinator::Load() {
  const Clock::TimePoint now = clock_->Now();
  // Jobs that finished longer ago stay in the store (JobRecord).
  const absl::Time archived_before = clock_->WallNow() - absl::FromChrono(ArchiveAfter());
  AIDN_ASSIGN_OR_RETURN(std::vector<StoredJob> jobs, store_->LoadJobs(archived_before));
  AIDN_ASSIGN_OR_RETURN(archived_by_state_, store_->CountJobsFinishedBefore(archived_before));
  AIDN_ASSIGN_OR_RETURN(const int64_t max_number, store_->MaxJobNumber());
  next_job_number_ = max_number + 1;
  Deferred deferred;  // answers no one: nobody waits yet
  for (StoredJob& stored : jobs) LoadJob(std::move(stored), now, &deferred);
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::Worker> workers, store_->LoadWorkers());
  for (v1::Worker& w : workers) {
    WorkerEntry entry;
    entry.worker = std::move(w);
    // Every worker gets a full timeout from now to come back.
    entry.last_seen = now;
    entry.heard = false;
    workers_[entry.worker.info().id()] = std::move(entry);
  }
  for (const auto& [id, w] : workers_) {
    if (w.worker.scheduling() == v1::Worker::DRAINING) AskCheckpointsToMoveOff(id);
  }
  AIDN_LOG(INFO) << "state loaded" << Kv("jobs", jobs_.size()) << Kv("workers", workers_.size())
                 << Kv("next_job", next_job_number_);
  return absl::OkStatus();
}

void Coordinator::LoadJob(StoredJob stored, Clock::TimePoint now, Deferred* deferred) {
  auto entry = std::make_unique<JobEntry>();
  entry->stored = std::move(stored);
  const Job& job = entry->stored.job;
  if (!IsTerminal(job.state())) {
    auth_->AddToken(entry->stored.trainer_token,
                    Principal{Role::kTrainer, "trainer:" + job.id(), job.id(), {}});
  }
  if (HoldsSlots(job.state())) {
    entry->rendezvous = std::make_unique<Rendezvous>(
        job.spec().world_size(), now + ToMillis(job.spec().timeouts().rendezvous()));
    entry->kv = std::make_unique<KvStore>(options_.kv_limits);
    // The ranks kept training while the coordinator was away: a full
    // progress timeout from now.
    entry->health.last_advance = now;
    entry->health.running_since = now;
    if (job.state() == Job::RUNNING) {
      RebuildRendezvous(entry.get(), deferred);
      // Where the generation's stored steps end: its trainers send again
      // the records the last process may not have stored.
      ingest_.RecoverStored(job, &entry->metrics, entry->checkpoints.resumed_from_step);
    }
  }
  if (job.state() == Job::RESTARTING) entry->restart_at = now + RestartDelay(job);
  // A job that succeeded recently too: the last process may have ended
  // before it could commit the final checkpoint whose metrics it had stored.
  // Older ones had a running coordinator's ticks for that (and reading every
  // old job's checkpoints would slow every start).
  if (!IsTerminal(job.state()) || (job.state() == Job::SUCCEEDED && !ingest_.PastRetention(job))) {
    LoadAwaitingCheckpoints(entry.get(), deferred);
  }
  if (!IsTerminal(job.state())) unfinished_[entry->stored.number] = entry.get();
  jobs_[job.id()] = std::move(entry);
}

void Coordinator::RebuildRendezvous(JobEntry* entry, Deferred* deferred) {
  const Job& job = entry->stored.job;
  v1::JoinRendezvousResponse base;
  base.set_world_size(job.spec().world_size());
  base.set_generation(job.generation());
  *base.mutable_spec() = job.spec();
  for (const v1::RankPlacement& p : job.placement()) {
    v1::Peer peer;
    peer.set_rank(p.rank());
    peer.set_worker_id(p.worker_id());
    peer.set_address(p.address());
    entry->rendezvous->Join(
        peer, [](absl::StatusOr<v1::JoinRendezvousResponse>) {}, deferred);
    *base.add_peers() = peer;
  }
  checkpoints_.FillResume(job, &entry->checkpoints, &base);
  entry->rendezvous->Complete(base, deferred);
}

void Coordinator::Shutdown() {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return;
  shutting_down_ = true;
  const absl::Status& closing = ShuttingDownError();
  for (auto& [id, entry] : jobs_) {
    if (entry->rendezvous != nullptr && !entry->rendezvous->completed()) {
      // A fresh rendezvous, so trainers that retry after the restart can
      // still complete it.
      entry->rendezvous->Fail(closing, &deferred);
    }
    if (entry->kv != nullptr) entry->kv->Close(closing, &deferred);
    NotifyWatchers(id, &deferred);
  }
  held_.FailAll(closing, &deferred);
}

void Coordinator::StartTicker(milliseconds interval) {
  absl::MutexLock lock(&ticker_mu_);
  if (ticker_.joinable()) return;
  ticker_stop_ = std::make_unique<absl::Notification>();
  absl::Notification* stop = ticker_stop_.get();
  ticker_ = std::thread([this, stop, interval]() {
    // At a fixed rate, not `interval` after the last tick's work: under load
    // a tick (answering hundreds of held heartbeats, writing steps) takes
    // tens of milliseconds, and every deadline it checks would slip by that
    // much more. A tick that overran starts the next at once, without
    // catching up on the ones missed.
    absl::Time next = absl::Now() + absl::FromChrono(interval);
    while (!stop->WaitForNotificationWithDeadline(next)) {
      Tick();
      FlushSteps();
      TickLogs();
      next = std::max(next + absl::FromChrono(interval), absl::Now());
    }
    FlushSteps();
  });
  {
    absl::MutexLock lock(&mu_);
    held_timer_stop_ = false;
  }
  held_timer_ =
      std::thread([this, interval]() { RunHeldTimer(std::max(interval, 10 * kHeldGranularity)); });
}

void Coordinator::RunHeldTimer(milliseconds longest_sleep) {
  for (;;) {
    Clock::TimePoint wake;
    {
      Deferred deferred;  // the answers, sent once the lock is released
      absl::MutexLock lock(&mu_);
      if (held_timer_stop_) return;
      const Clock::TimePoint now = clock_->Now();
      held_.AnswerDue(now, HeartbeatBuilder(), &deferred);
      wake = now + longest_sleep;
      if (const std::optional<Clock::TimePoint> next = held_.NextDeadline(); next.has_value()) {
        wake = std::clamp(*next, now + kHeldGranularity, wake);
      }
      // From here on a call held due sooner sets held_wake_ (Heartbeat).
      held_wake_at_ = wake;
      held_wake_ = false;
    }
    absl::MutexLock lock(&mu_);
    // The clock may be a test's FakeClock: the real wait is then only a cap
    // (the ticker answers what falls due too).
    mu_.AwaitWithTimeout(absl::Condition(&held_wake_), absl::FromChrono(wake - clock_->Now()));
    held_wake_at_ = Clock::TimePoint::max();
  }
}

void Coordinator::StopTicker() {
  absl::MutexLock lock(&ticker_mu_);
  if (!ticker_.joinable()) return;
  ticker_stop_->Notify();
  {
    absl::MutexLock stop(&mu_);
    held_timer_stop_ = true;
    held_wake_ = true;
  }
  ticker_.join();
  held_timer_.join();
}

void Coordinator::Tick() {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  const auto started = std::chrono::steady_clock::now();
  CheckTimeouts(&deferred);
  Schedule(&deferred);
  const Clock::TimePoint now = clock_->Now();
  for (auto& [id, entry] : jobs_) {
    if (entry->health.step_window_changed) CheckStragglers(entry.get(), &deferred);
    if (ingest_.Expire(entry->stored.job, &entry->metrics, now)) NotifyWatchers(id, &deferred);
    if (!entry->checkpoints.awaiting_metrics.empty()) {
      const std::vector<int64_t> committed =
          CompleteCheckpoints(entry.get(), DurableInMemory(entry.get()), &deferred);
      if (!committed.empty()) CheckpointCommitted(entry.get(), committed.back(), &deferred);
    }
  }
  StoreUnstoredJobs();
  ArchiveFinishedJobs();
  metrics_.tick_seconds.Observe(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  // `deferred` runs after the lock is released (declared first, destroyed last).
}

void Coordinator::FlushSteps() {
  absl::MutexLock flush(&flush_mu_);
  FlushStepsLocked();
}

void Coordinator::FlushStepsLocked() {
  FlushBatch batch = std::move(failed_flush_);
  failed_flush_ = FlushBatch();
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, entry] : jobs_) ingest_.Take(id, &entry->metrics, &batch);
    // Out of the logs, not yet in the store: not durable (MetricsReceipt).
    ingest_.InFlight(batch);
  }
  if (batch.empty()) return;
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = store_->PutSteps(batch.steps);
  metrics_.store_batch_seconds.Observe(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (!s.ok()) {
    // Kept for the next flush; watchers still get them from memory.
    constexpr size_t kMaxFailed = 1'000'000;
    if (batch.steps.size() > kMaxFailed) {
      metrics_.records_dropped.Increment(static_cast<double>(batch.steps.size() - kMaxFailed));
      batch.steps.erase(batch.steps.begin(), batch.steps.end() - kMaxFailed);
    }
    AIDN_LOG(ERROR) << "could not store metric steps; will retry" << Kv("steps", batch.steps.size())
                    << Kv("error", s);
    // The in-flight steps stay not durable: they are retried first.
    failed_flush_ = std::move(batch);
    return;
  }
  metrics_.steps_stored.Increment(static_cast<double>(batch.steps.size()));
  absl::MutexLock lock(&mu_);
  ingest_.Stored();
  for (auto& [id, seq] : batch.taken) {
    auto it = jobs_.find(id);
    if (it != jobs_.end()) MetricIngest::NoteFlushed(&it->second->metrics, seq);
  }
  for (const Store::JobStep& s : batch.steps) {
    auto it = jobs_.find(s.job_id);
    if (it == jobs_.end()) continue;
    MetricIngest::NoteStored(it->second->stored.job.generation(), &it->second->metrics, s.step);
  }
}

// ---------------------------------------------------------------------------
// Internal helpers.

const absl::Status& Coordinator::ShuttingDownError() {
  static const absl::Status* status =
      new absl::Status(absl::UnavailableError("coordinator is shutting down"));
  return *status;
}

absl::StatusOr<JobEntry*> Coordinator::FindJob(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no such job: ", job_id));
  return it->second.get();
}

absl::StatusOr<Job> Coordinator::JobRecord(const std::string& job_id) {
  if (auto it = jobs_.find(job_id); it != jobs_.end()) return it->second->stored.job;
  AIDN_ASSIGN_OR_RETURN(std::optional<StoredJob> stored, store_->GetJob(job_id));
  if (!stored.has_value()) return absl::NotFoundError(absl::StrCat("no such job: ", job_id));
  return std::move(stored->job);
}

std::chrono::milliseconds Coordinator::ArchiveAfter() const {
  return std::max(options_.job_retention, options_.metrics_retention);
}

void Coordinator::ArchiveFinishedJobs() {
  const absl::Time before = clock_->WallNow() - absl::FromChrono(ArchiveAfter());
  std::set<std::string> series_left;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    JobEntry& entry = *it->second;
    const Job& job = entry.stored.job;
    // Its steps left memory once all were stored (MetricIngest::Expire),
    // and no checkpoint waits for them.
    if (!IsTerminal(job.state()) || FromProto(job.finished_at()) > before ||
        unstored_jobs_.contains(it->first) || entry.metrics.steps != nullptr ||
        !entry.checkpoints.awaiting_metrics.empty()) {
      ++it;
      continue;
    }
    // Series that no scrape took off yet.
    if (!entry.metrics.series_removed) series_left.insert(it->first);
    logs_deleted_.erase(it->first);
    ++archived_by_state_[job.state()];
    it = jobs_.erase(it);
  }
  ingest_.RemoveSeriesOfJobs(series_left);
}

absl::StatusOr<JobEntry*> Coordinator::FencedJob(const std::string& job_id, int64_t generation) {
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(job_id));
  const Job& job = entry->stored.job;
  if (IsTerminal(job.state())) {
    return absl::FailedPreconditionError(
        absl::StrCat(job_id, " has ended (", StateName(job.state()), ")"));
  }
  if (generation != job.generation()) {
    return absl::FailedPreconditionError(absl::StrCat("generation ", generation, " of ", job_id,
                                                      " is superseded by ", job.generation()));
  }
  if (!HoldsSlots(job.state())) {
    return absl::FailedPreconditionError(absl::StrCat("generation ", generation, " of ", job_id,
                                                      " is not placed (", StateName(job.state()),
                                                      ")"));
  }
  return entry;
}

absl::StatusOr<JobEntry*> Coordinator::FencedRank(const std::string& job_id, int64_t generation,
                                                  int rank) {
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FencedJob(job_id, generation));
  if (rank < 0 || rank >= entry->stored.job.spec().world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: out of range: ", rank));
  }
  return entry;
}

absl::StatusOr<JobEntry*> Coordinator::FencedJobToWaitOn(const std::string& job_id,
                                                         int64_t generation) {
  if (shutting_down_) return ShuttingDownError();
  return FencedJob(job_id, generation);
}

void Coordinator::Emit(const std::string& type, const std::string& job_id,
                       const std::string& worker_id, int64_t generation, const std::string& message,
                       Deferred* deferred) {
  v1::Event event;
  *event.mutable_time() = ToProto(clock_->WallNow());
  event.set_job_id(job_id);
  event.set_worker_id(worker_id);
  event.set_generation(generation);
  event.set_type(type);
  event.set_message(message);
  absl::Status s = store_->AppendEvent(&event);
  if (!s.ok()) AIDN_LOG(ERROR) << "could not store event: " << s << Kv("type", type);
  AIDN_LOG(INFO) << type << (message.empty() ? "" : ": ") << message
                 << Kv("job", job_id.empty() ? "-" : job_id)
                 << Kv("worker", worker_id.empty() ? "-" : worker_id) << Kv("gen", generation);
  if (!job_id.empty()) NotifyWatchers(job_id, deferred);
}

absl::Status Coordinator::PersistJob(JobEntry* entry, Deferred* deferred) {
  entry->version++;
  *entry->stored.job.mutable_updated_at() = ToProto(clock_->WallNow());
  absl::Status s = store_->PutJob(entry->stored);
  if (!s.ok()) {
    // Memory has changed already (a cancel, a failure): the tick writes it
    // once the store takes writes again (a full disk freed).
    AIDN_LOG(ERROR) << "could not store job; retrying every tick"
                    << Kv("job", entry->stored.job.id()) << Kv("error", s);
    unstored_jobs_.insert(entry->stored.job.id());
  } else {
    unstored_jobs_.erase(entry->stored.job.id());
  }
  NotifyWatchers(entry->stored.job.id(), deferred);
  return s;
}

void Coordinator::StoreUnstoredJobs() {
  for (auto it = unstored_jobs_.begin(); it != unstored_jobs_.end();) {
    auto job = jobs_.find(*it);
    if (job == jobs_.end()) {
      it = unstored_jobs_.erase(it);
      continue;
    }
    if (!store_->PutJob(job->second->stored).ok()) return;  // not yet: the next tick
    AIDN_LOG(INFO) << "job stored after an earlier write failed" << Kv("job", *it);
    it = unstored_jobs_.erase(it);
  }
}

void Coordinator::PersistWorker(const WorkerEntry& entry) {
  absl::Status s = store_->PutWorker(entry.worker);
  if (!s.ok()) {
    AIDN_LOG(ERROR) << "could not store worker: " << s << Kv("worker", entry.worker.info().id());
  }
}

absl::Status Coordinator::SetState(JobEntry* entry, Job::State state, const std::string& message,
                                   Deferred* deferred) {
  Job& job = entry->stored.job;
  if (absl::Status refused = CheckTransition(job.state(), state); !refused.ok()) {
    // A programmer error: the callers only ask for edges of the lifecycle.
    AIDN_LOG(ERROR) << "refused job state change: " << refused << Kv("job", job.id());
    return refused;
  }
  job.set_state(state);
  job.set_message(message);
  if (IsTerminal(state) || state == Job::PAUSED) job.clear_pausing();
  PlacementsChanged();
  if (state == Job::RUNNING && !job.has_started_at()) {
    *job.mutable_started_at() = ToProto(clock_->WallNow());
  }
  if (IsTerminal(state)) {
    *job.mutable_finished_at() = ToProto(clock_->WallNow());
    auth_->RemoveToken(entry->stored.trainer_token);
    unfinished_.erase(entry->stored.number);
  }
  absl::Status s = PersistJob(entry, deferred);
  Emit("job." + Lower(StateName(state)), job.id(), "", job.generation(), message, deferred);
  return s;
}

void Coordinator::NotifyWatchers(const std::string& job_id, Deferred* deferred) {
  deferred->Add([this, job_id]() {
    watchers_.Notify(job_id);
    log_followers_.Notify(job_id);
  });
}

void Coordinator::AssignmentsChanged(const std::set<std::string>& workers, Deferred* deferred) {
  assignments_version_++;
  const HeldHeartbeats::Builder build = HeartbeatBuilder();
  for (const std::string& id : workers) {
    if (workers_.contains(id)) held_.AnswerWorker(id, build, deferred);
  }
}

void Coordinator::ReleaseGeneration(JobEntry* entry, const std::string& reason,
                                    const absl::Status& status, Deferred* deferred) {
  const Job& job = entry->stored.job;
  std::set<std::string> workers;
  for (const v1::RankPlacement& p : job.placement()) workers.insert(p.worker_id());
  for (const std::string& worker_id : workers) {
    auto it = workers_.find(worker_id);
    if (it == workers_.end()) continue;
    v1::StopOrder stop;
    stop.set_job_id(job.id());
    stop.set_generation(job.generation());
    stop.set_reason(reason);
    stop.mutable_grace()->set_seconds(options_.stop_grace.count() / 1000);
    it->second.pending_stops.push_back(std::move(stop));
  }
  if (entry->rendezvous != nullptr) entry->rendezvous->Fail(status, deferred);
  if (entry->kv != nullptr) entry->kv->Close(status, deferred);
  entry->rendezvous.reset();
  entry->kv.reset();
  entry->exited_ok.clear();
  entry->health.Clear();
  entry->agreement = {};
  entry->move_asked = false;
  // Steps still missing a rank will not get it from this generation.
  if (ingest_.EndGeneration(&entry->metrics)) NotifyWatchers(job.id(), deferred);
  AssignmentsChanged(workers, deferred);
}

void Coordinator::FailGeneration(JobEntry* entry, const std::string& reason, bool permanent,
                                 Deferred* deferred, std::optional<absl::Time> rank_exit_at) {
  Job& job = entry->stored.job;
  if (!HoldsSlots(job.state())) return;
  const int64_t generation = job.generation();
  FailureCause& cause = entry->last_failure.emplace();
  cause.generation = generation;
  cause.seen_at = clock_->WallNow();
  cause.at = rank_exit_at.value_or(cause.seen_at);
  cause.reason = reason;
  cause.revisable = rank_exit_at.has_value();
  for (const v1::RankPlacement& p : job.placement()) cause.workers.insert(p.worker_id());
  ReleaseGeneration(entry, reason,
                    absl::FailedPreconditionError(absl::StrCat("generation ", generation, " of ",
                                                               job.id(), " ended: ", reason)),
                    deferred);
  const int32_t max_restarts = job.spec().max_restarts();
  if (permanent) {
    (void)SetState(entry, Job::FAILED, absl::StrCat("permanent failure: ", reason), deferred);
    return;
  }
  if (job.restarts() >= max_restarts) {
    (void)SetState(
        entry, Job::FAILED,
        absl::StrCat("failed after ", job.restarts(), " restart", job.restarts() == 1 ? "" : "s",
                     " (max_restarts ", max_restarts, "): ", reason),
        deferred);
    return;
  }
  job.set_restarts(job.restarts() + 1);
  job.set_generation(generation + 1);
  entry->unconfirmed_workers.clear();
  for (const v1::RankPlacement& p : job.placement()) {
    entry->unconfirmed_workers.insert(p.worker_id());
  }
  entry->failed_at = clock_->Now();
  job.clear_placement();
  PlacementsChanged();
  // Asked to pause: it stays stopped rather than restarting.
  if (job.has_pausing()) {
    (void)SetState(
        entry, Job::PAUSED,
        absl::StrCat(PausedBy(job.pausing()), " (its generation failed first: ", reason, ")"),
        deferred);
    return;
  }
  // A failure that repeats (a crash at start-up, a bad node) should not spin:
  // each restart waits twice as long as the one before.
  const milliseconds delay = RestartDelay(job);
  entry->restart_at = clock_->Now() + delay;
  (void)SetState(entry, Job::RESTARTING,
                 absl::StrCat("restart ", job.restarts(), " of ", max_restarts, " in ",
                              FormatMillis(delay), ": ", reason),
                 deferred);
}

milliseconds Coordinator::RestartDelay(const Job& job) const {
  milliseconds base = ToMillis(job.spec().timeouts().restart_backoff());
  if (base.count() <= 0) base = kDefaultRestartBackoff;
  // restarts() counts this one: the k-th restart waits base * 2^(k-1).
  milliseconds delay = base;
  for (int k = 1; k < job.restarts() && delay < kMaxRestartBackoff; ++k) delay *= 2;
  return std::min(delay, kMaxRestartBackoff);
}

// ---------------------------------------------------------------------------
// Scheduling and time-driven checks.

void Coordinator::Schedule(Deferred* deferred) {
  // Nothing waits for slots (the usual case on a tick): the workers need not
  // be looked at. Building their free-slot table costs O(workers) under mu_,
  // every tick and on every registration (10,000 registrations: O(n^2)).
  std::vector<JobEntry*> queue;
  for (const auto& [number, entry] : unfinished_) {
    if (Waiting(entry->stored.job)) queue.push_back(entry);
  }
  if (queue.empty()) return;
  SlotTable slots = FreeSlots();
  std::sort(queue.begin(), queue.end(), [](const JobEntry* a, const JobEntry* b) {
    if (a->stored.job.spec().priority() != b->stored.job.spec().priority()) {
      return a->stored.job.spec().priority() > b->stored.job.spec().priority();
    }
    return a->stored.number < b->stored.number;
  });
  for (JobEntry* entry : queue) {
    if (!TryPlace(entry, &slots, deferred)) break;
  }
}

SlotTable Coordinator::FreeSlots() {
  SlotTable slots;
  for (const auto& [id, w] : workers_) {
    if (w.worker.state() != v1::Worker::ALIVE) continue;
    slots.AddWorker(id, w.worker.info().cpu_slots(), w.worker.info().gpus_size());
  }
  for (const auto& [number, entry] : unfinished_) {
    if (HoldsSlots(entry->stored.job.state())) slots.MarkUsed(entry->stored.job);
  }
  return slots;
}

bool Coordinator::TryPlace(JobEntry* entry, SlotTable* slots, Deferred* deferred) {
  Job& job = entry->stored.job;
  const Clock::TimePoint now = clock_->Now();
  // Backing off before a restart; it does not hold up the jobs behind it.
  if (job.state() == Job::RESTARTING && now < entry->restart_at) return true;
  // Only workers heard from within this job's worker timeout: one silent
  // longer would fail the new generation on the next tick again.
  const milliseconds job_timeout = failures_.JobWorkerTimeout(job);
  int refuse_commands = 0;
  int refuse_paths = 0;
  int cordoned = 0;
  int unheard = 0;
  std::string path_reason;  // the first worker's
  const std::vector<WorkerSlots> snapshot = slots->Snapshot([&](const std::string& id) {
    const WorkerEntry& worker = workers_.at(id);
    if (worker.worker.scheduling() != v1::Worker::SCHEDULABLE) {
      ++cordoned;
      return false;
    }
    if (job.spec().has_command() && !worker.worker.info().runs_commands()) {
      ++refuse_commands;
      return false;
    }
    if (std::optional<PathOutside> out = PathRefusedBy(job.spec(), worker.worker.info())) {
      if (refuse_paths++ == 0) {
        path_reason = absl::StrCat(out->named.field, ": ", out->named.path, " is outside ", id,
                                   "'s allowed paths");
      }
      return false;
    }
    const Clock::TimePoint seen = worker.last_seen;
    if (now - seen > job_timeout) return false;
    if (!worker.heard) {
      ++unheard;
      return false;
    }
    return !(entry->unconfirmed_workers.contains(id) && seen < entry->failed_at);
  });
  absl::StatusOr<std::vector<v1::RankPlacement>> placement =
      PlaceGang(GangRequestOf(job.spec()), snapshot);
  if (!placement.ok()) {
    std::string reason(placement.status().message());
    if (refuse_commands > 0) {
      absl::StrAppend(&reason, " (", refuse_commands,
                      " worker(s) run no command jobs: started with --no-command-jobs, or as "
                      "root without --command-user)");
    }
    if (cordoned > 0) absl::StrAppend(&reason, " (", cordoned, " worker(s) cordoned)");
    if (unheard > 0) {
      absl::StrAppend(&reason, " (", unheard,
                      " worker(s) not heard from since the coordinator started)");
    }
    if (refuse_paths > 0) {
      absl::StrAppend(&reason, " (", refuse_paths,
                      " worker(s) do not allow the job's paths: ", path_reason, ")");
    }
    if (reason != entry->waiting_reason) {
      entry->waiting_reason = reason;
      job.set_message(reason);
      (void)PersistJob(entry, deferred);
      Emit("job.waiting", job.id(), "", job.generation(), reason, deferred);
    }
    // A job that can never fit does not hold the queue up; one that waits
    // for room does (FIFO within priority, no backfill).
    return placement.status().code() == absl::StatusCode::kFailedPrecondition;
  }
  job.clear_placement();
  std::set<std::string> on;
  for (v1::RankPlacement& p : *placement) {
    on.insert(p.worker_id());
    *job.add_placement() = std::move(p);
  }
  PlacementsChanged();
  slots->MarkUsed(job);
  StartGeneration(entry, on, deferred);
  return true;
}

void Coordinator::StartGeneration(JobEntry* entry, const std::set<std::string>& workers,
                                  Deferred* deferred) {
  Job& job = entry->stored.job;
  if (job.generation() == 0) job.set_generation(1);
  entry->waiting_reason.clear();
  entry->unconfirmed_workers.clear();
  entry->rendezvous = std::make_unique<Rendezvous>(
      job.spec().world_size(), clock_->Now() + ToMillis(job.spec().timeouts().rendezvous()));
  entry->kv = std::make_unique<KvStore>(options_.kv_limits);
  entry->exited_ok.clear();
  entry->health.Restart(clock_->Now());
  (void)SetState(
      entry, Job::SCHEDULED,
      absl::StrCat("placed ", job.spec().world_size(), " ranks on ", absl::StrJoin(workers, ", ")),
      deferred);
  AssignmentsChanged(workers, deferred);
}

void Coordinator::CheckTimeouts(Deferred* deferred) {
  const Clock::TimePoint now = clock_->Now();
  CheckWorkers(now, deferred);
  for (auto& [job_id, entry] : jobs_) {
    if (HoldsSlots(entry->stored.job.state())) CheckJob(entry.get(), now, deferred);
  }
  held_.AnswerDue(now, HeartbeatBuilder(), deferred);
}

void Coordinator::CheckWorkers(Clock::TimePoint now, Deferred* deferred) {
  for (auto& [id, w] : workers_) {
    const std::optional<milliseconds> silent =
        failures_.WorkerSilence({w.worker.state(), w.last_seen}, now);
    if (!silent.has_value()) continue;
    w.worker.set_state(v1::Worker::LOST);
    PersistWorker(w);
    const std::string silence = absl::StrCat("no heartbeat for ", FormatMillis(*silent));
    Emit("worker.lost", "", id, 0, silence, deferred);
    WorkerLostForJobs(w, silence, deferred);
    // Answer its held heartbeat, if any, so the call does not hang.
    held_.FailWorker(id, absl::NotFoundError("worker was declared lost; register again"), deferred);
  }
}

void Coordinator::CheckJob(JobEntry* entry, Clock::TimePoint now, Deferred* deferred) {
  const Job& job = entry->stored.job;
  // A worker of this job lost, or silent past the job's own timeout.
  const std::string failed = failures_.PlacementFailure(
      job,
      [this](const std::string& id)
          ABSL_NO_THREAD_SAFETY_ANALYSIS -> std::optional<WorkerLiveness> {
            auto it = workers_.find(id);
            if (it == workers_.end()) return std::nullopt;
            return WorkerLiveness{it->second.worker.state(), it->second.last_seen};
          },
      now);
  if (!failed.empty()) return FailGeneration(entry, failed, false, deferred);
  if (entry->rendezvous != nullptr) {
    if (std::optional<std::string> reason =
            FailureDetector::RendezvousTimeout(job, *entry->rendezvous, now)) {
      entry->rendezvous->Fail(absl::DeadlineExceededError(*reason), deferred);
      Emit("rendezvous.timeout", job.id(), "", job.generation(), *reason, deferred);
      return FailGeneration(entry, *reason, false, deferred);
    }
  }
  // Progress deadline. Beats go on while training is stuck (they come from
  // a thread of their own), so it runs from the last step taken.
  const StepLog* steps = entry->metrics.steps.get();
  if (std::optional<std::string> reason =
          failures_.Hang(job, entry->health,
                         steps != nullptr ? &steps->recent_train_step_seconds() : nullptr, now)) {
    Emit("job.hang", job.id(), "", job.generation(), *reason, deferred);
    return FailGeneration(entry, *reason, false, deferred);
  }
  if (entry->kv != nullptr) entry->kv->Expire(now, deferred);
}

void Coordinator::CheckStragglers(JobEntry* entry, Deferred* deferred) {
  const Job& job = entry->stored.job;
  for (const StragglerChange& c : FailureDetector::CheckStragglers(&entry->health)) {
    Emit(c.slow ? "rank.straggler" : "rank.recovered", job.id(), WorkerOfRank(job, c.rank),
         job.generation(), c.message, deferred);
  }
}

void Coordinator::AnswerDueHeartbeats() {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  const Clock::TimePoint now = clock_->Now();
  if (!held_.AnyDue(now)) return;
  held_.AnswerDue(now, HeartbeatBuilder(), &deferred);
}

}  // namespace aidn::coordinator
