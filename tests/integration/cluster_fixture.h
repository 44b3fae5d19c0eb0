#ifndef AIDN_TESTS_INTEGRATION_CLUSTER_FIXTURE_H_
#define AIDN_TESTS_INTEGRATION_CLUSTER_FIXTURE_H_

// Real binaries on loopback for integration tests. TestCluster is one test's
// cluster: a real aidn-coordinator on an ephemeral port with its own state
// directory, real aidn-worker daemons, an aidnctl runner and gRPC stubs, with
// the job helpers every test needs (submit, wait for a state, events,
// metrics). The free functions under it are its parts, for tests that need a
// coordinator handle of their own (aidnctl against nothing, two coordinators).

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "common/rpc/client.h"
#include "gtest/gtest.h"
#include "tests/support/files.h"
#include "tests/support/process.h"
#include "tests/support/wait.h"

namespace aidn::testing {

// Debian's dataset-fashion-mnist, which the training tests skip without.
inline constexpr char kFashionMnist[] = "/usr/share/datasets/fashion-mnist";
bool FashionMnistInstalled();

struct CoordinatorHandle {
  std::unique_ptr<Process> process;
  std::string address;  // 127.0.0.1:PORT
  // Where /metrics is served; empty when the extra args turned it off.
  std::string metrics_address;
  std::string state_dir;
  std::string admin_token;   // read from <state_dir>/admin.token
  std::string worker_token;  // read from <state_dir>/worker.token
  // The CA the coordinator made in <state_dir>/tls (TLS is on by default);
  // empty when it was started with --insecure.
  std::string ca_file;
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
// empty, and a limit of `timeout`. An empty `token` passes no --token at all.
CommandResult Aidnctl(const CoordinatorHandle& coordinator, const std::string& token,
                      const std::vector<std::string>& args,
                      std::chrono::milliseconds timeout = std::chrono::seconds(30));

// Aidnctl's command in the background (for --follow and watch): HOME set to
// `home` (an empty directory the caller keeps), stdout and stderr to the
// files named.
absl::StatusOr<std::unique_ptr<Process>> StartAidnctl(const CoordinatorHandle& coordinator,
                                                      const std::string& token,
                                                      const std::vector<std::string>& args,
                                                      const std::string& home,
                                                      const std::string& stdout_path,
                                                      const std::string& stderr_path);

std::unique_ptr<v1::CoordinatorService::Stub> CoordinatorStub(const std::string& address);
std::unique_ptr<v1::ClusterService::Stub> ClusterStub(const std::string& address);
// How to reach the coordinator at `address`: TLS verified with the CA it made
// (StartCoordinator remembers it by address), or plaintext if it was started
// with --insecure.
rpc::ChannelOptions ChannelTo(const std::string& address);
void RememberCaFile(const std::string& address, const std::string& ca_file);

// A ClientContext with "authorization: Bearer <token>" and a deadline.
std::unique_ptr<grpc::ClientContext> Context(
    const std::string& token, std::chrono::milliseconds timeout = std::chrono::seconds(10));

// "code N: message", for failure messages.
std::string Describe(const grpc::Status& status);
// "exit N", stdout and stderr, for failure messages.
std::string Describe(const CommandResult& result);

// SUCCEEDED, FAILED or CANCELLED.
bool JobEnded(const v1::Job& job);

// Jobs through a CoordinatorService stub as `token` (TestCluster's helpers
// use these, as do the load benchmarks in bench/).
absl::StatusOr<std::string> SubmitJob(v1::CoordinatorService::Stub* stub, const std::string& token,
                                      const v1::JobSpec& spec);
// The job, or an empty Job when the call fails.
v1::Job GetJob(v1::CoordinatorService::Stub* stub, const std::string& token,
               const std::string& job_id);
// Polls until the job ended or `timeout` passed; returns it as last seen.
v1::Job WaitForJobEnd(v1::CoordinatorService::Stub* stub, const std::string& token,
                      const std::string& job_id, std::chrono::milliseconds timeout);

// How a TestCluster starts a worker daemon.
struct WorkerOptions {
  int cpu_slots = 1;
  // Flags after the defaults (a later flag wins).
  std::vector<std::string> args;
  std::string binary = AIDN_WORKER_BIN;
  // A command the daemon runs under, before `binary` (the partition test's
  // "ip netns exec <ns>", which execs it: the pid stays the daemon's).
  std::vector<std::string> wrapper = {};
};

// One test's cluster. Its directory holds the coordinator's state
// ("<dir>/state", or another name given) and one directory per worker
// ("<dir>/<id>", the worker's --work-dir, with its output in worker.log).
// The destructor stops the workers (their trainers die with them), then the
// coordinator, and removes the directory unless Keep() was called. Not
// thread-safe.
class TestCluster {
 public:
  // Generous: builds and other tests share the machine's cores.
  static constexpr std::chrono::milliseconds kStartTimeout{30'000};

  explicit TestCluster(const std::string& name);
  ~TestCluster();
  TestCluster(const TestCluster&) = delete;
  TestCluster& operator=(const TestCluster&) = delete;

  const std::string& dir() const { return dir_.path(); }
  // `dir()/name`.
  std::string Path(const std::string& name) const { return dir_ / name; }

  // The coordinator, with `args` after the fixture's flags, its state in
  // `dir()/state_name`.
  absl::Status StartCoordinator(const std::vector<std::string>& args = {},
                                const std::string& state_name = "state");
  // kill -9 the coordinator and reap it: its exit code.
  absl::StatusOr<int> KillCoordinator();
  // kill -9 the coordinator (if running) and start it again with the same
  // arguments and state, on the same address when `same_address` (the
  // workers know only that one), else on a new ephemeral port.
  absl::Status RestartCoordinator(bool same_address = true);
  const CoordinatorHandle& coordinator() const { return coordinator_; }
  CoordinatorHandle& coordinator() { return coordinator_; }
  const std::string& address() const { return coordinator_.address; }
  const std::string& admin_token() const { return coordinator_.admin_token; }
  const std::string& worker_token() const { return coordinator_.worker_token; }
  // Stubs for the running coordinator (new ones after a restart).
  v1::CoordinatorService::Stub* coord() { return coord_.get(); }
  v1::ClusterService::Stub* cluster() { return cluster_.get(); }
  const std::shared_ptr<v1::ClusterService::Stub>& shared_cluster() { return cluster_; }

  // An aidn-worker daemon `id` against the coordinator with its worker
  // token, --work-dir=<dir>/<id>, --metrics-addr= (off) and options.args.
  absl::Status StartWorker(const std::string& id, const WorkerOptions& options = {});
  // Starts each, then waits until all of the cluster's running workers are
  // ALIVE.
  ::testing::AssertionResult StartWorkers(const std::vector<std::string>& ids,
                                          const WorkerOptions& options = {});
  // The worker daemon's process; nullptr once stopped.
  Process* worker(const std::string& id);
  std::string WorkDir(const std::string& id) const { return Path(id); }
  // stdout and stderr of the worker daemon.
  std::string WorkerLog(const std::string& id) const;
  std::vector<std::string> worker_ids() const;
  // Stops the worker daemon (SIGKILL) and forgets it.
  void RemoveWorker(const std::string& id);

  // aidnctl as `token` (the admin's by default), killed after `timeout`.
  CommandResult Aidnctl(const std::vector<std::string>& args,
                        std::chrono::milliseconds timeout = std::chrono::seconds(30)) const;
  CommandResult AidnctlAs(const std::string& token, const std::vector<std::string>& args) const;

  // Workers by id, as the coordinator lists them.
  std::map<std::string, v1::Worker> Workers();
  bool WorkerIs(const std::string& id, v1::Worker::State state);
  ::testing::AssertionResult WaitForAliveWorkers(int count,
                                                 std::chrono::milliseconds timeout = kStartTimeout);

  // Jobs, as the admin.
  absl::StatusOr<std::string> Submit(const v1::JobSpec& spec);
  // The job, or an empty Job when the call fails.
  v1::Job GetJob(const std::string& job_id);
  absl::Status Cancel(const std::string& job_id, const std::string& reason = "");
  // Polls the job until `predicate` holds; on a timeout the failure shows
  // the job as last seen and its events.
  ::testing::AssertionResult WaitForJob(const std::string& job_id,
                                        const std::function<bool(const v1::Job&)>& predicate,
                                        const std::string& what, std::chrono::milliseconds timeout,
                                        v1::Job* last = nullptr);
  ::testing::AssertionResult WaitForState(const std::string& job_id, v1::Job::State state,
                                          std::chrono::milliseconds timeout,
                                          v1::Job* last = nullptr);
  // Polls until the job ended or `timeout` passed; the job as last seen.
  v1::Job WaitForEnd(const std::string& job_id, std::chrono::milliseconds timeout);

  // The job's events (all events for ""), oldest first.
  std::vector<v1::Event> Events(const std::string& job_id = "");
  // One line per event: "seq type gen=G worker=W: message".
  std::string EventText(const std::string& job_id = "");
  // The messages of the job's events of `type`.
  std::vector<std::string> EventMessages(const std::string& job_id, const std::string& type);
  bool HasEvent(const std::string& type, const std::string& job_id,
                const std::string& worker_id = "");
  ::testing::AssertionResult WaitForEvent(const std::string& type, const std::string& job_id,
                                          std::chrono::milliseconds timeout,
                                          const std::string& worker_id = "");
  // The job's step records, steps `from`..`to` (0: no bound).
  std::vector<v1::StepMetrics> Metrics(const std::string& job_id, int64_t from = 0, int64_t to = 0);
  std::vector<v1::Checkpoint> Checkpoints(const std::string& job_id);

  // Stops the workers (their trainers die with them), then the coordinator.
  void StopAll();
  // Keep the directory (logs, state) after the cluster goes.
  void Keep() { dir_.Keep(); }
  // The last 6000 bytes of every worker's log and of the coordinator's, to
  // std::cerr.
  void PrintLogTails() const;

 private:
  TempDir dir_;
  std::vector<std::string> coordinator_args_;
  std::string state_name_;
  CoordinatorHandle coordinator_;
  std::unique_ptr<v1::CoordinatorService::Stub> coord_;
  std::shared_ptr<v1::ClusterService::Stub> cluster_;
  std::map<std::string, std::unique_ptr<Process>> workers_;
};

// A gtest fixture around one TestCluster, made in SetUp (after a subclass's
// skip checks): on a failure TearDown prints the processes' log tails and
// keeps the directory.
class ClusterFixture : public ::testing::Test {
 protected:
  explicit ClusterFixture(std::string name) : name_(std::move(name)) {}
  void SetUp() override { cluster_ = std::make_unique<TestCluster>(name_); }
  void TearDown() override {
    if (cluster_ == nullptr) return;
    if (HasFailure()) {
      cluster_->PrintLogTails();
      cluster_->Keep();
    }
    cluster_.reset();
  }

  TestCluster& cluster() { return *cluster_; }
  // Stops the workers and the coordinator and expects every process of the
  // test (anything naming its directory) gone within 15 s.
  void StopAllAndExpectNoProcesses();
  const std::string& admin() const { return cluster_->admin_token(); }

  std::unique_ptr<TestCluster> cluster_;

 private:
  std::string name_;
};

}  // namespace aidn::testing

#endif  // AIDN_TESTS_INTEGRATION_CLUSTER_FIXTURE_H_
