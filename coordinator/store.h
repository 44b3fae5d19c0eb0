#ifndef AIDN_COORDINATOR_STORE_H_
#define AIDN_COORDINATOR_STORE_H_

// The coordinator's durable state in one SQLite file (WAL mode, a schema
// version table and forward migrations): jobs, workers, events, checkpoints,
// the jobs' per-step metrics and their ranks' output lines. Rows hold the serialized v1 protos
// beside the columns queries filter on, so the schema follows the API without a migration per
// field.
//
// Thread-safe: one connection behind a mutex. Each call is one transaction.
// Writes survive kill -9 of the process once the call returned.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "aidn/v1/cluster.pb.h"
#include "aidn/v1/coordinator.pb.h"
#include "aidn/v1/job.pb.h"

struct sqlite3;

namespace aidn::coordinator {

struct StoreOptions {
  // The database file; ":memory:" for a private in-memory database (tests).
  std::string path;
  // How long a statement waits for a lock held by another connection.
  int busy_timeout_ms = 5000;
  // Tests only: called at the start of every PutSteps, before anything is
  // written; an error fails that PutSteps. Lets a test hold a batched write
  // in flight or make it fail.
  std::function<absl::Status()> before_put_steps = nullptr;
};

// A job row: the public record plus what the API does not show.
struct StoredJob {
  v1::Job job;
  // Job-scoped credential handed to its trainers.
  std::string trainer_token;
  // Submission order, increasing; also the numeric part of the id.
  int64_t number = 0;
};

class Store {
 public:
  // Opens or creates the database and migrates its schema to the current
  // version. FAILED_PRECONDITION if the file's schema is newer than this
  // binary knows; a clear error naming the path if it is not a database.
  static absl::StatusOr<std::unique_ptr<Store>> Open(const StoreOptions& options);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // The schema version of the open file.
  int SchemaVersion();
  // The version this binary creates and migrates to.
  static int CurrentSchemaVersion();

  // Jobs (store_jobs.cc). PutJob inserts or replaces by id; a job with
  // finished_at set counts as finished then.
  absl::Status PutJob(const StoredJob& job);
  // The jobs that have not finished, and those that finished at or after
  // `finished_since`, by number.
  absl::StatusOr<std::vector<StoredJob>> LoadJobs(absl::Time finished_since = absl::InfinitePast());
  // One job; nullopt if there is none of that id.
  absl::StatusOr<std::optional<StoredJob>> GetJob(const std::string& id);
  // The jobs numbered below `below`, newest first, in one of `states` (all
  // when empty): `next` is asked about each number first, and `take` gets
  // the job if it says kRead, until it says kStop or none is left. Neither
  // may call the store.
  enum class ScanNext { kRead, kSkip, kStop };
  absl::Status ScanJobs(int64_t below, const std::vector<int>& states,
                        const std::function<ScanNext(int64_t number)>& next,
                        const std::function<void(StoredJob)>& take);
  // How many jobs finished before `before`, by state.
  absl::StatusOr<std::map<int, int64_t>> CountJobsFinishedBefore(absl::Time before);
  // The finished jobs that finished before `before` and still have output
  // lines stored.
  absl::StatusOr<std::vector<std::string>> JobsWithLogsFinishedBefore(absl::Time before);
  // The largest job number stored, 0 if none.
  absl::StatusOr<int64_t> MaxJobNumber();

  // Workers, by info.id.
  absl::Status PutWorker(const v1::Worker& worker);
  // OK also when there is no such worker.
  absl::Status DeleteWorker(const std::string& id);
  absl::StatusOr<std::vector<v1::Worker>> LoadWorkers();

  // Events. AppendEvent assigns event->seq (increasing, never reused).
  absl::Status AppendEvent(v1::Event* event);
  // Events with seq > after_seq, oldest first, at most `limit`; of one job
  // if job_id is not empty.
  absl::StatusOr<std::vector<v1::Event>> ListEvents(const std::string& job_id, int64_t after_seq,
                                                    int limit);

  // Checkpoints, keyed by (job_id, step); PutCheckpoint inserts or replaces.
  absl::Status PutCheckpoint(const v1::Checkpoint& checkpoint);
  absl::StatusOr<std::vector<v1::Checkpoint>> ListCheckpoints(const std::string& job_id);
  absl::Status DeleteCheckpoint(const std::string& job_id, int64_t step);

  // A job's metrics, one row per (job, step, kind): StepMetrics combined
  // from the ranks' records. PutSteps writes a batch of any jobs' steps in
  // one transaction; a step written again (a restarted generation redoing
  // it) replaces the old row.
  struct JobStep {
    std::string job_id;
    v1::StepMetrics step;
  };
  absl::Status PutSteps(const std::vector<JobStep>& steps);
  // Steps with from_step <= step <= to_step (to_step 0: no bound), ordered
  // by step, TRAIN before EVAL, at most `limit` (0: 10000).
  absl::StatusOr<std::vector<v1::StepMetrics>> GetSteps(const std::string& job_id,
                                                        int64_t from_step, int64_t to_step,
                                                        int limit);
  // The highest stored step written by `generation` (at one step, EVAL
  // counts as above TRAIN, as GetSteps orders them), looking only at steps above
  // `after_step`; nullopt if there is none. A restarted coordinator asks
  // where the running generation's stored steps end, so that records its
  // trainers send again are not combined twice. Rows of one generation are
  // a run of consecutive steps, with older generations' rows above them
  // only where those went further, so the scan stops soon.
  absl::StatusOr<std::optional<v1::StepMetrics>> LastStepOfGeneration(const std::string& job_id,
                                                                      int64_t generation,
                                                                      int64_t after_step);

  // The ranks' output lines (store_logs.cc), in the order they arrived.
  //
  // AppendLogs stores the chunks' lines in one transaction. Per rank of a
  // generation, lines numbered below the next one expected are stored
  // already (a worker sending again what it was not sure went through) and
  // are skipped. A job's lines count their text plus one byte each; past
  // max_bytes_per_job (0: no bound) its oldest lines are deleted, down to
  // 63/64 of the bound, and counted as dropped: a job printing without end
  // deletes about a batch's worth with each batch (a 64 MiB bound: 1 MiB),
  // so no one call holds the store for long. Returns the lines stored.
  absl::StatusOr<int64_t> AppendLogs(const std::vector<v1::LogChunk>& chunks,
                                     int64_t max_bytes_per_job);
  struct LogQuery {
    std::string job_id;
    // -1: any.
    int32_t rank = -1;
    int64_t generation = -1;
    // Lines stored after the line with this id (0: from the first).
    int64_t after_id = 0;
  };
  struct StoredLogLine {
    // Arrival order, increasing, never reused.
    int64_t id = 0;
    v1::LogEntry entry;
  };
  // Lines matching `query`, oldest first, at most `limit` (0: 1000).
  absl::StatusOr<std::vector<StoredLogLine>> ReadLogs(const LogQuery& query, int limit);
  // The after_id from which `query` reads only its newest `n` lines.
  absl::StatusOr<int64_t> LogTailStart(const LogQuery& query, int n);
  struct JobLogState {
    int64_t bytes = 0;
    int64_t dropped_lines = 0;
    int64_t dropped_bytes = 0;
    // The ranks of `generation` (LogState's argument) whose output ended
    // and is all stored.
    std::vector<int32_t> complete_ranks;
  };
  absl::StatusOr<JobLogState> LogState(const std::string& job_id, int64_t generation);
  // Every line and count of the job (its log retention ran out).
  absl::Status DeleteLogs(const std::string& job_id);

 private:
  Store(sqlite3* db, std::string path);
  absl::Status Migrate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Schema v3: the per-rank records of the old metrics table, combined into
  // steps. Runs inside Migrate's transaction.
  absl::Status CombineOldMetrics(const std::string& context) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Schema v5: finished_us of the jobs stored before it, from their records.
  absl::Status FillFinishedTimes(const std::string& context) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // For error messages of Open and Migrate.
  const std::string path_;
  std::function<absl::Status()> before_put_steps_;
  absl::Mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_STORE_H_
