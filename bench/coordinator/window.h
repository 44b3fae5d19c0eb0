#ifndef AIDN_BENCH_COORDINATOR_WINDOW_H_
#define AIDN_BENCH_COORDINATOR_WINDOW_H_

// The measurement window over the steady load: a row every --sample-every
// (heartbeat and metrics rates and p99s, the coordinator's CPU, CPU per
// call answered and RSS, this process's CPU, the load average).

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bench/coordinator/load.h"
#include "bench/coordinator/options.h"

namespace aidn::bench {

struct Sample {
  double t_s = 0;      // since the window opened
  double cpu_pct = 0;  // of one core, since the previous sample
  // Coordinator CPU per call answered since the previous sample: what the
  // coordinator spends on the load, whatever share of the cores the other
  // processes on the host leave it (its CPU % follows that share when it is
  // short of CPU).
  double us_per_call = 0;
  double rss_mib = 0;
  double anon_mib = 0;  // RssAnon: the heap; the rest is mapped files
  double bench_cpu_pct = 0;
  std::string loadavg;
};

struct WindowResult {
  // At the window's start, every --sample-every, and at its end.
  std::vector<Sample> samples;
  int64_t records_in_window = 0;
  double cpu_in_window = 0;  // the coordinator's CPU seconds
  double window_s = 0;
};

// Opens load->window, samples the coordinator `pid` for --duration, closes
// the window.
WindowResult MeasureWindow(const Options& o, pid_t pid, Load* load);

}  // namespace aidn::bench

#endif  // AIDN_BENCH_COORDINATOR_WINDOW_H_
