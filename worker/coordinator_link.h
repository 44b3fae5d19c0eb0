#ifndef AIDN_WORKER_COORDINATOR_LINK_H_
#define AIDN_WORKER_COORDINATOR_LINK_H_

// The worker daemon's conversation with the coordinator: registration, the
// long-poll heartbeat that brings assignments, and the queue of trainer exit
// reports. It knows nothing of processes; the daemon (worker/daemon.h) tells
// it which trainers run and is told what should run.
//
//   CoordinatorLink link(options, {.trainers = ..., .on_assignments = ...});
//   link.Start();
//   link.QueueReport(report);          // any thread, whenever a trainer ends
//   ...
//   link.StopHeartbeats();             // no new work from here on
//   ... stop the trainers, queue their reports ...
//   link.FinishReports(3s);            // last chance to deliver, then joined

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "common/rpc/client.h"
#include "common/rpc/retry.h"
#include "worker/metrics.h"

namespace grpc {
class ClientContext;
}  // namespace grpc

namespace aidn::worker {

struct CoordinatorLinkOptions {
  // The coordinator: its address and how to verify it (its
  // max_message_bytes is this struct's).
  rpc::ChannelOptions coordinator;
  // The worker join token (role worker).
  std::string token;
  // This worker as RegisterWorker describes it (id, hostname, address,
  // slots, GPUs, version); the trainers are filled in at each call.
  v1::WorkerInfo info;
  // Used until the coordinator tells its own (RegisterWorkerResponse and
  // each HeartbeatResponse); also how long a heartbeat is held.
  std::chrono::milliseconds heartbeat_interval{2'000};
  // Deadline of each RPC (a held heartbeat gets its max_wait on top).
  std::chrono::milliseconds rpc_timeout{5'000};
  // Waits between failed calls while the coordinator is unreachable.
  rpc::BackoffOptions backoff;
  // Exit reports kept while they cannot be delivered; the oldest is dropped
  // (and logged) beyond this.
  size_t max_pending_reports = 1024;
  // Largest gRPC message sent or received.
  int max_message_bytes = 4 * 1024 * 1024;
  // coordinator_up and coordinator_call_failures go here; none when null.
  // Not owned.
  WorkerMetrics* metrics = nullptr;
};

// How the link asks for and hands over state. Both are called on the link's
// heartbeat thread, never with the link's lock held; they may call
// QueueReport() but not StopHeartbeats() or FinishReports().
struct CoordinatorLinkCallbacks {
  // The trainers running now, listed in RegisterWorker and every Heartbeat.
  std::function<std::vector<v1::TrainerStatus>()> trainers;
  // Each heartbeat answer: the complete set of trainers this worker should
  // run, and the stop orders that came with it (each order once).
  std::function<void(std::vector<v1::TrainerAssignment> assignments,
                     std::vector<v1::StopOrder> stops)>
      on_assignments;
};

// ReportTrainerExit failures worth another try: rpc::Transient, and also
// INTERNAL and UNKNOWN, which gRPC gives a call whose stream a crashing or
// restarting coordinator tore down (the coordinator itself answers an exit
// report only with OK, NOT_FOUND or an auth error). A lost exit report
// leaves a job waiting on a rank that is gone, so the report queue leans to
// retrying. UNAUTHENTICATED is final: the coordinator loads its tokens
// before it listens, so a token it refuses is not one it will accept later.
bool ExitReportRetryable(grpc::StatusCode code);

// Runs two threads:
//  - heartbeat: RegisterWorker (listing the trainers), then Heartbeat
//    long-polls (max_wait = the heartbeat interval, with the last
//    assignments_version, so new work arrives at once). NOT_FOUND registers
//    again under the same id; any other failure is retried with backoff,
//    for as long as the link runs. Exit reports still queued are given a
//    chance (up to rpc_timeout) before each registration: registering
//    without a trainer whose exit report waits would read as a lost trainer.
//  - reports: delivers ReportTrainerExit in the order queued, retrying what
//    ExitReportRetryable() with backoff; a report refused for good is logged
//    and dropped.
//
// Thread-safe. Start() at most once. StopHeartbeats() and FinishReports()
// are idempotent and end the two threads in that order; the destructor does
// both (FinishReports with no time left).
class CoordinatorLink {
 public:
  // Builds the channel; connects on first use.
  CoordinatorLink(CoordinatorLinkOptions options, CoordinatorLinkCallbacks callbacks);
  ~CoordinatorLink();
  CoordinatorLink(const CoordinatorLink&) = delete;
  CoordinatorLink& operator=(const CoordinatorLink&) = delete;

  // Starts both threads (a no-op after StopHeartbeats()).
  void Start();

  // Queues an exit report for delivery. Any thread, also after
  // StopHeartbeats(); one queued after FinishReports() returned is never
  // delivered.
  void QueueReport(v1::ReportTrainerExitRequest report);

  // Cancels the heartbeat in flight and joins the heartbeat thread: the
  // callbacks are not called once it returns.
  void StopHeartbeats();

  // Delivers what is queued for at most `timeout` (logging what is left
  // undelivered), then joins the report thread.
  void FinishReports(std::chrono::milliseconds timeout);

 private:
  void HeartbeatLoop();
  void ReportLoop();

  // One RegisterWorker or Heartbeat call and what follows from a success
  // (the interval the coordinator asks for, the assignments handed over).
  grpc::Status Register(std::chrono::milliseconds* interval);
  grpc::Status Heartbeat(std::chrono::milliseconds interval, int64_t* version,
                         std::chrono::milliseconds* next_interval);
  // After a failed heartbeat-thread call: metrics, one log line per outage,
  // the backoff wait. False when heartbeats are stopping.
  bool RetryAfter(const char* call, const grpc::Status& status);
  // After a successful one: metrics, "reachable again", backoff reset.
  void Succeeded();

  bool HeartbeatsStopping() const ABSL_LOCKS_EXCLUDED(mu_);
  // False when heartbeats are stopping (at once, not after `delay`).
  bool SleepUnlessStopping(std::chrono::milliseconds delay) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs `fn` with a context StopHeartbeats() can cancel.
  grpc::Status CallCancellable(std::chrono::milliseconds timeout,
                               const std::function<grpc::Status(grpc::ClientContext*)>& fn)
      ABSL_LOCKS_EXCLUDED(mu_);

  const CoordinatorLinkOptions options_;
  const CoordinatorLinkCallbacks callbacks_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ClusterService::Stub> stub_;

  // Heartbeat thread only.
  rpc::Backoff heartbeat_backoff_;
  // The last heartbeat failure logged, so that an outage is logged once.
  std::string heartbeat_problem_;

  // Serialises Start(), StopHeartbeats() and FinishReports().
  absl::Mutex lifecycle_mu_;
  std::thread heartbeat_thread_;
  std::thread report_thread_;

  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool heartbeats_stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The in-flight call of the heartbeat thread, cancelled by StopHeartbeats().
  grpc::ClientContext* heartbeat_call_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Set by FinishReports(): the report thread gives up at this time.
  std::optional<std::chrono::steady_clock::time_point> give_up_at_ ABSL_GUARDED_BY(mu_);
  // Oldest first, each with a sequence number (the front is popped only once
  // delivered or refused).
  std::deque<std::pair<uint64_t, v1::ReportTrainerExitRequest>> reports_ ABSL_GUARDED_BY(mu_);
  uint64_t next_report_seq_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace aidn::worker

#endif  // AIDN_WORKER_COORDINATOR_LINK_H_
