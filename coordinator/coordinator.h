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
// The Coordinator holds the lock and orchestrates; each concern is a
// component of its own, not thread-safe, guarded by that lock:
// FailureDetector (lost workers, rendezvous deadlines, hangs, stragglers),
// CheckpointRegistry (commits, retention, resume points), HeldHeartbeats
// (long polls), MetricIngest (records, durable steps, per-job series),
// WatchStreams (WatchJob), SlotTable (free slots, in scheduler.h), beside
// Rendezvous, KvStore and StepLog. What is kept per job (JobEntry, one
// member per component) is private, in job_entry.h.
//
// Time comes from options.clock; Tick() does the time-driven work (lost
// workers, rendezvous and wait timeouts, checkpoints whose metrics were
// stored). StartTicker() runs it on a thread; tests call Tick() themselves
// after advancing a FakeClock.

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
#include "coordinator/checkpoint_registry.h"
#include "coordinator/deferred.h"
#include "coordinator/failure_detector.h"
#include "coordinator/held_heartbeats.h"
#include "coordinator/job_logs.h"
#include "coordinator/kv_store.h"
#include "coordinator/metric_ingest.h"
#include "coordinator/metrics.h"
#include "coordinator/rendezvous.h"
#include "coordinator/scheduler.h"
#include "coordinator/spec.h"
#include "coordinator/step_log.h"
#include "coordinator/store.h"
#include "coordinator/watch_streams.h"

namespace aidn::coordinator {

// Private (coordinator/job_entry.h): what is kept of each job and worker.
struct JobEntry;
struct WorkerEntry;

struct CoordinatorOptions {
  SpecLimits spec_limits;
  // Told to workers; they heartbeat this often.
  std::chrono::milliseconds heartbeat_interval{2000};
  // A worker silent this long is declared lost.
  std::chrono::milliseconds worker_timeout{10'000};
  // Time a trainer gets between SIGTERM and SIGKILL on a stop order.
  std::chrono::milliseconds stop_grace{10'000};
  // A checkpoint asked for (a pause, a drain) is proposed this much training
  // time ahead of the furthest rank: long enough for every rank's progress
  // beat (every second) to bring it before it gets there, or the ranks
  // miss it and agree on a later one; the longer, the later the pause.
  std::chrono::milliseconds checkpoint_ask_lead{2000};
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
  // A finished job leaves memory this long after it ended (and not before
  // its metrics_retention): from then on it lives in the store only, still
  // listed, described, watched and exported, so that memory does not grow
  // with the number of jobs ever run. A restarted coordinator loads only
  // the jobs that have not finished or finished within it.
  std::chrono::milliseconds job_retention{std::chrono::hours(1)};
  // Per job: how many combined steps stay in memory, how long a step waits
  // for missing ranks.
  StepLogOptions step_log;
  // How often trainers send progress beats. A rank of a hung generation
  // whose beats stopped for more than three of these (a stopped or wedged
  // process) is named as the culprit rather than the ranks waiting for it.
  std::chrono::milliseconds trainer_beat_interval{1000};
  // The ranks' output lines: per-job bound, retention, followers' wait.
  JobLogsOptions logs;
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
  // second thread that answers held heartbeats when their time is up:
  // answered by the tick, 5,000 held calls a second from 10,000 workers
  // would come as bursts of 500 every 100 ms (each worker's next call right
  // behind its answer), and any call landing in a burst waits behind it.
  // That thread sleeps until the earliest held call is due (a new call due
  // sooner wakes it), but looks at most every kHeldGranularity, so a busy
  // coordinator answers in batches and an idle one hardly wakes.
  void StartTicker(std::chrono::milliseconds interval);
  void StopTicker();
  void Tick();
  // Answers the held heartbeats whose max_wait has passed (Tick does too).
  void AnswerDueHeartbeats();
  static constexpr std::chrono::milliseconds kHeldGranularity{5};
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
  // `visible` (when set) leaves out the jobs it refuses, before paging.
  absl::StatusOr<v1::ListJobsResponse> ListJobs(
      const v1::ListJobsRequest& request,
      const std::function<bool(const v1::Job&)>& visible = nullptr);
  // `by`: who asked, for the job's message and event.
  absl::StatusOr<v1::Job> CancelJob(const std::string& job_id, const std::string& reason,
                                    const std::string& by = "");
  // Pauses (checkpoint at an agreed step, then stop) and resumes a job
  // (coordinator_pause.cc); `by`: who asked.
  absl::StatusOr<v1::Job> PauseJob(const std::string& job_id, const std::string& reason,
                                   const std::string& by);
  absl::StatusOr<v1::Job> ResumeJob(const std::string& job_id, const std::string& by);
  v1::ListWorkersResponse ListWorkers();
  // Cordons, drains or uncordons a worker (coordinator_workers.cc); `by`:
  // who asked, for the worker's event. NOT_FOUND for an unknown worker.
  absl::StatusOr<v1::Worker> SetWorkerScheduling(const std::string& worker_id,
                                                 v1::Worker::Scheduling scheduling,
                                                 const std::string& reason, const std::string& by);
  // Forgets a LOST worker; FAILED_PRECONDITION for a live one.
  absl::Status RemoveWorker(const std::string& worker_id, const std::string& by);
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
  // Records the checkpoint as committed once every writer reported and the
  // job's metrics up to its step are in the store (if they are combined in
  // memory, this call stores them first); until then it awaits them
  // (committed false), and the tick commits it once a flush stored them. The commit applies the
  // job's keep_last retention; the retired steps are answered by the call that completed it, or,
  // when the tick did, by the job's next CommitCheckpoint call.
  absl::StatusOr<v1::CommitCheckpointResponse> CommitCheckpoint(
      const v1::CommitCheckpointRequest& request);
  // A rank found a checkpoint fails verification: it is never offered for a
  // resume again. Idempotent; NOT_FOUND for a step with no checkpoint.
  absl::Status ReportCheckpointInvalid(const v1::ReportCheckpointInvalidRequest& request);
  // What a StreamMetrics call answers once its stream ended: up to which
  // step the job's records are in the store (the ticker's batched flushes
  // put them there; this does not flush), and the incarnation.
  absl::StatusOr<v1::StreamMetricsResponse> MetricsReceipt(const std::string& job_id);

  // --- The ranks' output lines (coordinator_logs.cc) ---
  // A worker's lines: stored (chunks of jobs this coordinator does not know
  // are dropped), then the jobs' log followers are woken.
  absl::Status ShipLogs(const v1::ShipLogsRequest& request);
  // ReadLogs: subscribe (followers), then pull. NOT_FOUND for an unknown
  // job; Subscribe is for followers only.
  absl::Status SubscribeLogs(const std::string& job_id, WatchSubscriber* subscriber);
  void UnsubscribeLogs(const std::string& job_id, WatchSubscriber* subscriber);
  absl::StatusOr<LogBatch> PollLogs(const v1::ReadLogsRequest& request, LogCursor* cursor);
  // The ticker's part for logs, after each tick: once a second wakes the log
  // followers (one waiting for a lost rank's lines ends after the settle
  // time), once a minute deletes finished jobs' lines past their retention.
  void TickLogs();

  // Random, made once per process: trainers that see it change know the
  // coordinator restarted and send again what it may have lost.
  const std::string& incarnation() const { return incarnation_; }

 private:
  using JobMap = std::map<std::string, std::unique_ptr<JobEntry>>;
  using JobRef = JobMap::value_type*;

  Coordinator(const CoordinatorOptions& options, std::unique_ptr<Store> store, Authenticator* auth);
  // What parked calls get once shutting down.
  static const absl::Status& ShuttingDownError();

  // Loading (Create): jobs, and for a RUNNING one the answer its completed
  // rendezvous gave, rebuilt so a trainer that retries its join gets the
  // same peers.
  absl::Status Load() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LoadJob(StoredJob stored, Clock::TimePoint now, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RebuildRendezvous(JobEntry* entry, Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's written checkpoints not committed: committed now if the
  // store holds their metrics, else awaiting them (the running
  // generation's only).
  void LoadAwaitingCheckpoints(JobEntry* entry, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Looks up a job for a trainer call and checks its generation.
  absl::StatusOr<JobEntry*> FencedJob(const std::string& job_id, int64_t generation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FencedJob for a call of one of the job's ranks: INVALID_ARGUMENT for a
  // rank outside its world.
  absl::StatusOr<JobEntry*> FencedRank(const std::string& job_id, int64_t generation, int rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FencedJob for calls that park (rendezvous, KV waits): UNAVAILABLE once
  // shutting down, so nothing new is parked.
  absl::StatusOr<JobEntry*> FencedJobToWaitOn(const std::string& job_id, int64_t generation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<JobEntry*> FindJob(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FindJob for a job that has not ended: FAILED_PRECONDITION "<id> has
  // already ended (STATE)" for one that has (in memory or archived),
  // NOT_FOUND for an unknown one.
  absl::StatusOr<JobEntry*> UnfinishedJob(const std::string& job_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the job's current generation without a failure (a pause, a move
  // off a draining worker): stop orders, the generation fenced off, the
  // next generation's number, no placement. The caller sets the state.
  void EndGeneration(JobEntry* entry, const std::string& reason, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's record: from memory, or from the store once it left memory
  // (ArchiveFinishedJobs). NOT_FOUND for a job there is no record of.
  absl::StatusOr<v1::Job> JobRecord(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // How long after it ended a finished job leaves memory.
  std::chrono::milliseconds ArchiveAfter() const;
  // Takes the finished jobs past ArchiveAfter() whose steps are all stored
  // out of memory (their series off /metrics); the store keeps them.
  void ArchiveFinishedJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the jobs whose PersistJob failed (a full disk), until one fails
  // again.
  void StoreUnstoredJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // checkpoint.resume_from: the job and its checkpoint exist, committed and
  // valid, and fit `spec` (model, optimizer, global batch); step 0 becomes
  // the newest one's. INVALID_ARGUMENT or NOT_FOUND saying what does not.
  absl::Status ResolveResumeFrom(v1::JobSpec* spec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // INVALID_ARGUMENT naming the field when there are alive workers and none
  // of them allows a path the job names (WorkerInfo.path_roots).
  absl::Status CheckPathsAllowedSomewhere(const v1::JobSpec& spec)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // State changes; each persists the job and records an event.
  absl::Status SetState(JobEntry* entry, v1::Job::State state, const std::string& message,
                        Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the current generation: stops its trainers, drops its rendezvous and
  // KV store, and either restarts the job or fails it for good.
  // `rank_exit_at`: the failure is a rank's exit at that time, which an
  // earlier failure may yet turn out to have caused (failure_cause.h).
  void FailGeneration(JobEntry* entry, const std::string& reason, bool permanent,
                      Deferred* deferred, std::optional<absl::Time> rank_exit_at = std::nullopt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A failure of `generation` at `at`, found after the generation failed:
  // if it came first, it becomes the root cause (the job's message and a
  // job.cause event say so).
  void ReviseFailureCause(JobEntry* entry, int64_t generation, absl::Time at,
                          const std::string& cause, const std::string& worker_id,
                          Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A lost worker, as the jobs it ran see it: an event for each, and the
  // root cause of a generation that failed while it was already silent.
  void WorkerLostForJobs(const WorkerEntry& worker, const std::string& silence, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases the job's slots and tells its workers to stop its trainers.
  void ReleaseGeneration(JobEntry* entry, const std::string& reason, const absl::Status& status,
                         Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new generation of the job starts on its placement (just made): a
  // fresh rendezvous and KV store, SCHEDULED.
  void StartGeneration(JobEntry* entry, const std::set<std::string>& workers, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Scheduling: places the jobs waiting for slots, by priority then
  // submission, FIFO within a priority.
  void Schedule(Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Free slots of alive workers, from the placements of jobs holding slots.
  SlotTable FreeSlots() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tries to place one waiting job; false when the queue behind it must
  // wait (it waits for room).
  bool TryPlace(JobEntry* entry, SlotTable* slots, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The time-driven checks of a tick: lost workers, then each placed job's
  // workers, rendezvous deadline, progress and KV waits.
  void CheckTimeouts(Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckWorkers(Clock::TimePoint now, Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckJob(JobEntry* entry, Clock::TimePoint now, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the job's metrics up to a step of a generation are durable, as
  // far as this process knows (in memory), or as the store says (on load).
  MetricsDurable DurableInMemory(JobEntry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  MetricsDurable DurableInStore(JobEntry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Commits the job's checkpoints that awaited their metrics, if `durable`
  // now says they are: records the commits, applies retention (the retired
  // steps are answered with the next CommitCheckpoint) and persists the job.
  // Returns the steps committed.
  std::vector<int64_t> CompleteCheckpoints(JobEntry* entry, const MetricsDurable& durable,
                                           Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a trainer's exit under the lock (fails the generation on an
  // unclean one): whether it was the last rank of the current generation
  // to exit cleanly.
  absl::StatusOr<bool> RecordTrainerExit(const v1::ReportTrainerExitRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // CommitCheckpoint under the lock. True when the checkpoint is written
  // and awaits metrics that are combined in memory, not yet stored.
  absl::StatusOr<bool> CommitCheckpointLocked(const v1::CommitCheckpointRequest& request,
                                              v1::CommitCheckpointResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Reports ranks that became (or stopped being) stragglers.
  void CheckStragglers(JobEntry* entry, Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

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
  v1::HeartbeatResponse BuildHeartbeat(const std::string& worker_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Builds held heartbeats' answers.
  HeldHeartbeats::Builder HeartbeatBuilder() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The held-heartbeat thread's loop (StartTicker); returns on StopTicker.
  void RunHeldTimer(std::chrono::milliseconds longest_sleep) ABSL_LOCKS_EXCLUDED(mu_);
  // A worker that re-registered lost its trainers: running generations
  // with ranks there that it does not report alive fail.
  void FailGenerationsWithoutTrainers(const v1::RegisterWorkerRequest& request, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The jobs holding slots with ranks on the worker, in job id order (from
  // jobs_by_worker_, rebuilt first if a placement or job state changed).
  const std::vector<JobRef>& JobsOnWorker(const std::string& worker_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Placements or job states changed: jobs_by_worker_ is rebuilt on its
  // next use.
  void PlacementsChanged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { jobs_by_worker_stale_ = true; }
  void NotifyWatchers(const std::string& job_id, Deferred* deferred);
  // A checkpoint of the job was committed: if ranks of its running
  // generation are on a draining worker, the generation ends and the job is
  // placed again (on schedulable workers) to resume from that checkpoint,
  // without counting a restart.
  void MoveOffDrainingWorkers(JobEntry* entry, int64_t step, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A checkpoint of the job was committed: a pausing job pauses if it is
  // the one asked for (coordinator_pause.cc); else MoveOffDrainingWorkers.
  void CheckpointCommitted(JobEntry* entry, int64_t step, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the current generation (if any) and makes the job PAUSED.
  void PauseNow(JobEntry* entry, const std::string& message, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A progress beat of a job asked for a checkpoint (pausing, or moving off
  // a draining worker): the agreement on its step advances, and the answer
  // carries it.
  void AnswerCheckpointAsk(JobEntry* entry, const v1::ReportProgressRequest& request,
                           v1::ReportProgressResponse* response, Deferred* deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // As the job succeeds: its throughput from its stored `steps`, against
  // its baseline (coordinator_throughput.cc, scaling_report.h).
  void RecordThroughput(JobEntry* entry, const std::vector<v1::StepMetrics>& steps,
                        Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The running jobs with ranks on a draining worker that write checkpoints
  // are asked for one now, to move at it.
  void AskCheckpointsToMoveOff(const std::string& worker_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The worker as ListWorkers shows it: with the slots and jobs it has now.
  v1::Worker WorkerView(const std::string& id, const WorkerEntry& w)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Refreshes the gauges /metrics shows (a registry collect hook), and
  // takes finished jobs' series off once their retention ran out.
  void CollectMetrics();
  void CollectWorkerSeries(Clock::TimePoint now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FlushStepsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(flush_mu_);
  // Reads steps of a watched job back from the store (PollWatch's catch-up).
  absl::Status CatchUpFromStore(const v1::WatchJobRequest& request, WatchCursor* cursor,
                                WatchBatch* batch);
  // The wait before the job's restart number job.restarts().
  std::chrono::milliseconds RestartDelay(const v1::Job& job) const;

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
  FlushBatch failed_flush_ ABSL_GUARDED_BY(flush_mu_);

  absl::Mutex mu_;
  JobMap jobs_ ABSL_GUARDED_BY(mu_);
  // The jobs of jobs_ that have not finished, by number: scheduling looks
  // at these on every submission and exit, not at every job in memory.
  std::map<int64_t, JobEntry*> unfinished_ ABSL_GUARDED_BY(mu_);
  // Jobs changed in memory whose write to the store failed (StoreUnstoredJobs).
  std::set<std::string> unstored_jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, WorkerEntry> workers_ ABSL_GUARDED_BY(mu_);
  // The components, each guarded by mu_ (WatchStreams::ReadStored by
  // flush_mu_: it only reads the store).
  FailureDetector failures_ ABSL_GUARDED_BY(mu_);
  CheckpointRegistry checkpoints_ ABSL_GUARDED_BY(mu_);
  HeldHeartbeats held_ ABSL_GUARDED_BY(mu_);
  // The held-heartbeat thread: when it next looks (max() while it looks),
  // the flag that wakes it sooner (a call due before then, or stop), and
  // its stop flag.
  Clock::TimePoint held_wake_at_ ABSL_GUARDED_BY(mu_) = Clock::TimePoint::max();
  bool held_wake_ ABSL_GUARDED_BY(mu_) = false;
  bool held_timer_stop_ ABSL_GUARDED_BY(mu_) = false;
  MetricIngest ingest_ ABSL_GUARDED_BY(mu_);
  WatchStreams watch_;
  // Thread-safe on its own (it only talks to the store).
  JobLogs logs_;
  // Jobs whose lines were deleted (retention), not to be deleted again.
  std::set<std::string> logs_deleted_ ABSL_GUARDED_BY(mu_);
  // Jobs holding slots by the workers their ranks are placed on, so that a
  // heartbeat (thousands a second with 10,000 workers) or a worker's view
  // looks at its own jobs rather than at every placement of every job.
  std::map<std::string, std::vector<JobRef>> jobs_by_worker_ ABSL_GUARDED_BY(mu_);
  bool jobs_by_worker_stale_ ABSL_GUARDED_BY(mu_) = true;
  // How many jobs of each state left memory (ArchiveFinishedJobs), for
  // the per-state gauge.
  std::map<int, int64_t> archived_by_state_ ABSL_GUARDED_BY(mu_);
  int64_t next_job_number_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t assignments_version_ ABSL_GUARDED_BY(mu_) = 1;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;

  // Thread-safe; its lock is taken without mu_ held.
  WatchSubscribers watchers_;
  // ReadLogs followers, woken by ShipLogs, job changes and TickLogs.
  WatchSubscribers log_followers_;
  // TickLogs' clocks (the ticker thread's only).
  absl::Time logs_woken_ = absl::InfinitePast();
  absl::Time logs_pruned_ = absl::InfinitePast();

  absl::Mutex ticker_mu_;
  std::thread ticker_;
  std::thread held_timer_;
  std::unique_ptr<absl::Notification> ticker_stop_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_COORDINATOR_H_
