#include "worker/trainer/reporter.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace aidn::trainer {
namespace {

using std::chrono::milliseconds;
using ::testing::ElementsAre;

// A coordinator that keeps, in order, what reached it: "records 1,2,3"
// for a stored StreamMetrics call, "commit 3", "beat 3".
class FakeCoordinator final : public v1::ClusterService::Service {
 public:
  grpc::Status StreamMetrics(grpc::ServerContext*, grpc::ServerReader<v1::StreamMetricsRequest>* in,
                             v1::StreamMetricsResponse* response) override {
    std::vector<int64_t> steps;
    v1::StreamMetricsRequest request;
    while (in->Read(&request)) {
      for (const v1::MetricRecord& r : request.records()) steps.push_back(r.step());
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_metrics_ > 0) {
      --fail_metrics_;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "not now");
    }
    std::string event = "records";
    for (size_t i = 0; i < steps.size(); ++i) absl::StrAppend(&event, i ? "," : " ", steps[i]);
    Add(event);
    response->set_incarnation(incarnation_);
    if (!steps.empty() && !hold_durable_) stored_through_ = std::max(stored_through_, steps.back());
    response->set_durable_step(stored_through_);
    return grpc::Status::OK;
  }

  grpc::Status CommitCheckpoint(grpc::ServerContext*, const v1::CommitCheckpointRequest* request,
                                v1::CommitCheckpointResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    Add(absl::StrCat("commit ", request->step()));
    response->set_committed(true);
    return grpc::Status::OK;
  }

  grpc::Status ReportProgress(grpc::ServerContext*, const v1::ReportProgressRequest* request,
                              v1::ReportProgressResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fence_) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "generation over");
    beats_.push_back(request->step());
    if (request->checkpoint_ack() != 0) Add(absl::StrCat("ack ", request->checkpoint_ack()));
    if (request->checkpoint_missed() != 0) {
      Add(absl::StrCat("missed ", request->checkpoint_missed()));
    }
    if (ask_step_ != 0) {
      response->mutable_checkpoint()->set_step(ask_step_);
      response->mutable_checkpoint()->set_reason("pause");
    }
    cv_.notify_all();
    return grpc::Status::OK;
  }

  // Every beat's answer from now on asks for a checkpoint at `step`.
  void Ask(int64_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    ask_step_ = step;
  }

  // Records are received but not (yet) stored: durable_step stays.
  void HoldDurable(bool hold) {
    std::lock_guard<std::mutex> lock(mu_);
    hold_durable_ = hold;
  }
  // A restart: what was not stored is gone, and a new incarnation answers.
  void Restart() {
    std::lock_guard<std::mutex> lock(mu_);
    incarnation_ = "two";
    hold_durable_ = false;
  }
  void FailMetricsCalls(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_metrics_ = n;
  }
  void Fence() {
    std::lock_guard<std::mutex> lock(mu_);
    fence_ = true;
  }
  std::vector<std::string> events() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }
  // Waits (with a deadline) until `done` holds for the events.
  bool WaitFor(const std::function<bool(const std::vector<std::string>&)>& done) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(30), [&] { return done(events_); });
  }

 private:
  void Add(std::string event) {
    events_.push_back(std::move(event));
    cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> events_;
  std::vector<int64_t> beats_;
  int fail_metrics_ = 0;
  bool fence_ = false;
  bool hold_durable_ = false;
  int64_t ask_step_ = 0;
  int64_t stored_through_ = 0;
  std::string incarnation_ = "one";
};

class ReporterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&coordinator_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    channel_ =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  }
  void TearDown() override { server_->Shutdown(); }

  std::unique_ptr<Reporter> MakeReporter(milliseconds beat_period = milliseconds(1000)) {
    ReporterOptions options;
    options.beat_period = beat_period;
    options.job_id = "j";
    options.generation = 1;
    // Records go only when something else sends them: a commit or Close.
    options.report_period = std::chrono::hours(1);
    return std::make_unique<Reporter>(channel_, v1::ClusterService::NewStub(channel_), options,
                                      nullptr);
  }

  static v1::MetricRecord Train(int64_t step) {
    v1::MetricRecord r;
    r.set_kind(v1::MetricRecord::TRAIN);
    r.set_step(step);
    return r;
  }
  static v1::CommitCheckpointRequest CommitOf(int64_t step) {
    v1::CommitCheckpointRequest c;
    c.set_step(step);
    c.add_writer_ranks(0);
    return c;
  }
  static bool Has(const std::vector<std::string>& events, const std::string& event) {
    return std::find(events.begin(), events.end(), event) != events.end();
  }
  static bool HasCommit(const std::vector<std::string>& events) {
    for (const std::string& e : events) {
      if (e.rfind("commit", 0) == 0) return true;
    }
    return false;
  }

  FakeCoordinator coordinator_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(ReporterTest, SendsTheRecordsUpToACheckpointBeforeItsCommit) {
  std::unique_ptr<Reporter> reporter = MakeReporter();
  for (int64_t step = 1; step <= 3; ++step) reporter->Record(Train(step));
  reporter->Commit(CommitOf(3));
  ASSERT_TRUE(coordinator_.WaitFor(HasCommit)) << ::testing::PrintToString(coordinator_.events());
  EXPECT_THAT(coordinator_.events(), ElementsAre("records 1,2,3", "commit 3"));
  reporter->Close(milliseconds(5000));
}

TEST_F(ReporterTest, HoldsTheCommitBackUntilItsRecordsGetThrough) {
  coordinator_.FailMetricsCalls(2);
  std::unique_ptr<Reporter> reporter = MakeReporter();
  reporter->Record(Train(1));
  reporter->Record(Train(2));
  reporter->Commit(CommitOf(2));
  ASSERT_TRUE(coordinator_.WaitFor(HasCommit)) << ::testing::PrintToString(coordinator_.events());
  EXPECT_THAT(coordinator_.events(), ElementsAre("records 1,2", "commit 2"));
  reporter->Close(milliseconds(5000));
}

TEST_F(ReporterTest, CloseSendsWhatItHolds) {
  std::unique_ptr<Reporter> reporter = MakeReporter();
  for (int64_t step = 1; step <= 5; ++step) reporter->Record(Train(step));
  // Long before the next periodic send.
  reporter->Close(milliseconds(10'000));
  // Close returned after the thread sent everything.
  EXPECT_THAT(coordinator_.events(), ElementsAre("records 1,2,3,4,5"));
}

// The coordinator received the last records but restarted before it stored
// them, and nothing else told the rank: Close keeps asking until its
// records are stored, sees the new incarnation, and sends them again.
TEST_F(ReporterTest, CloseSendsAgainWhatARestartedCoordinatorDidNotStore) {
  coordinator_.HoldDurable(true);
  std::unique_ptr<Reporter> reporter = MakeReporter();
  for (int64_t step = 1; step <= 3; ++step) reporter->Record(Train(step));
  std::thread closer([&] { reporter->Close(milliseconds(30'000)); });
  ASSERT_TRUE(coordinator_.WaitFor([](const std::vector<std::string>& events) {
    return events.size() >= 2;  // the records, then a question
  })) << ::testing::PrintToString(coordinator_.events());
  coordinator_.Restart();
  closer.join();
  const std::vector<std::string> events = coordinator_.events();
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.front(), "records 1,2,3");
  EXPECT_EQ(events.back(), "records 1,2,3") << ::testing::PrintToString(events);
  for (size_t i = 1; i + 1 < events.size(); ++i) EXPECT_EQ(events[i], "records") << i;
}

TEST_F(ReporterTest, SendNowSendsBeforeTheReportPeriod) {
  std::unique_ptr<Reporter> reporter = MakeReporter();  // a report period of an hour
  reporter->Record(Train(1));
  reporter->Record(Train(2));
  reporter->SendNow();
  ASSERT_TRUE(coordinator_.WaitFor([](const std::vector<std::string>& events) {
    return !events.empty();
  })) << "nothing sent";
  EXPECT_THAT(coordinator_.events(), ElementsAre("records 1,2"));
  reporter->Close(milliseconds(5000));
}

TEST_F(ReporterTest, ConcurrentClosesAllReturn) {
  std::unique_ptr<Reporter> reporter = MakeReporter();
  reporter->Record(Train(1));
  std::thread other([&] { reporter->Close(milliseconds(10'000)); });
  reporter->Close(milliseconds(10'000));
  other.join();
  EXPECT_THAT(coordinator_.events(), ElementsAre("records 1"));
}

TEST_F(ReporterTest, AFencedGenerationIsSuperseded) {
  coordinator_.Fence();
  std::unique_ptr<Reporter> reporter = MakeReporter();
  EXPECT_FALSE(reporter->superseded());
  reporter->Progress(/*step=*/0, /*epoch=*/0, /*collective_seq=*/0, /*total_steps=*/10);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!reporter->superseded() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_TRUE(reporter->superseded());
}

// An ask that arrives while the training thread is between boundaries
// (perhaps blocked in a collective that waits for a rank already waiting at
// the step) is answered by the reporter itself: missed when the training
// thread already passed the step's boundary, ack when it has yet to reach
// it, and then the training thread finds the ask at that boundary.
TEST_F(ReporterTest, AnswersAnAskThatArrivesBetweenStepBoundaries) {
  std::unique_ptr<Reporter> reporter = MakeReporter(milliseconds(20));
  reporter->Progress(/*step=*/100, /*epoch=*/0, /*collective_seq=*/0, /*total_steps=*/1000);
  EXPECT_EQ(reporter->AtStepBoundary(100).step, 0);
  coordinator_.Ask(100);
  EXPECT_TRUE(coordinator_.WaitFor([](const auto& e) { return Has(e, "missed 100"); }));
  EXPECT_EQ(reporter->checkpoint_ask().step, 100);

  coordinator_.Ask(120);
  EXPECT_TRUE(coordinator_.WaitFor([](const auto& e) { return Has(e, "ack 120"); }));
  EXPECT_EQ(reporter->AtStepBoundary(119).step, 120);
  EXPECT_EQ(reporter->AtStepBoundary(120).step, 120);
}

// An ask that came before the first boundary is answered there.
TEST_F(ReporterTest, AnswersAnEarlierAskAtTheFirstBoundary) {
  coordinator_.Ask(5);
  std::unique_ptr<Reporter> reporter = MakeReporter(milliseconds(20));
  reporter->Progress(/*step=*/7, /*epoch=*/0, /*collective_seq=*/0, /*total_steps=*/1000);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (reporter->checkpoint_ask().step != 5 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_EQ(reporter->checkpoint_ask().step, 5);
  EXPECT_FALSE(Has(coordinator_.events(), "missed 5"));
  EXPECT_FALSE(Has(coordinator_.events(), "ack 5"));
  EXPECT_EQ(reporter->AtStepBoundary(8).step, 5);
  EXPECT_TRUE(coordinator_.WaitFor([](const auto& e) { return Has(e, "missed 5"); }));
}

}  // namespace
}  // namespace aidn::trainer
