#include "coordinator/job_logs.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class JobLogsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = Store::Open({.path = ":memory:"});
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    logs_ = std::make_unique<JobLogs>(JobLogsOptions{.max_bytes_per_job = 0,
                                                     .retention = std::chrono::hours(1),
                                                     .settle = std::chrono::seconds(10)},
                                      store_.get());
    job_.set_id("job-1");
    job_.set_generation(1);
    job_.set_state(v1::Job::RUNNING);
    job_.mutable_spec()->set_world_size(2);
  }

  void Ship(int32_t rank, const std::vector<std::string>& texts, bool complete = false,
            int64_t generation = 1) {
    int64_t& next = next_seq_[{generation, rank}];
    v1::LogChunk c;
    c.set_job_id("job-1");
    c.set_generation(generation);
    c.set_rank(rank);
    c.set_complete(complete);
    for (const std::string& text : texts) {
      v1::LogLine* line = c.add_lines();
      line->set_seq(next++);
      line->set_text(text);
    }
    ASSERT_TRUE(logs_->Append({c}).ok());
  }

  // "r<rank> <text>" per line polled; `finished` gets the batch's word.
  std::vector<std::string> Poll(const v1::ReadLogsRequest& request, LogCursor* cursor,
                                bool* finished = nullptr, absl::Time now = absl::UnixEpoch()) {
    absl::StatusOr<LogBatch> batch = logs_->Poll(request, job_, now, cursor);
    EXPECT_TRUE(batch.ok()) << batch.status();
    std::vector<std::string> out;
    if (!batch.ok()) return out;
    for (const v1::ReadLogsResponse& r : batch->responses) {
      for (const v1::LogEntry& e : r.lines())
        out.push_back(absl::StrCat("r", e.rank(), " ", e.text()));
    }
    if (finished != nullptr) *finished = batch->finished;
    return out;
  }

  static v1::ReadLogsRequest Request(bool follow = false) {
    v1::ReadLogsRequest request;
    request.set_job_id("job-1");
    request.set_follow(follow);
    return request;
  }

  std::unique_ptr<Store> store_;
  std::unique_ptr<JobLogs> logs_;
  v1::Job job_;
  std::map<std::pair<int64_t, int32_t>, int64_t> next_seq_;
};

TEST_F(JobLogsTest, AReadEndsOnceItReadEverything) {
  Ship(0, {"a", "b"});
  Ship(1, {"c"});
  LogCursor cursor;
  bool finished = false;
  EXPECT_THAT(Poll(Request(), &cursor, &finished), ElementsAre("r0 a", "r0 b", "r1 c"));
  EXPECT_TRUE(finished);
}

TEST_F(JobLogsTest, AFollowerGetsNewLinesAndEndsWhenEveryRankIsCompleteAfterTheJob) {
  LogCursor cursor;
  bool finished = true;
  // The first answer is there even without lines: the stream is open.
  absl::StatusOr<LogBatch> first = logs_->Poll(Request(true), job_, absl::UnixEpoch(), &cursor);
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->responses.size(), 1u);
  EXPECT_EQ(first->responses[0].lines_size(), 0);
  Ship(0, {"one"});
  EXPECT_THAT(Poll(Request(true), &cursor, &finished), ElementsAre("r0 one"));
  EXPECT_FALSE(finished);
  // Ended, but rank 1's output is not all in yet.
  job_.set_state(v1::Job::SUCCEEDED);
  Ship(0, {"two"}, /*complete=*/true);
  EXPECT_THAT(Poll(Request(true), &cursor, &finished), ElementsAre("r0 two"));
  EXPECT_FALSE(finished);
  Ship(1, {"last"}, /*complete=*/true);
  EXPECT_THAT(Poll(Request(true), &cursor, &finished), ElementsAre("r1 last"));
  EXPECT_TRUE(finished);
}

TEST_F(JobLogsTest, AFollowerStopsWaitingForALostRankAfterTheSettleTime) {
  LogCursor cursor;
  bool finished = true;
  Ship(0, {"x"}, /*complete=*/true);
  job_.set_state(v1::Job::FAILED);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_THAT(Poll(Request(true), &cursor, &finished, t0), ElementsAre("r0 x"));
  EXPECT_FALSE(finished);
  Poll(Request(true), &cursor, &finished, t0 + absl::Seconds(9));
  EXPECT_FALSE(finished);
  Poll(Request(true), &cursor, &finished, t0 + absl::Seconds(10));
  EXPECT_TRUE(finished);
}

TEST_F(JobLogsTest, TheCurrentGenerationByDefaultAndAFollowerOfItEndsWhenTheJobMovesOn) {
  Ship(0, {"old"}, false, /*generation=*/1);
  job_.set_generation(2);
  Ship(0, {"new"}, false, /*generation=*/2);
  LogCursor cursor;
  bool finished = false;
  EXPECT_THAT(Poll(Request(), &cursor), ElementsAre("r0 new"));
  v1::ReadLogsRequest all = Request();
  all.set_all_generations(true);
  LogCursor all_cursor;
  EXPECT_THAT(Poll(all, &all_cursor), ElementsAre("r0 old", "r0 new"));

  LogCursor follower;
  EXPECT_THAT(Poll(Request(true), &follower, &finished), ElementsAre("r0 new"));
  EXPECT_FALSE(finished);
  job_.set_generation(3);  // generation 2 failed; 3 starts
  Ship(0, {"newer"}, false, 3);
  Ship(0, {"tail"}, true, 2);
  Ship(1, {}, true, 2);
  EXPECT_THAT(Poll(Request(true), &follower, &finished), ElementsAre("r0 tail"));
  EXPECT_TRUE(finished);
}

TEST_F(JobLogsTest, TailRankAndTheDroppedCount) {
  JobLogs bounded({.max_bytes_per_job = 40}, store_.get());
  v1::LogChunk c;
  c.set_job_id("job-1");
  c.set_generation(1);
  c.set_rank(1);
  for (int i = 0; i < 10; ++i) {
    v1::LogLine* line = c.add_lines();
    line->set_seq(i);
    line->set_text(absl::StrCat("line ", i));  // 7 bytes with its newline
  }
  ASSERT_TRUE(bounded.Append({c}).ok());
  v1::ReadLogsRequest request = Request();
  request.set_rank(1);
  request.set_tail(2);
  LogCursor cursor;
  absl::StatusOr<LogBatch> batch = bounded.Poll(request, job_, absl::UnixEpoch(), &cursor);
  ASSERT_TRUE(batch.ok());
  ASSERT_EQ(batch->responses.size(), 2u);
  // 40 bytes hold 5 lines; down to 35: the newest 5 kept, 5 dropped.
  EXPECT_EQ(batch->responses[0].dropped_lines(), 5);
  EXPECT_EQ(batch->responses[0].dropped_bytes(), 35);
  ASSERT_EQ(batch->responses[1].lines_size(), 2);
  EXPECT_EQ(batch->responses[1].lines(0).text(), "line 8");
  request.set_rank(0);
  LogCursor other;
  EXPECT_THAT(Poll(request, &other), ElementsAre());
}

TEST_F(JobLogsTest, ValidationNamesTheField) {
  v1::ShipLogsRequest ship;
  v1::LogChunk* c = ship.add_chunks();
  c->set_job_id("job-1");
  c->add_lines()->set_seq(3);
  c->add_lines()->set_seq(3);
  absl::Status s = JobLogs::Validate(ship);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("chunks[0].lines[1].seq"));
  v1::ReadLogsRequest read = Request();
  read.set_tail(-1);
  EXPECT_THAT(JobLogs::Validate(read).message(), HasSubstr("tail"));
}

TEST_F(JobLogsTest, RetentionCountsFromTheJobsEnd) {
  // The coordinator finds the jobs whose lines are due in the store, by
  // when they finished; a job that runs has none due.
  Ship(0, {"a"});
  StoredJob stored{.job = job_, .trainer_token = "t", .number = 1};
  ASSERT_TRUE(store_->PutJob(stored).ok());
  EXPECT_THAT(*store_->JobsWithLogsFinishedBefore(absl::FromUnixSeconds(1000 + 9999)),
              ::testing::IsEmpty());
  stored.job.set_state(v1::Job::SUCCEEDED);
  stored.job.mutable_finished_at()->set_seconds(1000);
  ASSERT_TRUE(store_->PutJob(stored).ok());
  EXPECT_THAT(*store_->JobsWithLogsFinishedBefore(absl::FromUnixSeconds(1000)),
              ::testing::IsEmpty());
  EXPECT_THAT(*store_->JobsWithLogsFinishedBefore(absl::FromUnixSeconds(1001)),
              ElementsAre("job-1"));
  ASSERT_TRUE(store_->DeleteLogs("job-1").ok());
  EXPECT_THAT(*store_->JobsWithLogsFinishedBefore(absl::FromUnixSeconds(1001)),
              ::testing::IsEmpty());
}

}  // namespace
}  // namespace aidn::coordinator
