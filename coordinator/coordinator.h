#ifndef AIDN_COORDINATOR_COORDINATOR_H_
#define AIDN_COORDINATOR_COORDINATOR_H_

// The coordinator's domain: jobs and their lifecycle, workers, scheduling,
// rendezvous, the per-generation KV stores, failure detection, checkpoints
// and metric records. No gRPC in here: the service layer authenticates, calls
// one of these methods and turns the result into a response.
//
// Thread-safe: one mutex guards the state; SQLite writes happen under it so
// memory and disk change together. Calls that block (rendezvous, KV waits,
// long-poll heartbeats) take a callback and return at once; the callback runs
// on whichever thread completes them, never under the mutex.
//
// Time comes from options.clock; Tick() does the time-driven work (lost
// workers, rendezvous and wait timeouts). StartTicker() runs it on a thread;
// tests call Tick() themselves after advancing a FakeClock.

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "aidn/v1/cluster.pb.h"
#include "aidn/v1/coordinator.pb.h"
#include "common/clock.h"
#include "common/metrics/registry.h"
#include "coordinator/auth.h"
#include "coordinator/deferred.h"
#include "coordinator/kv_store.h"
#include "coordinator/metrics.h"
#include "coordinator/rendezvous.h"
#include "coordinator/spec.h"
#include "coordinator/step_log.h"
#include "coordinator/store.h"

namespace aidn::coordinator {

struct CoordinatorOptions {
  SpecLimits spec_limits;
  // Told to workers; they heartbeat this often.
  std::chrono::milliseconds heartbeat_interval{2000};
  // A worker silent this long is declared lost.
  std::chrono::milliseconds worker_timeout{10'000};
  // Time a trainer gets between SIGTERM and SIGKILL on a stop order.
  std::chrono::milliseconds stop_grace{10'000};
  // Longest KvGet wait accepted.
  std::chrono::milliseconds max_kv_wait{600'000};
  KvLimits kv_limits;
  // Not owned; Clock::Real() when null.
  Clock* clock = nullptr;
  // Where the coordinator's Prometheus metrics go (not owned); the
  // coordinator keeps a registry of its own when null.
  metrics::Registry* registry = nullptr;
  // A finished job's series leave /metrics, and its recent steps leave
  // memory, this long after it ended.
  std::chrono::milliseconds metrics_retention{600'000};
  // Per job: how many combined steps stay in memory, how long a step waits
  // for missing ranks.
  StepLogOptions step_log;
  // How often trainers send progress beats. A rank of a hung generation
  // whose beats stopped for more than three of these (a stopped or wedged
  // process) is named as the culprit rather than the ranks waiting for it.
  std::chrono::milliseconds trainer_beat_interval{1000};
};

// Something watching one job (a WatchJob stream). Notify() is called, never
// under the coordinator's mutex, when the job has something new; the
// watcher then pulls with PollWatch.
class WatchSubscriber {
 public:
  virtual ~WatchSubscriber() = default;
  virtual void Notify() = 0;
};

// Where a watcher is in a job's stream.
struct WatchCursor {
  int64_t job_version_sent = -1;
  int64_t last_event_seq = 0;
  // Steps: first read back from the store from `next_step` on, then
  // followed in memory after step number `metrics_seq`.
  bool catching_up = true;
  int64_t next_step = -1;  // -1: the request's from_step
  int64_t metrics_seq = 0;
  int64_t last_step_sent = -1;
};

struct WatchBatch {
  std::vector<v1::WatchJobResponse> items;
  // The job has ended and nothing is left to send.
  bool finished = false;
};

class Coordinator {
 public:
  // Loads every job, worker and trainer token from `store`; jobs that held
  // slots keep them, and their workers get worker_timeout to come back.
  // `auth` (not owned) learns the jobs' trainer tokens.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(const CoordinatorOptions& options,
                                                             std::unique_ptr<Store> store,
                                                             Authenticator* auth);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Answers every parked call (rendezvous, KV waits, held heartbeats,
  // watchers) with UNAVAILABLE and refuses new ones, so the server can shut
  // down without waiting for them.
  void Shutdown();

  // Starts the ticker thread (Tick and FlushSteps every `interval`) and a
  // second thread that answers held heartbeats when their time is up, every
  // few milliseconds: answered by the tick, 5,000 held calls a second from
  // 10,000 workers would come as bursts of 500 every 100 ms (each worker's
  // next call right behind its answer), and any call landing in a burst
  // waits behind it.
  void StartTicker(std::chrono::milliseconds interval);
  void StopTicker();
  void Tick();
  // Answers the held heartbeats whose max_wait has passed (Tick does too).
  void AnswerDueHeartbeats();
  // Writes combined steps not yet in the store, all jobs' in one
  // transaction, without holding the coordinator's mutex while writing.
  // The ticker calls it after every Tick.
  void FlushSteps();

  // The registry /metrics serves (options.registry, or the coordinator's).
  metrics::Registry* registry() const { return metrics_.registry; }
  CoordinatorMetrics* metrics() { return &metrics_; }

  // --- CoordinatorService ---
  absl::StatusOr<v1::Job> SubmitJob(v1::JobSpec spec, const std::string& owner);
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id);
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const v1::ListJobsRequest& request);
  absl::StatusOr<v1::Job> CancelJob(const std::string& job_id, const std::string& reason);
  v1::ListWorkersResponse ListWorkers();
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const std::string& job_id);
  absl::StatusOr<v1::ListEventsResponse> ListEvents(const v1::ListEventsRequest& request);
  // Flushes combined steps to the store first, so it sees every step
  // combined so far.
  absl::StatusOr<v1::GetMetricsResponse> GetMetrics(const v1::GetMetricsRequest& request);

  // WatchJob: subscribe, then pull. NOT_FOUND for an unknown job.
  absl::Status Subscribe(const std::string& job_id, WatchSubscriber* subscriber);
  void Unsubscribe(const std::string& job_id, WatchSubscriber* subscriber);
  absl::StatusOr<WatchBatch> PollWatch(const v1::WatchJobRequest& request, WatchCursor* cursor);

  // --- ClusterService: workers ---
  absl::StatusOr<v1::RegisterWorkerResponse> RegisterWorker(
      const v1::RegisterWorkerRequest& request);
  using HeartbeatCallback = std::function<void(absl::StatusOr<v1::HeartbeatResponse>)>;
  void Heartbeat(const v1::HeartbeatRequest& request, HeartbeatCallback done);
  absl::Status ReportTrainerExit(const v1::ReportTrainerExitRequest& request);

  // --- ClusterService: trainers (all fenced by generation) ---
  void JoinRendezvous(const v1::JoinRendezvousRequest& request, Rendezvous::Callback done);
  absl::Status KvSet(const v1::KvSetRequest& request);
  using KvGetCallback = std::function<void(absl::StatusOr<v1::KvGetResponse>)>;
  void KvGet(const v1::KvGetRequest& request, KvGetCallback done);
  absl::StatusOr<v1::KvAddResponse> KvAdd(const v1::KvAddRequest& request);
  absl::StatusOr<v1::KvCompareAndSetResponse> KvCompareAndSet(
      const v1::KvCompareAndSetRequest& request);
  absl::StatusOr<v1::ReportProgressResponse> ReportProgress(
      const v1::ReportProgressRequest& request);
  // One StreamMetrics message.
  absl::Status AppendMetrics(const v1::StreamMetricsRequest& request);
  // Records the checkpoint as committed once every writer reported; the
  // commit that completes it also applies the job's keep_last retention
  // and answers the steps it retired.
  absl::StatusOr<v1::CommitCheckpointResponse> CommitCheckpoint(
      const v1::CommitCheckpointRequest& request);
  // A rank found a checkpoint fails verification: it is never offered for a
  // resume again. Idempotent; NOT_FOUND for a step with no checkpoint.
  absl::Status ReportCheckpointInvalid(const v1::ReportCheckpointInvalidRequest& request);
  // What a StreamMetrics call answers once its stream ended: up to which
  // step the job's records are in the store (the ticker's batched flushes
  // put them there; this does not flush), and the incarnation.
  absl::StatusOr<v1::StreamMetricsResponse> MetricsReceipt(const std::string& job_id);

  // Random, made once per process: trainers that see it change know the
  // coordinator restarted and send again what it may have lost.
  const std::string& incarnation() const { return incarnation_; }

 private:
  struct JobEntry {
    StoredJob stored;
    // Bumped on every change a watcher should see.
    int64_t version = 0;
    // Of the current generation; null when the job holds no slots.
    std::unique_ptr<Rendezvous> rendezvous;
    std::unique_ptr<KvStore> kv;
    std::set<int> exited_ok;
    // The last progress beat of each rank of the current generation.
    struct Beat {
      int64_t step = -1;
      int64_t collective_seq = 0;
      Clock::TimePoint at{};
    };
    std::map<int, Beat> beats;
    // When a rank's step last went up, or the generation started running
    // (or the coordinator did): the progress deadline runs from here, not
    // from the last beat, since beats go on while training is stuck.
    Clock::TimePoint last_advance{};
    // When the generation started running (or the coordinator did).
    Clock::TimePoint running_since{};
    // The checkpoint step the current generation resumed from (-1: none);
    // retention never retires it.
    int64_t resumed_from_step = -1;
    // A RESTARTING job is not placed before this (restart backoff).
    Clock::TimePoint restart_at{};
    // Workers that ran the failed generation, and when it failed: a restart
    // is placed on one of them only once it was heard from after that (it
    // got its stop orders, it is alive), so a worker that died with the
    // generation is not chosen again before it is declared lost.
    std::set<std::string> unconfirmed_workers;
    Clock::TimePoint failed_at{};
    // Stragglers: each rank's newest TRAIN step times of this generation,
    // whether they changed since the last look, and the ranks reported as
    // stragglers now.
    std::map<int, std::deque<double>> step_window;
    bool step_window_changed = false;
    std::set<int> stragglers;
    // Per rank: TRAIN samples taken into step_window so far, and that count
    // when its straggler state last changed.
    std::map<int, int64_t> step_samples;
    std::map<int, int64_t> straggler_changed_at;
    // The reason it last waited for, so "job.waiting" is not repeated.
    std::string waiting_reason;
    // Metrics: combined steps (null until the first record, and again once
    // the job ended longer than the retention period ago), the highest
    // step number known to be in the store, per-rank series and progress
    // times, and whether the job's series were taken off /metrics.
    std::unique_ptr<StepLog> steps;
    int64_t steps_generation = 0;
    int64_t stored_seq = 0;
    std::vector<metrics::Histogram*> rank_step_seconds;
    std::vector<metrics::Histogram*> rank_allreduce_seconds;
    bool series_removed = false;
    // The highest (step, kind) of generation `stored_generation` known to be
    // in the store (for durable_step).
    int64_t stored_generation = 0;
    std::optional<std::pair<int64_t, int>> stored_key;
    // What the store held of the running generation when this process
    // loaded it: records at or below it, sent again by trainers that saw the
    // coordinator restart, are ignored. Above it the StepLog knows.
    int64_t resent_generation = 0;
    // The first TRAIN step of `resent_generation` not in the store when
    // this process loaded it: its StepLog combines from there in order.
    int64_t resent_first_step = 1;
    std::optional<std::pair<int64_t, int>> resent_floor;
  };
  struct HeldHeartbeat {
    Clock::TimePoint deadline;
    HeartbeatCallback done;
  };
  struct WorkerEntry {
    v1::Worker worker;
    Clock::TimePoint last_seen{};
    std::vector<v1::StopOrder> pending_stops;
    std::vector<HeldHeartbeat> held;
  };

  Coordinator(const CoordinatorOptions& options, std::unique_ptr<Store> store, Authenticator* auth);
  absl::Status Load() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Looks up a job for a trainer call and checks its generation.
  absl::StatusOr<JobEntry*> FencedJob(const std::string& job_id, int64_t generation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FencedJob for calls that park (rendezvous, KV waits): UNAVAILABLE once
  // shutting down, so nothing new is parked.
  absl::StatusOr<JobEntry*> FencedJobToWaitOn(const std::string& job_id, int64_t generation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<JobEntry*> FindJob(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // State changes; each persists the job and records an event.
  absl::Status SetState(JobEntry* entry, v1::Job::State state, const std::string& message,
                        Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the current generation: stops its trainers, drops its rendezvous and
  // KV store, and either restarts the job or fails it for good.
  void FailGeneration(JobEntry* entry, const std::string& reason, bool permanent,
                      Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases the job's slots and tells its workers to stop its trainers.
  void ReleaseGeneration(JobEntry* entry, const std::string& reason, const absl::Status& status,
                         Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Schedule(Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckTimeouts(Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void Emit(const std::string& type, const std::string& job_id, const std::string& worker_id,
            int64_t generation, const std::string& message, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PersistJob(JobEntry* entry, Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PersistWorker(const WorkerEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The assignments of `workers` changed (or they have stop orders): bump
  // the version and answer their held heartbeats. Other workers' held
  // heartbeats stay held and learn the new version at their deadline: waking
  // every worker for every job placed would answer 10,000 held calls at once
  // (each rebuilt under mu_) and bring them all straight back.
  void AssignmentsChanged(const std::set<std::string>& workers, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::HeartbeatResponse BuildHeartbeat(WorkerEntry* worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AnswerDueHeartbeatsLocked(Clock::TimePoint now, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The jobs holding slots with ranks on the worker, in job id order (from
  // jobs_by_worker_, rebuilt first if a placement or job state changed).
  const std::vector<std::pair<const std::string, std::unique_ptr<JobEntry>>*>& JobsOnWorker(
      const std::string& worker_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Placements or job states changed: jobs_by_worker_ is rebuilt on its
  // next use.
  void PlacementsChanged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { jobs_by_worker_stale_ = true; }
  void NotifyWatchers(const std::string& job_id, Deferred* deferred);
  // The worker as ListWorkers shows it: with the slots and jobs it has now.
  v1::Worker WorkerView(const std::string& id, const WorkerEntry& w)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's StepLog, started on the job's current generation.
  StepLog* StepsOf(JobEntry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Per-rank histograms of the job's current world size.
  void EnsureRankSeries(JobEntry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Refreshes the gauges /metrics shows (a registry collect hook), and
  // takes finished jobs' series off once their retention ran out.
  void CollectMetrics();
  void RemoveJobSeries(JobEntry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool PastRetention(const v1::Job& job) const;
  void FlushStepsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(flush_mu_);
  // Reads steps of a watched job back from the store (PollWatch's catch-up).
  absl::Status CatchUpFromStore(const v1::WatchJobRequest& request, WatchCursor* cursor,
                                WatchBatch* batch);
  std::chrono::milliseconds JobWorkerTimeout(const JobEntry& entry) const;
  // The job's progress timeout: the spec's, or the larger of 60s and 10x
  // the median of its recent step times.
  std::chrono::milliseconds ProgressTimeout(const JobEntry& entry) const;
  // Why a generation without progress hangs, naming the culprit ranks.
  std::string HangReport(const JobEntry& entry, Clock::TimePoint now,
                         std::chrono::milliseconds timeout) const;
  // Reports ranks that became (or stopped being) stragglers.
  void CheckStragglers(JobEntry* entry, Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The wait before the job's restart number job.restarts().
  std::chrono::milliseconds RestartDelay(const v1::Job& job) const;
  // Fills resume_from and resume_candidates from the checkpoints of
  // generations before the current one, and remembers what it resumes from.
  void FillResume(JobEntry* entry, v1::JoinRendezvousResponse* response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // keep_last retention over `checkpoints` (all of the job's): deletes the
  // retired ones from the store and returns their steps.
  std::vector<int64_t> RetireCheckpoints(JobEntry* entry,
                                         const std::vector<v1::Checkpoint>& checkpoints)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A combined step of the job went to the store.
  static void NoteStored(JobEntry* entry, const v1::StepMetrics& step);
  // The worker running `rank` of the job's current placement, "" if none.
  static std::string WorkerOfRank(const v1::Job& job, int rank);

  const CoordinatorOptions options_;
  Clock* const clock_;
  Authenticator* const auth_;
  // Set once in Create.
  std::string incarnation_;

  // Its own registry when options.registry is null; then the metrics.
  std::unique_ptr<metrics::Registry> own_registry_;
  CoordinatorMetrics metrics_;

  // Thread-safe on its own. Jobs, workers, events and checkpoints are
  // written under mu_, so memory and disk change together; combined steps
  // are written by FlushSteps outside it.
  const std::unique_ptr<Store> store_;
  // Held across one FlushSteps (and a watcher's read-back after it), so no
  // two flushes interleave. Taken before mu_, never after.
  absl::Mutex flush_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  // Steps taken from the logs whose write failed, retried first.
  std::vector<Store::JobStep> failed_steps_ ABSL_GUARDED_BY(flush_mu_);
  // (job id, highest step number) of those steps.
  std::vector<std::pair<std::string, int64_t>> failed_taken_ ABSL_GUARDED_BY(flush_mu_);

  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<JobEntry>> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, WorkerEntry> workers_ ABSL_GUARDED_BY(mu_);
  // The lowest step of each job among the steps taken from the logs and not
  // yet stored (the flush in flight, or failed_steps_ after a failed one),
  // kept under mu_ so that a metrics receipt (one per StreamMetrics call)
  // never waits for flush_mu_, which is held through a whole SQLite
  // transaction: receipts run on gRPC's callback threads, and blocking them
  // there stalls every other call, heartbeats included. By step, not (step,
  // kind): a step's EVAL row may be in flight after its TRAIN row was stored.
  std::map<std::string, int64_t> unstored_first_step_ ABSL_GUARDED_BY(mu_);
  // (deadline, worker id) of every heartbeat held, earliest first. An entry
  // may outlive its call (answered early, worker lost): the worker's own
  // `held` list is the truth, this only says when to look.
  std::multimap<Clock::TimePoint, std::string> held_deadlines_ ABSL_GUARDED_BY(mu_);
  // Jobs holding slots by the workers their ranks are placed on, so that a
  // heartbeat (thousands a second with 10,000 workers) or a worker's view
  // looks at its own jobs rather than at every placement of every job.
  std::map<std::string, std::vector<std::pair<const std::string, std::unique_ptr<JobEntry>>*>>
      jobs_by_worker_ ABSL_GUARDED_BY(mu_);
  bool jobs_by_worker_stale_ ABSL_GUARDED_BY(mu_) = true;
  int64_t next_job_number_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t assignments_version_ ABSL_GUARDED_BY(mu_) = 1;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;

  // Watchers have their own lock, taken without mu_ held, so that a watcher
  // can pull (taking mu_) from inside Notify().
  absl::Mutex watch_mu_;
  std::map<std::string, std::set<WatchSubscriber*>> watchers_ ABSL_GUARDED_BY(watch_mu_);

  absl::Mutex ticker_mu_;
  std::thread ticker_;
  std::thread held_timer_;
  std::unique_ptr<absl::Notification> ticker_stop_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_COORDINATOR_H_
