#include "coordinator/watch_streams.h"

#include <algorithm>
#include <utility>

#include "common/status.h"

namespace aidn::coordinator {

void WatchSubscribers::Add(const std::string& job_id, WatchSubscriber* subscriber) {
  absl::MutexLock lock(&mu_);
  subscribers_[job_id].insert(subscriber);
}

void WatchSubscribers::Remove(const std::string& job_id, WatchSubscriber* subscriber) {
  absl::MutexLock lock(&mu_);
  auto it = subscribers_.find(job_id);
  if (it == subscribers_.end()) return;
  it->second.erase(subscriber);
  if (it->second.empty()) subscribers_.erase(it);
}

void WatchSubscribers::Notify(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = subscribers_.find(job_id);
  if (it == subscribers_.end()) return;
  for (WatchSubscriber* s : it->second) s->Notify();
}

std::vector<std::string> WatchSubscribers::Jobs() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> jobs;
  jobs.reserve(subscribers_.size());
  for (const auto& [job_id, subscribers] : subscribers_) jobs.push_back(job_id);
  return jobs;
}

absl::StatusOr<bool> WatchStreams::PollMemory(const v1::WatchJobRequest& request,
                                              const v1::Job& job, int64_t version,
                                              const StepLog* steps, WatchCursor* cursor,
                                              WatchBatch* batch) {
  bool added = false;
  if (version > cursor->job_version_sent) {
    *batch->items.emplace_back().mutable_job() = job;
    cursor->job_version_sent = version;
    added = true;
  }
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::Event> events,
                        store_->ListEvents(request.job_id(), cursor->last_event_seq, 256));
  for (v1::Event& e : events) {
    cursor->last_event_seq = e.seq();
    *batch->items.emplace_back().mutable_event() = std::move(e);
    added = true;
  }
  if (!request.include_metrics() || cursor->catching_up || steps == nullptr) return added;
  std::vector<v1::StepMetrics> out;
  int64_t last = 0;
  const int64_t from = std::max(request.from_step(), cursor->last_step_sent + 1);
  if (!steps->After(cursor->metrics_seq, request.from_step(), kMaxSteps, &out, &last)) {
    // This watcher fell behind what memory holds: read the rest back.
    cursor->catching_up = true;
    cursor->next_step = from;
    return added;
  }
  cursor->metrics_seq = last;
  for (v1::StepMetrics& step : out) {
    cursor->last_step_sent = step.step();
    *batch->items.emplace_back().mutable_step() = std::move(step);
  }
  return added || !out.empty();
}

absl::StatusOr<bool> WatchStreams::ReadStored(const v1::WatchJobRequest& request,
                                              WatchCursor* cursor, WatchBatch* batch) {
  constexpr int kMax = static_cast<int>(kMaxSteps);
  AIDN_ASSIGN_OR_RETURN(std::vector<v1::StepMetrics> steps,
                        store_->GetSteps(request.job_id(), cursor->next_step, 0, kMax));
  const bool more = static_cast<int>(steps.size()) == kMax;
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
  return !more;
}

}  // namespace aidn::coordinator
