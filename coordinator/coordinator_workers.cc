// Operating workers, as an admin does to a node: cordon (no new ranks),
// drain (also move the running jobs off at a checkpoint asked for now),
// uncordon, and remove a worker that is gone for good.

#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "coordinator/coordinator.h"
#include "coordinator/job_entry.h"
#include "coordinator/job_state.h"

namespace aidn::coordinator {
namespace {

using v1::Job;
using v1::Worker;

std::string SchedulingName(Worker::Scheduling scheduling) {
  switch (scheduling) {
    case Worker::CORDONED:
      return "cordoned";
    case Worker::DRAINING:
      return "draining";
    default:
      return "schedulable";
  }
}

}  // namespace

absl::StatusOr<Worker> Coordinator::SetWorkerScheduling(const std::string& worker_id,
                                                        Worker::Scheduling scheduling,
                                                        const std::string& reason,
                                                        const std::string& by) {
  if (!Worker::Scheduling_IsValid(scheduling)) {
    return absl::InvalidArgumentError(absl::StrCat("scheduling: unknown value ",
                                                   static_cast<int>(scheduling),
                                                   " (SCHEDULABLE, CORDONED or DRAINING)"));
  }
  if (reason.size() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("reason: at most 1024 bytes, got ", reason.size()));
  }
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("no worker \"", worker_id, "\""));
  }
  WorkerEntry& w = it->second;
  if (w.worker.scheduling() == scheduling) return WorkerView(worker_id, w);
  const std::string who = by.empty() ? "unknown" : by;
  w.worker.set_scheduling(scheduling);
  if (scheduling == Worker::SCHEDULABLE) {
    w.worker.clear_scheduling_reason();
  } else {
    w.worker.set_scheduling_reason(reason.empty() ? who : absl::StrCat(who, ": ", reason));
  }
  PersistWorker(w);

  std::string message = absl::StrCat(SchedulingName(scheduling), " by ", who);
  if (!reason.empty()) absl::StrAppend(&message, ": ", reason);
  if (scheduling == Worker::DRAINING) {
    // Say what will happen to each job there.
    std::vector<std::string> moving, staying;
    for (const JobRef job_and_id : JobsOnWorker(worker_id)) {
      const Job& job = job_and_id->second->stored.job;
      (job.spec().checkpoint().dir().empty() ? staying : moving).push_back(job.id());
    }
    AskCheckpointsToMoveOff(worker_id);
    if (!moving.empty()) {
      absl::StrAppend(&message, "; moving at a checkpoint their ranks are asked for now: ",
                      absl::StrJoin(moving, ", "));
    }
    if (!staying.empty()) {
      absl::StrAppend(&message, "; taking no checkpoints, so running to their end here: ",
                      absl::StrJoin(staying, ", "));
    }
  }
  Emit(scheduling == Worker::SCHEDULABLE ? "worker.uncordoned"
                                         : absl::StrCat("worker.", SchedulingName(scheduling)),
       "", worker_id, 0, message, &deferred);
  // Uncordoned: jobs waiting for room may fit now.
  if (scheduling == Worker::SCHEDULABLE) Schedule(&deferred);
  return WorkerView(worker_id, w);
}

absl::Status Coordinator::RemoveWorker(const std::string& worker_id, const std::string& by) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("no worker \"", worker_id, "\""));
  }
  if (it->second.worker.state() != Worker::LOST) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker \"", worker_id,
        "\" is alive; only a LOST worker can be removed: drain it, then stop its daemon "
        "(it is LOST once silent for the worker timeout, ",
        options_.worker_timeout.count(), " ms)"));
  }
  AIDN_RETURN_IF_ERROR(store_->DeleteWorker(worker_id));
  // A heartbeat of its still parked (it went silent after sending it) is
  // answered now, as a heartbeat of an unknown worker is.
  held_.FailWorker(
      worker_id,
      absl::NotFoundError(absl::StrCat("worker \"", worker_id, "\" was removed; register again")),
      &deferred);
  workers_.erase(it);
  PlacementsChanged();
  // Its series go with it.
  for (metrics::Family<metrics::Gauge>* family :
       {&metrics_.worker_up, &metrics_.worker_scheduling, &metrics_.worker_heartbeat_age_seconds,
        &metrics_.worker_slots, &metrics_.worker_slots_used, &metrics_.worker_slots_free}) {
    family->RemoveMatching({{"worker_id", worker_id}});
  }
  Emit("worker.removed", "", worker_id, 0, absl::StrCat("removed by ", by.empty() ? "unknown" : by),
       &deferred);
  return absl::OkStatus();
}

void Coordinator::MoveOffDrainingWorkers(JobEntry* entry, int64_t step, Deferred* deferred) {
  Job& job = entry->stored.job;
  if (!HoldsSlots(job.state())) return;
  std::set<std::string> draining;
  for (const v1::RankPlacement& p : job.placement()) {
    auto it = workers_.find(p.worker_id());
    if (it != workers_.end() && it->second.worker.scheduling() == Worker::DRAINING) {
      draining.insert(p.worker_id());
    }
  }
  if (draining.empty()) return;
  const int64_t generation = job.generation();
  const std::string reason =
      absl::StrCat("moving off draining worker(s) ", absl::StrJoin(draining, ", "),
                   " at checkpoint step ", step);
  EndGeneration(entry, reason, deferred);
  // Placed again on the next schedule, at once: no backoff, no restart counted.
  entry->restart_at = clock_->Now();
  Emit("job.moving", job.id(), "", generation, reason, deferred);
  (void)SetState(entry, Job::RESTARTING, reason, deferred);
  Schedule(deferred);
}

void Coordinator::EndGeneration(JobEntry* entry, const std::string& reason, Deferred* deferred) {
  Job& job = entry->stored.job;
  const int64_t generation = job.generation();
  ReleaseGeneration(entry, reason,
                    absl::FailedPreconditionError(absl::StrCat("generation ", generation, " of ",
                                                               job.id(), " ended: ", reason)),
                    deferred);
  job.set_generation(generation + 1);
  job.clear_placement();
  PlacementsChanged();
}

}  // namespace aidn::coordinator
