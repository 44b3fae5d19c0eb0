#ifndef AIDN_BENCH_COORDINATOR_COORDINATOR_PROCESS_H_
#define AIDN_BENCH_COORDINATOR_COORDINATOR_PROCESS_H_

// The one real aidn-coordinator under load: started through the
// integration harness on 127.0.0.1:0 with its own state directory, and
// read from /proc (CPU, resident memory).

#include <sys/types.h>

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "aidn/v1/job.pb.h"
#include "bench/coordinator/load.h"
#include "bench/coordinator/options.h"
#include "tests/integration/cluster_fixture.h"

namespace aidn::bench {

struct CoordinatorProcess {
  std::string dir;  // /tmp/aidn-coordinator-load-<pid>; its state in dir/state
  testing::CoordinatorHandle handle;
  pid_t pid = 0;
  std::unique_ptr<v1::CoordinatorService::Stub> stub;  // with handle.admin_token
};

// Starts it with the default flags plus --coordinator-arg's.
absl::StatusOr<CoordinatorProcess> StartCoordinatorProcess(const Options& o);

// Stops it: SIGTERM (it answers every held call as it stops), then waits
// up to 20 s for it to exit.
void StopCoordinatorProcess(CoordinatorProcess* c);

// --channels channels to `address` (a TCP connection each), with a
// ClusterService stub and a generic stub over each.
void MakeStubs(const std::string& address, int count, Load* load);

// A job of the load ("load") or the big rendezvous ("rendezvous").
v1::JobSpec Spec(const std::string& name, int world_size, const std::string& role);

// VmRSS and RssAnon of /proc/<pid>/status, in MiB.
std::pair<double, double> ResidentMiB(pid_t pid);
// User + system CPU seconds of `pid` (0: this process); -1 if unreadable.
double CpuSeconds(pid_t pid);
// /proc/loadavg's first three figures.
std::string LoadAverage();
// The soft limit on open files raised to the hard one (a channel is a
// socket; the coordinator is another process).
void RaiseFileLimit();

}  // namespace aidn::bench

#endif  // AIDN_BENCH_COORDINATOR_COORDINATOR_PROCESS_H_
