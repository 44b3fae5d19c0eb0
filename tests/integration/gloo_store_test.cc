// Gloo's rendezvous through a real aidn-coordinator: two trainers (threads
// here) of a world_size 2 job build Gloo communicators whose store is the
// coordinator's KV of their (job, generation), and run collectives over
// loopback TCP. The test plays the workers (register, heartbeat until the
// assignments arrive) and the trainers' rendezvous with the generated stubs.

#include "worker/trainer/coordinator_store.h"

#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "aidn/v1/job.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"
#include "worker/engine/comm/gloo_communicator.h"
#if defined(AIDN_HAVE_NCCL) && AIDN_HAVE_NCCL
#include "worker/engine/comm/nccl_communicator.h"
#endif

namespace aidn::testing {
namespace {

using ::testing::HasSubstr;
using trainer::CoordinatorStore;

// Generous: other builds share the machine's two cores.
constexpr std::chrono::milliseconds kLong{20'000};

// Runs `fn`, which must throw engine::StoreStatusError, and returns its
// status (UNKNOWN if nothing or something else was thrown).
template <typename Fn>
absl::Status StoreErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const engine::StoreStatusError& e) {
    return e.status();
  } catch (const std::exception& e) {
    return absl::UnknownError(absl::StrCat("unexpected exception: ", e.what()));
  }
  return absl::UnknownError("nothing was thrown");
}

class GlooStoreTest : public ClusterFixture {
 protected:
  GlooStoreTest() : ClusterFixture("aidn-gloo-store-test") {}

  void SetUp() override {
    ClusterFixture::SetUp();
    // The fake workers heartbeat only while waiting for their assignments;
    // a long worker timeout keeps them alive for the rest of the test.
    const absl::Status started =
        cluster().StartCoordinator({"--worker-timeout=60s", "--tick-interval=50ms"});
    ASSERT_TRUE(started.ok()) << started;
    stub_ = cluster().shared_cluster();

    for (const std::string id : {"w1", "w2"}) {
      v1::RegisterWorkerRequest request;
      request.mutable_info()->set_id(id);
      request.mutable_info()->set_hostname(id);
      request.mutable_info()->set_address("127.0.0.1");
      request.mutable_info()->set_cpu_slots(1);
      v1::RegisterWorkerResponse response;
      grpc::Status status =
          stub_->RegisterWorker(Context(cluster().worker_token()).get(), request, &response);
      ASSERT_TRUE(status.ok()) << "RegisterWorker " << id << ": " << Describe(status);
    }

    v1::SubmitJobRequest submit;
    v1::JobSpec* spec = submit.mutable_spec();
    spec->set_name("gloo-store-test");
    spec->set_world_size(2);
    spec->set_device(v1::JobSpec::CPU);
    spec->mutable_model()->set_name("mlp");
    spec->set_epochs(1);
    v1::SubmitJobResponse submitted;
    grpc::Status status = cluster().coord()->SubmitJob(Context(admin()).get(), submit, &submitted);
    ASSERT_TRUE(status.ok()) << "SubmitJob: " << Describe(status);
    job_id_ = submitted.job().id();

    // Heartbeat both workers until each holds one rank of the job.
    assignments_.assign(2, v1::TrainerAssignment());
    const bool assigned = WaitFor(
        [&] {
          int found = 0;
          for (const std::string id : {"w1", "w2"}) {
            v1::HeartbeatRequest request;
            request.set_worker_id(id);
            v1::HeartbeatResponse response;
            if (!stub_->Heartbeat(Context(cluster().worker_token()).get(), request, &response)
                     .ok()) {
              continue;
            }
            for (const v1::TrainerAssignment& a : response.assignments()) {
              if (a.job_id() != job_id_ || a.rank() < 0 || a.rank() > 1) continue;
              assignments_[a.rank()] = a;
              worker_of_rank_[a.rank()] = id;
              ++found;
            }
          }
          return found == 2;
        },
        kLong);
    ASSERT_TRUE(assigned) << "the workers never got both ranks of " << job_id_;
    generation_ = assignments_[0].generation();
    ASSERT_EQ(assignments_[1].generation(), generation_);
    ASSERT_GE(generation_, 1);

    // Both ranks join at once; the rendezvous answers when both are in.
    std::vector<grpc::Status> joined(2);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        v1::JoinRendezvousRequest request;
        request.set_job_id(job_id_);
        request.set_generation(generation_);
        request.set_rank(rank);
        request.set_worker_id(worker_of_rank_[rank]);
        v1::JoinRendezvousResponse response;
        joined[rank] = stub_->JoinRendezvous(
            Context(assignments_[rank].trainer_token(), kLong).get(), request, &response);
      });
    }
    for (std::thread& t : threads) t.join();
    for (int rank = 0; rank < 2; ++rank) {
      ASSERT_TRUE(joined[rank].ok())
          << "JoinRendezvous rank " << rank << ": " << Describe(joined[rank]);
    }
  }

  std::shared_ptr<CoordinatorStore> StoreFor(int rank, int64_t generation,
                                             std::chrono::milliseconds timeout = kLong) {
    return std::make_shared<CoordinatorStore>(stub_, assignments_[rank].trainer_token(), job_id_,
                                              generation, timeout);
  }

  engine::GlooOptions GlooOptionsFor(int rank) {
    engine::GlooOptions options;
    options.rank = rank;
    options.world_size = 2;
    options.host = "127.0.0.1";
    options.timeout = kLong;
    options.prefix = "gloo";
    return options;
  }

  // The trainers' stub, shared with their stores.
  std::shared_ptr<v1::ClusterService::Stub> stub_;
  std::string job_id_;
  int64_t generation_ = 0;
  std::vector<v1::TrainerAssignment> assignments_;
  std::string worker_of_rank_[2];
};

TEST_F(GlooStoreTest, TwoRanksRendezvousThroughTheCoordinatorAndReduceExactly) {
  constexpr size_t kCount = 1000;
  std::vector<absl::Status> results(2);
  std::vector<std::vector<float>> reduced(2), broadcast(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      absl::StatusOr<std::unique_ptr<engine::Communicator>> comm =
          engine::CreateGlooCommunicator(GlooOptionsFor(rank), StoreFor(rank, generation_));
      if (!comm.ok()) {
        results[rank] = comm.status();
        return;
      }
      std::vector<float> data(kCount);
      for (size_t i = 0; i < kCount; ++i) data[i] = static_cast<float>(rank + i);
      results[rank] = (*comm)->AllReduce(data.data(), kCount, engine::ReduceOp::kSum);
      if (!results[rank].ok()) return;
      reduced[rank] = data;
      // Rank 1 broadcasts its own pattern over the reduced values.
      if (rank == 1) {
        for (size_t i = 0; i < kCount; ++i) data[i] = static_cast<float>(1000 + 2 * i);
      }
      results[rank] = (*comm)->Broadcast(data.data(), kCount, 1);
      broadcast[rank] = data;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(results[rank].ok()) << "rank " << rank << ": " << results[rank];
    ASSERT_EQ(reduced[rank].size(), kCount);
    ASSERT_EQ(broadcast[rank].size(), kCount);
    for (size_t i = 0; i < kCount; ++i) {
      ASSERT_EQ(reduced[rank][i], static_cast<float>(1 + 2 * i)) << "rank " << rank << " at " << i;
      ASSERT_EQ(broadcast[rank][i], static_cast<float>(1000 + 2 * i))
          << "rank " << rank << " at " << i;
    }
  }
}

TEST_F(GlooStoreTest, TheStoreKeepsBytesAndGetWaitsForTheKey) {
  std::shared_ptr<CoordinatorStore> rank0 = StoreFor(0, generation_);
  std::shared_ptr<CoordinatorStore> rank1 = StoreFor(1, generation_);
  const std::vector<char> value = {'a', '\0', '\xff', 'z'};
  rank0->set("bytes", value);
  EXPECT_EQ(rank1->get("bytes"), value);

  // A get before the set returns the value once it is set (in either order).
  std::vector<char> got;
  std::thread getter([&] { got = rank1->get("later"); });
  rank0->set("later", {'o', 'k'});
  getter.join();
  EXPECT_EQ(got, (std::vector<char>{'o', 'k'}));

  rank1->wait({"bytes", "later"}, std::chrono::milliseconds(1000));

  const auto start = std::chrono::steady_clock::now();
  absl::Status timed_out =
      StoreErrorOf([&] { rank1->wait({"never-set"}, std::chrono::milliseconds(300)); });
  EXPECT_EQ(timed_out.code(), absl::StatusCode::kDeadlineExceeded) << timed_out;
  EXPECT_THAT(std::string(timed_out.message()), HasSubstr("\"never-set\""));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(250));
}

TEST_F(GlooStoreTest, AStaleGenerationIsRefusedAsSuperseded) {
  std::shared_ptr<CoordinatorStore> stale = StoreFor(0, generation_ - 1);
  const std::string superseded = absl::StrCat("generation ", generation_ - 1, " of ", job_id_,
                                              " is superseded by ", generation_);

  absl::Status set = StoreErrorOf([&] { stale->set("k", {'v'}); });
  EXPECT_EQ(set.code(), absl::StatusCode::kFailedPrecondition) << set;
  EXPECT_THAT(std::string(set.message()), HasSubstr(superseded));
  absl::Status get = StoreErrorOf([&] { stale->get("k"); });
  EXPECT_EQ(get.code(), absl::StatusCode::kFailedPrecondition) << get;

  // Through Gloo, the communicator reports the same code.
  absl::StatusOr<std::unique_ptr<engine::Communicator>> comm =
      engine::CreateGlooCommunicator(GlooOptionsFor(0), stale);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr(superseded));
}

TEST_F(GlooStoreTest, AnUnknownTokenIsRefusedAtOnce) {
  auto store = std::make_shared<CoordinatorStore>(stub_, "not-a-token-of-this-cluster", job_id_,
                                                  generation_, kLong);
  const auto start = std::chrono::steady_clock::now();
  absl::Status set = StoreErrorOf([&] { store->set("k", {'v'}); });
  EXPECT_EQ(set.code(), absl::StatusCode::kUnauthenticated) << set;
  absl::Status get = StoreErrorOf([&] { store->get("k"); });
  EXPECT_EQ(get.code(), absl::StatusCode::kUnauthenticated) << get;
  // Not retried until the timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// The engine's KeyValueStore view of the same KV: what NCCL's id hand-out
// uses. Bytes round-trip (NUL included), a wait times out naming the key,
// and a stale generation is refused with FAILED_PRECONDITION.
TEST_F(GlooStoreTest, TheKeyValueStoreAdapterKeepsBytesWaitsAndIsFenced) {
  trainer::CoordinatorKeyValueStore store(StoreFor(0, generation_));
  const std::string bytes(
      "id\0with\xff"
      "bytes",
      14);
  ASSERT_TRUE(store.Set("nccl/x", bytes).ok());
  absl::StatusOr<std::string> got = store.Get("nccl/x", std::chrono::seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, bytes);

  absl::StatusOr<std::string> missing = store.Get("nccl/never", std::chrono::milliseconds(300));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded) << missing.status();
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("nccl/never"));

  trainer::CoordinatorKeyValueStore stale(StoreFor(1, generation_ - 1));
  absl::Status set = stale.Set("nccl/x", "late");
  EXPECT_EQ(set.code(), absl::StatusCode::kFailedPrecondition) << set;
}

#if defined(AIDN_HAVE_NCCL) && AIDN_HAVE_NCCL
// NCCL's unique id travels from rank 0 to rank 1 through the coordinator's
// KV of their generation (ncclGetUniqueId needs no GPU).
TEST_F(GlooStoreTest, TheNcclIdGoesFromRankZeroToRankOneThroughTheCoordinator) {
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  std::vector<absl::StatusOr<ncclUniqueId>> ids(2, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int rank = 1; rank >= 0; --rank) {  // rank 1 waits first
    threads.emplace_back([&, rank] {
      trainer::CoordinatorKeyValueStore store(StoreFor(rank, generation_));
      engine::NcclOptions options;
      options.rank = rank;
      options.world_size = 2;
      options.timeout = kLong;
      ids[rank] = engine::ExchangeNcclUniqueId(options, &store);
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(ids[0].ok()) << ids[0].status();
  ASSERT_TRUE(ids[1].ok()) << ids[1].status();
  EXPECT_EQ(std::string(ids[0]->internal, sizeof(ids[0]->internal)),
            std::string(ids[1]->internal, sizeof(ids[1]->internal)));
}
#endif

}  // namespace
}  // namespace aidn::testing
