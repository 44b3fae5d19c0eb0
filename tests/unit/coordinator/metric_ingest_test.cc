#include <atomic>
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "coordinator/metric_ingest.h"
#include "coordinator/store.h"
#include "coordinator/time_util.h"
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the shared fixture
using std::chrono::milliseconds;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using v1::Job;

// --- MetricIngest alone ------------------------------------------------------

class MetricIngestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Store>> store = Store::Open({.path = ":memory:"});
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    ingest_ =
        std::make_unique<MetricIngest>(MetricIngestOptions{}, &metrics_, store_.get(), &clock_);
    job_.set_id("job-1");
    job_.set_generation(1);
    job_.set_state(v1::Job::RUNNING);
    *job_.mutable_spec() = Spec(2);
  }

  // Rank `rank` sends TRAIN records of steps [first, last]; whether steps
  // were combined.
  bool Send(int rank, int64_t first, int64_t last) {
    v1::StreamMetricsRequest request;
    request.set_job_id(job_.id());
    request.set_generation(job_.generation());
    request.set_rank(rank);
    for (int64_t step = first; step <= last; ++step) {
      v1::MetricRecord* r = request.add_records();
      r->set_kind(v1::MetricRecord::TRAIN);
      r->set_step(step);
      r->set_samples(64);
      r->set_step_seconds(0.5);
    }
    return ingest_->Append(job_, &m_, request, clock_.Now(),
                           [this](const v1::MetricRecord&) { ++train_records_; });
  }

  // A flush as the coordinator does it, the store write succeeding.
  void Flush() {
    FlushBatch batch;
    ingest_->Take(job_.id(), &m_, &batch);
    ingest_->InFlight(batch);
    ASSERT_TRUE(store_->PutSteps(batch.steps).ok());
    ingest_->Stored();
    for (const auto& [id, seq] : batch.taken) MetricIngest::NoteFlushed(&m_, seq);
    for (const Store::JobStep& s : batch.steps) {
      MetricIngest::NoteStored(job_.generation(), &m_, s.step);
    }
  }

  FakeClock clock_;
  metrics::Registry registry_;
  CoordinatorMetrics metrics_{&registry_};
  std::unique_ptr<Store> store_;
  std::unique_ptr<MetricIngest> ingest_;
  v1::Job job_;
  JobMetrics m_;
  int train_records_ = 0;
};

TEST_F(MetricIngestTest, StepsCombineAcrossRanksAndAreDurableOnlyOnceStored) {
  EXPECT_FALSE(Send(0, 1, 3));
  EXPECT_TRUE(Send(1, 1, 3));
  EXPECT_EQ(train_records_, 6);
  EXPECT_EQ(m_.steps->last_seq(), 3);
  EXPECT_EQ(ingest_->DurableStep(job_, m_), 0);
  // Taken by a flush whose write has not ended: still not durable.
  FlushBatch batch;
  ingest_->Take(job_.id(), &m_, &batch);
  ASSERT_EQ(batch.steps.size(), 3u);
  ingest_->InFlight(batch);
  EXPECT_EQ(ingest_->DurableStep(job_, m_), 0);
  ASSERT_TRUE(store_->PutSteps(batch.steps).ok());
  ingest_->Stored();
  for (const Store::JobStep& s : batch.steps) {
    MetricIngest::NoteStored(job_.generation(), &m_, s.step);
  }
  EXPECT_EQ(ingest_->DurableStep(job_, m_), 3);
  // Step 4 waits for rank 1: durable stays at 3.
  Send(0, 4, 4);
  Flush();
  EXPECT_EQ(ingest_->DurableStep(job_, m_), 3);
}

TEST_F(MetricIngestTest, RecordsARestartedCoordinatorFoundStoredAreIgnored) {
  Send(0, 1, 2);
  Send(1, 1, 2);
  Flush();
  // A new process loads the job: its trainers send steps 1-3 again.
  JobMetrics loaded;
  ingest_->RecoverStored(job_, &loaded, /*resumed_from_step=*/-1);
  EXPECT_EQ(loaded.resent_first_step, 3);
  EXPECT_EQ(ingest_->DurableStep(job_, loaded), 2);
  m_ = std::move(loaded);
  train_records_ = 0;
  Send(0, 1, 3);
  Send(1, 1, 3);
  EXPECT_EQ(train_records_, 2);  // only step 3's
  ASSERT_NE(m_.steps, nullptr);
  EXPECT_EQ(m_.steps->last_seq(), 1);
  EXPECT_EQ(m_.steps->last_train()->step(), 3);
}

TEST_F(MetricIngestTest, AFinishedJobsStepsLeaveMemoryOnceStoredAndPastRetention) {
  Send(0, 1, 1);
  Send(1, 1, 1);
  job_.set_state(v1::Job::SUCCEEDED);
  *job_.mutable_finished_at() = ToProto(clock_.WallNow());
  clock_.Advance(MetricIngestOptions{}.metrics_retention);
  ingest_->Expire(job_, &m_, clock_.Now());
  EXPECT_NE(m_.steps, nullptr);  // not stored yet
  Flush();
  ingest_->Expire(job_, &m_, clock_.Now());
  EXPECT_EQ(m_.steps, nullptr);
}

// --- Coordinator-level: metric ingest -------------------------------------

TEST_F(CoordinatorTest, StepsAreCombinedOnceEveryRankReported) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(SendSteps(id, 0, 1, 3).ok());
  EXPECT_EQ(Get(id).last_step(), 3);
  v1::GetMetricsRequest get;
  get.set_job_id(id);
  absl::StatusOr<v1::GetMetricsResponse> none = c().GetMetrics(get);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->steps_size(), 0) << "rank 1 has not reported yet";

  ASSERT_TRUE(SendSteps(id, 1, 1, 2).ok());
  absl::StatusOr<v1::GetMetricsResponse> two = c().GetMetrics(get);
  ASSERT_TRUE(two.ok()) << two.status();
  ASSERT_EQ(two->steps_size(), 2);
  const v1::StepMetrics& s = two->steps(1);
  EXPECT_EQ(s.step(), 2);
  EXPECT_EQ(s.generation(), 1);
  EXPECT_EQ(s.ranks_reported(), 2);
  EXPECT_EQ(s.world_size(), 2);
  EXPECT_DOUBLE_EQ(s.loss(), 0.5 + 0.5);  // mean of 1/2 and 1/2 + 1
  EXPECT_EQ(s.samples(), 128);
  EXPECT_DOUBLE_EQ(s.step_seconds(), 0.02);
  EXPECT_EQ(s.slowest_rank(), 1);
  EXPECT_DOUBLE_EQ(s.samples_per_second(), 128 / 0.02);
  EXPECT_THAT(s.rank_step_seconds(), ElementsAre(0.01, 0.02));

  // Range and refusals.
  get.set_from_step(2);
  get.set_to_step(2);
  absl::StatusOr<v1::GetMetricsResponse> one = c().GetMetrics(get);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->steps_size(), 1);
  get.set_from_step(-1);
  EXPECT_EQ(c().GetMetrics(get).status().code(), absl::StatusCode::kInvalidArgument);
  get.set_job_id("job-404");
  get.set_from_step(0);
  EXPECT_EQ(c().GetMetrics(get).status().code(), absl::StatusCode::kNotFound);
  v1::StreamMetricsRequest bad;
  bad.set_job_id(id);
  bad.set_generation(1);
  bad.set_rank(2);
  EXPECT_EQ(c().AppendMetrics(bad).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, AStepStillMissingARankIsCombinedAfterTheWait) {
  options_.step_log.max_wait = milliseconds(5000);
  Open(":memory:");
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(SendSteps(id, 0, 1, 2).ok());
  ASSERT_TRUE(SendSteps(id, 1, 1, 1).ok());
  v1::GetMetricsRequest get;
  get.set_job_id(id);
  ASSERT_EQ(c().GetMetrics(get)->steps_size(), 1);
  clock_.Advance(milliseconds(4000));
  c().Tick();
  EXPECT_EQ(c().GetMetrics(get)->steps_size(), 1);
  clock_.Advance(milliseconds(1500));
  c().Tick();
  absl::StatusOr<v1::GetMetricsResponse> after = c().GetMetrics(get);
  ASSERT_TRUE(after.ok());
  ASSERT_EQ(after->steps_size(), 2);
  EXPECT_EQ(after->steps(1).ranks_reported(), 1);
  EXPECT_DOUBLE_EQ(after->steps(1).loss(), 0.5);
  // Rank 1's record of step 2 comes too late: dropped, step 2 unchanged.
  ASSERT_TRUE(SendSteps(id, 1, 2, 2).ok());
  EXPECT_EQ(c().GetMetrics(get)->steps(1).ranks_reported(), 1);
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr("aidn_metric_records_dropped_total 1\n"));
}

TEST_F(CoordinatorTest, RegistryShowsJobsRanksAndWorkersAndForgetsFinishedJobsAfterRetention) {
  options_.metrics_retention = milliseconds(60'000);
  Open(":memory:");
  const std::string id = RunningJobOnTwoWorkers();
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 1, 5).ok());
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 5, 5, v1::MetricRecord::EVAL).ok());
  v1::ReportProgressRequest progress;
  progress.set_job_id(id);
  progress.set_generation(1);
  progress.set_rank(1);
  progress.set_step(5);
  progress.set_total_steps(50);
  ASSERT_TRUE(c().ReportProgress(progress).ok());

  std::string text = c().registry()->Serialize();
  // Job series carry the job's name and owner; rank series its id.
  const std::string job = absl::StrCat("job_id=\"", id, "\",name=\"\",owner=\"alice\"");
  const std::string rank_job = absl::StrCat("job_id=\"", id, "\"");
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_step{", job, "} 5\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_total_steps{", job, "} 50\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_loss{", job, "} 0.7\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_test_accuracy{", job, "} 0.85")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_state{", job, ",state=\"RUNNING\"} 1\n")));
  EXPECT_THAT(
      text, HasSubstr(absl::StrCat("aidn_rank_step_seconds_count{", rank_job, ",rank=\"1\"} 5\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_rank_last_progress_age_seconds{", rank_job,
                                           ",rank=\"1\"} 0\n")));
  EXPECT_THAT(text, HasSubstr("aidn_jobs{state=\"RUNNING\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("aidn_worker_up{worker_id=\"w1\"} 1\n"));
  EXPECT_THAT(text,
              HasSubstr("aidn_worker_scheduling{scheduling=\"schedulable\",worker_id=\"w1\"} 1\n"));
  EXPECT_THAT(text,
              HasSubstr("aidn_worker_scheduling{scheduling=\"draining\",worker_id=\"w1\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("aidn_worker_slots_used{kind=\"cpu\",worker_id=\"w2\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("aidn_metric_records_total 12\n"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_rank_straggler{", rank_job, ",rank=\"1\"} 0\n")));

  for (int rank : {0, 1}) ASSERT_TRUE(Exit(id, 1, rank, 0).ok());
  clock_.Advance(milliseconds(30'000));
  text = c().registry()->Serialize();
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_state{", job, ",state=\"SUCCEEDED\"} 1\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_step{", job, "} 5\n")));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("aidn_rank_last_progress_age_seconds{")));
  EXPECT_THAT(text, HasSubstr("aidn_worker_slots_used{kind=\"cpu\",worker_id=\"w2\"} 0\n"));

  clock_.Advance(milliseconds(31'000));
  text = c().registry()->Serialize();
  EXPECT_THAT(text, ::testing::Not(HasSubstr(job)));
  EXPECT_THAT(text, HasSubstr("aidn_jobs{state=\"SUCCEEDED\"} 1\n"));
  // The steps are still in the store.
  c().Tick();
  v1::GetMetricsRequest get;
  get.set_job_id(id);
  EXPECT_EQ(c().GetMetrics(get)->steps_size(), 6);
}

TEST_F(CoordinatorTest, DurableStepIsTheLastStepBelowWhichEverythingIsStored) {
  const std::string id = RunningJobOnTwoWorkers();
  auto durable = [&]() -> int64_t {
    c().FlushSteps();  // the ticker's batched flush
    absl::StatusOr<v1::StreamMetricsResponse> r = c().MetricsReceipt(id);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->durable_step() : -1;
  };
  EXPECT_EQ(durable(), 0);
  ASSERT_TRUE(SendSteps(id, 0, 1, 5).ok());
  ASSERT_TRUE(SendSteps(id, 1, 1, 3).ok());
  EXPECT_EQ(durable(), 3) << "steps 4 and 5 wait for rank 1";
  ASSERT_TRUE(SendSteps(id, 1, 4, 5).ok());
  EXPECT_EQ(durable(), 5);
  // An evaluation at step 5 that only rank 0 sent holds step 5 back.
  ASSERT_TRUE(SendSteps(id, 0, 5, 5, v1::MetricRecord::EVAL).ok());
  EXPECT_EQ(durable(), 4);
  ASSERT_TRUE(SendSteps(id, 1, 5, 5, v1::MetricRecord::EVAL).ok());
  EXPECT_EQ(durable(), 5);
}

// Receipts do not wait for a flush (they run on gRPC's callback threads),
// so what a flush has taken but not yet stored, or failed to store, must
// not count as durable: the sender would drop records the store never got.

TEST_F(CoordinatorTest, AStepIsNotDurableWhileAnyOfItsRowsIsInFlightOrFailedToStore) {
  enum Mode { kPass, kBlock, kFail };
  std::atomic<int> mode{kPass};
  absl::Notification entered, release;
  put_steps_hook_ = [&]() -> absl::Status {
    if (mode == kBlock) {
      entered.Notify();
      release.WaitForNotification();
    }
    if (mode == kFail) return absl::UnavailableError("injected write failure");
    return absl::OkStatus();
  };
  Open(":memory:");
  const std::string id = RunningJobOnTwoWorkers();
  auto durable = [&]() -> int64_t {
    absl::StatusOr<v1::StreamMetricsResponse> r = c().MetricsReceipt(id);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->durable_step() : -1;
  };
  ASSERT_TRUE(SendSteps(id, 0, 1, 5).ok());
  ASSERT_TRUE(SendSteps(id, 1, 1, 5).ok());
  c().FlushSteps();
  EXPECT_EQ(durable(), 5);

  // Step 5's evaluation, combined, taken by a flush that is still writing
  // it: step 5's TRAIN row is stored, its EVAL row is not.
  ASSERT_TRUE(SendSteps(id, 0, 5, 5, v1::MetricRecord::EVAL).ok());
  ASSERT_TRUE(SendSteps(id, 1, 5, 5, v1::MetricRecord::EVAL).ok());
  mode = kBlock;
  std::thread flush([&] { c().FlushSteps(); });
  entered.WaitForNotification();
  EXPECT_EQ(durable(), 4) << "step 5's EVAL row is being written";
  mode = kPass;
  release.Notify();
  flush.join();
  EXPECT_EQ(durable(), 5);

  // A failed write keeps its steps not durable until a flush stores them.
  ASSERT_TRUE(SendSteps(id, 0, 6, 7).ok());
  ASSERT_TRUE(SendSteps(id, 1, 6, 7).ok());
  mode = kFail;
  c().FlushSteps();
  EXPECT_EQ(durable(), 5);
  mode = kPass;
  c().FlushSteps();
  EXPECT_EQ(durable(), 7);
}

TEST_F(CoordinatorTest, JobSeriesCarryNameAndOwnerAndCountStepsAndSamplesForRate) {
  v1::JobSpec spec = Spec(2);
  spec.set_name("resnet-sweep");
  const std::string id = RunningJobOnTwoWorkers(spec);
  const std::string labels =
      absl::StrCat("{job_id=\"", id, "\",name=\"resnet-sweep\",owner=\"alice\"}");
  std::string text = c().registry()->Serialize();
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_steps_total", labels, " 0\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_samples_total", labels, " 0\n")));
  ASSERT_TRUE(SendSteps(id, 0, 1, 3).ok());
  ASSERT_TRUE(SendSteps(id, 1, 1, 3).ok());
  ASSERT_TRUE(SendSteps(id, 0, 4, 4).ok());  // step 4 waits for rank 1
  ASSERT_TRUE(SendSteps(id, 0, 1, 1, v1::MetricRecord::EVAL).ok());
  ASSERT_TRUE(SendSteps(id, 1, 1, 1, v1::MetricRecord::EVAL).ok());
  text = c().registry()->Serialize();
  // Three TRAIN steps of 2 x 64 samples; evaluations are not counted.
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_steps_total", labels, " 3\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_samples_total", labels, " 384\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_step", labels, " 4\n")));
  // Counted once: another scrape with nothing new adds nothing.
  ASSERT_TRUE(SendSteps(id, 1, 4, 4).ok());
  (void)c().registry()->Serialize();
  text = c().registry()->Serialize();
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_steps_total", labels, " 4\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_samples_total", labels, " 512\n")));
}

}  // namespace
}  // namespace aidn::coordinator
