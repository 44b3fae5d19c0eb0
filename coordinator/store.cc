#include "coordinator/store.h"

#include <sqlite3.h>

#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/sqlite_util.h"
#include "coordinator/step_metrics.h"
#include "google/protobuf/message_lite.h"

namespace aidn::coordinator {
namespace {

using sqlite_util::Exec;
using sqlite_util::Parse;
using sqlite_util::Serialize;
using sqlite_util::SqliteError;
using sqlite_util::Statement;
using sqlite_util::Transaction;

// Forward migrations: kMigrations[v - 1] takes the schema from version v - 1
// to version v, and runs in the same transaction as the schema_version row
// that records it. Append new steps; never edit a released one. The
// schema_version table itself is outside the list: every version has it, so
// a binary can always read how new a file is before touching anything else.
constexpr const char* kMigrations[] = {
    // v1: every table. Rows carry the serialized v1 proto; the other columns
    // are only what queries filter or order on.
    R"sql(
      CREATE TABLE jobs(
        id TEXT PRIMARY KEY,
        number INTEGER NOT NULL UNIQUE,
        state INTEGER NOT NULL,
        trainer_token TEXT NOT NULL,
        job BLOB NOT NULL);
      CREATE TABLE workers(
        id TEXT PRIMARY KEY,
        worker BLOB NOT NULL);
      -- AUTOINCREMENT: a seq is never handed out twice, even after the newest
      -- rows were deleted, so watchers resuming "after seq N" never skip one.
      CREATE TABLE events(
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL DEFAULT '',
        event BLOB NOT NULL);
      CREATE INDEX events_job_id_seq ON events(job_id, seq);
      CREATE TABLE checkpoints(
        job_id TEXT NOT NULL,
        step INTEGER NOT NULL,
        checkpoint BLOB NOT NULL,
        PRIMARY KEY(job_id, step));
      CREATE TABLE metrics(
        job_id TEXT NOT NULL,
        step INTEGER NOT NULL,
        rank INTEGER NOT NULL,
        kind INTEGER NOT NULL,
        record BLOB NOT NULL);
      CREATE INDEX metrics_job_id_step_rank ON metrics(job_id, step, rank);
    )sql",
    // v2: metric records of one job in storage order (the index carries the
    // rowid), for watchers that follow a job as records arrive.
    R"sql(
      CREATE INDEX metrics_job_id_rowid ON metrics(job_id);
    )sql",
    // v3: metrics combined per step (StepMetrics) instead of one row per
    // rank and step; Migrate combines the old rows (CombineOldMetrics) and
    // then drops the old table.
    R"sql(
      CREATE TABLE steps(
        job_id TEXT NOT NULL,
        step INTEGER NOT NULL,
        kind INTEGER NOT NULL,
        metrics BLOB NOT NULL,
        PRIMARY KEY(job_id, step, kind)) WITHOUT ROWID;
    )sql",
    // v4: the ranks' output lines (store_logs.cc). The id is the order lines
    // arrived in; AUTOINCREMENT never hands one out twice, so a reader
    // resuming "after id N" never skips a line. log_streams: per rank of a
    // generation, the next line number expected (lines below it are stored
    // already) and whether its output ended. log_jobs: per job, the bytes
    // kept and what its bound dropped.
    R"sql(
      CREATE TABLE log_lines(
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL,
        generation INTEGER NOT NULL,
        rank INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        time_us INTEGER NOT NULL,
        text BLOB NOT NULL);
      CREATE INDEX log_lines_job_id ON log_lines(job_id);
      CREATE TABLE log_streams(
        job_id TEXT NOT NULL,
        generation INTEGER NOT NULL,
        rank INTEGER NOT NULL,
        next_seq INTEGER NOT NULL,
        complete INTEGER NOT NULL,
        PRIMARY KEY(job_id, generation, rank)) WITHOUT ROWID;
      CREATE TABLE log_jobs(
        job_id TEXT PRIMARY KEY,
        bytes INTEGER NOT NULL,
        dropped_lines INTEGER NOT NULL,
        dropped_bytes INTEGER NOT NULL) WITHOUT ROWID;
    )sql",
    // v5: when each job finished (microseconds since the epoch; 0 while it
    // runs), so that a coordinator loads only the jobs that have not
    // finished or finished recently, and finds finished jobs' lines by age.
    // Migrate fills it in for the jobs already there (FillFinishedTimes).
    R"sql(
      ALTER TABLE jobs ADD COLUMN finished_us INTEGER NOT NULL DEFAULT 0;
      CREATE INDEX jobs_finished_us ON jobs(finished_us);
    )sql",
};
constexpr int kStepsSchemaVersion = 3;
constexpr int kFinishedTimesSchemaVersion = 5;
constexpr int kSchemaVersion = static_cast<int>(std::size(kMigrations));

constexpr int kDefaultEventLimit = 1000;
constexpr int kDefaultMetricLimit = 10000;

absl::StatusOr<int> ReadSchemaVersion(sqlite3* db, std::string context) {
  AIDN_ASSIGN_OR_RETURN(
      Statement select,
      Statement::Prepare(db, "SELECT COALESCE(MAX(version), 0) FROM schema_version",
                         std::move(context)));
  AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
  if (!row) return 0;
  return static_cast<int>(select.ColumnInt64(0));
}

}  // namespace

Store::Store(sqlite3* db, std::string path) : path_(std::move(path)), db_(db) {}

Store::~Store() {
  absl::MutexLock lock(&mu_);
  // Every statement is finalized by now, so close cannot be refused; the last
  // connection to close checkpoints the WAL into the main file.
  sqlite3_close(db_);
}

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const StoreOptions& options) {
  if (options.path.empty()) {
    // SQLite would open a private temporary file, which is never what a
    // caller meant.
    return absl::InvalidArgumentError("store: open: the database path is empty");
  }
  const std::string context = absl::StrCat("open ", options.path);
  sqlite3* db = nullptr;
  // NOMUTEX: the store's own mutex serializes every use of the connection.
  int rc =
      sqlite3_open_v2(options.path.c_str(), &db,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    absl::Status status = SqliteError(db, rc, context);
    sqlite3_close(db);
    return status;
  }
  std::unique_ptr<Store> store(new Store(db, options.path));
  store->before_put_steps_ = options.before_put_steps;
  absl::MutexLock lock(&store->mu_);
  sqlite3_extended_result_codes(db, 1);
  sqlite3_busy_timeout(db, options.busy_timeout_ms);

  // The first statement reads the file header, so this is where a file that
  // is not a database is found out (SQLITE_NOTADB).
  {
    AIDN_ASSIGN_OR_RETURN(
        Statement wal,
        Statement::Prepare(db, "PRAGMA journal_mode=WAL", absl::StrCat(context, ": set WAL mode")));
    AIDN_ASSIGN_OR_RETURN(bool row, wal.Step());
    std::string mode = row ? wal.ColumnText(0) : "";
    // An in-memory database has no journal file and reports "memory".
    if (mode != "wal" && options.path != ":memory:") {
      return absl::FailedPreconditionError(absl::StrCat(
          "store: ", context, ": cannot use WAL mode (journal_mode is \"", mode, "\")"));
    }
  }
  // In WAL mode, synchronous=NORMAL syncs only at checkpoints, not at every
  // commit. A committed transaction is in the WAL file (the OS page cache)
  // when the call returns, so it survives a crash or kill -9 of this process,
  // which is the failure the coordinator is built to survive; only a power
  // loss or kernel crash may lose the newest commits (never corrupting the
  // file). FULL would add an fsync to every event and metric batch.
  AIDN_RETURN_IF_ERROR(
      Exec(db, "PRAGMA synchronous=NORMAL", absl::StrCat(context, ": set synchronous=NORMAL")));
  AIDN_RETURN_IF_ERROR(store->Migrate());
  return store;
}

absl::Status Store::Migrate() {
  const std::string context = absl::StrCat("open ", path_, ": migrate schema");
  Transaction txn(db_);
  AIDN_RETURN_IF_ERROR(txn.Begin(context));
  AIDN_RETURN_IF_ERROR(
      Exec(db_, "CREATE TABLE IF NOT EXISTS schema_version(version INTEGER PRIMARY KEY)", context));
  AIDN_ASSIGN_OR_RETURN(const int from, ReadSchemaVersion(db_, context));
  if (from > kSchemaVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "store: open ", path_, ": the file has schema version ", from, ", newer than version ",
        kSchemaVersion, ", the newest this binary knows; run a newer aidn-coordinator"));
  }
  for (int v = from + 1; v <= kSchemaVersion; ++v) {
    const std::string step_context = absl::StrCat(context, " to version ", v);
    AIDN_RETURN_IF_ERROR(Exec(db_, kMigrations[v - 1], step_context));
    if (v == kStepsSchemaVersion) {
      AIDN_RETURN_IF_ERROR(CombineOldMetrics(step_context));
      AIDN_RETURN_IF_ERROR(Exec(db_, "DROP TABLE metrics", step_context));
    }
    if (v == kFinishedTimesSchemaVersion) AIDN_RETURN_IF_ERROR(FillFinishedTimes(step_context));
    AIDN_ASSIGN_OR_RETURN(
        Statement insert,
        Statement::Prepare(db_, "INSERT INTO schema_version(version) VALUES(?)", step_context));
    insert.BindInt64(1, v);
    AIDN_RETURN_IF_ERROR(insert.Run());
  }
  AIDN_RETURN_IF_ERROR(txn.Commit(context));
  if (from != kSchemaVersion) {
    AIDN_LOG(INFO) << (from == 0 ? "store schema created" : "store schema migrated")
                   << Kv("path", path_) << Kv("from", from) << Kv("to", kSchemaVersion);
  }
  return absl::OkStatus();
}

int Store::SchemaVersion() {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<int> version = ReadSchemaVersion(db_, "read schema version");
  // The table was read when the store opened; failing now means the
  // connection is broken, and every other call will say how.
  return version.ok() ? *version : 0;
}

absl::Status Store::PutWorker(const v1::Worker& worker) {
  const std::string& id = worker.info().id();
  const std::string context = absl::StrCat("put worker ", id);
  if (id.empty()) return absl::InvalidArgumentError("store: put worker: the worker has no id");
  AIDN_ASSIGN_OR_RETURN(std::string blob, Serialize(worker, context));
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(Statement upsert, Statement::Prepare(db_, R"sql(
      INSERT INTO workers(id, worker) VALUES(?, ?)
      ON CONFLICT(id) DO UPDATE SET worker = excluded.worker)sql",
                                                             context));
  upsert.BindText(1, id);
  upsert.BindBlob(2, blob);
  return upsert.Run();
}

absl::Status Store::DeleteWorker(const std::string& id) {
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(Statement del, Statement::Prepare(db_, "DELETE FROM workers WHERE id = ?",
                                                          absl::StrCat("delete worker ", id)));
  del.BindText(1, id);
  return del.Run();
}

absl::StatusOr<std::vector<v1::Worker>> Store::LoadWorkers() {
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(
      Statement select,
      Statement::Prepare(db_, "SELECT id, worker FROM workers ORDER BY id", "load workers"));
  std::vector<v1::Worker> workers;
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) break;
    AIDN_RETURN_IF_ERROR(
        Parse(select.ColumnBytes(1), "workers", select.ColumnBytes(0), &workers.emplace_back()));
  }
  return workers;
}

absl::Status Store::AppendEvent(v1::Event* event) {
  const std::string context = absl::StrCat("append event ", event->type());
  // The seq is the rowid, known only after the insert; the stored blob must
  // carry it too, so insert a placeholder and fill it in, in one transaction.
  // `event` is only touched once the commit went through.
  v1::Event stored = *event;
  absl::MutexLock lock(&mu_);
  Transaction txn(db_);
  AIDN_RETURN_IF_ERROR(txn.Begin(context));
  AIDN_ASSIGN_OR_RETURN(
      Statement insert,
      Statement::Prepare(db_, "INSERT INTO events(job_id, event) VALUES(?, x'')", context));
  insert.BindText(1, stored.job_id());
  AIDN_RETURN_IF_ERROR(insert.Run());
  const int64_t seq = sqlite3_last_insert_rowid(db_);
  stored.set_seq(seq);
  AIDN_ASSIGN_OR_RETURN(std::string blob, Serialize(stored, context));
  AIDN_ASSIGN_OR_RETURN(
      Statement update,
      Statement::Prepare(db_, "UPDATE events SET event = ? WHERE seq = ?", context));
  update.BindBlob(1, blob);
  update.BindInt64(2, seq);
  AIDN_RETURN_IF_ERROR(update.Run());
  AIDN_RETURN_IF_ERROR(txn.Commit(context));
  event->set_seq(seq);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::Event>> Store::ListEvents(const std::string& job_id,
                                                         int64_t after_seq, int limit) {
  if (limit <= 0) limit = kDefaultEventLimit;
  absl::MutexLock lock(&mu_);
  const std::string context = absl::StrCat("list events of job \"", job_id, "\"");
  // Two statements rather than "job_id = ?1 OR ?1 = ''" so that both can use
  // an index (events_job_id_seq, or the seq primary key).
  absl::StatusOr<Statement> prepared =
      job_id.empty()
          ? Statement::Prepare(db_,
                               "SELECT seq, event FROM events WHERE seq > ?2 ORDER BY seq "
                               "LIMIT ?3",
                               context)
          : Statement::Prepare(db_,
                               "SELECT seq, event FROM events WHERE job_id = ?1 AND seq > ?2 "
                               "ORDER BY seq LIMIT ?3",
                               context);
  if (!prepared.ok()) return prepared.status();
  Statement& select = *prepared;
  if (!job_id.empty()) select.BindText(1, job_id);
  select.BindInt64(2, after_seq);
  select.BindInt64(3, limit);
  std::vector<v1::Event> events;
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) break;
    AIDN_RETURN_IF_ERROR(Parse(select.ColumnBytes(1), "events",
                               absl::StrCat("seq ", select.ColumnInt64(0)),
                               &events.emplace_back()));
  }
  return events;
}

absl::Status Store::PutCheckpoint(const v1::Checkpoint& checkpoint) {
  const std::string context =
      absl::StrCat("put checkpoint ", checkpoint.job_id(), " step ", checkpoint.step());
  if (checkpoint.job_id().empty()) {
    return absl::InvalidArgumentError("store: put checkpoint: the checkpoint has no job id");
  }
  AIDN_ASSIGN_OR_RETURN(std::string blob, Serialize(checkpoint, context));
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(Statement upsert, Statement::Prepare(db_, R"sql(
      INSERT INTO checkpoints(job_id, step, checkpoint) VALUES(?, ?, ?)
      ON CONFLICT(job_id, step) DO UPDATE SET checkpoint = excluded.checkpoint)sql",
                                                             context));
  upsert.BindText(1, checkpoint.job_id());
  upsert.BindInt64(2, checkpoint.step());
  upsert.BindBlob(3, blob);
  return upsert.Run();
}

absl::StatusOr<std::vector<v1::Checkpoint>> Store::ListCheckpoints(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(
      Statement select,
      Statement::Prepare(db_,
                         "SELECT step, checkpoint FROM checkpoints WHERE job_id = ? ORDER BY step",
                         absl::StrCat("list checkpoints of job ", job_id)));
  select.BindText(1, job_id);
  std::vector<v1::Checkpoint> checkpoints;
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) break;
    AIDN_RETURN_IF_ERROR(Parse(select.ColumnBytes(1), "checkpoints",
                               absl::StrCat(job_id, " step ", select.ColumnInt64(0)),
                               &checkpoints.emplace_back()));
  }
  return checkpoints;
}

absl::Status Store::DeleteCheckpoint(const std::string& job_id, int64_t step) {
  absl::MutexLock lock(&mu_);
  // Deleting a checkpoint that is not there is not an error: retention may
  // run again after a crash between removing the files and this row.
  AIDN_ASSIGN_OR_RETURN(
      Statement remove,
      Statement::Prepare(db_, "DELETE FROM checkpoints WHERE job_id = ? AND step = ?",
                         absl::StrCat("delete checkpoint ", job_id, " step ", step)));
  remove.BindText(1, job_id);
  remove.BindInt64(2, step);
  return remove.Run();
}

namespace {

absl::Status InsertSteps(sqlite3* db, const std::vector<Store::JobStep>& steps,
                         const std::string& context) {
  AIDN_ASSIGN_OR_RETURN(
      Statement insert,
      Statement::Prepare(
          db, "INSERT OR REPLACE INTO steps(job_id, step, kind, metrics) VALUES(?, ?, ?, ?)",
          context));
  for (const Store::JobStep& s : steps) {
    AIDN_ASSIGN_OR_RETURN(std::string blob, Serialize(s.step, context));
    insert.Reset();
    insert.BindText(1, s.job_id);
    insert.BindInt64(2, s.step.step());
    insert.BindInt64(3, s.step.kind());
    insert.BindBlob(4, blob);
    AIDN_RETURN_IF_ERROR(insert.Run());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Store::CombineOldMetrics(const std::string& context) {
  AIDN_ASSIGN_OR_RETURN(Statement select, Statement::Prepare(db_, R"sql(
      SELECT job_id, step, kind, record FROM metrics
      ORDER BY job_id, step, kind, rank, rowid)sql",
                                                             context));
  std::vector<JobStep> steps;
  std::vector<v1::MetricRecord> group;
  std::string group_job;
  auto flush = [&] {
    if (group.empty()) return;
    // The old rows do not say the world size: the ranks that reported it.
    steps.push_back({group_job, CombineRecords(group, 0)});
    group.clear();
  };
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) break;
    v1::MetricRecord record;
    std::string job_id(select.ColumnText(0));
    AIDN_RETURN_IF_ERROR(Parse(select.ColumnBytes(3), "metrics",
                               absl::StrCat(job_id, " step ", select.ColumnInt64(1)), &record));
    if (!group.empty() && (job_id != group_job || record.step() != group.front().step() ||
                           record.kind() != group.front().kind())) {
      flush();
    }
    // A rank's record stored twice counts once.
    if (!group.empty() && group.back().rank() == record.rank()) continue;
    group_job = job_id;
    group.push_back(std::move(record));
  }
  flush();
  AIDN_RETURN_IF_ERROR(InsertSteps(db_, steps, context));
  if (!steps.empty()) {
    AIDN_LOG(INFO) << "old per-rank metric records combined into steps"
                   << Kv("steps", steps.size());
  }
  return absl::OkStatus();
}

absl::Status Store::PutSteps(const std::vector<JobStep>& steps) {
  if (steps.empty()) return absl::OkStatus();
  const std::string context = absl::StrCat("put ", steps.size(), " metric steps");
  if (before_put_steps_) AIDN_RETURN_IF_ERROR(before_put_steps_());
  absl::MutexLock lock(&mu_);
  Transaction txn(db_);
  AIDN_RETURN_IF_ERROR(txn.Begin(context));
  AIDN_RETURN_IF_ERROR(InsertSteps(db_, steps, context));
  return txn.Commit(context);
}

absl::StatusOr<std::vector<v1::StepMetrics>> Store::GetSteps(const std::string& job_id,
                                                             int64_t from_step, int64_t to_step,
                                                             int limit) {
  if (limit <= 0) limit = kDefaultMetricLimit;
  const std::string context = absl::StrCat("get metrics of job ", job_id);
  absl::MutexLock lock(&mu_);
  AIDN_ASSIGN_OR_RETURN(Statement select, Statement::Prepare(db_, R"sql(
      SELECT step, metrics FROM steps
      WHERE job_id = ?1 AND step >= ?2 AND (?3 = 0 OR step <= ?3)
      ORDER BY step, kind LIMIT ?4)sql",
                                                             context));
  select.BindText(1, job_id);
  select.BindInt64(2, from_step);
  select.BindInt64(3, to_step);
  select.BindInt64(4, limit);
  std::vector<v1::StepMetrics> steps;
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) break;
    AIDN_RETURN_IF_ERROR(Parse(select.ColumnBytes(1), "steps",
                               absl::StrCat(job_id, " step ", select.ColumnInt64(0)),
                               &steps.emplace_back()));
  }
  return steps;
}

absl::StatusOr<std::optional<v1::StepMetrics>> Store::LastStepOfGeneration(
    const std::string& job_id, int64_t generation, int64_t after_step) {
  const std::string context =
      absl::StrCat("find the last step of job ", job_id, " generation ", generation);
  absl::MutexLock lock(&mu_);
  // The generation is only in the blob: read down from the top until a row
  // of it turns up.
  AIDN_ASSIGN_OR_RETURN(Statement select, Statement::Prepare(db_, R"sql(
      SELECT step, metrics FROM steps
      WHERE job_id = ?1 AND step > ?2
      ORDER BY step DESC, kind DESC)sql",
                                                             context));
  select.BindText(1, job_id);
  select.BindInt64(2, after_step);
  while (true) {
    AIDN_ASSIGN_OR_RETURN(bool row, select.Step());
    if (!row) break;
    v1::StepMetrics step;
    AIDN_RETURN_IF_ERROR(Parse(select.ColumnBytes(1), "steps",
                               absl::StrCat(job_id, " step ", select.ColumnInt64(0)), &step));
    if (step.generation() == generation) return step;
  }
  return std::nullopt;
}

int Store::CurrentSchemaVersion() { return kSchemaVersion; }

}  // namespace aidn::coordinator
