#include "coordinator/coordinator.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <iterator>
#include <optional>
#include <regex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/status.h"
#include "common/token.h"
#include "coordinator/job_state.h"
#include "coordinator/scheduler.h"

namespace aidn::coordinator {
namespace {

using std::chrono::milliseconds;
using v1::Job;

google::protobuf::Timestamp ToProto(absl::Time t) {
  google::protobuf::Timestamp ts;
  const int64_t nanos = absl::ToUnixNanos(t);
  ts.set_seconds(nanos / 1'000'000'000);
  ts.set_nanos(static_cast<int32_t>(nanos % 1'000'000'000));
  return ts;
}

milliseconds ToMillis(const google::protobuf::Duration& d) {
  return milliseconds(d.seconds() * 1000 + d.nanos() / 1'000'000);
}

std::string FormatMillis(milliseconds ms) {
  if (ms.count() % 1000 == 0) return absl::StrCat(ms.count() / 1000, "s");
  return absl::StrCat(static_cast<double>(ms.count()) / 1000.0, "s");
}

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

// The longest restart backoff, and the default for specs stored before
// timeouts.restart_backoff existed.
constexpr milliseconds kMaxRestartBackoff{5 * 60 * 1000};
constexpr milliseconds kDefaultRestartBackoff{1000};
// The automatic progress timeout: at least this, and this many median steps.
constexpr milliseconds kMinAutoProgressTimeout{60'000};
constexpr double kAutoProgressSteps = 10;
// A hung generation's rank is "silent" after this many beat intervals
// without a beat.
constexpr int kSilentBeats = 3;
// Stragglers: the window of step times per rank, how many a rank needs
// before it is judged, and how much slower than the others' median is too
// slow.
constexpr size_t kStragglerWindow = 50;
constexpr size_t kStragglerMinSamples = 20;
constexpr double kStragglerRatio = 1.5;
// Hysteresis, so that noise around 1.5x does not flap: a straggler recovers
// below 1.2x, and a rank's state changes at most once per window of its own
// new steps.
constexpr double kRecoveredRatio = 1.2;
// A checkpoint's invalid_reason is at most this long.
constexpr size_t kMaxInvalidReason = 1024;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  const double upper = v[mid];
  if (v.size() % 2 == 1) return upper;
  const double lower = *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid));
  return (lower + upper) / 2;
}

// The median of `sorted` without its element at index `skip`.
double MedianWithout(const std::vector<double>& sorted, size_t skip) {
  const size_t n = sorted.size() - 1;
  auto at = [&](size_t j) { return sorted[j < skip ? j : j + 1]; };
  if (n % 2 == 1) return at(n / 2);
  return (at(n / 2 - 1) + at(n / 2)) / 2;
}

// "rank 3" or "ranks 0, 1, 2".
std::string RankList(const std::vector<int>& ranks) {
  constexpr size_t kMaxNamed = 16;
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < kMaxNamed; ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ", ", ranks[i]);
  }
  if (ranks.size() > kMaxNamed) absl::StrAppend(&out, " and ", ranks.size() - kMaxNamed, " more");
  return out;
}

bool Valid(const v1::Checkpoint& c) { return c.committed() && c.invalid_reason().empty(); }

// The step of the newest committed checkpoint that is not known to be
// invalid, 0 if there is none.
int64_t NewestValidStep(const std::vector<v1::Checkpoint>& checkpoints) {
  int64_t newest = 0;
  for (const v1::Checkpoint& c : checkpoints) {
    if (Valid(c)) newest = std::max(newest, c.step());
  }
  return newest;
}

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
      store_(std::move(store)) {}

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
  for (StoredJob& stored : jobs) {
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
      entry->last_advance = now;
      entry->running_since = now;
      if (job.state() == Job::RUNNING) {
        // The rendezvous had completed before the restart: rebuild its answer
        // so a trainer that retries its join gets the same peers.
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
              peer, [](absl::StatusOr<v1::JoinRendezvousResponse>) {}, &deferred);
          *base.add_peers() = peer;
        }
        FillResume(entry.get(), &base);
        entry->rendezvous->Complete(base, &deferred);
        // Where the generation's stored steps end: its trainers send again
        // the records the last process may not have stored.
        absl::StatusOr<std::optional<v1::StepMetrics>> last = store_->LastStepOfGeneration(
            job.id(), job.generation(), std::max<int64_t>(entry->resumed_from_step - 1, -1));
        if (!last.ok()) {
          AIDN_LOG(ERROR) << "could not find the job's stored steps: " << last.status()
                          << Kv("job", job.id());
        } else {
          entry->resent_generation = job.generation();
          entry->resent_first_step = std::max<int64_t>(entry->resumed_from_step, 0) + 1;
          if (last->has_value()) {
            NoteStored(entry.get(), **last);
            entry->resent_floor = entry->stored_key;
            entry->resent_first_step = (*last)->step() + 1;
          }
        }
      }
    }
    if (job.state() == Job::RESTARTING) entry->restart_at = now + RestartDelay(job);
    jobs_[job.id()] = std::move(entry);
  }
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
  for (auto& [id, w] : workers_) {
    for (HeldHeartbeat& h : w.held) {
      deferred.Add([done = std::move(h.done), closing]() { done(closing); });
    }
    w.held.clear();
  }
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
    if (entry->step_window_changed) CheckStragglers(entry.get(), &deferred);
    if (entry->steps == nullptr) continue;
    const int64_t before = entry->steps->last_seq();
    entry->steps->Expire(now, /*everything=*/false);
    if (entry->steps->last_seq() != before) NotifyWatchers(id, &deferred);
    // A finished job's steps are all in the store; past the retention
    // period, watchers read them back from there.
    if (IsTerminal(entry->stored.job.state()) && !entry->steps->has_unstored() &&
        entry->stored_seq == entry->steps->last_seq() && PastRetention(entry->stored.job)) {
      entry->steps.reset();
    }
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
  std::vector<Store::JobStep> batch;
  batch.swap(failed_steps_);
  std::vector<std::pair<std::string, int64_t>> taken;
  taken.swap(failed_taken_);
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, entry] : jobs_) {
      if (entry->steps == nullptr || !entry->steps->has_unstored()) continue;
      std::vector<v1::StepMetrics> steps;
      const int64_t seq = entry->steps->TakeUnstored(&steps);
      for (v1::StepMetrics& step : steps) batch.push_back({id, std::move(step)});
      taken.emplace_back(id, seq);
    }
    // Out of the logs, not yet in the store: not durable (MetricsReceipt).
    unstored_first_step_.clear();
    for (const Store::JobStep& j : batch) {
      auto [it, inserted] = unstored_first_step_.emplace(j.job_id, j.step.step());
      if (!inserted) it->second = std::min(it->second, j.step.step());
    }
  }
  if (batch.empty()) return;
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = store_->PutSteps(batch);
  metrics_.store_batch_seconds.Observe(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (!s.ok()) {
    // Kept for the next flush; watchers still get them from memory.
    constexpr size_t kMaxFailed = 1'000'000;
    if (batch.size() > kMaxFailed) {
      metrics_.records_dropped.Increment(static_cast<double>(batch.size() - kMaxFailed));
      batch.erase(batch.begin(), batch.end() - kMaxFailed);
    }
    AIDN_LOG(ERROR) << "could not store metric steps; will retry" << Kv("steps", batch.size())
                    << Kv("error", s);
    failed_steps_ = std::move(batch);
    failed_taken_ = std::move(taken);
    // unstored_first_step_ stays: those steps are retried first.
    return;
  }
  metrics_.steps_stored.Increment(static_cast<double>(batch.size()));
  absl::MutexLock lock(&mu_);
  unstored_first_step_.clear();
  for (auto& [id, seq] : taken) {
    auto it = jobs_.find(id);
    if (it != jobs_.end()) it->second->stored_seq = std::max(it->second->stored_seq, seq);
  }
  for (const Store::JobStep& s : batch) {
    auto it = jobs_.find(s.job_id);
    if (it != jobs_.end()) NoteStored(it->second.get(), s.step);
  }
}

// ---------------------------------------------------------------------------
// Internal helpers.

absl::StatusOr<Coordinator::JobEntry*> Coordinator::FindJob(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no such job: ", job_id));
  return it->second.get();
}

absl::StatusOr<Coordinator::JobEntry*> Coordinator::FencedJob(const std::string& job_id,
                                                              int64_t generation) {
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

absl::StatusOr<Coordinator::JobEntry*> Coordinator::FencedJobToWaitOn(const std::string& job_id,
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
  deferred->Add([this, job_id]() {
    absl::MutexLock lock(&watch_mu_);
    auto it = watchers_.find(job_id);
    if (it == watchers_.end()) return;
    for (WatchSubscriber* s : it->second) s->Notify();
  });
}

milliseconds Coordinator::JobWorkerTimeout(const JobEntry& entry) const {
  const auto& d = entry.stored.job.spec().timeouts().worker();
  milliseconds ms = ToMillis(d);
  return ms.count() > 0 ? ms : options_.worker_timeout;
}

void Coordinator::AssignmentsChanged(const std::set<std::string>& workers, Deferred* deferred) {
  assignments_version_++;
  for (const std::string& id : workers) {
    auto it = workers_.find(id);
    if (it == workers_.end() || it->second.held.empty()) continue;
    WorkerEntry& worker = it->second;
    std::vector<HeldHeartbeat> held;
    held.swap(worker.held);
    for (HeldHeartbeat& h : held) {
      v1::HeartbeatResponse response = BuildHeartbeat(&worker);
      deferred->Add(
          [done = std::move(h.done), response = std::move(response)]() { done(response); });
    }
  }
}

const std::vector<std::pair<const std::string, std::unique_ptr<Coordinator::JobEntry>>*>&
Coordinator::JobsOnWorker(const std::string& worker_id) {
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
  static const auto* const kNone =
      new std::vector<std::pair<const std::string, std::unique_ptr<JobEntry>>*>();
  auto it = jobs_by_worker_.find(worker_id);
  return it == jobs_by_worker_.end() ? *kNone : it->second;
}

v1::HeartbeatResponse Coordinator::BuildHeartbeat(WorkerEntry* worker) {
  v1::HeartbeatResponse response;
  const std::string& worker_id = worker->worker.info().id();
  for (const auto* job_and_id : JobsOnWorker(worker_id)) {
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
  for (v1::StopOrder& stop : worker->pending_stops) *response.add_stops() = std::move(stop);
  worker->pending_stops.clear();
  response.set_assignments_version(assignments_version_);
  const int64_t ms = options_.heartbeat_interval.count();
  response.mutable_heartbeat_interval()->set_seconds(ms / 1000);
  response.mutable_heartbeat_interval()->set_nanos(static_cast<int32_t>(ms % 1000) * 1'000'000);
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
  entry->beats.clear();
  entry->step_window.clear();
  entry->step_window_changed = false;
  entry->stragglers.clear();
  entry->step_samples.clear();
  entry->straggler_changed_at.clear();
  // Steps still missing a rank will not get it from this generation.
  if (entry->steps != nullptr) {
    entry->steps->Expire(Clock::TimePoint::max(), /*everything=*/true);
    NotifyWatchers(job.id(), deferred);
  }
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
  for (const v1::RankPlacement& p : job.placement())
    entry->unconfirmed_workers.insert(p.worker_id());
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

void Coordinator::Schedule(Deferred* deferred) {
  // Nothing waits for slots (the usual case on a tick): the workers need not
  // be looked at. Building their free-slot table costs O(workers) under mu_,
  // every tick and on every registration (10,000 registrations: O(n^2)).
  const bool any_waiting = std::any_of(jobs_.begin(), jobs_.end(), [](const auto& job) {
    const Job::State state = job.second->stored.job.state();
    return state == Job::PENDING || state == Job::RESTARTING;
  });
  if (!any_waiting) return;
  // Free slots of alive workers, from the placements of jobs holding slots.
  std::map<std::string, WorkerSlots> slots;
  for (const auto& [id, w] : workers_) {
    if (w.worker.state() != v1::Worker::ALIVE) continue;
    WorkerSlots& ws = slots[id];
    ws.worker_id = id;
    ws.cpu_used.assign(std::max(0, w.worker.info().cpu_slots()), false);
    ws.gpu_used.assign(w.worker.info().gpus_size(), false);
  }
  auto mark_used = [&slots](const Job& job) {
    const bool gpu = job.spec().device() == v1::JobSpec::GPU;
    const int k = gpu ? 1 : std::max(1, job.spec().threads_per_rank());
    for (const v1::RankPlacement& p : job.placement()) {
      auto it = slots.find(p.worker_id());
      if (it == slots.end()) continue;
      std::vector<bool>& used = gpu ? it->second.gpu_used : it->second.cpu_used;
      for (int s = p.slot(); s < p.slot() + k && s < static_cast<int>(used.size()); ++s) {
        if (s >= 0) used[s] = true;
      }
    }
  };
  std::vector<JobEntry*> queue;
  for (auto& [id, entry] : jobs_) {
    const Job& job = entry->stored.job;
    if (HoldsSlots(job.state())) mark_used(job);
    if (job.state() == Job::PENDING || job.state() == Job::RESTARTING) {
      queue.push_back(entry.get());
    }
  }
  std::sort(queue.begin(), queue.end(), [](const JobEntry* a, const JobEntry* b) {
    if (a->stored.job.spec().priority() != b->stored.job.spec().priority()) {
      return a->stored.job.spec().priority() > b->stored.job.spec().priority();
    }
    return a->stored.number < b->stored.number;
  });

  for (JobEntry* entry : queue) {
    Job& job = entry->stored.job;
    const Clock::TimePoint now = clock_->Now();
    // Backing off before a restart; it does not hold up the jobs behind it.
    if (job.state() == Job::RESTARTING && now < entry->restart_at) continue;
    // Only workers heard from within this job's worker timeout: one silent
    // longer would fail the new generation on the next tick again.
    const milliseconds job_timeout = JobWorkerTimeout(*entry);
    std::vector<WorkerSlots> snapshot;
    for (const auto& [id, ws] : slots) {
      const Clock::TimePoint seen = workers_.at(id).last_seen;
      if (now - seen > job_timeout) continue;
      if (entry->unconfirmed_workers.contains(id) && seen < entry->failed_at) continue;
      snapshot.push_back(ws);
    }
    GangRequest request;
    request.world_size = job.spec().world_size();
    request.gpu = job.spec().device() == v1::JobSpec::GPU;
    request.slots_per_rank = job.spec().threads_per_rank();
    absl::StatusOr<std::vector<v1::RankPlacement>> placement = PlaceGang(request, snapshot);
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
      if (placement.status().code() == absl::StatusCode::kFailedPrecondition) continue;
      break;
    }
    job.clear_placement();
    std::set<std::string> on;
    for (v1::RankPlacement& p : *placement) {
      on.insert(p.worker_id());
      *job.add_placement() = std::move(p);
    }
    PlacementsChanged();
    mark_used(job);
    if (job.generation() == 0) job.set_generation(1);
    entry->waiting_reason.clear();
    entry->unconfirmed_workers.clear();
    entry->rendezvous = std::make_unique<Rendezvous>(
        job.spec().world_size(), clock_->Now() + ToMillis(job.spec().timeouts().rendezvous()));
    entry->kv = std::make_unique<KvStore>(options_.kv_limits);
    entry->exited_ok.clear();
    entry->beats.clear();
    entry->last_advance = clock_->Now();
    entry->running_since = entry->last_advance;
    (void)SetState(
        entry, Job::SCHEDULED,
        absl::StrCat("placed ", job.spec().world_size(), " ranks on ", absl::StrJoin(on, ", ")),
        deferred);
    AssignmentsChanged(on, deferred);
  }
}

void Coordinator::CheckTimeouts(Deferred* deferred) {
  const Clock::TimePoint now = clock_->Now();
  // Workers gone silent.
  for (auto& [id, w] : workers_) {
    if (w.worker.state() != v1::Worker::ALIVE) continue;
    const auto silent = std::chrono::duration_cast<milliseconds>(now - w.last_seen);
    if (silent <= options_.worker_timeout) continue;
    w.worker.set_state(v1::Worker::LOST);
    PersistWorker(w);
    Emit("worker.lost", "", id, 0, absl::StrCat("no heartbeat for ", FormatMillis(silent)),
         deferred);
    // Answer its held heartbeat, if any, so the call does not hang.
    for (HeldHeartbeat& h : w.held) {
      deferred->Add([done = std::move(h.done)]() {
        done(absl::NotFoundError("worker was declared lost; register again"));
      });
    }
    w.held.clear();
  }
  for (auto& [job_id, entry] : jobs_) {
    Job& job = entry->stored.job;
    if (!HoldsSlots(job.state())) continue;
    // A worker of this job lost, or silent past the job's own timeout.
    std::string failed;
    for (const v1::RankPlacement& p : job.placement()) {
      auto it = workers_.find(p.worker_id());
      if (it == workers_.end()) {
        failed = absl::StrCat("worker ", p.worker_id(), " is unknown");
        break;
      }
      const auto silent = std::chrono::duration_cast<milliseconds>(now - it->second.last_seen);
      if (it->second.worker.state() == v1::Worker::LOST) {
        failed = absl::StrCat("worker ", p.worker_id(), " lost (no heartbeat for ",
                              FormatMillis(silent), ") with rank ", p.rank());
        break;
      }
      if (silent > JobWorkerTimeout(*entry)) {
        failed = absl::StrCat("worker ", p.worker_id(), " silent for ", FormatMillis(silent),
                              " (job's worker timeout ", FormatMillis(JobWorkerTimeout(*entry)),
                              ") with rank ", p.rank());
        break;
      }
    }
    if (!failed.empty()) {
      FailGeneration(entry.get(), failed, false, deferred);
      continue;
    }
    // Rendezvous deadline.
    if (job.state() == Job::SCHEDULED && entry->rendezvous != nullptr &&
        !entry->rendezvous->completed() && now >= entry->rendezvous->deadline()) {
      const std::string missing = absl::StrJoin(entry->rendezvous->MissingRanks(), ", ");
      const std::string reason = absl::StrCat(
          "rendezvous of ", job_id, " generation ", job.generation(), " timed out after ",
          FormatMillis(ToMillis(job.spec().timeouts().rendezvous())), ": missing ranks ", missing);
      entry->rendezvous->Fail(absl::DeadlineExceededError(reason), deferred);
      Emit("rendezvous.timeout", job_id, "", job.generation(), reason, deferred);
      FailGeneration(entry.get(), reason, false, deferred);
      continue;
    }
    // Progress deadline. Beats go on while training is stuck (they come from
    // a thread of their own), so it runs from the last step taken.
    if (job.state() == Job::RUNNING) {
      milliseconds timeout = ProgressTimeout(*entry);
      // Until every rank has beaten once the ranks are still setting up
      // (loading data, a checkpoint, connecting to each other): that gets
      // at least the automatic minimum, however short the spec's timeout.
      if (static_cast<int>(entry->beats.size()) < job.spec().world_size()) {
        timeout = std::max(timeout, kMinAutoProgressTimeout);
      }
      if (now - entry->last_advance > timeout) {
        const std::string reason = HangReport(*entry, now, timeout);
        Emit("job.hang", job_id, "", job.generation(), reason, deferred);
        FailGeneration(entry.get(), reason, false, deferred);
        continue;
      }
    }
    if (entry->kv != nullptr) entry->kv->Expire(now, deferred);
  }
  AnswerDueHeartbeatsLocked(now, deferred);
}

void Coordinator::AnswerDueHeartbeats() {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  if (held_deadlines_.empty() || held_deadlines_.begin()->first > clock_->Now()) return;
  AnswerDueHeartbeatsLocked(clock_->Now(), &deferred);
}

void Coordinator::AnswerDueHeartbeatsLocked(Clock::TimePoint now, Deferred* deferred) {
  while (!held_deadlines_.empty() && held_deadlines_.begin()->first <= now) {
    const std::string worker_id = std::move(held_deadlines_.begin()->second);
    held_deadlines_.erase(held_deadlines_.begin());
    auto w = workers_.find(worker_id);
    if (w == workers_.end()) continue;
    std::vector<HeldHeartbeat>& held = w->second.held;
    for (auto it = held.begin(); it != held.end();) {
      if (it->deadline <= now) {
        v1::HeartbeatResponse response = BuildHeartbeat(&w->second);
        deferred->Add(
            [done = std::move(it->done), response = std::move(response)]() { done(response); });
        it = held.erase(it);
      } else {
        ++it;
      }
    }
  }
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
  absl::MutexLock lock(&mu_);
  std::vector<const JobEntry*> matching;
  for (const auto& [id, entry] : jobs_) {
    const Job& job = entry->stored.job;
    if (entry->stored.number >= below) continue;
    if (!states.empty() && !states.contains(job.state())) continue;
    bool labels_ok = true;
    for (const auto& [k, v] : request.labels()) {
      auto it = job.spec().labels().find(k);
      if (it == job.spec().labels().end() || it->second != v) {
        labels_ok = false;
        break;
      }
    }
    if (labels_ok) matching.push_back(entry.get());
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
  for (const auto* job_and_id : JobsOnWorker(id)) {
    const std::string& job_id = job_and_id->first;
    const Job& job = job_and_id->second->stored.job;
    for (const v1::RankPlacement& p : job.placement()) {
      if (p.worker_id() != id) continue;
      job_ids.insert(job_id);
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
  absl::MutexLock lock(&watch_mu_);
  watchers_[job_id].insert(subscriber);
  return absl::OkStatus();
}

void Coordinator::Unsubscribe(const std::string& job_id, WatchSubscriber* subscriber) {
  absl::MutexLock lock(&watch_mu_);
  auto it = watchers_.find(job_id);
  if (it == watchers_.end()) return;
  it->second.erase(subscriber);
  if (it->second.empty()) watchers_.erase(it);
}

absl::StatusOr<WatchBatch> Coordinator::PollWatch(const v1::WatchJobRequest& request,
                                                  WatchCursor* cursor) {
  constexpr size_t kMaxSteps = 1024;
  if (cursor->next_step < 0) cursor->next_step = std::max<int64_t>(request.from_step(), 0);
  WatchBatch batch;
  bool terminal = false;
  bool quiet = true;  // nothing new but possibly steps
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return ShuttingDown();
    AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(request.job_id()));
    if (entry->version > cursor->job_version_sent) {
      *batch.items.emplace_back().mutable_job() = entry->stored.job;
      cursor->job_version_sent = entry->version;
      quiet = false;
    }
    AIDN_ASSIGN_OR_RETURN(std::vector<v1::Event> events,
                          store_->ListEvents(request.job_id(), cursor->last_event_seq, 256));
    for (v1::Event& e : events) {
      cursor->last_event_seq = e.seq();
      *batch.items.emplace_back().mutable_event() = std::move(e);
      quiet = false;
    }
    if (request.include_metrics() && !cursor->catching_up && entry->steps != nullptr) {
      std::vector<v1::StepMetrics> steps;
      int64_t last = 0;
      const int64_t from = std::max(request.from_step(), cursor->last_step_sent + 1);
      if (entry->steps->After(cursor->metrics_seq, request.from_step(), kMaxSteps, &steps, &last)) {
        cursor->metrics_seq = last;
        for (v1::StepMetrics& step : steps) {
          cursor->last_step_sent = step.step();
          *batch.items.emplace_back().mutable_step() = std::move(step);
        }
        if (!steps.empty()) quiet = false;
      } else {
        // This watcher fell behind what memory holds: read the rest back.
        cursor->catching_up = true;
        cursor->next_step = from;
      }
    }
    terminal = IsTerminal(entry->stored.job.state()) &&
               (entry->steps == nullptr || entry->steps->pending() == 0);
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
  constexpr int kMaxSteps = 1024;
  // Under flush_mu_ from the flush to reading stored_seq: no other flush
  // can store steps in between, so every step numbered after stored_seq is
  // still only in memory, and none is sent twice.
  absl::MutexLock flush(&flush_mu_);
  FlushStepsLocked();
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::StepMetrics> steps,
                        store_->GetSteps(request.job_id(), cursor->next_step, 0, kMaxSteps));
  const bool more = static_cast<int>(steps.size()) == kMaxSteps;
  if (more) {
    // Leave the last step's rows for the next read, so a TRAIN and an EVAL
    // row of one step are not split between reads.
    const int64_t last = steps.back().step();
    while (!steps.empty() && steps.back().step() == last) steps.pop_back();
    cursor->next_step = last;
  }
  for (v1::StepMetrics& step : steps) {
    cursor->last_step_sent = step.step();
    *batch->items.emplace_back().mutable_step() = std::move(step);
  }
  if (!more) {
    absl::MutexLock lock(&mu_);
    AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(request.job_id()));
    cursor->catching_up = false;
    cursor->metrics_seq = entry->stored_seq;
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
  if (info.gpus_size() > 64) {
    return absl::InvalidArgumentError("info.gpus: at most 64");
  }
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  const Clock::TimePoint now = clock_->Now();
  auto [it, inserted] = workers_.try_emplace(info.id());
  WorkerEntry& w = it->second;
  const bool was_lost = !inserted && w.worker.state() == v1::Worker::LOST;
  *w.worker.mutable_info() = info;
  if (w.worker.info().address().empty()) w.worker.mutable_info()->set_address(info.hostname());
  w.worker.set_state(v1::Worker::ALIVE);
  *w.worker.mutable_registered_at() = ToProto(clock_->WallNow());
  *w.worker.mutable_last_heartbeat() = w.worker.registered_at();
  w.last_seen = now;
  PersistWorker(w);
  Emit(inserted ? "worker.registered" : (was_lost ? "worker.back" : "worker.reregistered"), "",
       info.id(), 0,
       absl::StrCat(info.cpu_slots(), " cpu slots, ", info.gpus_size(), " gpus at ",
                    w.worker.info().address()),
       &deferred);
  if (!inserted) {
    // A worker that restarted lost its trainers (they die with it): running
    // generations with ranks there cannot go on.
    std::set<std::pair<std::string, int>> alive;
    for (const v1::TrainerStatus& t : request.trainers()) {
      alive.insert({absl::StrCat(t.job_id(), "#", t.generation()), t.rank()});
    }
    for (auto& [job_id, entry] : jobs_) {
      const Job& job = entry->stored.job;
      if (job.state() != Job::RUNNING) continue;
      for (const v1::RankPlacement& p : job.placement()) {
        if (p.worker_id() != info.id()) continue;
        if (!alive.contains({absl::StrCat(job_id, "#", job.generation()), p.rank()})) {
          FailGeneration(entry.get(),
                         absl::StrCat("worker ", info.id(), " re-registered without rank ",
                                      p.rank(), " (its trainer is gone)"),
                         false, &deferred);
          break;
        }
      }
    }
  }
  Schedule(&deferred);
  v1::RegisterWorkerResponse response;
  response.set_worker_id(info.id());
  const auto set = [](google::protobuf::Duration* d, milliseconds ms) {
    d->set_seconds(ms.count() / 1000);
    d->set_nanos(static_cast<int32_t>(ms.count() % 1000) * 1'000'000);
  };
  set(response.mutable_heartbeat_interval(), options_.heartbeat_interval);
  set(response.mutable_worker_timeout(), options_.worker_timeout);
  return response;
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
    const Clock::TimePoint deadline = clock_->Now() + max_wait;
    w.held.push_back(HeldHeartbeat{deadline, std::move(done)});
    held_deadlines_.emplace(deadline, request.worker_id());
    return;
  }
  v1::HeartbeatResponse response = BuildHeartbeat(&w);
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
  if (request.exit_code() == 0 && request.signal() == 0) {
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
  FailGeneration(entry, message, request.permanent(), &deferred);
  Schedule(&deferred);
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
  FillResume(entry, &base);
  entry->last_advance = clock_->Now();
  entry->running_since = entry->last_advance;
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
  const Clock::TimePoint now = clock_->Now();
  JobEntry::Beat& beat = entry->beats[request.rank()];
  if (request.step() > beat.step) entry->last_advance = now;
  beat.step = request.step();
  beat.collective_seq = request.collective_seq();
  beat.at = now;
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
  StepLog* steps = StepsOf(entry);
  EnsureRankSeries(entry);
  const int64_t seq_before = steps->last_seq();
  const Clock::TimePoint now = clock_->Now();
  const int rank = request.rank();
  // Records of steps the last coordinator process stored: a trainer sends
  // again what it was not told is durable when the coordinator restarted.
  // (Later duplicates the StepLog drops as late.)
  std::optional<std::pair<int64_t, int>> stored;
  if (entry->resent_generation == job.generation()) stored = entry->resent_floor;
  int64_t dropped = 0;
  for (const v1::MetricRecord& in : request.records()) {
    if (stored.has_value() && std::make_pair(in.step(), static_cast<int>(in.kind())) <= *stored) {
      continue;
    }
    v1::MetricRecord r = in;
    r.set_rank(rank);
    r.set_generation(request.generation());
    if (r.kind() == v1::MetricRecord::TRAIN) {
      entry->rank_step_seconds[rank]->Observe(r.step_seconds());
      entry->rank_allreduce_seconds[rank]->Observe(r.allreduce_seconds());
      std::deque<double>& window = entry->step_window[rank];
      // What the rank itself spent: in DDP the others wait for a slow rank
      // in the allreduce, so their step_seconds are as long as its.
      window.push_back(r.compute_seconds() > 0 ? r.compute_seconds() : r.step_seconds());
      if (window.size() > kStragglerWindow) window.pop_front();
      ++entry->step_samples[rank];
      entry->step_window_changed = true;
      if (r.step() >= job.last_step()) {
        job.set_last_step(r.step());
        job.set_epoch(r.epoch());
      }
    }
    if (!steps->Add(r, now)) ++dropped;
  }
  metrics_.records_received.Increment(request.records_size());
  if (dropped > 0) metrics_.records_dropped.Increment(static_cast<double>(dropped));
  if (steps->last_seq() != seq_before) NotifyWatchers(request.job_id(), &deferred);
  return absl::OkStatus();
}

StepLog* Coordinator::StepsOf(JobEntry* entry) {
  const Job& job = entry->stored.job;
  if (entry->steps == nullptr) entry->steps = std::make_unique<StepLog>(options_.step_log);
  if (entry->steps_generation != job.generation()) {
    entry->steps->StartGeneration(job.generation(), job.spec().world_size());
    entry->steps_generation = job.generation();
    if (entry->resent_generation == job.generation()) {
      entry->steps->ExpectFrom(entry->resent_first_step);
    }
  }
  return entry->steps.get();
}

void Coordinator::EnsureRankSeries(JobEntry* entry) {
  const Job& job = entry->stored.job;
  const int world = job.spec().world_size();
  if (static_cast<int>(entry->rank_step_seconds.size()) == world) return;
  entry->rank_step_seconds.clear();
  entry->rank_allreduce_seconds.clear();
  for (int r = 0; r < world; ++r) {
    const metrics::Labels labels{{"job_id", job.id()}, {"rank", absl::StrCat(r)}};
    entry->rank_step_seconds.push_back(&metrics_.rank_step_seconds.Add(labels));
    entry->rank_allreduce_seconds.push_back(&metrics_.rank_allreduce_seconds.Add(labels));
  }
  entry->series_removed = false;
}

bool Coordinator::PastRetention(const Job& job) const {
  if (!IsTerminal(job.state())) return false;
  const absl::Time finished = absl::FromUnixSeconds(job.finished_at().seconds()) +
                              absl::Nanoseconds(job.finished_at().nanos());
  return clock_->WallNow() - finished >= absl::FromChrono(options_.metrics_retention);
}

void Coordinator::RemoveJobSeries(JobEntry* entry) {
  const metrics::Labels match{{"job_id", entry->stored.job.id()}};
  for (metrics::Family<metrics::Gauge>* f :
       {&metrics_.job_state, &metrics_.job_step, &metrics_.job_total_steps, &metrics_.job_epoch,
        &metrics_.job_loss, &metrics_.job_samples_per_second, &metrics_.job_step_seconds,
        &metrics_.job_allreduce_seconds, &metrics_.job_restarts, &metrics_.job_generation,
        &metrics_.job_world_size, &metrics_.job_last_checkpoint_step, &metrics_.job_test_accuracy,
        &metrics_.job_test_loss, &metrics_.rank_step, &metrics_.rank_last_progress_age_seconds,
        &metrics_.rank_straggler}) {
    f->RemoveMatching(match);
  }
  metrics_.rank_step_seconds.RemoveMatching(match);
  metrics_.rank_allreduce_seconds.RemoveMatching(match);
  entry->rank_step_seconds.clear();
  entry->rank_allreduce_seconds.clear();
  entry->series_removed = true;
}

void Coordinator::CollectMetrics() {
  absl::MutexLock lock(&mu_);
  const Clock::TimePoint now = clock_->Now();
  std::map<Job::State, int> by_state;
  for (int s = Job::PENDING; s <= Job::CANCELLED; ++s) by_state[static_cast<Job::State>(s)] = 0;
  for (auto& [id, entry] : jobs_) {
    const Job& job = entry->stored.job;
    ++by_state[job.state()];
    if (entry->series_removed) continue;
    if (PastRetention(job)) {
      RemoveJobSeries(entry.get());
      continue;
    }
    const metrics::Labels labels{{"job_id", id}};
    // One series per job: the old state's goes when the state changes.
    metrics_.job_state.RemoveMatching(labels);
    metrics_.job_state.Add({{"job_id", id}, {"state", StateName(job.state())}}).Set(1);
    metrics_.job_step.Add(labels).Set(static_cast<double>(job.last_step()));
    metrics_.job_total_steps.Add(labels).Set(static_cast<double>(job.total_steps()));
    metrics_.job_epoch.Add(labels).Set(job.epoch());
    metrics_.job_restarts.Add(labels).Set(job.restarts());
    metrics_.job_generation.Add(labels).Set(static_cast<double>(job.generation()));
    metrics_.job_world_size.Add(labels).Set(job.spec().world_size());
    metrics_.job_last_checkpoint_step.Add(labels).Set(
        static_cast<double>(job.last_checkpoint_step()));
    if (entry->steps != nullptr) {
      if (const v1::StepMetrics* t = entry->steps->last_train(); t != nullptr) {
        metrics_.job_loss.Add(labels).Set(t->loss());
        metrics_.job_samples_per_second.Add(labels).Set(t->samples_per_second());
        metrics_.job_step_seconds.Add(labels).Set(t->step_seconds());
        metrics_.job_allreduce_seconds.Add(labels).Set(t->allreduce_seconds());
      }
      if (const v1::StepMetrics* e = entry->steps->last_eval(); e != nullptr) {
        metrics_.job_test_accuracy.Add(labels).Set(e->test_accuracy());
        metrics_.job_test_loss.Add(labels).Set(e->test_loss());
      }
    }
    // Progress of the ranks of a generation that holds slots; none after.
    metrics_.rank_step.RemoveMatching(labels);
    metrics_.rank_last_progress_age_seconds.RemoveMatching(labels);
    metrics_.rank_straggler.RemoveMatching(labels);
    for (const auto& [rank, beat] : entry->beats) {
      const metrics::Labels rank_labels{{"job_id", id}, {"rank", absl::StrCat(rank)}};
      metrics_.rank_step.Add(rank_labels).Set(static_cast<double>(beat.step));
      metrics_.rank_last_progress_age_seconds.Add(rank_labels)
          .Set(std::chrono::duration<double>(now - beat.at).count());
    }
    if (job.state() == Job::RUNNING) {
      for (int rank = 0; rank < job.spec().world_size(); ++rank) {
        metrics_.rank_straggler.Add({{"job_id", id}, {"rank", absl::StrCat(rank)}})
            .Set(entry->stragglers.contains(rank) ? 1 : 0);
      }
    }
  }
  for (const auto& [state, count] : by_state) {
    metrics_.jobs.Add({{"state", StateName(state)}}).Set(count);
  }

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

absl::StatusOr<v1::CommitCheckpointResponse> Coordinator::CommitCheckpoint(
    const v1::CommitCheckpointRequest& request) {
  AIDN_RETURN_IF_ERROR(ValidateSpecPath("path", request.path()));
  if (request.step() < 0) return absl::InvalidArgumentError("step: must be >= 0");
  if (request.writer_ranks().empty()) {
    return absl::InvalidArgumentError("writer_ranks: must name the ranks that write");
  }
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FencedJob(request.job_id(), request.generation()));
  Job& job = entry->stored.job;
  std::set<int> writers(request.writer_ranks().begin(), request.writer_ranks().end());
  for (int r : writers) {
    if (r < 0 || r >= job.spec().world_size()) {
      return absl::InvalidArgumentError(absl::StrCat("writer_ranks: rank ", r, " out of range"));
    }
  }
  if (!writers.contains(request.rank())) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", request.rank(), " is not among writer_ranks"));
  }
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::Checkpoint> existing, store_->ListCheckpoints(job.id()));
  auto found = std::find_if(existing.begin(), existing.end(),
                            [&](const v1::Checkpoint& c) { return c.step() == request.step(); });
  if (found == existing.end()) found = existing.insert(existing.end(), v1::Checkpoint());
  // `existing` stays the store's view: retention looks at all of them.
  v1::Checkpoint& checkpoint = *found;
  if (checkpoint.job_id().empty() || checkpoint.generation() != request.generation()) {
    // New, or a directory an earlier generation left at this step that this
    // one wrote again.
    checkpoint.Clear();
    checkpoint.set_job_id(job.id());
    checkpoint.set_step(request.step());
    checkpoint.set_generation(request.generation());
    checkpoint.set_path(request.path());
    for (int r : writers) checkpoint.add_ranks_expected(r);
    *checkpoint.mutable_created_at() = ToProto(clock_->WallNow());
  }
  std::set<int> reported(checkpoint.ranks_reported().begin(), checkpoint.ranks_reported().end());
  const bool was_committed = checkpoint.committed();
  if (!reported.contains(request.rank())) {
    reported.insert(request.rank());
    checkpoint.add_ranks_reported(request.rank());
    checkpoint.set_bytes(checkpoint.bytes() + request.bytes());
    if (checkpoint.manifest_sha256().empty()) {
      checkpoint.set_manifest_sha256(request.manifest_sha256());
    }
  }
  bool all = true;
  for (int r : checkpoint.ranks_expected()) all = all && reported.contains(r);
  checkpoint.set_committed(all);
  AIDN_RETURN_IF_ERROR(store_->PutCheckpoint(checkpoint));
  v1::CommitCheckpointResponse response;
  response.set_committed(all);
  if (all && !was_committed) {
    Emit("checkpoint.committed", job.id(), "", job.generation(),
         absl::StrCat("step ", request.step(), " at ", request.path()), &deferred);
    for (int64_t step : RetireCheckpoints(entry, existing)) response.add_retired_steps(step);
    std::erase_if(existing, [&](const v1::Checkpoint& c) {
      return std::find(response.retired_steps().begin(), response.retired_steps().end(),
                       c.step()) != response.retired_steps().end();
    });
    job.set_last_checkpoint_step(NewestValidStep(existing));
    (void)PersistJob(entry, &deferred);
  }
  return response;
}

std::vector<int64_t> Coordinator::RetireCheckpoints(
    JobEntry* entry, const std::vector<v1::Checkpoint>& checkpoints) {
  const Job& job = entry->stored.job;
  const int keep = std::max(1, job.spec().checkpoint().keep_last());
  std::vector<int64_t> valid;  // newest first
  for (const v1::Checkpoint& c : checkpoints) {
    if (Valid(c)) valid.push_back(c.step());
  }
  std::sort(valid.rbegin(), valid.rend());
  if (valid.empty()) return {};
  const int64_t newest_valid = valid.front();
  std::vector<int64_t> retired;
  for (const v1::Checkpoint& c : checkpoints) {
    bool retire;
    if (!c.invalid_reason().empty()) {
      // Never resumed from again; one newer than every valid checkpoint is
      // kept until a newer valid one exists, so that it can still be looked at.
      retire = c.step() < newest_valid;
    } else if (c.committed()) {
      retire = std::find(valid.begin(), valid.end(), c.step()) - valid.begin() >= keep;
    } else {
      // Half written by a generation that is gone: it will never commit.
      retire = c.generation() < job.generation() && c.step() < newest_valid;
    }
    // Ranks may still be reading it.
    if (c.step() == entry->resumed_from_step) retire = false;
    if (!retire) continue;
    absl::Status s = store_->DeleteCheckpoint(job.id(), c.step());
    if (!s.ok()) {
      AIDN_LOG(ERROR) << "could not retire checkpoint: " << s << Kv("job", job.id())
                      << Kv("step", c.step());
      continue;
    }
    retired.push_back(c.step());
  }
  std::sort(retired.begin(), retired.end());
  if (!retired.empty()) {
    AIDN_LOG(INFO) << "checkpoints retired" << Kv("job", job.id())
                   << Kv("steps", absl::StrJoin(retired, ",")) << Kv("keep_last", keep);
  }
  return retired;
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
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::Checkpoint> checkpoints, store_->ListCheckpoints(job.id()));
  auto it = std::find_if(checkpoints.begin(), checkpoints.end(),
                         [&](const v1::Checkpoint& c) { return c.step() == request.step(); });
  if (it == checkpoints.end()) {
    return absl::NotFoundError(
        absl::StrCat("no checkpoint of ", job.id(), " at step ", request.step()));
  }
  // Every rank that tries it finds it bad; the first one says so.
  if (!it->invalid_reason().empty()) return absl::OkStatus();
  std::string reason = request.reason().empty() ? "no reason given" : request.reason();
  if (reason.size() > kMaxInvalidReason) reason = reason.substr(0, kMaxInvalidReason) + "...";
  it->set_invalid_reason(reason);
  AIDN_RETURN_IF_ERROR(store_->PutCheckpoint(*it));
  if (entry->resumed_from_step == request.step()) {
    // The ranks go on to the next candidate, the newest valid one below.
    entry->resumed_from_step = -1;
    for (const v1::Checkpoint& c : checkpoints) {
      if (Valid(c) && c.step() < request.step() && c.generation() < job.generation()) {
        entry->resumed_from_step = std::max(entry->resumed_from_step, c.step());
      }
    }
  }
  const int64_t newest = NewestValidStep(checkpoints);
  if (newest != job.last_checkpoint_step()) {
    job.set_last_checkpoint_step(newest);
    (void)PersistJob(entry, &deferred);
  }
  Emit("checkpoint.invalid", job.id(), WorkerOfRank(job, request.rank()), job.generation(),
       absl::StrCat("step ", request.step(), " (", it->path(), ") failed verification on rank ",
                    request.rank(), ": ", reason),
       &deferred);
  return absl::OkStatus();
}

void Coordinator::FillResume(JobEntry* entry, v1::JoinRendezvousResponse* response) {
  const Job& job = entry->stored.job;
  entry->resumed_from_step = -1;
  absl::StatusOr<std::vector<v1::Checkpoint>> checkpoints = store_->ListCheckpoints(job.id());
  if (!checkpoints.ok()) {
    // The ranks start from scratch rather than not at all; steps are
    // redone, nothing is lost.
    AIDN_LOG(ERROR) << "could not list checkpoints: " << checkpoints.status()
                    << Kv("job", job.id());
    return;
  }
  // Listed by step: newest first. Only earlier generations' checkpoints: a
  // coordinator that restarted rebuilds this answer while the generation
  // writes its own.
  for (auto it = checkpoints->rbegin(); it != checkpoints->rend(); ++it) {
    if (!Valid(*it) || it->generation() >= job.generation()) continue;
    *response->add_resume_candidates() = *it;
  }
  if (response->resume_candidates().empty()) {
    response->clear_resume_from();
    return;
  }
  *response->mutable_resume_from() = response->resume_candidates(0);
  entry->resumed_from_step = response->resume_from().step();
}

absl::StatusOr<v1::StreamMetricsResponse> Coordinator::MetricsReceipt(const std::string& job_id) {
  // No flush here: a receipt per stream would put a SQLite transaction on
  // every StreamMetrics call. The answer covers what the ticker's batched
  // flushes stored so far; the sender keeps the rest and learns of it from
  // a later receipt. Only mu_: steps a flush took out of the log but has not
  // stored (in flight, or failed and waiting for the next flush) are in
  // unstored_first_step_ until a flush stores them.
  std::optional<int64_t> failed;
  absl::MutexLock lock(&mu_);
  if (auto it = unstored_first_step_.find(job_id); it != unstored_first_step_.end()) {
    failed = it->second;
  }
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(job_id));
  const Job& job = entry->stored.job;
  int64_t durable = 0;
  if (entry->stored_generation == job.generation() && entry->stored_key.has_value()) {
    durable = entry->stored_key->first;
  }
  if (entry->steps != nullptr) {
    if (std::optional<int64_t> first = entry->steps->FirstStepNotTaken(); first.has_value()) {
      durable = std::min(durable, *first - 1);
    }
  }
  if (failed.has_value()) durable = std::min(durable, *failed - 1);
  v1::StreamMetricsResponse response;
  response.set_durable_step(std::max<int64_t>(durable, 0));
  response.set_incarnation(incarnation_);
  return response;
}

void Coordinator::NoteStored(JobEntry* entry, const v1::StepMetrics& step) {
  const int64_t generation = entry->stored.job.generation();
  if (step.generation() != generation) return;
  if (entry->stored_generation != generation) {
    entry->stored_generation = generation;
    entry->stored_key.reset();
  }
  const std::pair<int64_t, int> key{step.step(), static_cast<int>(step.kind())};
  if (!entry->stored_key.has_value() || key > *entry->stored_key) entry->stored_key = key;
}

std::string Coordinator::WorkerOfRank(const Job& job, int rank) {
  for (const v1::RankPlacement& p : job.placement()) {
    if (p.rank() == rank) return p.worker_id();
  }
  return "";
}

milliseconds Coordinator::RestartDelay(const Job& job) const {
  milliseconds base = ToMillis(job.spec().timeouts().restart_backoff());
  if (base.count() <= 0) base = kDefaultRestartBackoff;
  // restarts() counts this one: the k-th restart waits base * 2^(k-1).
  milliseconds delay = base;
  for (int k = 1; k < job.restarts() && delay < kMaxRestartBackoff; ++k) delay *= 2;
  return std::min(delay, kMaxRestartBackoff);
}

milliseconds Coordinator::ProgressTimeout(const JobEntry& entry) const {
  const milliseconds set = ToMillis(entry.stored.job.spec().timeouts().progress());
  if (set.count() > 0) return set;
  milliseconds timeout = kMinAutoProgressTimeout;
  if (entry.steps != nullptr) {
    const std::deque<double>& recent = entry.steps->recent_train_step_seconds();
    const double median = Median({recent.begin(), recent.end()});
    const auto steps = std::chrono::duration_cast<milliseconds>(
        std::chrono::duration<double>(kAutoProgressSteps * median));
    timeout = std::max(timeout, steps);
  }
  return timeout;
}

std::string Coordinator::HangReport(const JobEntry& entry, Clock::TimePoint now,
                                    milliseconds timeout) const {
  const Job& job = entry.stored.job;
  const int world = job.spec().world_size();
  const auto silent_after = kSilentBeats * options_.trainer_beat_interval;
  int64_t top_step = -1;
  for (const auto& [rank, beat] : entry.beats) top_step = std::max(top_step, beat.step);
  std::string reason = absl::StrCat("no progress for ", FormatMillis(timeout));
  if (top_step >= 0) {
    absl::StrAppend(&reason, " at step ", top_step, ": ");
  } else {
    absl::StrAppend(&reason, " since the generation started: ");
  }

  // Ranks whose beats stopped (a stopped or wedged process) are the culprits;
  // the others are waiting for them in a collective.
  std::vector<std::string> silent;
  std::vector<int> alive;
  for (int r = 0; r < world; ++r) {
    auto it = entry.beats.find(r);
    if (it == entry.beats.end()) {
      const auto quiet = std::chrono::duration_cast<milliseconds>(now - entry.running_since);
      silent.push_back(
          absl::StrCat("rank ", r, " silent for ", FormatMillis(quiet), " (no beat yet)"));
      continue;
    }
    const auto quiet = std::chrono::duration_cast<milliseconds>(now - it->second.at);
    if (quiet > silent_after) {
      silent.push_back(absl::StrCat("rank ", r, " silent for ", FormatMillis(quiet),
                                    " (last beat at step ", it->second.step, ", collective ",
                                    it->second.collective_seq, ")"));
    } else {
      alive.push_back(r);
    }
  }
  constexpr size_t kMaxNamed = 16;
  if (silent.size() > kMaxNamed) {
    const size_t more = silent.size() - kMaxNamed;
    silent.resize(kMaxNamed);
    silent.push_back(absl::StrCat("and ", more, " more silent"));
  }
  // The alive ranks by where they are, furthest first.
  std::map<std::pair<int64_t, int64_t>, std::vector<int>, std::greater<>> at;
  for (int r : alive) {
    const JobEntry::Beat& b = entry.beats.at(r);
    at[{b.step, b.collective_seq}].push_back(r);
  }
  auto where = [](const std::pair<int64_t, int64_t>& p) {
    return absl::StrCat("step ", p.first, ", collective ", p.second);
  };
  std::vector<std::string> parts;
  if (!silent.empty()) {
    parts.push_back(absl::StrJoin(silent, ", "));
    for (const auto& [pos, ranks] : at) {
      parts.push_back(absl::StrCat(RankList(ranks), " waiting at ", where(pos)));
    }
  } else if (at.size() <= 1) {
    // Everyone beats from the same place: no rank to blame.
    parts.push_back(at.empty() ? "no rank reported"
                               : absl::StrCat("all ranks at ", where(at.begin()->first)));
  } else {
    // Those behind the furthest in step or collective are where it hangs.
    for (auto it = std::next(at.begin()); it != at.end(); ++it) {
      parts.push_back(absl::StrCat(RankList(it->second), " behind at ", where(it->first)));
    }
    parts.push_back(
        absl::StrCat(RankList(at.begin()->second), " waiting at ", where(at.begin()->first)));
  }
  absl::StrAppend(&reason, absl::StrJoin(parts, "; "));
  return reason;
}

void Coordinator::CheckStragglers(JobEntry* entry, Deferred* deferred) {
  entry->step_window_changed = false;
  Job& job = entry->stored.job;
  std::vector<std::pair<int, double>> medians;
  for (const auto& [rank, window] : entry->step_window) {
    if (window.size() >= kStragglerMinSamples) {
      medians.emplace_back(rank, Median({window.begin(), window.end()}));
    }
  }
  if (medians.size() < 2) return;
  std::vector<double> sorted;
  for (const auto& [rank, m] : medians) sorted.push_back(m);
  std::sort(sorted.begin(), sorted.end());
  for (const auto& [rank, m] : medians) {
    const size_t index = std::lower_bound(sorted.begin(), sorted.end(), m) - sorted.begin();
    const double others = MedianWithout(sorted, index);
    const bool was_slow = entry->stragglers.contains(rank);
    const bool slow = was_slow ? m >= kRecoveredRatio * others : m > kStragglerRatio * others;
    if (slow == was_slow) continue;
    const int64_t samples_now = entry->step_samples[rank];
    auto changed = entry->straggler_changed_at.find(rank);
    if (changed != entry->straggler_changed_at.end() &&
        samples_now - changed->second < static_cast<int64_t>(kStragglerWindow)) {
      continue;
    }
    entry->straggler_changed_at[rank] = samples_now;
    const size_t samples = entry->step_window.at(rank).size();
    std::string message = absl::StrFormat(
        "rank %d: median compute time %.3gs over its last %d steps, the other ranks' %.3gs", rank,
        m, samples, others);
    if (others > 0) absl::StrAppend(&message, absl::StrFormat(" (%.2fx)", m / others));
    if (slow) {
      entry->stragglers.insert(rank);
      Emit("rank.straggler", job.id(), WorkerOfRank(job, rank), job.generation(), message,
           deferred);
    } else {
      entry->stragglers.erase(rank);
      Emit("rank.recovered", job.id(), WorkerOfRank(job, rank), job.generation(), message,
           deferred);
    }
  }
}

}  // namespace aidn::coordinator
