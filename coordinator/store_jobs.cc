// The jobs in the store: table jobs (schema v1, finished_us from v5,
// store.cc).

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "coordinator/sqlite_util.h"
#include "coordinator/store.h"

namespace aidn::coordinator {
namespace {

using sqlite_util::Parse;
using sqlite_util::Serialize;
using sqlite_util::Statement;

// When the job finished, in microseconds since the epoch (at least 1); 0 if
// it has not.
int64_t FinishedMicros(const v1::Job& job) {
  if (!job.has_finished_at()) return 0;
  const absl::Time t = absl::FromUnixSeconds(job.finished_at().seconds()) +
                       absl::Nanoseconds(job.finished_at().nanos());
  return std::max<int64_t>(1, absl::ToUnixMicros(t));
}

// Reads the row's columns id, number, trainer_token, job (from `first` on).
absl::Status ReadJob(Statement& select, int first, StoredJob* job) {
  job->number = select.ColumnInt64(first + 1);
  job->trainer_token = select.ColumnText(first + 2);
  return Parse(select.ColumnBytes(first + 3), "jobs", select.ColumnBytes(first), &job->job);
}

}  // namespace

absl::Status Store::PutJob(const StoredJob& job) {
  const std::string& id = job.job.id();
  const std::string context = absl::StrCat("put job ", id);
  if (id.empty()) return absl::InvalidArgumentError("store: put job: the job has no id");
  AIDN_ASSIGN_OR_RETURN(std::string blob, Serialize(job.job, context));
  absl::MutexLock lock(&mu_);
  // An upsert rather than INSERT OR REPLACE: REPLACE would silently delete a
  // different job holding the same number; this refuses with ALREADY_EXISTS.
  AIDN_ASSIGN_OR_RETURN(Statement upsert, Statement::Prepare(db_, R"sql(
      INSERT INTO jobs(id, number, state, trainer_token, job, finished_us) VALUES(?, ?, ?, ?, ?, ?)
      ON CONFLICT(id) DO UPDATE SET
        number = excluded.number, state = excluded.state,
        trainer_token = excluded.trainer_token, job = excluded.job,
        finished_us = excluded.finished_us)sql",
                                                             context));
  upsert.BindText(1, id);
  upsert.BindInt64(2, job.number);
  upsert.BindInt64(3, job.job.state());
  upsert.BindText(4, job.trainer_token);
  upsert.BindBlob(5, blob);
  upsert.BindInt64(6, FinishedMicros(job.job));
  return upsert.Run();
}

absl::StatusOr<std::vector<StoredJob>> Store::LoadJobs(absl::Time finished_since) {
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(Statement select, Statement::Prepare(db_, R"sql(
      SELECT id, number, trainer_token, job FROM jobs
      WHERE finished_us = 0 OR finished_us >= ? ORDER BY number)sql",
                                                             "load jobs"));
  select.BindInt64(1, finished_since == absl::InfinitePast()
                          ? 0
                          : std::max<int64_t>(1, absl::ToUnixMicros(finished_since)));
  std::vector<StoredJob> jobs;
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) break;
    AIDN_RETURN_IF_ERROR(ReadJob(select, 0, &jobs.emplace_back()));
  }
  return jobs;
}

absl::StatusOr<std::optional<StoredJob>> Store::GetJob(const std::string& id) {
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(
      Statement select,
      Statement::Prepare(db_, "SELECT id, number, trainer_token, job FROM jobs WHERE id = ?",
                         absl::StrCat("get job ", id)));
  select.BindText(1, id);
  AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
  if (!row) return std::nullopt;
  StoredJob job;
  AIDN_RETURN_IF_ERROR(ReadJob(select, 0, &job));
  return job;
}

absl::Status Store::ScanJobs(int64_t below, const std::vector<int>& states,
                             const std::function<ScanNext(int64_t number)>& next,
                             const std::function<void(StoredJob)>& take) {
  // The states are enum numbers the caller checked; written into the SQL
  // so that the number index serves the order and the filter alike.
  std::string sql = "SELECT id, number, trainer_token, job FROM jobs WHERE number < ?";
  if (!states.empty()) absl::StrAppend(&sql, " AND state IN (", absl::StrJoin(states, ", "), ")");
  sql += " ORDER BY number DESC";
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(Statement select, Statement::Prepare(db_, sql.c_str(), "list jobs"));
  select.BindInt64(1, below);
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) return absl::OkStatus();
    const ScanNext what = next(select.ColumnInt64(1));
    if (what == ScanNext::kStop) return absl::OkStatus();
    if (what == ScanNext::kSkip) continue;
    StoredJob job;
    AIDN_RETURN_IF_ERROR(ReadJob(select, 0, &job));
    take(std::move(job));
  }
}

absl::StatusOr<std::vector<std::string>> Store::JobsWithLogsFinishedBefore(absl::Time before) {
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(Statement select, Statement::Prepare(db_, R"sql(
      SELECT log_jobs.job_id FROM log_jobs JOIN jobs ON jobs.id = log_jobs.job_id
      WHERE jobs.finished_us > 0 AND jobs.finished_us < ?)sql",
                                                             "find finished jobs' lines"));
  select.BindInt64(1, absl::ToUnixMicros(before));
  std::vector<std::string> ids;
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) return ids;
    ids.push_back(select.ColumnText(0));
  }
}

absl::StatusOr<std::map<int, int64_t>> Store::CountJobsFinishedBefore(absl::Time before) {
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(Statement select, Statement::Prepare(db_, R"sql(
      SELECT state, COUNT(*) FROM jobs WHERE finished_us > 0 AND finished_us < ?
      GROUP BY state)sql",
                                                             "count finished jobs"));
  select.BindInt64(1, absl::ToUnixMicros(before));
  std::map<int, int64_t> counts;
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) return counts;
    counts[static_cast<int>(select.ColumnInt64(0))] = select.ColumnInt64(1);
  }
}

absl::StatusOr<int64_t> Store::MaxJobNumber() {
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(Statement select,
                        Statement::Prepare(db_, "SELECT COALESCE(MAX(number), 0) FROM jobs",
                                           "read largest job number"));
  AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
  return row ? select.ColumnInt64(0) : 0;
}

absl::Status Store::FillFinishedTimes(const std::string& context) {
  AIDN_ASSIGN_OR_RETURN(Statement select,
                        Statement::Prepare(db_, "SELECT id, job FROM jobs", context));
  AIDN_ASSIGN_OR_RETURN(
      Statement update,
      Statement::Prepare(db_, "UPDATE jobs SET finished_us = ? WHERE id = ?", context));
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) return absl::OkStatus();
    v1::Job job;
    AIDN_RETURN_IF_ERROR(Parse(select.ColumnBytes(1), "jobs", select.ColumnBytes(0), &job));
    const int64_t finished = FinishedMicros(job);
    if (finished == 0) continue;
    update.Reset();
    update.BindInt64(1, finished);
    update.BindText(2, job.id());
    AIDN_RETURN_IF_ERROR(update.Run());
  }
}

}  // namespace aidn::coordinator
