#ifndef AIDN_COORDINATOR_METRICS_H_
#define AIDN_COORDINATOR_METRICS_H_

// The coordinator's Prometheus metrics: the families it exports on
// /metrics, and a gRPC server interceptor that counts every RPC by method
// and status code and times it. docs/metrics.md lists them all.

#include <memory>

#include "common/metrics/registry.h"
#include "grpcpp/support/server_interceptor.h"

namespace aidn::coordinator {

// Families, registered in `registry` (not owned) on construction.
struct CoordinatorMetrics {
  explicit CoordinatorMetrics(metrics::Registry* registry);

  metrics::Registry* const registry;

  // Jobs by state (every state, zeros included).
  metrics::Family<metrics::Gauge>& jobs;
  // Jobs held in memory: the unfinished and the recently finished ones.
  metrics::Gauge& jobs_in_memory;
  // Jobs changed in memory whose write to the database failed (a full
  // disk), retried every tick.
  metrics::Gauge& jobs_unstored;
  // Per job (labels job_id, name, owner), for jobs running or ended within
  // the retention period.
  metrics::Family<metrics::Gauge>& job_state;  // 1, with a state label
  metrics::Family<metrics::Gauge>& job_step;
  metrics::Family<metrics::Gauge>& job_total_steps;
  metrics::Family<metrics::Gauge>& job_epoch;
  metrics::Family<metrics::Gauge>& job_loss;
  metrics::Family<metrics::Gauge>& job_samples_per_second;
  metrics::Family<metrics::Gauge>& job_tokens_per_second;
  metrics::Family<metrics::Gauge>& job_peak_memory_bytes;
  metrics::Family<metrics::Gauge>& job_device_peak_memory_bytes;
  metrics::Family<metrics::Gauge>& job_step_seconds;
  metrics::Family<metrics::Gauge>& job_allreduce_seconds;
  metrics::Family<metrics::Gauge>& job_restarts;
  metrics::Family<metrics::Gauge>& job_generation;
  metrics::Family<metrics::Gauge>& job_world_size;
  metrics::Family<metrics::Gauge>& job_last_checkpoint_step;
  metrics::Family<metrics::Gauge>& job_test_accuracy;
  metrics::Family<metrics::Gauge>& job_test_loss;
  // Counters of the job's combined TRAIN steps and their samples, so that
  // rate() gives its throughput over any window.
  metrics::Family<metrics::Counter>& job_steps_total;
  metrics::Family<metrics::Counter>& job_samples_total;
  // Per rank of a job (labels job_id, rank).
  metrics::Family<metrics::Histogram>& rank_step_seconds;
  metrics::Family<metrics::Histogram>& rank_allreduce_seconds;
  metrics::Family<metrics::Gauge>& rank_step;
  metrics::Family<metrics::Gauge>& rank_last_progress_age_seconds;
  metrics::Family<metrics::Gauge>& rank_straggler;  // 0 or 1
  // Per worker (label worker_id).
  metrics::Family<metrics::Gauge>& worker_up;
  metrics::Family<metrics::Gauge>& worker_scheduling;
  metrics::Family<metrics::Gauge>& worker_heartbeat_age_seconds;
  metrics::Family<metrics::Gauge>& worker_slots;
  metrics::Family<metrics::Gauge>& worker_slots_used;
  metrics::Family<metrics::Gauge>& worker_slots_free;
  // The metrics pipeline itself.
  metrics::Counter& records_received;
  metrics::Counter& records_dropped;
  metrics::Counter& steps_stored;
  metrics::Histogram& store_batch_seconds;
  // How long each tick held the coordinator's lock (every call waits
  // behind it).
  metrics::Histogram& tick_seconds;
  // RPCs (labels service, method, code; the histogram service, method).
  metrics::Family<metrics::Counter>& rpcs;
  metrics::Family<metrics::Histogram>& rpc_duration_seconds;
};

// Counts and times every call the server handles into `metrics->rpcs` and
// `metrics->rpc_duration_seconds`. `metrics` is not owned.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewRpcMetricsInterceptor(
    CoordinatorMetrics* metrics);

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_METRICS_H_
