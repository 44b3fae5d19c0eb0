#ifndef AIDN_BENCH_COORDINATOR_REPORT_H_
#define AIDN_BENCH_COORDINATOR_REPORT_H_

// The report after the window: latencies, the coordinator's samples, the
// rendezvous, false failures, and each target with PASS or MISS.

#include <string>

#include "bench/coordinator/load.h"
#include "bench/coordinator/measure.h"
#include "bench/coordinator/options.h"
#include "bench/coordinator/verdict.h"
#include "bench/coordinator/window.h"

namespace aidn::bench {

// Client-side latencies of the calls started in the window.
struct WindowLatencies {
  Summary heartbeat;       // answered at once
  Summary heartbeat_late;  // held: lateness past max_wait
  Summary metrics;
  Summary progress;
  Summary exits;
  Summary joins;
};
WindowLatencies SummarizeWindow(const Load& load);

void PrintLatencies(const Load& load, const WindowLatencies& l, const WindowResult& w);
void PrintCoordinatorSamples(const WindowResult& w);

// The big rendezvous' figures, as its trainers saw them.
struct RendezvousFigures {
  int answered = 0;
  double ms = -1;  // first join sent -> last answer
};
RendezvousFigures PrintRendezvous(const Options& o, Load* load, const std::string& job,
                                  const Verdict& v);

void PrintFalseFailures(const Verdict& v, const Load& load);

// `rings_full`: whether the warm-up lasted until the jobs' step rings
// were full (else RSS flatness is not judged).
void PrintTargets(const Options& o, const Load& load, const WindowLatencies& l,
                  const WindowResult& w, bool rings_full, const Verdict& v,
                  const RendezvousFigures& rendezvous);

}  // namespace aidn::bench

#endif  // AIDN_BENCH_COORDINATOR_REPORT_H_
