// The coordinator's CoordinatorService calls (jobs, workers listed,
// checkpoints, events, metrics, watch streams) and its Prometheus series.

#include <algorithm>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status.h"
#include "common/token.h"
#include "coordinator/coordinator.h"
#include "coordinator/job_entry.h"
#include "coordinator/job_state.h"
#include "coordinator/parallel_spec.h"
#include "coordinator/time_util.h"
#include "google/protobuf/util/message_differencer.h"

namespace aidn::coordinator {

using v1::Job;

// ---------------------------------------------------------------------------
// CoordinatorService.

absl::StatusOr<Job> Coordinator::SubmitJob(v1::JobSpec spec, const std::string& owner) {
  ApplyJobSpecDefaults(options_.spec_limits, &spec);
  AIDN_RETURN_IF_ERROR(ValidateJobSpec(options_.spec_limits, spec));
  AIDN_ASSIGN_OR_RETURN(std::string token, RandomHex(24));

  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_RETURN_IF_ERROR(CheckPathsAllowedSomewhere(spec));
  if (spec.checkpoint().has_resume_from()) AIDN_RETURN_IF_ERROR(ResolveResumeFrom(&spec));
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
  auth_->AddToken(token, Principal{Role::kTrainer, "trainer:" + id, id, {}});
  Emit("job.submitted", id, "", 0,
       absl::StrCat("world_size ", job.spec().world_size(), ", model ", job.spec().model().name(),
                    owner.empty() ? "" : ", by " + owner),
       &deferred);
  unfinished_[entry->stored.number] = entry.get();
  jobs_[id] = std::move(entry);
  Schedule(&deferred);
  return jobs_[id]->stored.job;
}

absl::Status Coordinator::CheckPathsAllowedSomewhere(const v1::JobSpec& spec) {
  std::vector<std::string> roots;
  std::optional<PathOutside> first;
  for (const auto& [id, w] : workers_) {
    if (w.worker.state() != v1::Worker::ALIVE) continue;
    std::optional<PathOutside> outside = PathRefusedBy(spec, w.worker.info());
    if (!outside.has_value()) return absl::OkStatus();  // it may run there (or does not say)
    if (!first.has_value()) first = std::move(outside);
    roots.push_back(absl::StrCat(id, ": ", absl::StrJoin(w.worker.info().path_roots(), ", ")));
  }
  // No alive worker: placement tells later.
  if (!first.has_value()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      first->named.field, ": ", first->named.path,
      " is outside the paths every alive worker allows (", absl::StrJoin(roots, "; "),
      "); a worker's operator can add a root with --allowed-paths, or name a path under one"));
}

absl::Status Coordinator::ResolveResumeFrom(v1::JobSpec* spec) {
  v1::CheckpointSource* source = spec->mutable_checkpoint()->mutable_resume_from();
  const std::string field = "checkpoint.resume_from";
  absl::StatusOr<Job> found = JobRecord(source->job());
  if (absl::IsNotFound(found.status())) {
    return absl::NotFoundError(absl::StrCat(field, ": there is no job ", source->job()));
  }
  AIDN_RETURN_IF_ERROR(found.status());
  const v1::JobSpec& theirs = found->spec();
  if (theirs.has_command()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": job ", source->job(), " runs a command; its checkpoints are its program's own"));
  }
  // The weights must fit: the same model, whatever activation
  // checkpointing does to its memory.
  v1::ModelSpec mine = spec->model(), other = theirs.model();
  mine.clear_activation_checkpointing();
  other.clear_activation_checkpointing();
  if (!google::protobuf::util::MessageDifferencer::Equals(mine, other)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": job ", source->job(), " trained another model (",
        theirs.model().ShortDebugString(), "); this job's is ", spec->model().ShortDebugString()));
  }
  if (spec->optimizer().name() != theirs.optimizer().name()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": job ", source->job(),
                                                   " used optimizer ", theirs.optimizer().name(),
                                                   ", this job ", spec->optimizer().name()));
  }
  // The same samples per step, so that the step goes on where it stopped.
  // Pipeline and tensor groups share their replica's samples.
  auto global_batch = [](const v1::JobSpec& s) {
    return int64_t{s.batch_size()} * std::max(1, s.grad_accum_steps()) * DataReplicas(s);
  };
  if (global_batch(*spec) != global_batch(theirs)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": job ", source->job(), " trained with a global batch of ", global_batch(theirs),
        " (batch_size ", theirs.batch_size(), " x grad_accum_steps ",
        std::max(1, theirs.grad_accum_steps()), " x data-parallel replicas ", DataReplicas(theirs),
        "); this job's is ", global_batch(*spec),
        ": set batch_size or grad_accum_steps so that "
        "they match"));
  }
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::Checkpoint> checkpoints,
                        store_->ListCheckpoints(source->job()));
  const v1::Checkpoint* chosen = nullptr;
  std::vector<std::string> valid;
  for (const v1::Checkpoint& c : checkpoints) {
    if (!CheckpointRegistry::Valid(c)) continue;
    valid.push_back(absl::StrCat(c.step()));
    if (source->step() == 0 ? (chosen == nullptr || c.step() > chosen->step())
                            : c.step() == source->step()) {
      chosen = &c;
    }
  }
  if (chosen == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        field, ": job ", source->job(), " has no committed, valid checkpoint",
        source->step() == 0 ? "" : absl::StrCat(" of step ", source->step()),
        valid.empty() ? "" : absl::StrCat(" (it has steps ", absl::StrJoin(valid, ", "), ")")));
  }
  source->set_step(chosen->step());
  return absl::OkStatus();
}

absl::StatusOr<Job> Coordinator::GetJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  return JobRecord(job_id);
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(
    const v1::ListJobsRequest& request, const std::function<bool(const v1::Job&)>& visible) {
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
  const auto matches = [&](const Job& job) {
    return (states.empty() || states.contains(job.state())) &&
           (visible == nullptr || visible(job)) && labels_match(job);
  };
  // The jobs in memory, and those only in the store (finished, archived),
  // merged by number, newest first. One past the page says whether there
  // is a next one.
  const size_t wanted = static_cast<size_t>(page_size) + 1;
  std::map<int64_t, Job, std::greater<>> page;
  std::set<int64_t> in_memory;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<int64_t, const Job*>> matching;
    for (const auto& [id, entry] : jobs_) {
      if (entry->stored.number >= below) continue;
      in_memory.insert(entry->stored.number);
      if (matches(entry->stored.job))
        matching.emplace_back(entry->stored.number, &entry->stored.job);
    }
    const size_t keep = std::min(wanted, matching.size());
    std::partial_sort(matching.begin(), matching.begin() + static_cast<ptrdiff_t>(keep),
                      matching.end(),
                      [](const auto& a, const auto& b) { return a.first > b.first; });
    for (size_t i = 0; i < keep; ++i) page.emplace(matching[i].first, *matching[i].second);
  }
  // A job archived after the copy above is in the store as it was in memory.
  const std::vector<int> wanted_states(states.begin(), states.end());
  AIDN_RETURN_IF_ERROR(store_->ScanJobs(
      below, wanted_states,
      [&](int64_t number) {
        // Done once the page is full of newer jobs; those in memory are in it already.
        if (page.size() == wanted && number < page.rbegin()->first) return Store::ScanNext::kStop;
        return in_memory.contains(number) ? Store::ScanNext::kSkip : Store::ScanNext::kRead;
      },
      [&](StoredJob stored) {
        if (matches(stored.job)) {
          page.emplace(stored.number, std::move(stored.job));
          if (page.size() > wanted) page.erase(std::prev(page.end()));
        }
      }));
  v1::ListJobsResponse response;
  int64_t last = 0;
  for (auto& [number, job] : page) {
    if (response.jobs_size() == page_size) {
      response.set_next_page_token(absl::StrCat(last));
      break;
    }
    *response.add_jobs() = std::move(job);
    last = number;
  }
  return response;
}

absl::StatusOr<JobEntry*> Coordinator::UnfinishedJob(const std::string& job_id) {
  absl::StatusOr<JobEntry*> found = FindJob(job_id);
  if (!found.ok()) {
    // Only finished jobs leave memory.
    AIDN_ASSIGN_OR_RETURN(const Job archived, JobRecord(job_id));
    return absl::FailedPreconditionError(
        absl::StrCat(job_id, " has already ended (", StateName(archived.state()), ")"));
  }
  const Job::State state = (*found)->stored.job.state();
  if (IsTerminal(state)) {
    return absl::FailedPreconditionError(
        absl::StrCat(job_id, " has already ended (", StateName(state), ")"));
  }
  return found;
}

absl::StatusOr<Job> Coordinator::CancelJob(const std::string& job_id, const std::string& reason,
                                           const std::string& by) {
  Deferred deferred;
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(JobEntry * entry, UnfinishedJob(job_id));
  Job& job = entry->stored.job;
  const std::string who = by.empty() ? "" : " by " + by;
  const std::string message = reason.empty()
                                  ? absl::StrCat("cancelled", by.empty() ? " by user" : who)
                                  : absl::StrCat("cancelled", who, ": ", reason);
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
  AIDN_RETURN_IF_ERROR(JobRecord(job_id).status());
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::Checkpoint> checkpoints, store_->ListCheckpoints(job_id));
  v1::ListCheckpointsResponse response;
  for (v1::Checkpoint& c : checkpoints) *response.add_checkpoints() = std::move(c);
  return response;
}

absl::StatusOr<v1::ListEventsResponse> Coordinator::ListEvents(
    const v1::ListEventsRequest& request) {
  const int limit = request.limit() <= 0 ? 1000 : std::min(request.limit(), 10000);
  absl::MutexLock lock(&mu_);
  if (!request.job_id().empty()) AIDN_RETURN_IF_ERROR(JobRecord(request.job_id()).status());
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
    AIDN_RETURN_IF_ERROR(JobRecord(request.job_id()).status());
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
    AIDN_RETURN_IF_ERROR(JobRecord(job_id).status());
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
    if (shutting_down_) return ShuttingDownError();
    absl::StatusOr<JobEntry*> found = FindJob(request.job_id());
    if (found.ok()) {
      JobEntry* entry = *found;
      const StepLog* steps = entry->metrics.steps.get();
      AIDN_ASSIGN_OR_RETURN(bool added, watch_.PollMemory(request, entry->stored.job,
                                                          entry->version, steps, cursor, &batch));
      if (added) quiet = false;
      terminal =
          IsTerminal(entry->stored.job.state()) && (steps == nullptr || steps->pending() == 0);
    } else {
      // Finished and out of memory: the record and every step are stored,
      // and it changes no more (the newest version).
      AIDN_ASSIGN_OR_RETURN(const Job job, JobRecord(request.job_id()));
      AIDN_ASSIGN_OR_RETURN(bool added,
                            watch_.PollMemory(request, job, INT64_MAX, nullptr, cursor, &batch));
      if (added) quiet = false;
      terminal = true;
    }
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
    cursor->catching_up = false;
    // A job out of memory has no steps there to follow.
    if (absl::StatusOr<JobEntry*> entry = FindJob(request.job_id()); entry.ok()) {
      cursor->metrics_seq = (*entry)->metrics.stored_seq;
    } else {
      AIDN_RETURN_IF_ERROR(JobRecord(request.job_id()).status());
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Prometheus.

void Coordinator::CollectMetrics() {
  absl::MutexLock lock(&mu_);
  const Clock::TimePoint now = clock_->Now();
  std::map<Job::State, int64_t> by_state;
  for (int s = Job::PENDING; s <= Job::PAUSED; ++s) by_state[static_cast<Job::State>(s)] = 0;
  for (const auto& [state, count] : archived_by_state_) {
    by_state[static_cast<Job::State>(state)] += count;
  }
  std::set<std::string> past_retention;
  for (auto& [id, entry] : jobs_) {
    ++by_state[entry->stored.job.state()];
    if (!ingest_.CollectJob(entry->stored.job, &entry->metrics, entry->health, now)) {
      past_retention.insert(id);
    }
  }
  ingest_.RemoveSeriesOfJobs(past_retention);
  for (const std::string& id : past_retention) MetricIngest::SeriesRemoved(&jobs_[id]->metrics);
  for (const auto& [state, count] : by_state) {
    metrics_.jobs.Add({{"state", StateName(state)}}).Set(static_cast<double>(count));
  }
  metrics_.jobs_in_memory.Set(static_cast<double>(jobs_.size()));
  metrics_.jobs_unstored.Set(static_cast<double>(unstored_jobs_.size()));
  CollectWorkerSeries(now);
}

void Coordinator::CollectWorkerSeries(Clock::TimePoint now) {
  for (const auto& [id, w] : workers_) {
    const v1::Worker worker = WorkerView(id, w);
    const bool alive = worker.state() != v1::Worker::LOST;
    const metrics::Labels labels{{"worker_id", id}};
    metrics_.worker_up.Add(labels).Set(alive ? 1 : 0);
    for (const v1::Worker::Scheduling s :
         {v1::Worker::SCHEDULABLE, v1::Worker::CORDONED, v1::Worker::DRAINING}) {
      metrics_.worker_scheduling
          .Add({{"worker_id", id},
                {"scheduling", absl::AsciiStrToLower(v1::Worker::Scheduling_Name(s))}})
          .Set(worker.scheduling() == s ? 1 : 0);
    }
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
