// Finished jobs leaving the coordinator's memory after --job_retention: they
// stay listed, described, watched and counted, from the store, and a
// restarted coordinator does not load them.

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using std::chrono::milliseconds;
using test_util::CoordinatorTest;
using test_util::Spec;
using test_util::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using v1::Job;

class JobArchiveTest : public CoordinatorTest {
 protected:
  void OpenWithRetention(const std::string& path) {
    options_.metrics_retention = milliseconds(30'000);
    options_.job_retention = milliseconds(60'000);
    Open(path);
  }

  std::vector<std::string> ListIds(v1::ListJobsRequest request) {
    std::vector<std::string> ids;
    absl::StatusOr<v1::ListJobsResponse> page = c().ListJobs(request);
    EXPECT_TRUE(page.ok()) << page.status();
    if (!page.ok()) return ids;
    for (const Job& job : page->jobs()) ids.push_back(job.id());
    if (!page->next_page_token().empty()) ids.push_back("next:" + page->next_page_token());
    return ids;
  }

  // Lets `ms` pass as the workers heartbeat, ticking.
  void Pass(milliseconds ms) {
    for (milliseconds left = ms; left.count() > 0; left -= milliseconds(1000)) {
      clock_.Advance(std::min(left, milliseconds(1000)));
      for (const char* w : {"w1", "w2"}) EXPECT_TRUE(Beat(w).ok());
      c().Tick();
    }
  }

  std::string Gauge(const std::string& series) {
    const std::string text = "\n" + c().registry()->Serialize();
    const size_t at = text.find("\n" + series + " ");
    if (at == std::string::npos) return "absent";
    const size_t start = at + series.size() + 2;
    return text.substr(start, text.find('\n', start) - start);
  }

  // A job that succeeded after steps 1..3 on both ranks, and one that was
  // cancelled; then one that waits for room.
  void FinishTwoAndRunOne() {
    succeeded_ = RunningJobOnTwoWorkers();
    for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(succeeded_, rank, 1, 3).ok());
    for (int rank : {0, 1}) ASSERT_TRUE(Exit(succeeded_, 1, rank, 0).ok());
    ASSERT_EQ(Get(succeeded_).state(), Job::SUCCEEDED);
    v1::JobSpec labelled = Spec(2);
    (*labelled.mutable_labels())["team"] = "vision";
    cancelled_ = Submit(labelled);
    ASSERT_TRUE(c().CancelJob(cancelled_, "not needed", "alice").ok());
    waiting_ = Submit(Spec(3));
    c().FlushSteps();
    c().Tick();
  }

  std::string succeeded_, cancelled_, waiting_;
};

TEST_F(JobArchiveTest, AFinishedJobLeavesMemoryAfterItsRetentionAndIsStillServed) {
  TempDir dir;
  const std::string db = dir.path() + "/state.db";
  OpenWithRetention(db);
  FinishTwoAndRunOne();
  EXPECT_EQ(Gauge("aidn_jobs_in_memory"), "3");

  Pass(milliseconds(59'000));
  EXPECT_EQ(Gauge("aidn_jobs_in_memory"), "3");
  Pass(milliseconds(2'000));
  EXPECT_EQ(Gauge("aidn_jobs_in_memory"), "1");
  // Still counted by state.
  EXPECT_EQ(Gauge("aidn_jobs{state=\"SUCCEEDED\"}"), "1");
  EXPECT_EQ(Gauge("aidn_jobs{state=\"CANCELLED\"}"), "1");
  EXPECT_EQ(Gauge("aidn_jobs{state=\"PENDING\"}"), "1");

  // Described as it ended.
  const Job job = Get(succeeded_);
  EXPECT_EQ(job.state(), Job::SUCCEEDED);
  EXPECT_EQ(job.last_step(), 3);
  EXPECT_THAT(Get(cancelled_).message(), HasSubstr("cancelled by alice"));
  absl::StatusOr<Job> cancel = c().CancelJob(succeeded_, "", "alice");
  EXPECT_EQ(cancel.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(cancel.status().message(), HasSubstr("has already ended (SUCCEEDED)"));
  EXPECT_EQ(c().GetJob("job-99").status().code(), absl::StatusCode::kNotFound);

  // Listed among the jobs in memory, newest first, page by page, filtered.
  v1::ListJobsRequest all;
  EXPECT_THAT(ListIds(all), ElementsAre(waiting_, cancelled_, succeeded_));
  v1::ListJobsRequest paged;
  paged.set_page_size(1);
  EXPECT_THAT(ListIds(paged), ElementsAre(waiting_, "next:3"));
  paged.set_page_token("3");
  EXPECT_THAT(ListIds(paged), ElementsAre(cancelled_, "next:2"));
  paged.set_page_token("2");
  EXPECT_THAT(ListIds(paged), ElementsAre(succeeded_));
  v1::ListJobsRequest done;
  done.add_states(Job::SUCCEEDED);
  done.add_states(Job::PENDING);
  EXPECT_THAT(ListIds(done), ElementsAre(waiting_, succeeded_));
  v1::ListJobsRequest team;
  (*team.mutable_labels())["team"] = "vision";
  EXPECT_THAT(ListIds(team), ElementsAre(cancelled_));
  EXPECT_THAT(c().ListJobs(all, [](const Job& j) { return j.owner() != "alice"; })->jobs(),
              ::testing::IsEmpty());

  // Its events, steps and checkpoints are read from the store.
  EXPECT_THAT(Events(succeeded_), ::testing::Contains("job.succeeded"));
  v1::GetMetricsRequest metrics;
  metrics.set_job_id(succeeded_);
  EXPECT_EQ(c().GetMetrics(metrics)->steps_size(), 3);
  EXPECT_TRUE(c().ListCheckpoints(succeeded_).ok());

  // A watch replays it and ends.
  v1::WatchJobRequest watch;
  watch.set_job_id(succeeded_);
  watch.set_include_metrics(true);
  WatchCursor cursor;
  std::vector<std::string> seen;
  for (int poll = 0; poll < 10; ++poll) {
    absl::StatusOr<WatchBatch> batch = c().PollWatch(watch, &cursor);
    ASSERT_TRUE(batch.ok()) << batch.status();
    for (const v1::WatchJobResponse& item : batch->items) {
      if (item.has_job()) seen.push_back(Job::State_Name(item.job().state()));
      if (item.has_step()) seen.push_back(absl::StrCat("step ", item.step().step()));
    }
    if (batch->finished) break;
  }
  EXPECT_THAT(seen, ::testing::IsSupersetOf({"SUCCEEDED", "step 1", "step 3"}));

  // Another job may still resume from it: the job is found, and says what
  // it lacks.
  v1::JobSpec resume = Spec(2);
  resume.mutable_checkpoint()->mutable_resume_from()->set_job(succeeded_);
  absl::StatusOr<Job> resumed = c().SubmitJob(resume, "alice");
  EXPECT_EQ(resumed.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(resumed.status().message(), HasSubstr("has no committed, valid checkpoint"));

  // A restarted coordinator loads only the job that waits, and numbers on.
  OpenWithRetention(db);
  EXPECT_EQ(Gauge("aidn_jobs_in_memory"), "1");
  EXPECT_EQ(Gauge("aidn_jobs{state=\"SUCCEEDED\"}"), "1");
  EXPECT_EQ(Get(succeeded_).state(), Job::SUCCEEDED);
  EXPECT_THAT(ListIds(all), ElementsAre(waiting_, cancelled_, succeeded_));
  EXPECT_EQ(Submit(Spec(1)), "job-4");
}

TEST_F(JobArchiveTest, AJobStaysInMemoryWhileItsStepsOrSeriesDo) {
  // The retention is the longer of the two: with metrics kept longer than
  // jobs, the job stays until its series and steps left.
  options_.metrics_retention = milliseconds(120'000);
  options_.job_retention = milliseconds(10'000);
  Open(":memory:");
  FinishTwoAndRunOne();
  Pass(milliseconds(119'000));
  EXPECT_EQ(Gauge("aidn_jobs_in_memory"), "3");
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr(absl::StrCat("job_id=\"", succeeded_)));
  Pass(milliseconds(2'000));
  EXPECT_EQ(Gauge("aidn_jobs_in_memory"), "1");
  EXPECT_THAT(c().registry()->Serialize(),
              ::testing::Not(HasSubstr(absl::StrCat("job_id=\"", succeeded_))));
}

}  // namespace
}  // namespace aidn::coordinator
