// coordinator_load: many simulated workers and trainers against ONE real
// coordinator on loopback: the coordinator's figure at scale.
//
//   coordinator_load [--workers=10000] [--ranks=1000] [--duration=300s] ...
//                    (--help lists every flag)
//
// The coordinator is the real binary (started through the integration
// harness on 127.0.0.1:0 with its own state directory, default flags: a 2 s
// heartbeat interval, a 10 s worker timeout). This program plays
//
//  - --workers worker daemons, each with --slots-per-worker CPU slots. They
//    register, then heartbeat the way worker/daemon.cc does: the call carries
//    the trainers the worker runs, max_wait = the heartbeat interval and the
//    assignments_version of the last answer, so the coordinator holds it
//    until the assignments change or the interval passed; a changed answer is
//    followed by the next heartbeat at once, an early unchanged one waits out
//    the interval. Assignments in the answers are reconciled as the daemon
//    does (start what is missing, stop what is not listed or ordered
//    stopped, report every trainer's end with ReportTrainerExit).
//    --probe-workers of them (1 % by default) heartbeat with max_wait 0
//    instead, like a daemon without long polls: the coordinator answers those
//    at once, so their client-side latency is the heartbeat RPC's own cost
//    under load (a held call's round trip is the hold). Probes offer no
//    slots (they would learn of new work up to an interval late).
//  - the trainers those workers are assigned, instead of processes: each
//    joins the rendezvous, then reports like worker/trainer/trainer.cc's
//    Reporter: every second one StreamMetrics call carrying the TRAIN
//    records made since the last one (--records-per-second per rank, one
//    call in flight per rank), and a ReportProgress beat every second (the
//    first at once).
//
// The load is --ranks ranks in jobs of --ranks-per-job submitted through
// SubmitJob and placed by the coordinator's scheduler. Once every rank
// streams, a job of --rendezvous-world ranks is submitted under that load;
// its trainers join the rendezvous as their workers learn of them, and exit
// 0 once answered (their workers report it, the job succeeds). The time from
// the first JoinRendezvous sent to the last rank answered is its figure
// (those answers are taken as bytes, unparsed: see SimTrainer::Join).
// Then, after --warmup, the measurement window (--duration) of the steady
// load. The default warm-up lasts until every job's in-memory ring of recent
// steps is full (the coordinator keeps the newest 4,096 combined steps of a
// job, coordinator/step_log.h: 410 s at 10 steps/s); before that the
// coordinator's memory grows by design, and whether it is flat cannot be
// judged. With a shorter --warmup the memory verdict says so.
//
// All RPCs use gRPC's callback API over --channels channels (one TCP
// connection each), shared round-robin by the simulated workers and
// trainers; one timer thread paces them. So 10,000 workers need neither
// 10,000 threads nor 10,000 connections; the output says so.
//
// Printed: latencies (client side, calls started in the window), the
// coordinator's CPU (% of one core, and per call answered, from
// /proc/<pid>/stat) and VmRSS (/proc/<pid>/status) at the start of the
// window, every --sample-every and at the end, false failures (workers the
// coordinator declared lost, per its events and ListWorkers; generations
// failed, per its events and ListJobs), the rendezvous time, and each target
// with PASS or MISS. A benchmark: no ctest registration.
//
// The pieces, in the order they run: options (flags), coordinator_process
// (the real coordinator, /proc), sim_worker and sim_trainer (the simulated
// processes over load.h's shared channels, timer and counters), phases
// (set-up, registration, load jobs, rendezvous, warm-up), window (the
// measurement window), verdict (false failures, read back) and report.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "bench/coordinator/coordinator_process.h"
#include "bench/coordinator/load.h"
#include "bench/coordinator/options.h"
#include "bench/coordinator/phases.h"
#include "bench/coordinator/report.h"
#include "bench/coordinator/sim_worker.h"
#include "bench/coordinator/verdict.h"
#include "bench/coordinator/window.h"

namespace aidn::bench {
namespace {

// The coordinator answers every held call as it stops; then the calls
// still in flight drain. Returns the exit status.
int Teardown(CoordinatorProcess* c, Load* load) {
  load->stopping = true;
  StopCoordinatorProcess(c);
  const Clock::time_point drain_deadline = Clock::now() + seconds(20);
  while (load->in_flight.load() > 0 && Clock::now() < drain_deadline) {
    std::this_thread::sleep_for(milliseconds(50));
  }
  load->timer.Stop();
  std::filesystem::remove_all(c->dir);
  if (load->in_flight.load() > 0) {
    // Calls still pending refer to the simulation's objects: leave without
    // destroying them.
    std::fflush(stdout);
    std::_Exit(0);
  }
  return 0;
}

int Run(const Options& o) {
  WarnIfNotRepresentative();
  RaiseFileLimit();
  absl::StatusOr<CoordinatorProcess> c = StartCoordinatorProcess(o);
  if (!c.ok()) {
    std::fprintf(stderr, "coordinator_load: %s\n", c.status().ToString().c_str());
    return 1;
  }
  Load load(o);
  load.worker_token = c->handle.worker_token;
  MakeStubs(c->handle.address, o.channels, &load);
  PrintSetup(o, *c);

  const std::vector<std::unique_ptr<SimWorker>> workers = RegisterWorkers(o, &load);
  const absl::StatusOr<Clock::time_point> streaming_since = StartLoadJobs(o, *c, &load);
  if (!streaming_since.ok()) {
    std::fprintf(stderr, "coordinator_load: %s\n", streaming_since.status().ToString().c_str());
    return 1;
  }
  const std::string rendezvous_job = RunRendezvous(o, *c, &load);
  const bool rings_full = WarmUp(o, c->pid, *streaming_since);
  const WindowResult window = MeasureWindow(o, c->pid, &load);
  const Verdict verdict = ReadVerdict(c->stub.get(), c->handle.admin_token, rendezvous_job);

  const WindowLatencies latencies = SummarizeWindow(load);
  PrintLatencies(load, latencies, window);
  PrintCoordinatorSamples(window);
  const RendezvousFigures rendezvous = PrintRendezvous(o, &load, rendezvous_job, verdict);
  PrintFalseFailures(verdict, load);
  PrintTargets(o, load, latencies, window, rings_full, verdict, rendezvous);
  return Teardown(&*c, &load);
}

}  // namespace
}  // namespace aidn::bench

int main(int argc, char** argv) {
  // Debian's Abseil is built without NDEBUG, so every absl::Mutex lock (ours
  // and gRPC's) would run the deadlock detector through one global graph
  // lock: a debugging aid, not part of the load.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  aidn::bench::Options options;
  switch (aidn::bench::ParseFlags(argc, argv, &options)) {
    case aidn::bench::ParseResult::kHelp:
      aidn::bench::PrintUsage(stdout);
      return 0;
    case aidn::bench::ParseResult::kBadFlag:
      aidn::bench::PrintUsage(stderr);
      return 2;
    case aidn::bench::ParseResult::kRun:
      break;
  }
  return aidn::bench::Run(options);
}
