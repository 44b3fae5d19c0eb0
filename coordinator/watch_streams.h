#ifndef AIDN_COORDINATOR_WATCH_STREAMS_H_
#define AIDN_COORDINATOR_WATCH_STREAMS_H_

// WatchJob streams: who watches which job, and what a watcher is sent next
// (the job when it changed, its events after the cursor, its combined steps
// from memory, or, for a watcher behind what memory holds, read back from
// the store).
//
// WatchSubscribers is thread-safe with a lock of its own, taken without the
// coordinator's mutex held, so that a watcher can pull (taking that mutex)
// from inside Notify(). WatchStreams is not thread-safe: PollMemory runs
// under the coordinator's mutex, ReadStored under its flush lock.

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "aidn/v1/coordinator.pb.h"
#include "aidn/v1/job.pb.h"
#include "coordinator/step_log.h"
#include "coordinator/store.h"

namespace aidn::coordinator {

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

class WatchSubscribers {
 public:
  void Add(const std::string& job_id, WatchSubscriber* subscriber);
  void Remove(const std::string& job_id, WatchSubscriber* subscriber);
  // Notifies the job's subscribers (never call under the coordinator's mutex).
  void Notify(const std::string& job_id);
  // The jobs with a subscriber now.
  std::vector<std::string> Jobs();

 private:
  absl::Mutex mu_;
  std::map<std::string, std::set<WatchSubscriber*>> subscribers_ ABSL_GUARDED_BY(mu_);
};

class WatchStreams {
 public:
  // Steps sent per pull at most.
  static constexpr size_t kMaxSteps = 1024;

  explicit WatchStreams(Store* store) : store_(store) {}  // not owned

  // What a watcher gets from memory (and the event log): the job if its
  // `version` is newer than the cursor's, the events after the cursor,
  // and, once caught up, the steps `steps` (may be null) combined after
  // the cursor; a watcher behind what memory holds is put back to catching
  // up. Returns whether anything was added.
  absl::StatusOr<bool> PollMemory(const v1::WatchJobRequest& request, const v1::Job& job,
                                  int64_t version, const StepLog* steps, WatchCursor* cursor,
                                  WatchBatch* batch);

  // Catching up: steps read back from the store from the cursor's next
  // step. Returns true once the store had no more (the caller then follows
  // memory after the steps stored: cursor->metrics_seq). Call with every
  // combined step flushed, and no flush in between.
  absl::StatusOr<bool> ReadStored(const v1::WatchJobRequest& request, WatchCursor* cursor,
                                  WatchBatch* batch);

 private:
  Store* const store_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_WATCH_STREAMS_H_
