#ifndef AIDN_COORDINATOR_JOB_ENTRY_H_
#define AIDN_COORDINATOR_JOB_ENTRY_H_

// What the coordinator keeps in memory of each job and worker: the stored
// record, the current generation's rendezvous and KV store, and one member
// per component for that component's per-job state. Private to the
// coordinator; guarded by its mutex.

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "aidn/v1/cluster.pb.h"
#include "aidn/v1/job.pb.h"
#include "common/clock.h"
#include "coordinator/checkpoint_agreement.h"
#include "coordinator/checkpoint_registry.h"
#include "coordinator/failure_cause.h"
#include "coordinator/failure_detector.h"
#include "coordinator/kv_store.h"
#include "coordinator/metric_ingest.h"
#include "coordinator/rendezvous.h"
#include "coordinator/store.h"

namespace aidn::coordinator {

struct JobEntry {
  StoredJob stored;
  // Bumped on every change a watcher should see.
  int64_t version = 0;
  // Of the current generation; null when the job holds no slots.
  std::unique_ptr<Rendezvous> rendezvous;
  std::unique_ptr<KvStore> kv;
  std::set<int> exited_ok;
  // A RESTARTING job is not placed before this (restart backoff).
  Clock::TimePoint restart_at{};
  // Workers that ran the failed generation, and when it failed: a restart
  // is placed on one of them only once it was heard from after that (it
  // got its stop orders, it is alive), so a worker that died with the
  // generation is not chosen again before it is declared lost.
  std::set<std::string> unconfirmed_workers;
  Clock::TimePoint failed_at{};
  // The reason it last waited for, so "job.waiting" is not repeated.
  std::string waiting_reason;
  // Why the last failed generation failed (revised as earlier failures come
  // to light; see failure_cause.h).
  std::optional<FailureCause> last_failure;
  // The checkpoint step the ranks of the current generation agree on while
  // the job pauses, or moves off a draining worker (see
  // checkpoint_agreement.h); `move_asked`: the latter.
  CheckpointAgreement agreement;
  bool move_asked = false;

  // Per component.
  JobHealth health;            // FailureDetector
  JobCheckpoints checkpoints;  // CheckpointRegistry
  JobMetrics metrics;          // MetricIngest
};

struct WorkerEntry {
  v1::Worker worker;
  Clock::TimePoint last_seen{};
  // Registered or heartbeat since this coordinator started: a worker known
  // only from the store (its node may be gone) gets no new ranks before.
  bool heard = true;
  std::vector<v1::StopOrder> pending_stops;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_JOB_ENTRY_H_
