#ifndef AIDN_BENCH_COORDINATOR_VERDICT_H_
#define AIDN_BENCH_COORDINATOR_VERDICT_H_

// False failures, as the coordinator records them: workers declared lost
// (its events and ListWorkers) and generations failed (its events and
// ListJobs).

#include <cstdint>
#include <map>
#include <string>

#include "aidn/v1/coordinator.grpc.pb.h"

namespace aidn::bench {

struct Verdict {
  int workers_listed = 0;
  int workers_lost_now = 0;
  std::map<std::string, int> events;  // by type, the failure kinds only
  int64_t restarts = 0;               // sum over jobs
  int jobs_failed = 0;
  std::string rendezvous_job_state;
  bool read_ok = true;
  std::string error;
};

Verdict ReadVerdict(v1::CoordinatorService::Stub* stub, const std::string& token,
                    const std::string& rendezvous_job);

}  // namespace aidn::bench

#endif  // AIDN_BENCH_COORDINATOR_VERDICT_H_
