// The worker's CoordinatorLink against a fake ClusterService on loopback:
// registration, heartbeats handing over assignments, and the exit report
// queue (order, retries, refusals, giving up at shutdown).

#include "worker/coordinator_link.h"

#include <chrono>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace aidn::worker {
namespace {

using ::testing::ElementsAre;
using SteadyClock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Generous: other builds share the machine's cores.
constexpr milliseconds kLinkWait{10'000};

template <typename Predicate>
bool WaitForLink(Predicate predicate, milliseconds timeout = kLinkWait) {
  const auto deadline = SteadyClock::now() + timeout;
  while (!predicate()) {
    if (SteadyClock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return true;
}

// Answers exit reports with the codes queued in `report_answers` (then OK),
// heartbeats with `assignments` at once, and `heartbeat_not_found` heartbeats
// with NOT_FOUND.
class FakeCluster final : public v1::ClusterService::Service {
 public:
  grpc::Status RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest* request,
                              v1::RegisterWorkerResponse* response) override {
    absl::MutexLock lock(&mu);
    registrations.push_back(*request);
    response->set_worker_id(request->info().id());
    response->mutable_heartbeat_interval()->set_nanos(20'000'000);
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse* response) override {
    absl::MutexLock lock(&mu);
    ++heartbeats;
    if (heartbeat_not_found > 0) {
      --heartbeat_not_found;
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker");
    }
    for (const v1::TrainerAssignment& a : assignments) *response->add_assignments() = a;
    response->set_assignments_version(1);
    return grpc::Status::OK;
  }

  grpc::Status ReportTrainerExit(grpc::ServerContext*, const v1::ReportTrainerExitRequest* request,
                                 v1::ReportTrainerExitResponse*) override {
    absl::MutexLock lock(&mu);
    attempts.push_back(request->job_id());
    if (!report_answers.empty()) {
      const grpc::StatusCode code = report_answers.front();
      report_answers.pop_front();
      return grpc::Status(code, "scripted");
    }
    if (always_unavailable || unavailable_for.contains(request->job_id())) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "away");
    }
    delivered.push_back(request->job_id());
    return grpc::Status::OK;
  }

  absl::Mutex mu;
  std::vector<v1::RegisterWorkerRequest> registrations ABSL_GUARDED_BY(mu);
  int heartbeats ABSL_GUARDED_BY(mu) = 0;
  int heartbeat_not_found ABSL_GUARDED_BY(mu) = 0;
  std::vector<v1::TrainerAssignment> assignments ABSL_GUARDED_BY(mu);
  std::deque<grpc::StatusCode> report_answers ABSL_GUARDED_BY(mu);
  bool always_unavailable ABSL_GUARDED_BY(mu) = false;
  std::set<std::string> unavailable_for ABSL_GUARDED_BY(mu);
  std::vector<std::string> attempts ABSL_GUARDED_BY(mu);
  std::vector<std::string> delivered ABSL_GUARDED_BY(mu);
};

class CoordinatorLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    options_.coordinator.address = absl::StrCat("127.0.0.1:", port);
    options_.coordinator.insecure = true;  // the fake serves plaintext
    options_.token = "worker-token-0123456789";
    options_.info.set_id("w1");
    options_.heartbeat_interval = milliseconds(20);
    options_.rpc_timeout = milliseconds(2'000);
    options_.backoff = {.initial = milliseconds(1), .max = milliseconds(5)};
  }
  void TearDown() override {
    link_.reset();
    server_->Shutdown();
  }

  void StartLink() {
    link_ = std::make_unique<CoordinatorLink>(
        options_,
        CoordinatorLinkCallbacks{
            .trainers =
                [] {
                  v1::TrainerStatus t;
                  t.set_job_id("running");
                  t.set_generation(1);
                  return std::vector<v1::TrainerStatus>{t};
                },
            .on_assignments =
                [this](std::vector<v1::TrainerAssignment> assignments, std::vector<v1::StopOrder>) {
                  absl::MutexLock lock(&mu_);
                  handed_over_ = std::move(assignments);
                  ++handovers_;
                }});
    link_->Start();
  }

  static v1::ReportTrainerExitRequest Report(const std::string& job) {
    v1::ReportTrainerExitRequest r;
    r.set_worker_id("w1");
    r.set_job_id(job);
    r.set_generation(1);
    return r;
  }

  std::vector<std::string> Delivered() {
    absl::MutexLock lock(&fake_.mu);
    return fake_.delivered;
  }
  std::vector<std::string> Attempts() {
    absl::MutexLock lock(&fake_.mu);
    return fake_.attempts;
  }

  FakeCluster fake_;
  std::unique_ptr<grpc::Server> server_;
  CoordinatorLinkOptions options_;
  std::unique_ptr<CoordinatorLink> link_;
  absl::Mutex mu_;
  std::vector<v1::TrainerAssignment> handed_over_ ABSL_GUARDED_BY(mu_);
  int handovers_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST_F(CoordinatorLinkTest, RegistersWithItsTrainersAndHandsOverAssignments) {
  {
    absl::MutexLock lock(&fake_.mu);
    v1::TrainerAssignment a;
    a.set_job_id("job-1");
    a.set_rank(0);
    fake_.assignments.push_back(a);
  }
  StartLink();
  ASSERT_TRUE(WaitForLink([&] {
    absl::MutexLock lock(&mu_);
    return handovers_ > 0;
  }));
  {
    absl::MutexLock lock(&mu_);
    ASSERT_EQ(handed_over_.size(), 1u);
    EXPECT_EQ(handed_over_[0].job_id(), "job-1");
  }
  absl::MutexLock lock(&fake_.mu);
  ASSERT_EQ(fake_.registrations.size(), 1u);
  EXPECT_EQ(fake_.registrations[0].info().id(), "w1");
  ASSERT_EQ(fake_.registrations[0].trainers_size(), 1);
  EXPECT_EQ(fake_.registrations[0].trainers(0).job_id(), "running");
}

TEST_F(CoordinatorLinkTest, RegistersAgainWhenTheCoordinatorForgotTheWorker) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.heartbeat_not_found = 1;
  }
  StartLink();
  EXPECT_TRUE(WaitForLink([&] {
    absl::MutexLock lock(&fake_.mu);
    return fake_.registrations.size() == 2 && fake_.heartbeats >= 2;
  }));
  link_->StopHeartbeats();
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.registrations.size(), 2u);
}

TEST_F(CoordinatorLinkTest, DeliversExitReportsInOrderRetryingWhatMayPass) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.report_answers = {grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::INTERNAL};
  }
  StartLink();
  link_->QueueReport(Report("a"));
  link_->QueueReport(Report("b"));
  link_->QueueReport(Report("c"));
  ASSERT_TRUE(WaitForLink([&] { return Delivered().size() == 3; }));
  EXPECT_THAT(Delivered(), ElementsAre("a", "b", "c"));
  EXPECT_THAT(Attempts(), ElementsAre("a", "a", "a", "b", "c"));
}

TEST_F(CoordinatorLinkTest, DropsAnExitReportRefusedForGood) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.report_answers = {grpc::StatusCode::NOT_FOUND, grpc::StatusCode::UNAUTHENTICATED};
  }
  StartLink();
  link_->QueueReport(Report("a"));
  link_->QueueReport(Report("b"));
  link_->QueueReport(Report("c"));
  ASSERT_TRUE(WaitForLink([&] { return Delivered().size() == 1; }));
  EXPECT_THAT(Delivered(), ElementsAre("c"));
  EXPECT_THAT(Attempts(), ElementsAre("a", "b", "c"));
}

TEST_F(CoordinatorLinkTest, FinishReportsDeliversWhatIsQueuedAfterHeartbeatsStopped) {
  StartLink();
  link_->StopHeartbeats();
  link_->QueueReport(Report("last"));
  link_->FinishReports(kLinkWait);
  EXPECT_THAT(Delivered(), ElementsAre("last"));
}

TEST_F(CoordinatorLinkTest, FinishReportsGivesUpOnAnUnreachableCoordinator) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.always_unavailable = true;
  }
  StartLink();
  link_->QueueReport(Report("lost"));
  ASSERT_TRUE(WaitForLink([&] { return !Attempts().empty(); }));
  link_->StopHeartbeats();
  // Returns (the test would hang otherwise) without delivering.
  link_->FinishReports(milliseconds(50));
  EXPECT_TRUE(Delivered().empty());
}

TEST_F(CoordinatorLinkTest, DropsTheOldestReportBeyondTheQueueLimit) {
  options_.max_pending_reports = 2;
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.unavailable_for = {"a"};
  }
  StartLink();
  link_->StopHeartbeats();
  link_->QueueReport(Report("a"));
  ASSERT_TRUE(WaitForLink([&] { return !Attempts().empty(); }));
  // "a" is stuck at the front; a third report pushes it out.
  link_->QueueReport(Report("b"));
  link_->QueueReport(Report("c"));
  ASSERT_TRUE(WaitForLink([&] { return Delivered().size() == 2; }));
  EXPECT_THAT(Delivered(), ElementsAre("b", "c"));
}

}  // namespace
}  // namespace aidn::worker
