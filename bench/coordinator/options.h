#ifndef AIDN_BENCH_COORDINATOR_OPTIONS_H_
#define AIDN_BENCH_COORDINATOR_OPTIONS_H_

// coordinator_load's command line.

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace aidn::bench {

// StepLogOptions::recent_steps (coordinator/step_log.h): combined steps a
// job keeps in memory. The default warm-up lasts until they are full.
constexpr int kRecentSteps = 4096;

struct Options {
  int workers = 10'000;
  int ranks = 1'000;
  int ranks_per_job = 8;
  int slots_per_worker = 4;
  int records_per_second = 10;
  int channels = 32;
  int probe_workers = -1;  // -1: 1 % of the workers, at least 1
  int rendezvous_world = 1'024;
  int register_concurrency = 64;
  std::chrono::seconds duration{300};
  std::chrono::seconds warmup{-1};  // -1: until the step rings are full
  std::chrono::seconds sample_every{30};
  // Extra flags for the coordinator (--coordinator-arg=--tick-interval=50ms).
  std::vector<std::string> coordinator_args;
};

enum class ParseResult { kRun, kHelp, kBadFlag };

// Fills `o` from argv, resolving the "auto" defaults (probe workers,
// warm-up). A bad flag is reported on stderr.
ParseResult ParseFlags(int argc, char** argv, Options* o);

// The flags and their defaults, to `out` (stdout for --help, stderr after a
// bad flag).
void PrintUsage(std::FILE* out);

}  // namespace aidn::bench

#endif  // AIDN_BENCH_COORDINATOR_OPTIONS_H_
