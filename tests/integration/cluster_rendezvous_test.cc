// The rendezvous and the key-value store of a generation, as the trainers use
// them, against a real coordinator (cluster_test_fixture.h).

#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_test_fixture.h"

namespace aidn::testing {
namespace {

using ::testing::HasSubstr;

TEST_F(ClusterTest, TwoWorkersGetOneRankEachAndRendezvousTogether) {
  ASSERT_NO_FATAL_FAILURE(StartDefaultCoordinator());
  FakeWorker* w1 = AddWorker("w1", 1);
  FakeWorker* w2 = AddWorker("w2", 1);
  EXPECT_EQ(w1->registered_id(), "w1");
  EXPECT_EQ(w2->registered_id(), "w2");

  absl::StatusOr<v1::Job> submitted = Submit(MlpSpec(2));
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const std::string job_id = submitted->id();
  EXPECT_EQ(job_id, "job-1");

  std::vector<std::pair<std::string, v1::TrainerAssignment>> by_rank;
  ASSERT_TRUE(WaitForAssignments(job_id, 1, 2, &by_rank));
  // One rank on each worker.
  std::map<std::string, std::vector<v1::TrainerAssignment>> per_worker = AssignmentsOf(job_id);
  ASSERT_EQ(per_worker.size(), 2u) << DescribeAssignments();
  EXPECT_EQ(per_worker["w1"].size(), 1u);
  EXPECT_EQ(per_worker["w2"].size(), 1u);
  EXPECT_NE(by_rank[0].first, by_rank[1].first);
  for (const auto& [worker_id, a] : by_rank) {
    EXPECT_EQ(a.world_size(), 2);
    EXPECT_EQ(a.slot(), 0);
    EXPECT_EQ(a.spec().model().name(), "mlp");
    EXPECT_EQ(a.spec().world_size(), 2);
    EXPECT_FALSE(a.trainer_token().empty());
  }

  v1::Job job;
  ASSERT_TRUE(WaitForState(job_id, v1::Job::SCHEDULED, &job));
  EXPECT_EQ(job.generation(), 1);
  ASSERT_EQ(job.placement_size(), 2);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(job.placement(r).rank(), r);
    EXPECT_EQ(job.placement(r).worker_id(), by_rank[r].first);
  }
  EXPECT_TRUE(HasEvent("job.scheduled", job_id));
  std::map<std::string, v1::Worker> workers = Workers();
  for (const std::string id : {"w1", "w2"}) {
    EXPECT_EQ(workers[id].state(), v1::Worker::ALIVE) << id;
    EXPECT_EQ(workers[id].cpu_slots_used(), 1) << id;
    EXPECT_THAT(workers[id].job_ids(), ::testing::ElementsAre(job_id)) << id;
  }

  // Both trainers join at once and get the same view of the world.
  std::vector<JoinResult> joins = JoinAll(by_rank);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(joins[r].status.ok()) << "rank " << r << ": " << Describe(joins[r].status);
    const v1::JoinRendezvousResponse& answer = joins[r].response;
    EXPECT_EQ(answer.rank(), r);
    EXPECT_EQ(answer.world_size(), 2);
    EXPECT_EQ(answer.generation(), 1);
    EXPECT_EQ(answer.spec().model().name(), "mlp");
    EXPECT_FALSE(answer.has_resume_from());
    ASSERT_EQ(answer.peers_size(), 2);
    for (int p = 0; p < 2; ++p) {
      EXPECT_EQ(answer.peers(p).rank(), p);
      EXPECT_EQ(answer.peers(p).worker_id(), by_rank[p].first);
      EXPECT_EQ(answer.peers(p).address(), AddressOfRank(p));
    }
  }
  ASSERT_TRUE(WaitForState(job_id, v1::Job::RUNNING, &job));
  EXPECT_EQ(job.generation(), 1);
  ASSERT_EQ(job.placement_size(), 2);
  EXPECT_EQ(job.placement(0).address(), AddressOfRank(0));
  EXPECT_EQ(job.placement(1).address(), AddressOfRank(1));
  EXPECT_TRUE(HasEvent("job.running", job_id));

  // A rank that joins again gets the same answer.
  JoinResult again = Join(by_rank[0].second, by_rank[0].first);
  ASSERT_TRUE(again.status.ok()) << Describe(again.status);
  EXPECT_EQ(again.response.peers_size(), 2);
  EXPECT_EQ(again.response.generation(), 1);

  const v1::TrainerAssignment& rank0 = by_rank[0].second;
  const v1::TrainerAssignment& rank1 = by_rank[1].second;

  // KvGet without wait answers at once; with a wait on a key nobody sets it
  // runs into DEADLINE_EXCEEDED.
  v1::KvGetResponse got;
  grpc::Status status = KvGet(rank1, "nccl-id", std::chrono::milliseconds(0), &got);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_FALSE(got.found());
  const auto before = std::chrono::steady_clock::now();
  status = KvGet(rank1, "never-set", std::chrono::milliseconds(300), &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(status);
  EXPECT_GE(std::chrono::steady_clock::now() - before, std::chrono::milliseconds(250));

  // Rank 1 waits for the key before rank 0 sets it.
  grpc::Status waited_status;
  v1::KvGetResponse waited;
  std::thread getter(
      [&] { waited_status = KvGet(rank1, "nccl-id", std::chrono::seconds(15), &waited); });
  // Either order must give the value. Nothing outside the coordinator shows
  // when the get is parked, so no order is forced here; a parked waiter woken
  // by a later set is tested deterministically in kv_store_test.
  const std::string value("unique\0id", 9);
  status = KvSet(rank0, "nccl-id", value);
  getter.join();
  ASSERT_TRUE(status.ok()) << "KvSet: " << Describe(status);
  ASSERT_TRUE(waited_status.ok()) << "KvGet(wait): " << Describe(waited_status);
  EXPECT_TRUE(waited.found());
  EXPECT_EQ(waited.value(), value);

  // Counters from both ranks add up.
  int64_t counter = 0;
  std::vector<std::thread> adders;
  std::vector<grpc::Status> add_status(2);
  for (int r = 0; r < 2; ++r) {
    adders.emplace_back([&, r] {
      const v1::TrainerAssignment& a = by_rank[r].second;
      for (int i = 0; i < 10; ++i) {
        int64_t ignored = 0;
        grpc::Status s = KvAdd(a, "barrier", r + 1, &ignored);
        if (!s.ok()) add_status[r] = s;
      }
    });
  }
  for (std::thread& t : adders) t.join();
  for (const grpc::Status& s : add_status) ASSERT_TRUE(s.ok()) << "KvAdd: " << Describe(s);
  status = KvAdd(rank0, "barrier", 0, &counter);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(counter, 30);  // 10 * 1 + 10 * 2
  status = KvGet(rank1, "barrier", std::chrono::milliseconds(0), &got);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_TRUE(got.found());
  EXPECT_EQ(got.value(), "30");
  status = KvAdd(rank1, "fresh-counter", -4, &counter);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(counter, -4);

  // Compare-and-set.
  v1::KvCompareAndSetResponse cas;
  status = Cas(rank0, "leader", /*expect_absent=*/true, "", "rank0", &cas);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_TRUE(cas.swapped());
  EXPECT_TRUE(cas.found());
  EXPECT_EQ(cas.current(), "rank0");
  status = Cas(rank1, "leader", /*expect_absent=*/true, "", "rank1", &cas);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_FALSE(cas.swapped());
  EXPECT_TRUE(cas.found());
  EXPECT_EQ(cas.current(), "rank0");
  status = Cas(rank1, "leader", /*expect_absent=*/false, "someone-else", "rank1", &cas);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_FALSE(cas.swapped());
  EXPECT_EQ(cas.current(), "rank0");
  status = Cas(rank1, "leader", /*expect_absent=*/false, "rank0", "rank1", &cas);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_TRUE(cas.swapped());
  EXPECT_EQ(cas.current(), "rank1");
  status = Cas(rank0, "missing-key", /*expect_absent=*/false, "x", "y", &cas);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_FALSE(cas.swapped());
  EXPECT_FALSE(cas.found());
  status = KvGet(rank0, "leader", std::chrono::milliseconds(0), &got);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(got.value(), "rank1");
}

TEST_F(ClusterTest, RendezvousTimeoutNamesTheMissingRank) {
  ASSERT_NO_FATAL_FAILURE(StartDefaultCoordinator());
  AddWorker("w1", 1);
  AddWorker("w2", 1);
  v1::JobSpec spec = MlpSpec(2);
  spec.mutable_timeouts()->mutable_rendezvous()->set_seconds(1);
  spec.set_max_restarts(0);
  absl::StatusOr<v1::Job> submitted = Submit(spec);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const std::string job_id = submitted->id();
  std::vector<std::pair<std::string, v1::TrainerAssignment>> by_rank;
  ASSERT_TRUE(WaitForAssignments(job_id, 1, 2, &by_rank));

  // Only rank 0 shows up.
  JoinResult alone = Join(by_rank[0].second, by_rank[0].first);
  ASSERT_EQ(alone.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << Describe(alone.status);
  const std::string& message = alone.status.error_message();
  const size_t missing = message.find("missing");
  ASSERT_NE(missing, std::string::npos) << message;
  EXPECT_THAT(message.substr(missing), HasSubstr("1")) << message;

  v1::Job job;
  ASSERT_TRUE(WaitForState(job_id, v1::Job::FAILED, &job));
  EXPECT_FALSE(job.message().empty());
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_TRUE(WaitForEvent("job.failed", job_id));
  // The failed job's trainers are gone from the workers.
  EXPECT_TRUE(WaitFor([&] { return AssignmentsOf(job_id).empty(); }, kLong))
      << DescribeAssignments();
}

}  // namespace
}  // namespace aidn::testing
