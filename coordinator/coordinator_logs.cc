// Coordinator: the ranks' output lines (ShipLogs, ReadLogs) and their
// retention. The store does the work; this file finds the jobs under the
// lock and wakes the followers.

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/coordinator.h"
#include "coordinator/job_entry.h"
#include "coordinator/job_state.h"

namespace aidn::coordinator {
namespace {

constexpr absl::Duration kWakeFollowersEvery = absl::Seconds(1);
constexpr absl::Duration kPruneEvery = absl::Minutes(1);

}  // namespace

absl::Status Coordinator::ShipLogs(const v1::ShipLogsRequest& request) {
  AIDN_RETURN_IF_ERROR(JobLogs::Validate(request));
  std::vector<v1::LogChunk> chunks;
  std::set<std::string> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const v1::LogChunk& c : request.chunks()) {
      // A job this coordinator does not know (or whose lines retention
      // deleted) is not coming back: its lines are acknowledged and dropped,
      // so the worker does not send them forever.
      if (!jobs_.contains(c.job_id()) || logs_deleted_.contains(c.job_id())) continue;
      chunks.push_back(c);
      jobs.insert(c.job_id());
    }
  }
  // Outside the lock: a batch of lines is a transaction of its own, which
  // jobs and heartbeats need not wait behind.
  absl::StatusOr<int64_t> stored = logs_.Append(chunks);
  if (!stored.ok()) {
    AIDN_LOG(WARNING) << "could not store log lines" << Kv("worker", request.worker_id())
                      << Kv("error", stored.status());
    return stored.status();
  }
  for (const std::string& job_id : jobs) log_followers_.Notify(job_id);
  return absl::OkStatus();
}

absl::Status Coordinator::SubscribeLogs(const std::string& job_id, WatchSubscriber* subscriber) {
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return ShuttingDownError();
    AIDN_RETURN_IF_ERROR(JobRecord(job_id).status());
  }
  log_followers_.Add(job_id, subscriber);
  return absl::OkStatus();
}

void Coordinator::UnsubscribeLogs(const std::string& job_id, WatchSubscriber* subscriber) {
  log_followers_.Remove(job_id, subscriber);
}

absl::StatusOr<LogBatch> Coordinator::PollLogs(const v1::ReadLogsRequest& request,
                                               LogCursor* cursor) {
  AIDN_RETURN_IF_ERROR(JobLogs::Validate(request));
  v1::Job job;
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return ShuttingDownError();
    AIDN_ASSIGN_OR_RETURN(job, JobRecord(request.job_id()));
  }
  return logs_.Poll(request, job, clock_->WallNow(), cursor);
}

void Coordinator::TickLogs() {
  const absl::Time now = absl::Now();
  if (now - logs_woken_ >= kWakeFollowersEvery) {
    logs_woken_ = now;
    for (const std::string& job_id : log_followers_.Jobs()) log_followers_.Notify(job_id);
  }
  if (options_.logs.retention.count() <= 0 || now - logs_pruned_ < kPruneEvery) return;
  logs_pruned_ = now;
  // From the store: finished jobs leave memory before their lines do.
  absl::StatusOr<std::vector<std::string>> due = store_->JobsWithLogsFinishedBefore(
      clock_->WallNow() - absl::FromChrono(options_.logs.retention));
  if (!due.ok()) {
    AIDN_LOG(WARNING) << "could not find finished jobs' log lines" << Kv("error", due.status());
    return;
  }
  for (const std::string& id : *due) {
    absl::Status s = store_->DeleteLogs(id);
    if (!s.ok()) {
      AIDN_LOG(WARNING) << "could not delete a finished job's log lines" << Kv("job", id)
                        << Kv("error", s);
      continue;
    }
    AIDN_LOG(INFO) << "log lines deleted: past their retention" << Kv("job", id);
    absl::MutexLock lock(&mu_);
    logs_deleted_.insert(id);
  }
}

}  // namespace aidn::coordinator
