#include "coordinator/coordinator.h"

#include <algorithm>
#include <regex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
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

// The last non-empty line of a trainer's stderr, shortened for a message.
std::string LastLine(const std::string& text) {
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n', absl::SkipWhitespace());
  if (lines.empty()) return "";
  std::string last(absl::StripAsciiWhitespace(lines.back()));
  if (last.size() > 200) last = last.substr(0, 200) + "...";
  return last;
}

// Answers a parked-call callback with an error once the lock is released.
template <typename Callback>
void AnswerLater(Deferred* deferred, Callback done, const absl::Status& status) {
  deferred->Add([done = std::move(done), status]() { done(status); });
}

const absl::Status& ShuttingDown() {
  static const absl::Status* status =
      new absl::Status(absl::UnavailableError("coordinator is shutting down"));
  return *status;
}

bool ValidWorkerId(const std::string& id) {
  static const std::regex re("[a-zA-Z0-9._-]{1,63}");
  return std::regex_match(id, re);
}

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
      watch_(store_.get()) {}

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
  AIDN_ASSIGN_OR_RETURN(std::vector<StoredJob> jobs, store_->LoadJobs());
  Deferred deferred;  // answers no one: nobody waits yet
  for (StoredJob& stored : jobs) LoadJob(std::move(stored), now, &deferred);
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::Worker> workers, store_->LoadWorkers());
  for (v1::Worker& w : workers) {
    WorkerEntry entry;
    entry.worker = std::move(w);
    // Every worker gets a full timeout from now to come back.
    entry.last_seen = now;
    workers_[entry.worker.info().id()] = std::move(entry);
  }
  AIDN_LOG(INFO) << "state loaded" << Kv("jobs", jobs_.size()) << Kv("workers", workers_.size())
                 << Kv("next_job", next_job_number_);
  return absl::OkStatus();
}

void Coordinator::LoadJob(StoredJob stored, Clock::TimePoint now, Deferred* deferred) {
  auto entry = std::make_unique<JobEntry>();
  entry->stored = std::move(stored);
  const Job& job = entry->stored.job;
  next_job_number_ = std::max(next_job_number_, entry->stored.number + 1);
  if (!IsTerminal(job.state())) {
    auth_->AddToken(entry->stored.trainer_token,
                    Principal{Role::kTrainer, "trainer:" + job.id(), job.id()});
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
  const absl::Status& closing = ShuttingDown();
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
      next = std::max(next + absl::FromChrono(interval), absl::Now());
    }
    FlushSteps();
  });
  const milliseconds held_period = std::min(interval, milliseconds(5));
  held_timer_ = std::thread([this, stop, held_period]() {
    while (!stop->WaitForNotificationWithTimeout(absl::FromChrono(held_period))) {
      AnswerDueHeartbeats();
    }
  });
}

void Coordinator::StopTicker() {
  absl::MutexLock lock(&ticker_mu_);
  if (!ticker_.joinable()) return;
  ticker_stop_->Notify();
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
  }
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

absl::StatusOr<JobEntry*> Coordinator::FindJob(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no such job: ", job_id));
  return it->second.get();
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

absl::StatusOr<JobEntry*> Coordinator::FencedJobToWaitOn(const std::string& job_id,
                                                         int64_t generation) {
  if (shutting_down_) return ShuttingDown();
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
  if (!s.ok()) AIDN_LOG(ERROR) << "could not store job: " << s << Kv("job", entry->stored.job.id());
  NotifyWatchers(entry->stored.job.id(), deferred);
  return s;
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
  PlacementsChanged();
  if (state == Job::RUNNING && !job.has_started_at()) {
    *job.mutable_started_at() = ToProto(clock_->WallNow());
  }
  if (IsTerminal(state)) {
    *job.mutable_finished_at() = ToProto(clock_->WallNow());
    auth_->RemoveToken(entry->stored.trainer_token);
  }
  absl::Status s = PersistJob(entry, deferred);
  Emit("job." + Lower(StateName(state)), job.id(), "", job.generation(), message, deferred);
  return s;
}

void Coordinator::NotifyWatchers(const std::string& job_id, Deferred* deferred) {
  deferred->Add([this, job_id]() { watchers_.Notify(job_id); });
}

void Coordinator::AssignmentsChanged(const std::set<std::string>& workers, Deferred* deferred) {
  assignments_version_++;
  const HeldHeartbeats::Builder build = HeartbeatBuilder();
  for (const std::string& id : workers) {
    if (workers_.contains(id)) held_.AnswerWorker(id, build, deferred);
  }
}

HeldHeartbeats::Builder Coordinator::HeartbeatBuilder() {
  return [this](const std::string& worker_id)
             ABSL_NO_THREAD_SAFETY_ANALYSIS { return BuildHeartbeat(worker_id); };
}

const std::vector<Coordinator::JobRef>& Coordinator::JobsOnWorker(const std::string& worker_id) {
  if (jobs_by_worker_stale_) {
    jobs_by_worker_.clear();
    for (auto& job : jobs_) {
      if (!HoldsSlots(job.second->stored.job.state())) continue;
      std::set<std::string> on;
      for (const v1::RankPlacement& p : job.second->stored.job.placement()) {
        if (on.insert(p.worker_id()).second) jobs_by_worker_[p.worker_id()].push_back(&job);
      }
    }
    jobs_by_worker_stale_ = false;
  }
  static const auto* const kNone = new std::vector<JobRef>();
  auto it = jobs_by_worker_.find(worker_id);
  return it == jobs_by_worker_.end() ? *kNone : it->second;
}

v1::HeartbeatResponse Coordinator::BuildHeartbeat(const std::string& worker_id) {
  v1::HeartbeatResponse response;
  for (const JobRef job_and_id : JobsOnWorker(worker_id)) {
    const std::string& job_id = job_and_id->first;
    const JobEntry* entry = job_and_id->second.get();
    const Job& job = entry->stored.job;
    for (const v1::RankPlacement& p : job.placement()) {
      if (p.worker_id() != worker_id) continue;
      v1::TrainerAssignment* a = response.add_assignments();
      a->set_job_id(job_id);
      a->set_generation(job.generation());
      a->set_rank(p.rank());
      a->set_world_size(job.spec().world_size());
      a->set_slot(p.slot());
      *a->mutable_spec() = job.spec();
      a->set_trainer_token(entry->stored.trainer_token);
    }
  }
  WorkerEntry& worker = workers_.at(worker_id);
  for (v1::StopOrder& stop : worker.pending_stops) *response.add_stops() = std::move(stop);
  worker.pending_stops.clear();
  response.set_assignments_version(assignments_version_);
  SetDuration(response.mutable_heartbeat_interval(), options_.heartbeat_interval);
  return response;
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
  // Steps still missing a rank will not get it from this generation.
  if (ingest_.EndGeneration(&entry->metrics)) NotifyWatchers(job.id(), deferred);
  AssignmentsChanged(workers, deferred);
}

void Coordinator::FailGeneration(JobEntry* entry, const std::string& reason, bool permanent,
                                 Deferred* deferred) {
  Job& job = entry->stored.job;
  if (!HoldsSlots(job.state())) return;
  const int64_t generation = job.generation();
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
  const bool any_waiting = std::any_of(
      jobs_.begin(), jobs_.end(), [](const auto& job) { return Waiting(job.second->stored.job); });
  if (!any_waiting) return;
  SlotTable slots = FreeSlots();
  std::vector<JobEntry*> queue;
  for (auto& [id, entry] : jobs_) {
    if (Waiting(entry->stored.job)) queue.push_back(entry.get());
  }
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
  for (const auto& [id, entry] : jobs_) {
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
  const std::vector<WorkerSlots> snapshot = slots->Snapshot([&](const std::string& id) {
    const Clock::TimePoint seen = workers_.at(id).last_seen;
    if (now - seen > job_timeout) return false;
    return !(entry->unconfirmed_workers.contains(id) && seen < entry->failed_at);
  });
  absl::StatusOr<std::vector<v1::RankPlacement>> placement =
      PlaceGang(GangRequestOf(job.spec()), snapshot);
  if (!placement.ok()) {
    const std::string reason(placement.status().message());
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
    Emit("worker.lost", "", id, 0, absl::StrCat("no heartbeat for ", FormatMillis(*silent)),
         deferred);
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

// ---------------------------------------------------------------------------
// CoordinatorService.

absl::StatusOr<Job> Coordinator::SubmitJob(v1::JobSpec spec, const std::string& owner) {
  ApplyJobSpecDefaults(options_.spec_limits, &spec);
  AIDN_RETURN_IF_ERROR(ValidateJobSpec(options_.spec_limits, spec));
  AIDN_ASSIGN_OR_RETURN(std::string token, RandomHex(24));

  Deferred deferred;
  absl::MutexLock lock(&mu_);
  auto entry = std::make_unique<JobEntry>();
  entry->stored.number = next_job_number_;
  entry->stored.trainer_token = token;
  Job& job = entry->stored.job;
  job.set_id(absl::StrCat("job-", next_job_number_));
  *job.mutable_spec() = std::move(spec);
  job.set_state(Job::PENDING);
  job.set_message("waiting to be scheduled");
  job.set_owner(owner);
  *job.mutable_created_at() = ToProto(clock_->WallNow());
  *job.mutable_updated_at() = job.created_at();
  AIDN_RETURN_IF_ERROR(store_->PutJob(entry->stored));
  next_job_number_++;
  const std::string id = job.id();
  auth_->AddToken(token, Principal{Role::kTrainer, "trainer:" + id, id});
  Emit("job.submitted", id, "", 0,
       absl::StrCat("world_size ", job.spec().world_size(), ", model ", job.spec().model().name(),
                    owner.empty() ? "" : ", by " + owner),
       &deferred);
  jobs_[id] = std::move(entry);
  Schedule(&deferred);
  return jobs_[id]->stored.job;
}

absl::StatusOr<Job> Coordinator::GetJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(job_id));
  return entry->stored.job;
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const v1::ListJobsRequest& request) {
  int page_size = request.page_size() <= 0 ? 100 : std::min(request.page_size(), 1000);
  int64_t below = INT64_MAX;
  if (!request.page_token().empty() &&
      (!absl::SimpleAtoi(request.page_token(), &below) || below <= 0)) {
    return absl::InvalidArgumentError("page_token: malformed");
  }
  std::set<int> states(request.states().begin(), request.states().end());
  const auto labels_match = [&request](const Job& job) {
    for (const auto& [k, v] : request.labels()) {
      auto it = job.spec().labels().find(k);
      if (it == job.spec().labels().end() || it->second != v) return false;
    }
    return true;
  };
  absl::MutexLock lock(&mu_);
  std::vector<const JobEntry*> matching;
  for (const auto& [id, entry] : jobs_) {
    const Job& job = entry->stored.job;
    if (entry->stored.number >= below) continue;
    if (!states.empty() && !states.contains(job.state())) continue;
    if (labels_match(job)) matching.push_back(entry.get());
  }
  std::sort(matching.begin(), matching.end(), [](const JobEntry* a, const JobEntry* b) {
    return a->stored.number > b->stored.number;
  });
  v1::ListJobsResponse response;
  for (size_t i = 0; i < matching.size() && static_cast<int>(i) < page_size; ++i) {
    *response.add_jobs() = matching[i]->stored.job;
  }
  if (static_cast<int>(matching.size()) > page_size) {
    response.set_next_page_token(absl::StrCat(matching[page_size - 1]->stored.number));
  }
  return response;
}

absl::StatusOr<Job> Coordinator::CancelJob(const std::string& job_id, const std::string& reason) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(job_id));
  Job& job = entry->stored.job;
  if (IsTerminal(job.state())) {
    return absl::FailedPreconditionError(
        absl::StrCat(job_id, " has already ended (", StateName(job.state()), ")"));
  }
  const std::string message = reason.empty() ? "cancelled by user" : "cancelled: " + reason;
  if (HoldsSlots(job.state())) {
    ReleaseGeneration(entry, message,
                      absl::FailedPreconditionError(absl::StrCat(job_id, " was cancelled")),
                      &deferred);
  }
  AIDN_RETURN_IF_ERROR(SetState(entry, Job::CANCELLED, message, &deferred));
  Schedule(&deferred);
  return job;
}

v1::ListWorkersResponse Coordinator::ListWorkers() {
  absl::MutexLock lock(&mu_);
  v1::ListWorkersResponse response;
  for (const auto& [id, w] : workers_) *response.add_workers() = WorkerView(id, w);
  return response;
}

v1::Worker Coordinator::WorkerView(const std::string& id, const WorkerEntry& w) {
  v1::Worker worker = w.worker;
  std::set<std::string> job_ids;
  for (const JobRef job_and_id : JobsOnWorker(id)) {
    const Job& job = job_and_id->second->stored.job;
    for (const v1::RankPlacement& p : job.placement()) {
      if (p.worker_id() != id) continue;
      job_ids.insert(job_and_id->first);
      if (job.spec().device() == v1::JobSpec::GPU) {
        worker.set_gpus_used(worker.gpus_used() + 1);
      } else {
        worker.set_cpu_slots_used(worker.cpu_slots_used() +
                                  std::max(1, job.spec().threads_per_rank()));
      }
    }
  }
  for (const std::string& j : job_ids) worker.add_job_ids(j);
  return worker;
}

absl::StatusOr<v1::ListCheckpointsResponse> Coordinator::ListCheckpoints(
    const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  AIDN_RETURN_IF_ERROR(FindJob(job_id).status());
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::Checkpoint> checkpoints, store_->ListCheckpoints(job_id));
  v1::ListCheckpointsResponse response;
  for (v1::Checkpoint& c : checkpoints) *response.add_checkpoints() = std::move(c);
  return response;
}

absl::StatusOr<v1::ListEventsResponse> Coordinator::ListEvents(
    const v1::ListEventsRequest& request) {
  const int limit = request.limit() <= 0 ? 1000 : std::min(request.limit(), 10000);
  absl::MutexLock lock(&mu_);
  if (!request.job_id().empty()) AIDN_RETURN_IF_ERROR(FindJob(request.job_id()).status());
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::Event> events,
                        store_->ListEvents(request.job_id(), request.after_seq(), limit));
  v1::ListEventsResponse response;
  for (v1::Event& e : events) *response.add_events() = std::move(e);
  return response;
}

absl::StatusOr<v1::GetMetricsResponse> Coordinator::GetMetrics(
    const v1::GetMetricsRequest& request) {
  const int limit = request.limit() <= 0 ? 10000 : std::min(request.limit(), 100000);
  if (request.from_step() < 0 || request.to_step() < 0) {
    return absl::InvalidArgumentError("from_step, to_step: must be >= 0");
  }
  {
    absl::MutexLock lock(&mu_);
    AIDN_RETURN_IF_ERROR(FindJob(request.job_id()).status());
  }
  FlushSteps();
  AIDN_ASSIGN_OR_RETURN(
      std::vector<v1::StepMetrics> steps,
      store_->GetSteps(request.job_id(), request.from_step(), request.to_step(), limit));
  v1::GetMetricsResponse response;
  for (v1::StepMetrics& step : steps) *response.add_steps() = std::move(step);
  return response;
}

absl::Status Coordinator::Subscribe(const std::string& job_id, WatchSubscriber* subscriber) {
  {
    absl::MutexLock lock(&mu_);
    AIDN_RETURN_IF_ERROR(FindJob(job_id).status());
  }
  watchers_.Add(job_id, subscriber);
  return absl::OkStatus();
}

void Coordinator::Unsubscribe(const std::string& job_id, WatchSubscriber* subscriber) {
  watchers_.Remove(job_id, subscriber);
}

absl::StatusOr<WatchBatch> Coordinator::PollWatch(const v1::WatchJobRequest& request,
                                                  WatchCursor* cursor) {
  if (cursor->next_step < 0) cursor->next_step = std::max<int64_t>(request.from_step(), 0);
  WatchBatch batch;
  bool terminal = false;
  bool quiet = true;  // nothing new but possibly steps
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return ShuttingDown();
    AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(request.job_id()));
    const StepLog* steps = entry->metrics.steps.get();
    AIDN_ASSIGN_OR_RETURN(bool added, watch_.PollMemory(request, entry->stored.job, entry->version,
                                                        steps, cursor, &batch));
    if (added) quiet = false;
    terminal = IsTerminal(entry->stored.job.state()) && (steps == nullptr || steps->pending() == 0);
  }
  if (request.include_metrics() && cursor->catching_up) {
    const size_t before = batch.items.size();
    AIDN_RETURN_IF_ERROR(CatchUpFromStore(request, cursor, &batch));
    if (batch.items.size() != before) quiet = false;
  }
  batch.finished = terminal && quiet && !(request.include_metrics() && cursor->catching_up);
  return batch;
}

absl::Status Coordinator::CatchUpFromStore(const v1::WatchJobRequest& request, WatchCursor* cursor,
                                           WatchBatch* batch) {
  // Under flush_mu_ from the flush to reading stored_seq: no other flush
  // can store steps in between, so every step numbered after stored_seq is
  // still only in memory, and none is sent twice.
  absl::MutexLock flush(&flush_mu_);
  FlushStepsLocked();
  AIDN_ASSIGN_OR_RETURN(bool done, watch_.ReadStored(request, cursor, batch));
  if (done) {
    absl::MutexLock lock(&mu_);
    AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(request.job_id()));
    cursor->catching_up = false;
    cursor->metrics_seq = entry->metrics.stored_seq;
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// ClusterService: workers.

absl::StatusOr<v1::RegisterWorkerResponse> Coordinator::RegisterWorker(
    const v1::RegisterWorkerRequest& request) {
  const v1::WorkerInfo& info = request.info();
  if (!ValidWorkerId(info.id())) {
    return absl::InvalidArgumentError(
        absl::StrCat("info.id: must match [a-zA-Z0-9._-]{1,63}, got \"", info.id(), "\""));
  }
  if (info.cpu_slots() < 0 || info.cpu_slots() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("info.cpu_slots: must be in [0, 4096], got ", info.cpu_slots()));
  }
  if (info.gpus_size() > 64) return absl::InvalidArgumentError("info.gpus: at most 64");
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = workers_.try_emplace(info.id());
  WorkerEntry& w = it->second;
  const bool was_lost = !inserted && w.worker.state() == v1::Worker::LOST;
  *w.worker.mutable_info() = info;
  if (w.worker.info().address().empty()) w.worker.mutable_info()->set_address(info.hostname());
  w.worker.set_state(v1::Worker::ALIVE);
  *w.worker.mutable_registered_at() = ToProto(clock_->WallNow());
  *w.worker.mutable_last_heartbeat() = w.worker.registered_at();
  w.last_seen = clock_->Now();
  PersistWorker(w);
  Emit(inserted ? "worker.registered" : (was_lost ? "worker.back" : "worker.reregistered"), "",
       info.id(), 0,
       absl::StrCat(info.cpu_slots(), " cpu slots, ", info.gpus_size(), " gpus at ",
                    w.worker.info().address()),
       &deferred);
  if (!inserted) FailGenerationsWithoutTrainers(request, &deferred);
  Schedule(&deferred);
  v1::RegisterWorkerResponse response;
  response.set_worker_id(info.id());
  SetDuration(response.mutable_heartbeat_interval(), options_.heartbeat_interval);
  SetDuration(response.mutable_worker_timeout(), options_.worker_timeout);
  return response;
}

void Coordinator::FailGenerationsWithoutTrainers(const v1::RegisterWorkerRequest& request,
                                                 Deferred* deferred) {
  // A worker that restarted lost its trainers (they die with it): running
  // generations with ranks there cannot go on.
  const std::string& worker_id = request.info().id();
  std::set<std::pair<std::string, int>> alive;
  for (const v1::TrainerStatus& t : request.trainers()) {
    alive.insert({absl::StrCat(t.job_id(), "#", t.generation()), t.rank()});
  }
  for (auto& [job_id, entry] : jobs_) {
    const Job& job = entry->stored.job;
    if (job.state() != Job::RUNNING) continue;
    for (const v1::RankPlacement& p : job.placement()) {
      if (p.worker_id() != worker_id) continue;
      if (!alive.contains({absl::StrCat(job_id, "#", job.generation()), p.rank()})) {
        FailGeneration(entry.get(),
                       absl::StrCat("worker ", worker_id, " re-registered without rank ", p.rank(),
                                    " (its trainer is gone)"),
                       false, deferred);
        break;
      }
    }
  }
}

void Coordinator::Heartbeat(const v1::HeartbeatRequest& request, HeartbeatCallback done) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return AnswerLater(&deferred, std::move(done), ShuttingDown());
  auto it = workers_.find(request.worker_id());
  if (it == workers_.end()) {
    return AnswerLater(&deferred, std::move(done),
                       absl::NotFoundError(absl::StrCat("unknown worker ", request.worker_id(),
                                                        "; register again")));
  }
  WorkerEntry& w = it->second;
  w.last_seen = clock_->Now();
  *w.worker.mutable_last_heartbeat() = ToProto(clock_->WallNow());
  if (w.worker.state() != v1::Worker::ALIVE) {
    w.worker.set_state(v1::Worker::ALIVE);
    PersistWorker(w);
    Emit("worker.back", "", request.worker_id(), 0, "heartbeats resumed", &deferred);
    Schedule(&deferred);
  }
  const milliseconds max_wait = std::min(ToMillis(request.max_wait()), options_.heartbeat_interval);
  if (max_wait.count() > 0 && request.assignments_version() == assignments_version_ &&
      w.pending_stops.empty()) {
    held_.Hold(request.worker_id(), clock_->Now() + max_wait, std::move(done));
    return;
  }
  v1::HeartbeatResponse response = BuildHeartbeat(request.worker_id());
  deferred.Add([done = std::move(done), response = std::move(response)]() { done(response); });
}

absl::Status Coordinator::ReportTrainerExit(const v1::ReportTrainerExitRequest& request) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(request.job_id()));
  Job& job = entry->stored.job;
  const bool current = request.generation() == job.generation() && HoldsSlots(job.state());
  std::string what = request.signal() != 0 ? absl::StrCat("killed by signal ", request.signal())
                                           : absl::StrCat("exited with code ", request.exit_code());
  const bool clean = request.exit_code() == 0 && request.signal() == 0;
  // A clean exit's last log line is no reason for anything.
  const std::string tail = clean ? "" : LastLine(request.stderr_tail());
  std::string message = absl::StrCat("rank ", request.rank(), " on worker ", request.worker_id(),
                                     " ", what, tail.empty() ? "" : ": " + tail);
  Emit("trainer.exited", job.id(), request.worker_id(), request.generation(), message, &deferred);
  if (!current || request.stopped_by_order()) return absl::OkStatus();
  if (!clean) {
    FailGeneration(entry, message, request.permanent(), &deferred);
    Schedule(&deferred);
    return absl::OkStatus();
  }
  entry->exited_ok.insert(request.rank());
  if (static_cast<int>(entry->exited_ok.size()) >= job.spec().world_size()) {
    ReleaseGeneration(entry, "job succeeded",
                      absl::FailedPreconditionError(absl::StrCat(job.id(), " has succeeded")),
                      &deferred);
    (void)SetState(entry, Job::SUCCEEDED,
                   absl::StrCat("all ", job.spec().world_size(), " ranks exited 0"), &deferred);
    Schedule(&deferred);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// ClusterService: trainers.

void Coordinator::JoinRendezvous(const v1::JoinRendezvousRequest& request,
                                 Rendezvous::Callback done) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<JobEntry*> found = FencedJobToWaitOn(request.job_id(), request.generation());
  if (!found.ok()) return AnswerLater(&deferred, std::move(done), found.status());
  JobEntry* entry = *found;
  Job& job = entry->stored.job;
  v1::RankPlacement* placed = nullptr;
  for (v1::RankPlacement& p : *job.mutable_placement()) {
    if (p.rank() == request.rank()) placed = &p;
  }
  if (placed == nullptr) {
    return AnswerLater(
        &deferred, std::move(done),
        absl::InvalidArgumentError(absl::StrCat("rank: must be in [0, ", job.spec().world_size(),
                                                "), got ", request.rank())));
  }
  if (!request.worker_id().empty() && request.worker_id() != placed->worker_id()) {
    return AnswerLater(&deferred, std::move(done),
                       absl::FailedPreconditionError(absl::StrCat(
                           "rank ", request.rank(), " of ", request.job_id(), " is placed on ",
                           placed->worker_id(), ", not ", request.worker_id())));
  }
  v1::Peer peer;
  peer.set_rank(request.rank());
  peer.set_worker_id(placed->worker_id());
  peer.set_address(request.address());
  entry->rendezvous->Join(peer, std::move(done), &deferred);
  if (!entry->rendezvous->AllJoined() || entry->rendezvous->completed()) return;

  v1::JoinRendezvousResponse base;
  base.set_world_size(job.spec().world_size());
  base.set_generation(job.generation());
  *base.mutable_spec() = job.spec();
  for (const v1::Peer& p : entry->rendezvous->Peers()) {
    *base.add_peers() = p;
    for (v1::RankPlacement& rp : *job.mutable_placement()) {
      if (rp.rank() == p.rank()) rp.set_address(p.address());
    }
  }
  checkpoints_.FillResume(job, &entry->checkpoints, &base);
  entry->health.last_advance = clock_->Now();
  entry->health.running_since = entry->health.last_advance;
  (void)SetState(
      entry, Job::RUNNING,
      absl::StrCat("all ", job.spec().world_size(), " ranks joined generation ", job.generation()),
      &deferred);
  entry->rendezvous->Complete(base, &deferred);
}

absl::Status Coordinator::KvSet(const v1::KvSetRequest& request) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FencedJob(request.job_id(), request.generation()));
  return entry->kv->Set(request.key(), request.value(), &deferred);
}

void Coordinator::KvGet(const v1::KvGetRequest& request, KvGetCallback done) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<JobEntry*> found = FencedJobToWaitOn(request.job_id(), request.generation());
  if (!found.ok()) return AnswerLater(&deferred, std::move(done), found.status());
  KvStore* kv = (*found)->kv.get();
  const milliseconds wait = std::min(ToMillis(request.wait()), options_.max_kv_wait);
  if (wait.count() <= 0) {
    absl::StatusOr<std::string> value = kv->Get(request.key());
    v1::KvGetResponse response;
    if (value.ok()) {
      response.set_found(true);
      response.set_value(*std::move(value));
    } else if (value.status().code() != absl::StatusCode::kNotFound) {
      return AnswerLater(&deferred, std::move(done), value.status());
    }
    deferred.Add([done = std::move(done), response = std::move(response)]() { done(response); });
    return;
  }
  kv->WaitFor(
      request.key(), clock_->Now() + wait,
      [done = std::move(done)](absl::StatusOr<std::string> value) {
        if (!value.ok()) {
          done(value.status());
          return;
        }
        v1::KvGetResponse response;
        response.set_found(true);
        response.set_value(*std::move(value));
        done(response);
      },
      &deferred);
}

absl::StatusOr<v1::KvAddResponse> Coordinator::KvAdd(const v1::KvAddRequest& request) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FencedJob(request.job_id(), request.generation()));
  AIDN_ASSIGN_OR_RETURN(int64_t value, entry->kv->Add(request.key(), request.delta(), &deferred));
  v1::KvAddResponse response;
  response.set_value(value);
  return response;
}

absl::StatusOr<v1::KvCompareAndSetResponse> Coordinator::KvCompareAndSet(
    const v1::KvCompareAndSetRequest& request) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FencedJob(request.job_id(), request.generation()));
  AIDN_ASSIGN_OR_RETURN(CasResult cas,
                        entry->kv->CompareAndSet(request.key(), request.expect_absent(),
                                                 request.expected(), request.desired(), &deferred));
  v1::KvCompareAndSetResponse response;
  response.set_swapped(cas.swapped);
  response.set_found(cas.found);
  response.set_current(std::move(cas.current));
  return response;
}

absl::StatusOr<v1::ReportProgressResponse> Coordinator::ReportProgress(
    const v1::ReportProgressRequest& request) {
  if (request.total_steps() < 0) return absl::InvalidArgumentError("total_steps: must be >= 0");
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FencedJob(request.job_id(), request.generation()));
  if (request.rank() < 0 || request.rank() >= entry->stored.job.spec().world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: out of range: ", request.rank()));
  }
  FailureDetector::Beat(&entry->health, request.rank(), request.step(), request.collective_seq(),
                        clock_->Now());
  // Kept in memory; persisted with the job's next state change.
  Job& job = entry->stored.job;
  if (request.step() >= job.last_step()) {
    job.set_last_step(request.step());
    job.set_epoch(request.epoch());
  }
  if (request.total_steps() > 0 && request.total_steps() != job.total_steps()) {
    job.set_total_steps(request.total_steps());
    ++entry->version;
    NotifyWatchers(job.id(), &deferred);
  }
  v1::ReportProgressResponse response;
  response.set_incarnation(incarnation_);
  return response;
}

absl::Status Coordinator::AppendMetrics(const v1::StreamMetricsRequest& request) {
  if (request.records_size() > 10000) {
    return absl::InvalidArgumentError("records: at most 10000 per message");
  }
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FencedJob(request.job_id(), request.generation()));
  Job& job = entry->stored.job;
  if (request.rank() < 0 || request.rank() >= job.spec().world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: out of range: ", request.rank()));
  }
  const bool combined =
      ingest_.Append(job, &entry->metrics, request, clock_->Now(), [&](const v1::MetricRecord& r) {
        // What the rank itself spent: in DDP the others wait for a slow rank
        // in the allreduce, so their step_seconds are as long as its.
        FailureDetector::AddStepTime(
            &entry->health, r.rank(),
            r.compute_seconds() > 0 ? r.compute_seconds() : r.step_seconds());
        if (r.step() >= job.last_step()) {
          job.set_last_step(r.step());
          job.set_epoch(r.epoch());
        }
      });
  if (combined) NotifyWatchers(request.job_id(), &deferred);
  return absl::OkStatus();
}

absl::StatusOr<v1::StreamMetricsResponse> Coordinator::MetricsReceipt(const std::string& job_id) {
  // No flush here: a receipt per stream would put a SQLite transaction on
  // every StreamMetrics call. The answer covers what the ticker's batched
  // flushes stored so far; the sender keeps the rest and learns of it from
  // a later receipt. Only mu_: steps a flush took out of the log but has not
  // stored (in flight, or failed and waiting for the next flush) are known
  // to the ingest until a flush stores them.
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(job_id));
  v1::StreamMetricsResponse response;
  response.set_durable_step(ingest_.DurableStep(entry->stored.job, entry->metrics));
  response.set_incarnation(incarnation_);
  return response;
}

// ---------------------------------------------------------------------------
// Checkpoints.

absl::StatusOr<v1::CommitCheckpointResponse> Coordinator::CommitCheckpoint(
    const v1::CommitCheckpointRequest& request) {
  AIDN_RETURN_IF_ERROR(CheckpointRegistry::ValidateCommit(request));
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FencedJob(request.job_id(), request.generation()));
  Job& job = entry->stored.job;
  AIDN_ASSIGN_OR_RETURN(CommitOutcome outcome, checkpoints_.Commit(job, request));
  v1::CommitCheckpointResponse response;
  response.set_committed(outcome.committed);
  if (!outcome.newly_committed) return response;
  Emit("checkpoint.committed", job.id(), "", job.generation(),
       absl::StrCat("step ", request.step(), " at ", request.path()), &deferred);
  for (int64_t step : checkpoints_.ApplyRetention(job, entry->checkpoints, &outcome.checkpoints)) {
    response.add_retired_steps(step);
  }
  job.set_last_checkpoint_step(CheckpointRegistry::NewestValidStep(outcome.checkpoints));
  (void)PersistJob(entry, &deferred);
  return response;
}

absl::Status Coordinator::ReportCheckpointInvalid(
    const v1::ReportCheckpointInvalidRequest& request) {
  if (request.step() < 0) return absl::InvalidArgumentError("step: must be >= 0");
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FencedJob(request.job_id(), request.generation()));
  Job& job = entry->stored.job;
  if (request.rank() < 0 || request.rank() >= job.spec().world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: out of range: ", request.rank()));
  }
  AIDN_ASSIGN_OR_RETURN(InvalidOutcome outcome,
                        checkpoints_.MarkInvalid(job, &entry->checkpoints, request));
  if (outcome.already) return absl::OkStatus();
  if (outcome.newest_valid_step != job.last_checkpoint_step()) {
    job.set_last_checkpoint_step(outcome.newest_valid_step);
    (void)PersistJob(entry, &deferred);
  }
  Emit("checkpoint.invalid", job.id(), WorkerOfRank(job, request.rank()), job.generation(),
       absl::StrCat("step ", request.step(), " (", outcome.path, ") failed verification on rank ",
                    request.rank(), ": ", outcome.reason),
       &deferred);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Prometheus.

void Coordinator::CollectMetrics() {
  absl::MutexLock lock(&mu_);
  const Clock::TimePoint now = clock_->Now();
  std::map<Job::State, int> by_state;
  for (int s = Job::PENDING; s <= Job::CANCELLED; ++s) by_state[static_cast<Job::State>(s)] = 0;
  for (auto& [id, entry] : jobs_) {
    ++by_state[entry->stored.job.state()];
    ingest_.CollectJob(entry->stored.job, &entry->metrics, entry->health, now);
  }
  for (const auto& [state, count] : by_state) {
    metrics_.jobs.Add({{"state", StateName(state)}}).Set(count);
  }
  CollectWorkerSeries(now);
}

void Coordinator::CollectWorkerSeries(Clock::TimePoint now) {
  for (const auto& [id, w] : workers_) {
    const v1::Worker worker = WorkerView(id, w);
    const bool alive = worker.state() != v1::Worker::LOST;
    const metrics::Labels labels{{"worker_id", id}};
    metrics_.worker_up.Add(labels).Set(alive ? 1 : 0);
    metrics_.worker_heartbeat_age_seconds.Add(labels).Set(
        std::chrono::duration<double>(now - w.last_seen).count());
    const std::pair<const char*, std::pair<int, int>> kinds[] = {
        {"cpu", {worker.info().cpu_slots(), worker.cpu_slots_used()}},
        {"gpu", {worker.info().gpus_size(), worker.gpus_used()}}};
    for (const auto& [kind, total_used] : kinds) {
      const metrics::Labels slot_labels{{"worker_id", id}, {"kind", kind}};
      const auto [total, in_use] = total_used;
      metrics_.worker_slots.Add(slot_labels).Set(total);
      metrics_.worker_slots_used.Add(slot_labels).Set(in_use);
      metrics_.worker_slots_free.Add(slot_labels).Set(alive ? std::max(total - in_use, 0) : 0);
    }
  }
}

}  // namespace aidn::coordinator
