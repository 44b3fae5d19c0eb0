#ifndef AIDN_TESTS_INTEGRATION_HARNESS_H_
#define AIDN_TESTS_INTEGRATION_HARNESS_H_

// Real binaries on loopback for integration tests: a coordinator on an
// ephemeral port with its own state directory, aidnctl invocations, and gRPC
// stubs for tests that play the part of workers and trainers.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "tests/integration/process.h"

namespace aidn::testing {

struct CoordinatorHandle {
  std::unique_ptr<Process> process;
  std::string address;  // 127.0.0.1:PORT
  // Where /metrics is served; empty when the extra args turned it off.
  std::string metrics_address;
  std::string state_dir;
  std::string admin_token;   // read from <state_dir>/admin.token
  std::string worker_token;  // read from <state_dir>/worker.token
};

// Starts AIDN_COORDINATOR_BIN with --listen=127.0.0.1:0
// --state-dir=<state_dir> --addr-file=<state_dir>/coordinator.addr
// --metrics-addr=127.0.0.1:0 --metrics-addr-file=<state_dir>/metrics.addr plus
// `extra_args`, and waits (up to 30 s) until the address file appears and the
// gRPC health check answers SERVING. The address file is removed first, so a
// restart on the same state dir never reads a stale one. The coordinator's
// stderr goes to <state_dir>/coordinator.<n>.log.
absl::StatusOr<CoordinatorHandle> StartCoordinator(const std::string& state_dir,
                                                   const std::vector<std::string>& extra_args = {});

// Runs AIDNCTL_BIN --addr=<address> --token=<token> args... with HOME set to
// an empty directory (so no user config is read), AIDN_ADDR and AIDN_TOKEN
// empty, and a 30 s limit. An empty `token` passes no --token at all.
CommandResult Aidnctl(const CoordinatorHandle& coordinator, const std::string& token,
                      const std::vector<std::string>& args);

std::unique_ptr<v1::CoordinatorService::Stub> CoordinatorStub(const std::string& address);
std::unique_ptr<v1::ClusterService::Stub> ClusterStub(const std::string& address);

// Starts `binary` (default AIDN_WORKER_BIN) against `coordinator` with its worker token,
// --worker-id=<id>, --cpu-slots=1, --work-dir=<work_dir> (created) and
// --metrics-addr= (off), then `extra_args`; stdout and stderr go to
// <work_dir>/worker.out and worker.err.
absl::StatusOr<std::unique_ptr<Process>> StartWorker(
    const CoordinatorHandle& coordinator, const std::string& id, const std::string& work_dir,
    const std::vector<std::string>& extra_args = {}, const std::string& binary = AIDN_WORKER_BIN);

// For a failed test's output: the last 6000 bytes of each worker's stderr
// (<dir>/<id>/worker.err, as StartWorker writes it) and of the
// coordinator's, to std::cerr.
void PrintStderrTails(const std::string& dir, const std::vector<std::string>& worker_ids,
                      const CoordinatorHandle& coordinator);

// Waits until at least `count` workers are ALIVE; false after `timeout`.
bool WaitForAliveWorkers(v1::CoordinatorService::Stub* stub, const std::string& token, int count,
                         std::chrono::milliseconds timeout);

// Jobs through the CoordinatorService as `token`.
absl::StatusOr<std::string> SubmitJob(v1::CoordinatorService::Stub* stub, const std::string& token,
                                      const v1::JobSpec& spec);
// The job, or an empty Job when the call fails.
v1::Job GetJob(v1::CoordinatorService::Stub* stub, const std::string& token,
               const std::string& job_id);
// SUCCEEDED, FAILED or CANCELLED.
bool JobEnded(const v1::Job& job);
// Polls until the job ended or `timeout` passed; returns it as last seen.
v1::Job WaitForJobEnd(v1::CoordinatorService::Stub* stub, const std::string& token,
                      const std::string& job_id, std::chrono::milliseconds timeout);

// A ClientContext with "authorization: Bearer <token>" and a deadline.
std::unique_ptr<grpc::ClientContext> Context(
    const std::string& token, std::chrono::milliseconds timeout = std::chrono::seconds(10));

}  // namespace aidn::testing

#endif  // AIDN_TESTS_INTEGRATION_HARNESS_H_
