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
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "aidn/v1/cluster.pb.h"
#include "aidn/v1/coordinator.pb.h"
#include "common/clock.h"
#include "coordinator/auth.h"
#include "coordinator/deferred.h"
#include "coordinator/kv_store.h"
#include "coordinator/rendezvous.h"
#include "coordinator/spec.h"
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
  // The store row of the last metric record sent.
  int64_t last_metric_row = 0;
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

  void StartTicker(std::chrono::milliseconds interval);
  void StopTicker();
  void Tick();

  // --- CoordinatorService ---
  absl::StatusOr<v1::Job> SubmitJob(v1::JobSpec spec, const std::string& owner);
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id);
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const v1::ListJobsRequest& request);
  absl::StatusOr<v1::Job> CancelJob(const std::string& job_id, const std::string& reason);
  v1::ListWorkersResponse ListWorkers();
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const std::string& job_id);
  absl::StatusOr<v1::ListEventsResponse> ListEvents(const v1::ListEventsRequest& request);
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
  absl::StatusOr<v1::CommitCheckpointResponse> CommitCheckpoint(
      const v1::CommitCheckpointRequest& request);

 private:
  struct JobEntry {
    StoredJob stored;
    // Bumped on every change a watcher should see.
    int64_t version = 0;
    // Of the current generation; null when the job holds no slots.
    std::unique_ptr<Rendezvous> rendezvous;
    std::unique_ptr<KvStore> kv;
    std::set<int> exited_ok;
    std::map<int, int64_t> progress_step;
    Clock::TimePoint last_progress{};
    // The reason it last waited for, so "job.waiting" is not repeated.
    std::string waiting_reason;
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
  // Assignments changed: bump the version and answer held heartbeats.
  void AssignmentsChanged(Deferred* deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::HeartbeatResponse BuildHeartbeat(WorkerEntry* worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifyWatchers(const std::string& job_id, Deferred* deferred);
  std::chrono::milliseconds JobWorkerTimeout(const JobEntry& entry) const;

  const CoordinatorOptions options_;
  Clock* const clock_;
  Authenticator* const auth_;

  absl::Mutex mu_;
  std::unique_ptr<Store> store_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<JobEntry>> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, WorkerEntry> workers_ ABSL_GUARDED_BY(mu_);
  int64_t next_job_number_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t assignments_version_ ABSL_GUARDED_BY(mu_) = 1;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;

  // Watchers have their own lock, taken without mu_ held, so that a watcher
  // can pull (taking mu_) from inside Notify().
  absl::Mutex watch_mu_;
  std::map<std::string, std::set<WatchSubscriber*>> watchers_ ABSL_GUARDED_BY(watch_mu_);

  absl::Mutex ticker_mu_;
  std::thread ticker_;
  std::unique_ptr<absl::Notification> ticker_stop_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_COORDINATOR_H_
