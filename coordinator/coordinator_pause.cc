// Pausing and resuming a job: its ranks checkpoint at a step they agree on
// (checkpoint_agreement.h) and stop, and the job waits, PAUSED and holding
// no slots, until it is resumed from that checkpoint. Neither counts as a
// restart. What a Slurm allocation about to end, or a maintenance window,
// needs.

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/coordinator.h"
#include "coordinator/job_entry.h"
#include "coordinator/job_state.h"
#include "coordinator/time_util.h"

namespace aidn::coordinator {
namespace {

using v1::Job;

// The job's typical step time: the median of the ranks' newest ones; 0
// when none came (a command job that reports no step_seconds).
double TypicalStepSeconds(const JobHealth& health) {
  std::vector<double> seconds;
  for (const auto& [rank, window] : health.step_window) {
    if (!window.empty()) seconds.push_back(window.back());
  }
  if (seconds.empty()) return 0;
  auto middle = seconds.begin() + static_cast<std::ptrdiff_t>(seconds.size() / 2);
  std::nth_element(seconds.begin(), middle, seconds.end());
  return *middle;
}

AgreementInputs InputsOf(const Job& job, const JobHealth& health, std::chrono::milliseconds lead) {
  AgreementInputs in;
  in.lead = lead;
  in.world_size = job.spec().world_size();
  in.max_step = job.last_step();
  for (const auto& [rank, beat] : health.beats) in.max_step = std::max(in.max_step, beat.step);
  in.total_steps = job.total_steps();
  in.step_seconds = TypicalStepSeconds(health);
  return in;
}

}  // namespace

absl::StatusOr<Job> Coordinator::PauseJob(const std::string& job_id, const std::string& reason,
                                          const std::string& by) {
  // Stored with the job and sent with every rank's progress answer.
  if (reason.size() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("reason: at most 1024 bytes, got ", reason.size()));
  }
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, UnfinishedJob(job_id));
  Job& job = entry->stored.job;
  if (job.state() == Job::PAUSED) {
    return absl::FailedPreconditionError(absl::StrCat(job_id, " is already paused"));
  }
  // Asked twice (a script's retry): the first request stands.
  if (job.has_pausing()) return job;
  if (job.state() == Job::RUNNING && job.spec().checkpoint().dir().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        job_id,
        " writes no checkpoints (its spec has no checkpoint.dir), so pausing it would lose "
        "its progress: cancel it, or let it finish"));
  }
  v1::PauseRequest& pause = *job.mutable_pausing();
  pause.set_by(by);
  pause.set_reason(reason);
  pause.set_after_step(job.last_step());
  *pause.mutable_at() = ToProto(clock_->WallNow());
  if (job.state() != Job::RUNNING) {
    // Nothing trained since the checkpoint it would resume from.
    PauseNow(entry, PausedBy(pause), &deferred);
    Schedule(&deferred);
    return job;
  }
  // The ranks hear of it on their next progress beats.
  entry->agreement = {};
  const int64_t step = CheckpointAgreements::Propose(
      &entry->agreement, InputsOf(job, entry->health, options_.checkpoint_ask_lead));
  ++entry->version;
  (void)PersistJob(entry, &deferred);
  NotifyWatchers(job.id(), &deferred);
  Emit("job.pausing", job.id(), "", job.generation(),
       absl::StrCat("pause requested by ", by.empty() ? "unknown" : by,
                    reason.empty() ? "" : ": " + reason, "; the ranks checkpoint at step ", step,
                    " or later, then stop"),
       &deferred);
  return job;
}

absl::StatusOr<Job> Coordinator::ResumeJob(const std::string& job_id, const std::string& by) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, UnfinishedJob(job_id));
  Job& job = entry->stored.job;
  if (job.state() != Job::PAUSED) {
    return absl::FailedPreconditionError(
        absl::StrCat(job_id, " is not paused (", StateName(job.state()), ")"));
  }
  AIDN_RETURN_IF_ERROR(SetState(entry, Job::PENDING,
                                absl::StrCat("resumed by ", by.empty() ? "unknown" : by,
                                             job.last_checkpoint_step() > 0
                                                 ? absl::StrCat("; continues from checkpoint step ",
                                                                job.last_checkpoint_step())
                                                 : ""),
                                &deferred));
  Schedule(&deferred);
  return job;
}

void Coordinator::PauseNow(JobEntry* entry, const std::string& message, Deferred* deferred) {
  if (HoldsSlots(entry->stored.job.state())) EndGeneration(entry, message, deferred);
  (void)SetState(entry, Job::PAUSED, message, deferred);
}

void Coordinator::CheckpointCommitted(JobEntry* entry, int64_t step, Deferred* deferred) {
  Job& job = entry->stored.job;
  if (job.has_pausing() && HoldsSlots(job.state()) && step >= job.pausing().after_step()) {
    PauseNow(entry, absl::StrCat(PausedBy(job.pausing()), " (at checkpoint step ", step, ")"),
             deferred);
    Schedule(deferred);
    return;
  }
  MoveOffDrainingWorkers(entry, step, deferred);
}

void Coordinator::AnswerCheckpointAsk(JobEntry* entry, const v1::ReportProgressRequest& request,
                                      v1::ReportProgressResponse* response, Deferred* deferred) {
  Job& job = entry->stored.job;
  if (job.state() != Job::RUNNING) return;
  const std::string purpose = job.has_pausing() ? "to pause" : "to move off draining worker(s)";
  CheckpointAgreement& agreement = entry->agreement;
  const int64_t before = agreement.step;
  if (CheckpointAgreements::Beat(&agreement, request.rank(), request.checkpoint_ack(),
                                 request.checkpoint_missed(),
                                 InputsOf(job, entry->health, options_.checkpoint_ask_lead))) {
    if (agreement.go) {
      Emit("job.checkpoint_agreed", job.id(), "", job.generation(),
           absl::StrCat("every rank checkpoints at step ", agreement.step, " ", purpose), deferred);
    } else if (before != 0) {
      AIDN_LOG(INFO) << "a rank was past the proposed checkpoint step; proposing a later one"
                     << Kv("job", job.id()) << Kv("rank", request.rank()) << Kv("missed", before)
                     << Kv("step", agreement.step);
    }
  }
  v1::CheckpointRequest& checkpoint = *response->mutable_checkpoint();
  checkpoint.set_step(agreement.step);
  checkpoint.set_go(agreement.go);
  checkpoint.set_reason(job.has_pausing() ? PausedBy(job.pausing())
                                          : "moving off a draining worker");
}

void Coordinator::AskCheckpointsToMoveOff(const std::string& worker_id) {
  for (const JobRef job_and_id : JobsOnWorker(worker_id)) {
    JobEntry* entry = job_and_id->second.get();
    if (!entry->stored.job.spec().checkpoint().dir().empty()) entry->move_asked = true;
  }
}

}  // namespace aidn::coordinator
