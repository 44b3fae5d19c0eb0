#ifndef AIDN_TESTS_INTEGRATION_CLUSTER_TEST_FIXTURE_H_
#define AIDN_TESTS_INTEGRATION_CLUSTER_TEST_FIXTURE_H_

// The cluster protocol end to end against a real aidn-coordinator on
// loopback. The tests play the worker daemons (FakeWorker: register,
// heartbeat on a thread, remember the assignments) and their trainers
// (rendezvous, KV, progress and exit reports), through the generated gRPC
// stubs. ClusterTest is their fixture; the tests are split by theme over
// cluster_*_test.cc.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "aidn/v1/job.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/integration/fake_worker.h"

namespace aidn::testing {

using ::testing::AssertionFailure;
using ::testing::AssertionResult;
using ::testing::AssertionSuccess;

// Generous: other builds and tests share the machine's cores.
inline constexpr std::chrono::milliseconds kLong{20'000};

inline v1::JobSpec MlpSpec(int32_t world_size) {
  v1::JobSpec spec;
  spec.set_name("cluster-test");
  spec.set_world_size(world_size);
  spec.set_device(v1::JobSpec::CPU);
  spec.mutable_model()->set_name("mlp");
  spec.set_epochs(1);
  return spec;
}

struct JoinResult {
  grpc::Status status;
  v1::JoinRendezvousResponse response;
};

class ClusterTest : public ClusterFixture {
 protected:
  ClusterTest() : ClusterFixture("aidn-cluster-test") {}

  void TearDown() override {
    // The fake workers stop before the coordinator does.
    workers_.clear();
    ClusterFixture::TearDown();
  }

  // Short timeouts so failures show within seconds.
  std::vector<std::string> CoordinatorArgs(const std::string& worker_timeout = "2s") {
    return {absl::StrCat("--worker-timeout=", worker_timeout),
            absl::StrCat("--heartbeat-interval=", kHeartbeatEvery.count(), "ms"),
            "--tick-interval=50ms"};
  }

  void StartCoordinatorWith(const std::vector<std::string>& args) {
    const absl::Status started = cluster().StartCoordinator(args);
    ASSERT_TRUE(started.ok()) << started;
  }

  void StartDefaultCoordinator() { StartCoordinatorWith(CoordinatorArgs()); }

  v1::CoordinatorService::Stub* coord() { return cluster().coord(); }
  v1::ClusterService::Stub* cluster_stub() { return cluster().cluster(); }

  // Registers a fake worker with the worker token and starts its heartbeats.
  FakeWorker* AddWorker(const std::string& id, int cpu_slots, const std::string& token = "") {
    auto worker = std::make_unique<FakeWorker>(
        id, cpu_slots, token.empty() ? cluster().worker_token() : token, cluster().address());
    grpc::Status status = worker->Register();
    EXPECT_TRUE(status.ok()) << "RegisterWorker " << id << ": " << Describe(status);
    worker->Start();
    workers_.push_back(std::move(worker));
    return workers_.back().get();
  }

  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec, const std::string& token = "") {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    v1::SubmitJobResponse response;
    grpc::Status status =
        coord()->SubmitJob(Context(token.empty() ? admin() : token).get(), request, &response);
    if (!status.ok()) return absl::InternalError(absl::StrCat("SubmitJob: ", Describe(status)));
    return response.job();
  }

  absl::StatusOr<v1::Job> GetJob(const std::string& job_id) {
    v1::GetJobRequest request;
    request.set_job_id(job_id);
    v1::Job job;
    grpc::Status status = coord()->GetJob(Context(admin()).get(), request, &job);
    if (!status.ok()) return absl::InternalError(absl::StrCat("GetJob: ", Describe(status)));
    return job;
  }

  std::vector<v1::Event> Events(const std::string& job_id = "") { return cluster().Events(job_id); }

  bool HasEvent(const std::string& type, const std::string& job_id,
                const std::string& worker_id = "") {
    return cluster().HasEvent(type, job_id, worker_id);
  }

  AssertionResult WaitForEvent(const std::string& type, const std::string& job_id,
                               const std::string& worker_id = "") {
    return cluster().WaitForEvent(type, job_id, kLong, worker_id);
  }

  std::map<std::string, v1::Worker> Workers() { return cluster().Workers(); }

  // Polls GetJob until `predicate` holds; on failure shows the last job seen.
  AssertionResult WaitForJob(const std::string& job_id,
                             const std::function<bool(const v1::Job&)>& predicate,
                             const std::string& what, v1::Job* out = nullptr) {
    return cluster().WaitForJob(job_id, predicate, "becoming " + what, kLong, out);
  }

  AssertionResult WaitForState(const std::string& job_id, v1::Job::State state,
                               v1::Job* out = nullptr) {
    return cluster().WaitForState(job_id, state, kLong, out);
  }

  // Every worker's assignments of `job_id`, keyed by worker id.
  std::map<std::string, std::vector<v1::TrainerAssignment>> AssignmentsOf(
      const std::string& job_id) {
    std::map<std::string, std::vector<v1::TrainerAssignment>> by_worker;
    for (const auto& worker : workers_) {
      for (const v1::TrainerAssignment& a : worker->Assignments()) {
        if (a.job_id() == job_id) by_worker[worker->id()].push_back(a);
      }
    }
    return by_worker;
  }

  std::string DescribeAssignments() {
    std::vector<std::string> lines;
    for (const auto& worker : workers_) {
      for (const v1::TrainerAssignment& a : worker->Assignments()) {
        lines.push_back(absl::StrCat(worker->id(), ": ", a.job_id(), " gen ", a.generation(),
                                     " rank ", a.rank(), "/", a.world_size(), " slot ", a.slot()));
      }
    }
    return lines.empty() ? "(none)" : absl::StrJoin(lines, "; ");
  }

  // Waits until the workers' heartbeats carry exactly the `world_size` ranks
  // of `generation` of the job and nothing of any other generation of it.
  // Returns them by rank, each with the worker that runs it.
  AssertionResult WaitForAssignments(
      const std::string& job_id, int64_t generation, int32_t world_size,
      std::vector<std::pair<std::string, v1::TrainerAssignment>>* by_rank) {
    bool ok = WaitFor(
        [&] {
          std::vector<std::pair<std::string, v1::TrainerAssignment>> found(world_size);
          int count = 0;
          for (const auto& [worker_id, list] : AssignmentsOf(job_id)) {
            for (const v1::TrainerAssignment& a : list) {
              if (a.generation() != generation) return false;
              if (a.rank() < 0 || a.rank() >= world_size) return false;
              if (!found[a.rank()].first.empty()) return false;
              found[a.rank()] = {worker_id, a};
              ++count;
            }
          }
          if (count != world_size) return false;
          if (by_rank != nullptr) *by_rank = std::move(found);
          return true;
        },
        kLong);
    if (ok) return AssertionSuccess();
    return AssertionFailure() << "workers never got the " << world_size << " ranks of " << job_id
                              << " generation " << generation
                              << "; assignments: " << DescribeAssignments();
  }

  JoinResult Join(const v1::TrainerAssignment& a, const std::string& worker_id,
                  int64_t generation_override = -1) {
    v1::JoinRendezvousRequest request;
    request.set_job_id(a.job_id());
    request.set_generation(generation_override >= 0 ? generation_override : a.generation());
    request.set_rank(a.rank());
    request.set_worker_id(worker_id);
    request.set_address(AddressOfRank(a.rank()));
    JoinResult result;
    result.status = cluster_stub()->JoinRendezvous(Context(a.trainer_token(), kLong).get(), request,
                                                   &result.response);
    return result;
  }

  // Every rank joins at once, one thread each.
  std::vector<JoinResult> JoinAll(
      const std::vector<std::pair<std::string, v1::TrainerAssignment>>& by_rank) {
    std::vector<JoinResult> results(by_rank.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < by_rank.size(); ++i) {
      threads.emplace_back([&, i] { results[i] = Join(by_rank[i].second, by_rank[i].first); });
    }
    for (std::thread& t : threads) t.join();
    return results;
  }

  // Two 1-slot workers "w1", "w2" and a world_size 2 job past its rendezvous.
  void StartRunningJob(std::string* job_id,
                       std::vector<std::pair<std::string, v1::TrainerAssignment>>* by_rank) {
    AddWorker("w1", 1);
    AddWorker("w2", 1);
    absl::StatusOr<v1::Job> job = Submit(MlpSpec(2));
    ASSERT_TRUE(job.ok()) << job.status();
    *job_id = job->id();
    ASSERT_TRUE(WaitForAssignments(*job_id, 1, 2, by_rank));
    for (const JoinResult& r : JoinAll(*by_rank)) {
      ASSERT_TRUE(r.status.ok()) << "JoinRendezvous: " << Describe(r.status);
    }
    ASSERT_TRUE(WaitForState(*job_id, v1::Job::RUNNING));
  }

  grpc::Status KvSet(const v1::TrainerAssignment& a, const std::string& key,
                     const std::string& value, int64_t generation_override = -1) {
    v1::KvSetRequest request;
    request.set_job_id(a.job_id());
    request.set_generation(generation_override >= 0 ? generation_override : a.generation());
    request.set_key(key);
    request.set_value(value);
    v1::KvSetResponse response;
    return cluster_stub()->KvSet(Context(a.trainer_token()).get(), request, &response);
  }

  grpc::Status KvGet(const v1::TrainerAssignment& a, const std::string& key,
                     std::chrono::milliseconds wait, v1::KvGetResponse* response) {
    v1::KvGetRequest request;
    request.set_job_id(a.job_id());
    request.set_generation(a.generation());
    request.set_key(key);
    *request.mutable_wait() = ProtoMillis(wait.count());
    return cluster_stub()->KvGet(Context(a.trainer_token(), wait + kLong).get(), request, response);
  }

  grpc::Status KvAdd(const v1::TrainerAssignment& a, const std::string& key, int64_t delta,
                     int64_t* value) {
    v1::KvAddRequest request;
    request.set_job_id(a.job_id());
    request.set_generation(a.generation());
    request.set_key(key);
    request.set_delta(delta);
    v1::KvAddResponse response;
    grpc::Status status =
        cluster_stub()->KvAdd(Context(a.trainer_token()).get(), request, &response);
    *value = response.value();
    return status;
  }

  grpc::Status Cas(const v1::TrainerAssignment& a, const std::string& key, bool expect_absent,
                   const std::string& expected, const std::string& desired,
                   v1::KvCompareAndSetResponse* response) {
    v1::KvCompareAndSetRequest request;
    request.set_job_id(a.job_id());
    request.set_generation(a.generation());
    request.set_key(key);
    request.set_expect_absent(expect_absent);
    request.set_expected(expected);
    request.set_desired(desired);
    return cluster_stub()->KvCompareAndSet(Context(a.trainer_token()).get(), request, response);
  }

  std::vector<std::unique_ptr<FakeWorker>> workers_;
};

}  // namespace aidn::testing

#endif  // AIDN_TESTS_INTEGRATION_CLUSTER_TEST_FIXTURE_H_
