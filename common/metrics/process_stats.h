#ifndef AIDN_COMMON_METRICS_PROCESS_STATS_H_
#define AIDN_COMMON_METRICS_PROCESS_STATS_H_

// A process's CPU time and memory, read from /proc (Linux), for the
// standard process_* metrics.

#include <sys/types.h>

#include <cstdint>

#include "absl/status/statusor.h"

namespace aidn::metrics {

class Registry;

struct ProcessStats {
  double cpu_seconds = 0;  // user + system
  int64_t resident_bytes = 0;
  int64_t virtual_bytes = 0;
  int64_t open_fds = 0;           // -1 when it cannot be counted
  double start_time_seconds = 0;  // since the Unix epoch
  int64_t threads = 0;
};

// `pid` 0 means this process. NOT_FOUND when the process is gone.
absl::StatusOr<ProcessStats> ReadProcessStats(pid_t pid = 0);

// Registers the standard Prometheus process metrics of this process on
// `registry` (not owned):
// process_cpu_seconds_total (counter), process_resident_memory_bytes,
// process_virtual_memory_bytes, process_open_fds, process_start_time_seconds
// and process_threads (gauges), refreshed by a collect hook before every
// Serialize. Calling it twice on one registry is harmless: the values stay
// right.
void AddProcessMetrics(Registry* registry);

}  // namespace aidn::metrics

#endif  // AIDN_COMMON_METRICS_PROCESS_STATS_H_
