#include "coordinator/checkpoint_registry.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/spec.h"
#include "coordinator/time_util.h"

namespace aidn::coordinator {
namespace {

// A checkpoint's invalid_reason is at most this long.
constexpr size_t kMaxInvalidReason = 1024;

// Whether keep_last retention retires `c`, given the valid steps newest
// first and the step being resumed from.
bool Retires(const v1::Checkpoint& c, const std::vector<int64_t>& valid, int keep,
             int64_t generation, int64_t resumed_from_step) {
  // Ranks may still be reading it.
  if (c.step() == resumed_from_step) return false;
  const int64_t newest_valid = valid.front();
  if (!c.invalid_reason().empty()) {
    // Never resumed from again; one newer than every valid checkpoint is
    // kept until a newer valid one exists, so that it can still be looked at.
    return c.step() < newest_valid;
  }
  if (c.committed()) return std::find(valid.begin(), valid.end(), c.step()) - valid.begin() >= keep;
  // Half written by a generation that is gone: it will never commit.
  return c.generation() < generation && c.step() < newest_valid;
}

}  // namespace

absl::Status CheckpointRegistry::ValidateCommit(const v1::CommitCheckpointRequest& request) {
  AIDN_RETURN_IF_ERROR(ValidateSpecPath("path", request.path()));
  if (request.step() < 0) return absl::InvalidArgumentError("step: must be >= 0");
  if (request.writer_ranks().empty()) {
    return absl::InvalidArgumentError("writer_ranks: must name the ranks that write");
  }
  return absl::OkStatus();
}

absl::StatusOr<CommitOutcome> CheckpointRegistry::Commit(const v1::Job& job, JobCheckpoints* state,
                                                         const v1::CommitCheckpointRequest& request,
                                                         const MetricsDurable& durable) {
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
  CommitOutcome outcome;
  AIDN_ASSIGN_OR_RETURN(outcome.checkpoints, store_->ListCheckpoints(job.id()));
  std::vector<v1::Checkpoint>& existing = outcome.checkpoints;
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
  outcome.written = Written(checkpoint);
  const bool committed =
      was_committed || (outcome.written && durable(checkpoint.step(), checkpoint.generation()));
  checkpoint.set_committed(committed);
  AIDN_RETURN_IF_ERROR(store_->PutCheckpoint(checkpoint));
  if (outcome.written && !committed) {
    state->awaiting_metrics[checkpoint.step()] = checkpoint.generation();
  } else {
    state->awaiting_metrics.erase(checkpoint.step());
  }
  outcome.committed = committed;
  outcome.newly_committed = committed && !was_committed;
  return outcome;
}

absl::StatusOr<AwaitedOutcome> CheckpointRegistry::CompleteAwaiting(const v1::Job& job,
                                                                    JobCheckpoints* state,
                                                                    const MetricsDurable& durable) {
  AwaitedOutcome outcome;
  std::map<int64_t, int64_t> ready;
  for (const auto& [step, generation] : state->awaiting_metrics) {
    if (durable(step, generation)) ready.emplace(step, generation);
  }
  if (ready.empty()) return outcome;
  AIDN_ASSIGN_OR_RETURN(outcome.checkpoints, store_->ListCheckpoints(job.id()));
  for (v1::Checkpoint& c : outcome.checkpoints) {
    auto it = ready.find(c.step());
    if (it == ready.end() || it->second != c.generation() || c.committed() ||
        !c.invalid_reason().empty() || !Written(c)) {
      continue;
    }
    c.set_committed(true);
    AIDN_RETURN_IF_ERROR(store_->PutCheckpoint(c));
    outcome.committed.push_back(c);
  }
  // Those gone from the store (retired, or started over) await nothing.
  for (const auto& [step, generation] : ready) state->awaiting_metrics.erase(step);
  return outcome;
}

absl::Status CheckpointRegistry::LoadAwaiting(const v1::Job& job, JobCheckpoints* state) {
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::Checkpoint> checkpoints, store_->ListCheckpoints(job.id()));
  for (const v1::Checkpoint& c : checkpoints) {
    if (Written(c) && !c.committed() && c.invalid_reason().empty()) {
      state->awaiting_metrics[c.step()] = c.generation();
    }
  }
  return absl::OkStatus();
}

bool CheckpointRegistry::Written(const v1::Checkpoint& c) {
  std::set<int> reported(c.ranks_reported().begin(), c.ranks_reported().end());
  for (int r : c.ranks_expected()) {
    if (!reported.contains(r)) return false;
  }
  return true;
}

std::vector<int64_t> CheckpointRegistry::ApplyRetention(const v1::Job& job, JobCheckpoints* state,
                                                        std::vector<v1::Checkpoint>* checkpoints) {
  const int keep = std::max(1, job.spec().checkpoint().keep_last());
  std::vector<int64_t> valid;  // newest first
  for (const v1::Checkpoint& c : *checkpoints) {
    if (Valid(c)) valid.push_back(c.step());
  }
  std::sort(valid.rbegin(), valid.rend());
  if (valid.empty()) return {};
  std::vector<int64_t> retired;
  for (const v1::Checkpoint& c : *checkpoints) {
    if (!Retires(c, valid, keep, job.generation(), state->resumed_from_step)) continue;
    absl::Status s = store_->DeleteCheckpoint(job.id(), c.step());
    if (!s.ok()) {
      AIDN_LOG(ERROR) << "could not retire checkpoint: " << s << Kv("job", job.id())
                      << Kv("step", c.step());
      continue;
    }
    retired.push_back(c.step());
    state->awaiting_metrics.erase(c.step());
  }
  std::sort(retired.begin(), retired.end());
  if (!retired.empty()) {
    AIDN_LOG(INFO) << "checkpoints retired" << Kv("job", job.id())
                   << Kv("steps", absl::StrJoin(retired, ",")) << Kv("keep_last", keep);
  }
  std::erase_if(*checkpoints, [&](const v1::Checkpoint& c) {
    return std::binary_search(retired.begin(), retired.end(), c.step());
  });
  return retired;
}

absl::StatusOr<InvalidOutcome> CheckpointRegistry::MarkInvalid(
    const v1::Job& job, JobCheckpoints* state, const v1::ReportCheckpointInvalidRequest& request) {
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::Checkpoint> checkpoints, store_->ListCheckpoints(job.id()));
  auto it = std::find_if(checkpoints.begin(), checkpoints.end(),
                         [&](const v1::Checkpoint& c) { return c.step() == request.step(); });
  if (it == checkpoints.end()) {
    return absl::NotFoundError(
        absl::StrCat("no checkpoint of ", job.id(), " at step ", request.step()));
  }
  InvalidOutcome outcome;
  // Every rank that tries it finds it bad; the first one says so.
  if (!it->invalid_reason().empty()) {
    outcome.already = true;
    return outcome;
  }
  std::string reason = request.reason().empty() ? "no reason given" : request.reason();
  if (reason.size() > kMaxInvalidReason) reason = reason.substr(0, kMaxInvalidReason) + "...";
  it->set_invalid_reason(reason);
  AIDN_RETURN_IF_ERROR(store_->PutCheckpoint(*it));
  if (state->resumed_from_step == request.step()) {
    // The ranks go on to the next candidate, the newest valid one below.
    state->resumed_from_step = -1;
    for (const v1::Checkpoint& c : checkpoints) {
      if (Valid(c) && c.step() < request.step() && c.generation() < job.generation()) {
        state->resumed_from_step = std::max(state->resumed_from_step, c.step());
      }
    }
  }
  outcome.path = it->path();
  outcome.reason = std::move(reason);
  outcome.newest_valid_step = NewestValidStep(checkpoints);
  return outcome;
}

void CheckpointRegistry::FillResume(const v1::Job& job, JobCheckpoints* state,
                                    v1::JoinRendezvousResponse* response) {
  state->resumed_from_step = -1;
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
  if (!response->resume_candidates().empty()) {
    *response->mutable_resume_from() = response->resume_candidates(0);
    state->resumed_from_step = response->resume_from().step();
    return;
  }
  response->clear_resume_from();
  if (!job.spec().checkpoint().has_resume_from()) return;
  // Nothing of its own yet: the checkpoint of another job the spec names
  // (pinned at submission). One that is gone still goes to the ranks, without
  // a path, so that they fail saying so rather than start afresh.
  const v1::CheckpointSource& source = job.spec().checkpoint().resume_from();
  v1::Checkpoint candidate;
  candidate.set_job_id(source.job());
  candidate.set_step(source.step());
  absl::StatusOr<std::vector<v1::Checkpoint>> theirs = store_->ListCheckpoints(source.job());
  if (theirs.ok()) {
    for (const v1::Checkpoint& c : *theirs) {
      if (c.step() == source.step() && Valid(c)) candidate = c;
    }
  }
  *response->add_resume_candidates() = candidate;
  *response->mutable_resume_from() = candidate;
}

int64_t CheckpointRegistry::NewestValidStep(const std::vector<v1::Checkpoint>& checkpoints) {
  int64_t newest = 0;
  for (const v1::Checkpoint& c : checkpoints) {
    if (Valid(c)) newest = std::max(newest, c.step());
  }
  return newest;
}

}  // namespace aidn::coordinator
