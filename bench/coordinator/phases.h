#ifndef AIDN_BENCH_COORDINATOR_PHASES_H_
#define AIDN_BENCH_COORDINATOR_PHASES_H_

// The phases before the measurement window, in the order main runs them:
// set-up, registration, the load jobs, the big rendezvous, the warm-up.
// Each prints its own lines.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/coordinator/coordinator_process.h"
#include "bench/coordinator/load.h"
#include "bench/coordinator/options.h"
#include "bench/coordinator/sim_worker.h"

namespace aidn::bench {

// Warnings when built with assertions or without optimisation.
void WarnIfNotRepresentative();

// What runs: the coordinator, the simulated load, the client, the machine.
void PrintSetup(const Options& o, const CoordinatorProcess& c);

// Creates the simulated workers (the probes spread over the id range) and
// registers them, --register-concurrency at a time.
std::vector<std::unique_ptr<SimWorker>> RegisterWorkers(const Options& o, Load* load);

// Submits the load jobs and waits (up to 3 minutes) until each rank joined
// and streams. Returns when that wait ended.
absl::StatusOr<Clock::time_point> StartLoadJobs(const Options& o, CoordinatorProcess& c,
                                                Load* load);

// The big rendezvous, under the full load but before the window: a
// one-off burst (each of its ranks is answered with every peer, a million
// peers in all) that would otherwise sit in the window's percentiles and
// memory samples. Its ranks exit 0 once answered and the job ends before
// the window opens. Returns its job id ("" with --rendezvous-world=0).
std::string RunRendezvous(const Options& o, CoordinatorProcess& c, Load* load);

// Warm-up, counted from when every rank streamed; the coordinator's memory
// as the jobs' step rings fill. Returns whether the rings are full.
bool WarmUp(const Options& o, pid_t pid, Clock::time_point streaming_since);

}  // namespace aidn::bench

#endif  // AIDN_BENCH_COORDINATOR_PHASES_H_
