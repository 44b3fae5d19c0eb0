// The coordinator's ClusterService calls: workers (registration,
// long-poll heartbeats, trainer exits) and trainers (rendezvous, KV store,
// progress, metrics, checkpoints), and the commit of checkpoints that
// awaited their metrics.

#include <regex>

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/coordinator.h"
#include "coordinator/job_entry.h"
#include "coordinator/job_state.h"
#include "coordinator/time_util.h"

namespace aidn::coordinator {
namespace {

using std::chrono::milliseconds;
using v1::Job;

// Steps read at a time for a succeeded job's throughput.
constexpr int kThroughputPage = 10'000;

// The last non-empty line of a trainer's stderr, shortened for a message.
std::string LastLine(const std::string& text) {
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n', absl::SkipWhitespace());
  if (lines.empty()) return "";
  std::string last(absl::StripAsciiWhitespace(lines.back()));
  if (last.size() > 200) last = last.substr(0, 200) + "...";
  return last;
}

bool ValidWorkerId(const std::string& id) {
  static const std::regex re("[a-zA-Z0-9._-]{1,63}");
  return std::regex_match(id, re);
}

}  // namespace

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
  if (auto live = workers_.find(info.id()); live != workers_.end()) {
    const v1::Worker& other = live->second.worker;
    if (other.state() == v1::Worker::ALIVE && !other.info().instance().empty() &&
        !info.instance().empty() && other.info().instance() != info.instance()) {
      const int64_t silent_ms =
          std::chrono::duration_cast<milliseconds>(clock_->Now() - live->second.last_seen).count();
      Emit("worker.refused", "", info.id(), 0,
           absl::StrCat("a second worker (host ", info.hostname(), ", instance ", info.instance(),
                        ") asked for the id of a live one (host ", other.info().hostname(), ")"),
           &deferred);
      return absl::AlreadyExistsError(
          absl::StrCat("info.id: worker id \"", info.id(), "\" belongs to a live worker (host ",
                       other.info().hostname(), ", instance ", other.info().instance(),
                       ", last heard ", silent_ms,
                       " ms ago); start this one with another --worker-id, or stop the other: "
                       "its id is free once it has been silent for the worker timeout (",
                       options_.worker_timeout.count(), " ms)"));
    }
  }
  auto [it, inserted] = workers_.try_emplace(info.id());
  WorkerEntry& w = it->second;
  const bool was_lost = !inserted && w.worker.state() == v1::Worker::LOST;
  *w.worker.mutable_info() = info;
  if (w.worker.info().address().empty()) w.worker.mutable_info()->set_address(info.hostname());
  w.worker.set_state(v1::Worker::ALIVE);
  *w.worker.mutable_registered_at() = ToProto(clock_->WallNow());
  *w.worker.mutable_last_heartbeat() = w.worker.registered_at();
  w.last_seen = clock_->Now();
  w.heard = true;
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
  if (shutting_down_) return AnswerLater(&deferred, std::move(done), ShuttingDownError());
  auto it = workers_.find(request.worker_id());
  if (it == workers_.end()) {
    return AnswerLater(&deferred, std::move(done),
                       absl::NotFoundError(absl::StrCat("unknown worker ", request.worker_id(),
                                                        "; register again")));
  }
  WorkerEntry& w = it->second;
  if (!request.instance().empty() && !w.worker.info().instance().empty() &&
      request.instance() != w.worker.info().instance()) {
    // Another worker registered under this id while this one was silent:
    // this one must register again (and is refused while the other lives).
    return AnswerLater(&deferred, std::move(done),
                       absl::NotFoundError(absl::StrCat(
                           "worker ", request.worker_id(), " is registered by another instance (",
                           w.worker.info().instance(), "); register again")));
  }
  w.last_seen = clock_->Now();
  w.heard = true;
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
    held_.Hold(request.worker_id(), deadline, std::move(done));
    if (deadline < held_wake_at_) held_wake_ = true;
    return;
  }
  v1::HeartbeatResponse response = BuildHeartbeat(request.worker_id());
  deferred.Add([done = std::move(done), response = std::move(response)]() { done(response); });
}

absl::Status Coordinator::ReportTrainerExit(const v1::ReportTrainerExitRequest& request) {
  AIDN_ASSIGN_OR_RETURN(const bool last_rank_done, RecordTrainerExit(request));
  if (!last_rank_done) return absl::OkStatus();
  // Every rank sent its records before it exited: store them now, so that
  // the checkpoints awaiting them commit before the job counts as succeeded
  // (an export right after success gets the final weights).
  FlushSteps();
  // Its steps for the throughput, read without the lock.
  std::vector<v1::StepMetrics> steps;
  for (int64_t from = 0;;) {
    absl::StatusOr<std::vector<v1::StepMetrics>> page =
        store_->GetSteps(request.job_id(), from, 0, kThroughputPage);
    if (!page.ok()) {
      AIDN_LOG(WARNING) << "no throughput for " << request.job_id() << ": " << page.status();
      steps.clear();
      break;
    }
    steps.insert(steps.end(), page->begin(), page->end());
    if (static_cast<int>(page->size()) < kThroughputPage) break;
    from = page->back().step() + 1;
  }
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(request.job_id()));
  Job& job = entry->stored.job;
  // Anything may have happened while the lock was free (a cancel, a
  // failure, this same report delivered twice).
  if (request.generation() != job.generation() || !HoldsSlots(job.state()) ||
      static_cast<int>(entry->exited_ok.size()) < job.spec().world_size()) {
    return absl::OkStatus();
  }
  RecordThroughput(entry, steps, &deferred);
  CompleteCheckpoints(entry, DurableInMemory(entry), &deferred);
  ReleaseGeneration(entry, "job succeeded",
                    absl::FailedPreconditionError(absl::StrCat(job.id(), " has succeeded")),
                    &deferred);
  (void)SetState(entry, Job::SUCCEEDED,
                 absl::StrCat("all ", job.spec().world_size(), " ranks exited 0"), &deferred);
  Schedule(&deferred);
  return absl::OkStatus();
}

absl::StatusOr<bool> Coordinator::RecordTrainerExit(const v1::ReportTrainerExitRequest& request) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(request.job_id()));
  Job& job = entry->stored.job;
  const bool current = request.generation() == job.generation() && HoldsSlots(job.state());
  std::string what = request.signal() != 0 ? absl::StrCat("killed by signal ", request.signal())
                                           : absl::StrCat("exited with code ", request.exit_code());
  const bool clean = request.exit_code() == 0 && request.signal() == 0;
  // A clean exit's last log line is no reason for anything.
  // What the program said of its failure (torch's @record error file) is
  // the best account, else its last log line.
  const std::string tail =
      clean ? "" : (!request.error().empty() ? request.error() : LastLine(request.stderr_tail()));
  std::string message = absl::StrCat("rank ", request.rank(), " on worker ", request.worker_id(),
                                     " ", what, tail.empty() ? "" : ": " + tail);
  Emit("trainer.exited", job.id(), request.worker_id(), request.generation(), message, &deferred);
  if (request.stopped_by_order()) return false;
  const absl::Time exited_at =
      request.has_exited_at() ? FromProto(request.exited_at()) : clock_->WallNow();
  if (!current) {
    // A rank of a generation that already failed, which failed on its own
    // before it was stopped: the first of them is the root cause.
    if (!clean) {
      ReviseFailureCause(entry, request.generation(), exited_at, message, request.worker_id(),
                         &deferred);
    }
    return false;
  }
  if (!clean) {
    FailGeneration(entry, message, request.permanent(), &deferred, exited_at);
    Schedule(&deferred);
    return false;
  }
  entry->exited_ok.insert(request.rank());
  if (static_cast<int>(entry->exited_ok.size()) < job.spec().world_size()) return false;
  // No rank of the generation can send again: steps still missing a rank's
  // record (one whose last records were dropped) are combined as they are,
  // so that the flush before success stores them.
  if (ingest_.EndGeneration(&entry->metrics)) NotifyWatchers(job.id(), &deferred);
  return true;
}

void Coordinator::ReviseFailureCause(JobEntry* entry, int64_t generation, absl::Time at,
                                     const std::string& cause, const std::string& worker_id,
                                     Deferred* deferred) {
  if (!entry->last_failure.has_value() || !entry->last_failure->PrecededBy(generation, at)) return;
  FailureCause& failure = *entry->last_failure;
  const std::string followed = failure.reason;
  failure.at = at;
  failure.reason = cause;
  Job& job = entry->stored.job;
  // The job's message names the new cause where it named the old one.
  if (const size_t pos = job.message().find(followed); pos != std::string::npos) {
    std::string message = job.message();
    message.replace(pos, followed.size(), cause);
    job.set_message(message);
    (void)PersistJob(entry, deferred);
  }
  Emit("job.cause", job.id(), worker_id, generation,
       absl::StrCat("root cause of generation ", generation, "'s failure: ", cause,
                    " (which came before: ", followed, ")"),
       deferred);
}

void Coordinator::WorkerLostForJobs(const WorkerEntry& w, const std::string& silence,
                                    Deferred* deferred) {
  const std::string& id = w.worker.info().id();
  // Jobs still placed there: the failure detector fails them on its next
  // look; the event says so under each job.
  for (const JobRef job_and_id : JobsOnWorker(id)) {
    const Job& job = job_and_id->second->stored.job;
    std::vector<std::string> ranks;
    for (const v1::RankPlacement& p : job.placement()) {
      if (p.worker_id() == id) ranks.push_back(absl::StrCat(p.rank()));
    }
    Emit("worker.lost", job.id(), id, job.generation(),
         absl::StrCat("worker ", id, " lost (", silence, "); rank", ranks.size() == 1 ? " " : "s ",
                      absl::StrJoin(ranks, ", "), " of this job ran there"),
         deferred);
  }
  // Generations that already failed with this worker in them: if it was
  // silent since before that failure, its loss came first.
  const absl::Time last_heard = FromProto(w.worker.last_heartbeat());
  for (auto& [job_id, entry] : jobs_) {
    if (!entry->last_failure.has_value() || !entry->last_failure->workers.contains(id)) continue;
    const FailureCause& failure = *entry->last_failure;
    if (!failure.SilentBefore(last_heard)) continue;
    const std::string cause = absl::StrCat("worker ", id, " lost (", silence, ")");
    Emit("worker.lost", job_id, id, failure.generation,
         absl::StrCat(cause, "; it ran ranks of generation ", failure.generation,
                      " and was silent before that generation failed"),
         deferred);
    // The loss becomes the cause, at the earliest time any rank's exit
    // could be compared with (the failure's own rank times are the
    // workers' clocks).
    ReviseFailureCause(entry.get(), failure.generation, absl::InfinitePast(), cause, id, deferred);
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
      a->set_restarts(job.restarts());
    }
  }
  WorkerEntry& worker = workers_.at(worker_id);
  for (v1::StopOrder& stop : worker.pending_stops) *response.add_stops() = std::move(stop);
  worker.pending_stops.clear();
  response.set_assignments_version(assignments_version_);
  SetDuration(response.mutable_heartbeat_interval(), options_.heartbeat_interval);
  return response;
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
  if (base.has_resume_from()) {
    // The ranks load it; without this only their logs would say so.
    Emit("job.resumed", job.id(), "", job.generation(),
         absl::StrCat("resumed from step ", base.resume_from().step(), ", checkpoint ",
                      base.resume_from().path()),
         &deferred);
  }
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
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry,
                        FencedRank(request.job_id(), request.generation(), request.rank()));
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
  if (job.has_pausing() || entry->move_asked) {
    AnswerCheckpointAsk(entry, request, &response, &deferred);
  }
  return response;
}

absl::Status Coordinator::AppendMetrics(const v1::StreamMetricsRequest& request) {
  if (request.records_size() > 10000) {
    return absl::InvalidArgumentError("records: at most 10000 per message");
  }
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry,
                        FencedRank(request.job_id(), request.generation(), request.rank()));
  Job& job = entry->stored.job;
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

void Coordinator::LoadAwaitingCheckpoints(JobEntry* entry, Deferred* deferred) {
  const Job& job = entry->stored.job;
  if (absl::Status s = checkpoints_.LoadAwaiting(job, &entry->checkpoints); !s.ok()) {
    AIDN_LOG(ERROR) << "could not list checkpoints: " << s << Kv("job", job.id());
    return;
  }
  if (entry->checkpoints.awaiting_metrics.empty()) return;
  // The last process may have stored their metrics and not yet committed them.
  CompleteCheckpoints(entry, DurableInStore(entry), deferred);
  // Metrics of a generation that ended can no longer come.
  const bool running = HoldsSlots(job.state());
  std::erase_if(entry->checkpoints.awaiting_metrics, [&](const auto& step_and_generation) {
    return !running || step_and_generation.second != job.generation();
  });
}

MetricsDurable Coordinator::DurableInMemory(JobEntry* entry) {
  return [entry](int64_t step, int64_t generation) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    // Only what this generation stored counts: its checkpoints lie past the
    // step it resumed from, whose steps an earlier generation stored, and
    // the coordinator's idea of that step may be wrong (a checkpoint rank 0
    // found bad without being able to say so).
    const int64_t through = MetricIngest::StoredTrainStep(entry->metrics, generation);
    return step <= std::max<int64_t>(through, 0);
  };
}

MetricsDurable Coordinator::DurableInStore(JobEntry* entry) {
  return [this, entry](int64_t step, int64_t generation) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (DurableInMemory(entry)(step, generation)) return true;
    absl::StatusOr<std::optional<v1::StepMetrics>> last =
        store_->LastStepOfGeneration(entry->stored.job.id(), generation, step - 1);
    return last.ok() && last->has_value();
  };
}

std::vector<int64_t> Coordinator::CompleteCheckpoints(JobEntry* entry,
                                                      const MetricsDurable& durable,
                                                      Deferred* deferred) {
  Job& job = entry->stored.job;
  absl::StatusOr<AwaitedOutcome> done =
      checkpoints_.CompleteAwaiting(job, &entry->checkpoints, durable);
  if (!done.ok()) {
    AIDN_LOG(ERROR) << "could not commit checkpoints: " << done.status() << Kv("job", job.id());
    return {};
  }
  if (done->committed.empty()) return {};
  std::vector<int64_t> committed;
  for (const v1::Checkpoint& c : done->committed) {
    Emit("checkpoint.committed", job.id(), "", c.generation(),
         absl::StrCat("step ", c.step(), " at ", c.path(), " (its metrics are stored)"), deferred);
    committed.push_back(c.step());
  }
  for (int64_t step : checkpoints_.ApplyRetention(job, &entry->checkpoints, &done->checkpoints)) {
    entry->checkpoints.retired_untold.push_back(step);
  }
  job.set_last_checkpoint_step(CheckpointRegistry::NewestValidStep(done->checkpoints));
  (void)PersistJob(entry, deferred);
  return committed;
}

absl::StatusOr<v1::CommitCheckpointResponse> Coordinator::CommitCheckpoint(
    const v1::CommitCheckpointRequest& request) {
  AIDN_RETURN_IF_ERROR(CheckpointRegistry::ValidateCommit(request));
  v1::CommitCheckpointResponse response;
  AIDN_ASSIGN_OR_RETURN(const bool steps_in_memory, CommitCheckpointLocked(request, &response));
  // What the registry holds once this call is done: rank 0 deletes what it
  // does not (below this step). The other ranks do not ask.
  const auto add_held = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (request.rank() != 0) return;
    absl::StatusOr<std::vector<v1::Checkpoint>> held = store_->ListCheckpoints(request.job_id());
    if (!held.ok()) return;  // without the list, nothing is deleted
    for (const v1::Checkpoint& c : *held) response.add_held_steps(c.step());
  };
  if (!steps_in_memory) {
    absl::MutexLock lock(&mu_);
    add_held();
    return response;
  }
  // Written, and its steps are combined but not yet stored (a trainer
  // sends its records before the commit): store them now, so that this
  // call commits it rather than a later tick. Once per checkpoint.
  FlushSteps();
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<JobEntry*> found = FindJob(request.job_id());
  if (!found.ok()) return response;  // the report itself was recorded
  JobEntry* entry = *found;
  const std::vector<int64_t> committed =
      CompleteCheckpoints(entry, DurableInMemory(entry), &deferred);
  for (int64_t step : committed) {
    if (step == request.step()) response.set_committed(true);
  }
  if (!committed.empty()) CheckpointCommitted(entry, committed.back(), &deferred);
  std::vector<int64_t> retired(response.retired_steps().begin(), response.retired_steps().end());
  retired.insert(retired.end(), entry->checkpoints.retired_untold.begin(),
                 entry->checkpoints.retired_untold.end());
  entry->checkpoints.retired_untold.clear();
  std::sort(retired.begin(), retired.end());
  response.clear_retired_steps();
  for (int64_t step : retired) response.add_retired_steps(step);
  add_held();
  return response;
}

absl::StatusOr<bool> Coordinator::CommitCheckpointLocked(const v1::CommitCheckpointRequest& request,
                                                         v1::CommitCheckpointResponse* response) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, FencedJob(request.job_id(), request.generation()));
  Job& job = entry->stored.job;
  AIDN_ASSIGN_OR_RETURN(
      CommitOutcome outcome,
      checkpoints_.Commit(job, &entry->checkpoints, request, DurableInMemory(entry)));
  response->set_committed(outcome.committed);
  std::vector<int64_t> retired;
  retired.swap(entry->checkpoints.retired_untold);
  if (outcome.newly_committed) {
    Emit("checkpoint.committed", job.id(), "", request.generation(),
         absl::StrCat("step ", request.step(), " at ", request.path()), &deferred);
    for (int64_t step :
         checkpoints_.ApplyRetention(job, &entry->checkpoints, &outcome.checkpoints)) {
      retired.push_back(step);
    }
    job.set_last_checkpoint_step(CheckpointRegistry::NewestValidStep(outcome.checkpoints));
    (void)PersistJob(entry, &deferred);
    CheckpointCommitted(entry, request.step(), &deferred);
  }
  std::sort(retired.begin(), retired.end());
  for (int64_t step : retired) response->add_retired_steps(step);
  const StepLog* steps = entry->metrics.steps.get();
  return outcome.written && !outcome.committed && steps != nullptr &&
         steps->last_train() != nullptr &&
         steps->last_train()->generation() == request.generation() &&
         steps->last_train()->step() >= request.step();
}

absl::Status Coordinator::ReportCheckpointInvalid(
    const v1::ReportCheckpointInvalidRequest& request) {
  if (request.step() < 0) return absl::InvalidArgumentError("step: must be >= 0");
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry,
                        FencedRank(request.job_id(), request.generation(), request.rank()));
  Job& job = entry->stored.job;
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

}  // namespace aidn::coordinator
