#ifndef AIDN_WORKER_METRICS_H_
#define AIDN_WORKER_METRICS_H_

// The worker daemon's Prometheus metrics (its own /metrics): trainers
// running, started, restarted and how they ended; whether the coordinator
// answers; each trainer's CPU and memory; GPU memory where NVIDIA's
// management library is present. docs/metrics.md lists them.

#include <string>
#include <vector>

#include "common/metrics/registry.h"

namespace aidn::worker {

struct WorkerMetrics {
  explicit WorkerMetrics(metrics::Registry* registry);

  metrics::Registry* const registry;
  metrics::Gauge& trainers_running;
  metrics::Counter& trainers_started;
  // Trainers started for a later generation of a job this worker ran
  // before: the job restarted.
  metrics::Counter& trainer_restarts;
  // Label outcome: ok, failed, stopped, killed (by a signal), not_started.
  metrics::Family<metrics::Counter>& trainer_exits;
  metrics::Gauge& coordinator_up;
  metrics::Family<metrics::Counter>& coordinator_call_failures;
  // Per trainer (labels job_id, rank). CPU time is cumulative, so a
  // counter; its series live as long as the trainer runs.
  metrics::Family<metrics::Counter>& trainer_cpu_seconds;
  metrics::Family<metrics::Gauge>& trainer_resident_memory_bytes;
  // Per GPU (label gpu, the index).
  metrics::Family<metrics::Gauge>& gpu_memory_used_bytes;
  metrics::Family<metrics::Gauge>& gpu_memory_total_bytes;
};

// GPU memory as NVML (libnvidia-ml.so.1, loaded at run time) reports it;
// empty where the library or a driver is missing.
struct GpuMemory {
  int index = 0;
  int64_t used_bytes = 0;
  int64_t total_bytes = 0;
};
std::vector<GpuMemory> ReadGpuMemory();

}  // namespace aidn::worker

#endif  // AIDN_WORKER_METRICS_H_
