#ifndef AIDN_COORDINATOR_METRIC_INGEST_H_
#define AIDN_COORDINATOR_METRIC_INGEST_H_

// The trainers' metric records on their way in: each job's StepLog
// (combining the ranks' records), the floors below which records a restarted
// coordinator already stored are ignored, the bookkeeping of what the
// batched flushes took and stored (durable_step, for MetricsReceipt), and
// the per-job and per-rank Prometheus series.
//
// Not thread-safe: the coordinator's mutex guards it and every job's
// JobMetrics. Steps are written to the store by the coordinator's flush,
// outside that mutex; this only says what to take and notes what was stored.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "aidn/v1/cluster.pb.h"
#include "aidn/v1/job.pb.h"
#include "common/clock.h"
#include "common/metrics/registry.h"
#include "coordinator/failure_detector.h"
#include "coordinator/metrics.h"
#include "coordinator/step_log.h"
#include "coordinator/store.h"

namespace aidn::coordinator {

// One job's metrics in memory.
struct JobMetrics {
  // Combined steps (null until the first record, and again once the job
  // ended longer than the retention period ago) and the generation it was
  // started on.
  std::unique_ptr<StepLog> steps;
  int64_t steps_generation = 0;
  // The highest step number (StepLog seq) known to be in the store.
  int64_t stored_seq = 0;
  // Per-rank series of the job's current world size, and whether the
  // job's series were taken off /metrics.
  std::vector<metrics::Histogram*> rank_step_seconds;
  std::vector<metrics::Histogram*> rank_allreduce_seconds;
  bool series_removed = false;
  // The state whose aidn_job_state series is set (-1: none), and whether
  // per-rank series may be there: what CollectJob must take off first.
  int state_in_series = -1;
  bool rank_series_present = false;
  // The highest (step, kind) of generation `stored_generation` known to be
  // in the store (for durable_step).
  int64_t stored_generation = 0;
  std::optional<std::pair<int64_t, int>> stored_key;
  // What the store held of the running generation when this process
  // loaded it: records at or below it, sent again by trainers that saw the
  // coordinator restart, are ignored. Above it the StepLog knows.
  int64_t resent_generation = 0;
  // The first TRAIN step of `resent_generation` not in the store when this
  // process loaded it: its StepLog combines from there in order.
  int64_t resent_first_step = 1;
  std::optional<std::pair<int64_t, int>> resent_floor;
  // Per generation: the highest TRAIN step known to be in the store. Steps
  // are combined and stored in order, so every TRAIN step of the generation
  // below it is stored too (checkpoints wait for this).
  std::map<int64_t, int64_t> stored_train_step;
  // The StepLog's TRAIN steps and samples already added to the job's
  // counters.
  int64_t steps_counted = 0;
  int64_t samples_counted = 0;
};

// Steps taken from the logs for one write to the store.
struct FlushBatch {
  std::vector<Store::JobStep> steps;
  // (job id, highest step number taken) per job.
  std::vector<std::pair<std::string, int64_t>> taken;
  bool empty() const { return steps.empty(); }
};

struct MetricIngestOptions {
  StepLogOptions step_log;
  // A finished job's series leave /metrics, and its recent steps leave
  // memory, this long after it ended.
  std::chrono::milliseconds metrics_retention{600'000};
};

class MetricIngest {
 public:
  // None owned.
  MetricIngest(const MetricIngestOptions& options, CoordinatorMetrics* metrics, Store* store,
               Clock* clock)
      : options_(options), metrics_(metrics), store_(store), clock_(clock) {}

  // The job's StepLog, started on the job's current generation.
  StepLog* StepsOf(const v1::Job& job, JobMetrics* m);

  // A coordinator that loaded the RUNNING `job` learns where its stored
  // steps end (above `resumed_from_step`): its trainers send again the
  // records the last process may not have stored.
  void RecoverStored(const v1::Job& job, JobMetrics* m, int64_t resumed_from_step);

  // One StreamMetrics message of a rank (in range) of the job's current
  // generation. `on_train` sees each TRAIN record taken (rank and
  // generation set). Returns whether new steps were combined (watchers
  // have something new).
  bool Append(const v1::Job& job, JobMetrics* m, const v1::StreamMetricsRequest& request,
              Clock::TimePoint now, const std::function<void(const v1::MetricRecord&)>& on_train);

  // The tick: combines steps that waited too long, and drops a finished
  // job's steps from memory once all are stored and its retention ran out.
  // Returns whether new steps were combined.
  bool Expire(const v1::Job& job, JobMetrics* m, Clock::TimePoint now);
  // The generation ended: steps still missing a rank are combined as they
  // are. Returns whether the job has a StepLog.
  bool EndGeneration(JobMetrics* m);

  // Flush: takes the job's combined steps not yet stored into `batch`.
  void Take(const std::string& job_id, JobMetrics* m, FlushBatch* batch);
  // The steps of `batch` are out of the logs and not (yet) in the store:
  // not durable until StoredBatch.
  void InFlight(const FlushBatch& batch);
  // The batch in flight was stored.
  void Stored() { unstored_first_step_.clear(); }
  // What a stored batch means for one job: steps numbered up to `seq` are
  // in the store.
  static void NoteFlushed(JobMetrics* m, int64_t seq) {
    m->stored_seq = std::max(m->stored_seq, seq);
  }
  // A combined step of the job (of its current generation `generation`)
  // went to the store.
  static void NoteStored(int64_t generation, JobMetrics* m, const v1::StepMetrics& step);

  // The highest TRAIN step of `generation` known to be in the store, -1 if
  // none.
  static int64_t StoredTrainStep(const JobMetrics& m, int64_t generation);

  // The step up to which the job's records of its current generation are
  // in the store, 0 if none.
  int64_t DurableStep(const v1::Job& job, const JobMetrics& m) const;

  // The job's series as /metrics shows them (`health` gives the ranks'
  // progress). False for a finished job past its retention, whose series
  // are to go: the caller takes those of every such job off at once
  // (RemoveSeriesOfJobs), then calls SeriesRemoved for each.
  bool CollectJob(const v1::Job& job, JobMetrics* m, const JobHealth& health, Clock::TimePoint now);
  static void SeriesRemoved(JobMetrics* m);
  // The labels of the job's series: job_id, name, owner.
  static metrics::Labels JobLabels(const v1::Job& job);
  // Whether the job ended longer than the retention period ago.
  bool PastRetention(const v1::Job& job) const;
  // Takes the series of every job in `job_ids` off /metrics, one pass over
  // each family whatever their number: jobs finish by the thousand between
  // two scrapes, and a pass per job would take O(jobs x series) under the
  // coordinator's lock.
  void RemoveSeriesOfJobs(const std::set<std::string>& job_ids);

 private:
  void EnsureRankSeries(const v1::Job& job, JobMetrics* m);

  const MetricIngestOptions options_;
  CoordinatorMetrics* const metrics_;
  Store* const store_;
  Clock* const clock_;
  // The lowest step of each job among the steps taken from the logs and not
  // yet stored (the flush in flight, or a failed one's steps waiting for
  // the next), kept under the coordinator's mutex so that a metrics receipt
  // (one per StreamMetrics call) never waits for the flush's own lock,
  // which is held through a whole SQLite transaction: receipts run on
  // gRPC's callback threads, and blocking them there stalls every other
  // call, heartbeats included. By step, not (step, kind): a step's EVAL row
  // may be in flight after its TRAIN row was stored.
  std::map<std::string, int64_t> unstored_first_step_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_METRIC_INGEST_H_
