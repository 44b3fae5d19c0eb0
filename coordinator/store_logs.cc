// The ranks' output lines in the store: tables log_lines, log_streams and
// log_jobs (schema v4, store.cc).

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "coordinator/sqlite_util.h"
#include "coordinator/store.h"
#include "google/protobuf/util/time_util.h"

namespace aidn::coordinator {
namespace {

using google::protobuf::util::TimeUtil;
using sqlite_util::Statement;
using sqlite_util::Transaction;

constexpr int kDefaultLogLimit = 1000;

// What a line counts against its job's bound: its text and its newline.
int64_t LineBytes(const std::string& text) { return static_cast<int64_t>(text.size()) + 1; }

struct StreamState {
  int64_t next_seq = 0;
  bool complete = false;
};

absl::StatusOr<StreamState> ReadStream(sqlite3* db, const v1::LogChunk& c,
                                       const std::string& context) {
  AIDN_ASSIGN_OR_RETURN(Statement select, Statement::Prepare(db, R"sql(
      SELECT next_seq, complete FROM log_streams
      WHERE job_id = ? AND generation = ? AND rank = ?)sql",
                                                             context));
  select.BindText(1, c.job_id());
  select.BindInt64(2, c.generation());
  select.BindInt64(3, c.rank());
  AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
  if (!row) return StreamState{};
  return StreamState{.next_seq = select.ColumnInt64(0), .complete = select.ColumnInt64(1) != 0};
}

// Inserts the chunk's new lines; returns how many and their bytes.
absl::StatusOr<std::pair<int64_t, int64_t>> InsertChunk(sqlite3* db, const v1::LogChunk& c,
                                                        const std::string& context) {
  AIDN_ASSIGN_OR_RETURN(StreamState stream, ReadStream(db, c, context));
  AIDN_ASSIGN_OR_RETURN(Statement insert, Statement::Prepare(db, R"sql(
      INSERT INTO log_lines(job_id, generation, rank, seq, time_us, text)
      VALUES(?, ?, ?, ?, ?, ?))sql",
                                                             context));
  int64_t lines = 0;
  int64_t bytes = 0;
  for (const v1::LogLine& line : c.lines()) {
    if (line.seq() < stream.next_seq) continue;  // stored before
    insert.Reset();
    insert.BindText(1, c.job_id());
    insert.BindInt64(2, c.generation());
    insert.BindInt64(3, c.rank());
    insert.BindInt64(4, line.seq());
    insert.BindInt64(5, TimeUtil::TimestampToMicroseconds(line.time()));
    insert.BindBlob(6, line.text());
    AIDN_RETURN_IF_ERROR(insert.Run());
    stream.next_seq = line.seq() + 1;
    ++lines;
    bytes += LineBytes(line.text());
  }
  stream.complete = stream.complete || c.complete();
  AIDN_ASSIGN_OR_RETURN(Statement upsert, Statement::Prepare(db, R"sql(
      INSERT INTO log_streams(job_id, generation, rank, next_seq, complete) VALUES(?, ?, ?, ?, ?)
      ON CONFLICT(job_id, generation, rank) DO UPDATE SET
        next_seq = excluded.next_seq, complete = excluded.complete)sql",
                                                             context));
  upsert.BindText(1, c.job_id());
  upsert.BindInt64(2, c.generation());
  upsert.BindInt64(3, c.rank());
  upsert.BindInt64(4, stream.next_seq);
  upsert.BindInt64(5, stream.complete ? 1 : 0);
  AIDN_RETURN_IF_ERROR(upsert.Run());
  return std::make_pair(lines, bytes);
}

// Adds `added` bytes to the job's count and, past `max_bytes`, deletes its
// oldest lines down to 63/64 of it.
absl::Status KeepWithinBound(sqlite3* db, const std::string& job_id, int64_t added,
                             int64_t max_bytes, const std::string& context) {
  AIDN_ASSIGN_OR_RETURN(Statement add, Statement::Prepare(db, R"sql(
      INSERT INTO log_jobs(job_id, bytes, dropped_lines, dropped_bytes) VALUES(?1, ?2, 0, 0)
      ON CONFLICT(job_id) DO UPDATE SET bytes = bytes + ?2
      RETURNING bytes)sql",
                                                          context));
  add.BindText(1, job_id);
  add.BindInt64(2, added);
  AIDN_ASSIGN_OR_RETURN(bool row, add.Step());
  const int64_t bytes = row ? add.ColumnInt64(0) : added;
  AIDN_RETURN_IF_ERROR(add.Run());  // RETURNING: step to the end
  if (max_bytes <= 0 || bytes <= max_bytes) return absl::OkStatus();

  const int64_t excess = bytes - (max_bytes - max_bytes / 64);
  AIDN_ASSIGN_OR_RETURN(Statement oldest, Statement::Prepare(db, R"sql(
      SELECT id, length(text) + 1 FROM log_lines WHERE job_id = ? ORDER BY id)sql",
                                                             context));
  oldest.BindText(1, job_id);
  int64_t freed = 0;
  int64_t lines = 0;
  int64_t cutoff = 0;
  while (freed < excess) {
    AIDN_ASSIGN_OR_RETURN(bool more, oldest.Step());
    if (!more) break;
    cutoff = oldest.ColumnInt64(0);
    freed += oldest.ColumnInt64(1);
    ++lines;
  }
  AIDN_ASSIGN_OR_RETURN(
      Statement remove,
      Statement::Prepare(db, "DELETE FROM log_lines WHERE job_id = ? AND id <= ?", context));
  remove.BindText(1, job_id);
  remove.BindInt64(2, cutoff);
  AIDN_RETURN_IF_ERROR(remove.Run());
  AIDN_ASSIGN_OR_RETURN(Statement count, Statement::Prepare(db, R"sql(
      UPDATE log_jobs SET bytes = bytes - ?2, dropped_lines = dropped_lines + ?3,
        dropped_bytes = dropped_bytes + ?2
      WHERE job_id = ?1)sql",
                                                            context));
  count.BindText(1, job_id);
  count.BindInt64(2, freed);
  count.BindInt64(3, lines);
  return count.Run();
}

// The filter every log query shares; ?1 job, ?2 after id, ?3 generation,
// ?4 rank (each -1: any).
constexpr const char* kLogFilter =
    "job_id = ?1 AND id > ?2 AND (?3 < 0 OR generation = ?3) AND (?4 < 0 OR rank = ?4)";

void BindFilter(const Store::LogQuery& q, Statement* s) {
  s->BindText(1, q.job_id);
  s->BindInt64(2, q.after_id);
  s->BindInt64(3, q.generation);
  s->BindInt64(4, q.rank);
}

}  // namespace

absl::StatusOr<int64_t> Store::AppendLogs(const std::vector<v1::LogChunk>& chunks,
                                          int64_t max_bytes_per_job) {
  if (chunks.empty()) return 0;
  const std::string context = absl::StrCat("append ", chunks.size(), " log chunks");
  absl::MutexLock lock(&mu_);
  Transaction txn(db_);
  AIDN_RETURN_IF_ERROR(txn.Begin(context));
  int64_t stored = 0;
  std::map<std::string, int64_t> added;  // bytes per job
  for (const v1::LogChunk& c : chunks) {
    AIDN_ASSIGN_OR_RETURN(auto inserted, InsertChunk(db_, c, context));
    stored += inserted.first;
    added[c.job_id()] += inserted.second;
  }
  for (const auto& [job_id, bytes] : added) {
    AIDN_RETURN_IF_ERROR(KeepWithinBound(db_, job_id, bytes, max_bytes_per_job, context));
  }
  AIDN_RETURN_IF_ERROR(txn.Commit(context));
  return stored;
}

absl::StatusOr<std::vector<Store::StoredLogLine>> Store::ReadLogs(const LogQuery& query,
                                                                  int limit) {
  if (limit <= 0) limit = kDefaultLogLimit;
  const std::string context = absl::StrCat("read logs of job ", query.job_id);
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(
      Statement select,
      Statement::Prepare(db_,
                         absl::StrCat("SELECT id, generation, rank, seq, time_us, text "
                                      "FROM log_lines WHERE ",
                                      kLogFilter, " ORDER BY id LIMIT ?5")
                             .c_str(),
                         context));
  BindFilter(query, &select);
  select.BindInt64(5, limit);
  std::vector<StoredLogLine> lines;
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) break;
    StoredLogLine& line = lines.emplace_back();
    line.id = select.ColumnInt64(0);
    line.entry.set_generation(select.ColumnInt64(1));
    line.entry.set_rank(static_cast<int32_t>(select.ColumnInt64(2)));
    line.entry.set_seq(select.ColumnInt64(3));
    *line.entry.mutable_time() = TimeUtil::MicrosecondsToTimestamp(select.ColumnInt64(4));
    line.entry.set_text(std::string(select.ColumnBytes(5)));
  }
  return lines;
}

absl::StatusOr<int64_t> Store::LogTailStart(const LogQuery& query, int n) {
  if (n <= 0) return query.after_id;
  const std::string context = absl::StrCat("find the log tail of job ", query.job_id);
  absl::MutexLock lock(&mu_);
  // The id of the (n+1)-th newest line: the tail starts after it.
  AIDN_ASSIGN_OR_RETURN(
      Statement select,
      Statement::Prepare(db_,
                         absl::StrCat("SELECT id FROM log_lines WHERE ", kLogFilter,
                                      " ORDER BY id DESC LIMIT 1 OFFSET ?5")
                             .c_str(),
                         context));
  BindFilter(query, &select);
  select.BindInt64(5, n);
  AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
  return row ? select.ColumnInt64(0) : query.after_id;
}

absl::StatusOr<Store::JobLogState> Store::LogState(const std::string& job_id, int64_t generation) {
  const std::string context = absl::StrCat("read the log state of job ", job_id);
  absl::MutexLock lock(&mu_);
  JobLogState state;
  AIDN_ASSIGN_OR_RETURN(
      Statement counts,
      Statement::Prepare(
          db_, "SELECT bytes, dropped_lines, dropped_bytes FROM log_jobs WHERE job_id = ?",
          context));
  counts.BindText(1, job_id);
  AIDN_ASSIGN_OR_RETURN(bool row, counts.Step());
  if (row) {
    state.bytes = counts.ColumnInt64(0);
    state.dropped_lines = counts.ColumnInt64(1);
    state.dropped_bytes = counts.ColumnInt64(2);
  }
  AIDN_ASSIGN_OR_RETURN(Statement complete, Statement::Prepare(db_, R"sql(
      SELECT rank FROM log_streams
      WHERE job_id = ? AND generation = ? AND complete != 0 ORDER BY rank)sql",
                                                               context));
  complete.BindText(1, job_id);
  complete.BindInt64(2, generation);
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool more, complete.Step());
    if (!more) break;
    state.complete_ranks.push_back(static_cast<int32_t>(complete.ColumnInt64(0)));
  }
  return state;
}

absl::Status Store::DeleteLogs(const std::string& job_id) {
  const std::string context = absl::StrCat("delete the logs of job ", job_id);
  absl::MutexLock lock(&mu_);
  Transaction txn(db_);
  AIDN_RETURN_IF_ERROR(txn.Begin(context));
  for (const char* sql :
       {"DELETE FROM log_lines WHERE job_id = ?", "DELETE FROM log_streams WHERE job_id = ?",
        "DELETE FROM log_jobs WHERE job_id = ?"}) {
    AIDN_ASSIGN_OR_RETURN(Statement remove, Statement::Prepare(db_, sql, context));
    remove.BindText(1, job_id);
    AIDN_RETURN_IF_ERROR(remove.Run());
  }
  return txn.Commit(context);
}

}  // namespace aidn::coordinator
