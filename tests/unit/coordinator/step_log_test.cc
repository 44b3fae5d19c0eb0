#include "coordinator/step_log.h"

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/step_metrics.h"

namespace aidn::coordinator {
namespace {

using std::chrono::milliseconds;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

v1::MetricRecord Record(int64_t step, int rank,
                        v1::MetricRecord::Kind kind = v1::MetricRecord::TRAIN) {
  v1::MetricRecord r;
  r.set_kind(kind);
  r.set_step(step);
  r.set_epoch(1);
  r.set_rank(rank);
  r.set_generation(1);
  r.set_loss(static_cast<double>(rank + 1));
  r.set_samples(32);
  r.set_step_seconds(0.1 * (rank + 1));
  r.set_allreduce_seconds(0.01 * (rank + 1));
  r.set_lr(0.5);
  r.mutable_time()->set_seconds(1000 + rank);
  if (kind == v1::MetricRecord::EVAL) {
    r.set_test_loss(0.5 * (rank + 1));
    r.set_test_accuracy(0.8 + 0.1 * rank);
  }
  return r;
}

// Steps the log has combined so far, as (step, kind), taking them.
std::vector<std::pair<int64_t, int>> Taken(StepLog* log) {
  std::vector<v1::StepMetrics> steps;
  log->TakeUnstored(&steps);
  std::vector<std::pair<int64_t, int>> out;
  for (const v1::StepMetrics& s : steps) out.emplace_back(s.step(), s.kind());
  return out;
}

using Steps = std::vector<std::pair<int64_t, int>>;
constexpr int kTrain = v1::MetricRecord::TRAIN;
constexpr int kEval = v1::MetricRecord::EVAL;
const Clock::TimePoint kT0{};

TEST(CombineRecords, TakesMeanLossSummedSamplesAndTheSlowestRank) {
  v1::StepMetrics s = CombineRecords({Record(7, 0), Record(7, 1), Record(7, 2)}, 4);
  EXPECT_EQ(s.step(), 7);
  EXPECT_EQ(s.world_size(), 4);
  EXPECT_EQ(s.ranks_reported(), 3);
  EXPECT_DOUBLE_EQ(s.loss(), 2.0);
  EXPECT_EQ(s.samples(), 96);
  EXPECT_DOUBLE_EQ(s.step_seconds(), 0.3);
  EXPECT_EQ(s.slowest_rank(), 2);
  EXPECT_DOUBLE_EQ(s.allreduce_seconds(), 0.02);
  EXPECT_DOUBLE_EQ(s.samples_per_second(), 96 / 0.3);
  EXPECT_DOUBLE_EQ(s.lr(), 0.5);
  EXPECT_EQ(s.time().seconds(), 1002) << "the newest of the ranks' times";
  EXPECT_THAT(s.rank_step_seconds(), ElementsAre(0.1, 0.2, 0.30000000000000004, 0.0));
  EXPECT_EQ(s.rank_allreduce_seconds_size(), 4);
}

TEST(CombineRecords, MemoryFiguresAreTheLargestRanks) {
  std::vector<v1::MetricRecord> records = {Record(3, 0), Record(3, 1)};
  records[0].set_peak_memory_bytes(5 << 20);
  records[1].set_peak_memory_bytes(3 << 20);
  records[0].set_device_peak_memory_bytes(int64_t{7} << 30);
  records[1].set_device_peak_memory_bytes(int64_t{9} << 30);
  const v1::StepMetrics s = CombineRecords(records, 2);
  EXPECT_EQ(s.peak_memory_bytes(), 5 << 20);
  EXPECT_EQ(s.device_peak_memory_bytes(), int64_t{9} << 30);
}

TEST(CombineRecords, EvaluationsAverageTheTestFiguresAndHaveNoStepTimes) {
  v1::StepMetrics s = CombineRecords(
      {Record(9, 0, v1::MetricRecord::EVAL), Record(9, 1, v1::MetricRecord::EVAL)}, 2);
  EXPECT_EQ(s.kind(), v1::MetricRecord::EVAL);
  EXPECT_DOUBLE_EQ(s.test_loss(), 0.75);
  EXPECT_DOUBLE_EQ(s.test_accuracy(), 0.85);
  EXPECT_EQ(s.rank_step_seconds_size(), 0);
  EXPECT_EQ(s.rank_allreduce_seconds_size(), 0);
  EXPECT_EQ(CombineRecords({}, 2).step(), 0);
}

TEST(StepLog, CombinesAStepOnlyOnceEveryRankReportedAndInStepOrder) {
  StepLog log({});
  log.StartGeneration(1, 2);
  // Rank 0 runs ahead; rank 1's records arrive later and out of order.
  for (int64_t k = 1; k <= 3; ++k) ASSERT_TRUE(log.Add(Record(k, 0), kT0));
  EXPECT_THAT(Taken(&log), IsEmpty());
  ASSERT_TRUE(log.Add(Record(2, 1), kT0));
  EXPECT_THAT(Taken(&log), IsEmpty()) << "step 1 still waits for rank 1";
  ASSERT_TRUE(log.Add(Record(1, 1), kT0));
  EXPECT_EQ(Taken(&log), (Steps{{1, kTrain}, {2, kTrain}}));
  ASSERT_TRUE(log.Add(Record(3, 1, v1::MetricRecord::EVAL), kT0));
  ASSERT_TRUE(log.Add(Record(3, 0, v1::MetricRecord::EVAL), kT0));
  EXPECT_THAT(Taken(&log), IsEmpty()) << "TRAIN 3 comes before EVAL 3";
  ASSERT_TRUE(log.Add(Record(3, 1), kT0));
  EXPECT_EQ(Taken(&log), (Steps{{3, kTrain}, {3, kEval}}));
  EXPECT_EQ(log.last_seq(), 4);
  ASSERT_NE(log.last_eval(), nullptr);
  EXPECT_EQ(log.last_train()->step(), 3);
}

TEST(StepLog, AfterARestartStepsAreCombinedFromTheExpectedOneInOrder) {
  // A coordinator that restarted with steps 1..17 stored: the trainers send
  // new steps (51, 52) before the lost ones (18..50) come again.
  StepLog log({});
  log.StartGeneration(1, 2);
  log.ExpectFrom(18);
  for (int64_t k : {51, 52}) {
    for (int rank : {0, 1}) ASSERT_TRUE(log.Add(Record(k, rank), kT0));
  }
  EXPECT_THAT(Taken(&log), IsEmpty()) << "51 waits for 18..50";
  for (int64_t k = 18; k <= 50; ++k) {
    for (int rank : {0, 1}) ASSERT_TRUE(log.Add(Record(k, rank), kT0)) << k;
  }
  Steps expected;
  for (int64_t k = 18; k <= 52; ++k) expected.push_back({k, kTrain});
  EXPECT_EQ(Taken(&log), expected);
  EXPECT_EQ(log.dropped(), 0);
  // A gap that never fills is combined past after max_wait.
  for (int rank : {0, 1}) ASSERT_TRUE(log.Add(Record(60, rank), kT0));
  EXPECT_THAT(Taken(&log), IsEmpty());
  log.Expire(kT0 + milliseconds(10'000), /*everything=*/false);
  EXPECT_EQ(Taken(&log), (Steps{{60, kTrain}}));
}

TEST(StepLog, ARecordSentTwiceCountsOnceAndALateOneIsDropped) {
  StepLog log({});
  log.StartGeneration(1, 2);
  ASSERT_TRUE(log.Add(Record(1, 0), kT0));
  ASSERT_TRUE(log.Add(Record(1, 0), kT0));
  EXPECT_THAT(Taken(&log), IsEmpty()) << "a duplicate is not a second rank";
  ASSERT_TRUE(log.Add(Record(1, 1), kT0));
  EXPECT_EQ(Taken(&log), (Steps{{1, kTrain}}));
  EXPECT_FALSE(log.Add(Record(1, 1), kT0)) << "step 1 was combined already";
  EXPECT_FALSE(log.Add(Record(2, 5), kT0)) << "rank out of range";
  EXPECT_EQ(log.dropped(), 2);
}

TEST(StepLog, AStepMissingARankIsCombinedAfterMaxWaitAndOrderHolds) {
  StepLog log({.max_wait = milliseconds(1000)});
  log.StartGeneration(1, 2);
  ASSERT_TRUE(log.Add(Record(1, 0), kT0));
  ASSERT_TRUE(log.Add(Record(2, 0), kT0 + milliseconds(600)));
  ASSERT_TRUE(log.Add(Record(2, 1), kT0 + milliseconds(600)));
  log.Expire(kT0 + milliseconds(999), false);
  EXPECT_THAT(Taken(&log), IsEmpty());
  log.Expire(kT0 + milliseconds(1000), false);
  std::vector<v1::StepMetrics> steps;
  log.TakeUnstored(&steps);
  ASSERT_EQ(steps.size(), 2u) << "step 2 was complete behind step 1";
  EXPECT_EQ(steps[0].ranks_reported(), 1);
  EXPECT_EQ(steps[1].ranks_reported(), 2);
}

TEST(StepLog, ANewGenerationCombinesWhatIsLeftAndMayGoBackInSteps) {
  StepLog log({});
  log.StartGeneration(1, 2);
  for (int64_t k = 1; k <= 5; ++k) ASSERT_TRUE(log.Add(Record(k, 0), kT0));
  for (int64_t k = 1; k <= 3; ++k) ASSERT_TRUE(log.Add(Record(k, 1), kT0));
  EXPECT_EQ(Taken(&log).size(), 3u);
  log.StartGeneration(2, 2);
  EXPECT_EQ(Taken(&log), (Steps{{4, kTrain}, {5, kTrain}})) << "rank 0's steps, partial";
  // Resumed from a checkpoint at step 2: step 3 again.
  v1::MetricRecord again0 = Record(3, 0), again1 = Record(3, 1);
  again0.set_generation(2);
  again1.set_generation(2);
  ASSERT_TRUE(log.Add(again0, kT0));
  ASSERT_TRUE(log.Add(again1, kT0));
  std::vector<v1::StepMetrics> steps;
  log.TakeUnstored(&steps);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].generation(), 2);
}

TEST(StepLog, MemoryKeepsTheRecentStepsAndAfterSaysWhenItFellBehind) {
  StepLog log({.recent_steps = 3});
  log.StartGeneration(1, 1);
  for (int64_t k = 1; k <= 5; ++k) ASSERT_TRUE(log.Add(Record(k, 0), kT0));
  EXPECT_EQ(log.first_seq(), 3);
  EXPECT_EQ(log.last_seq(), 5);
  std::vector<v1::StepMetrics> out;
  int64_t last = 0;
  EXPECT_FALSE(log.After(1, 0, 100, &out, &last)) << "step number 2 is gone";
  ASSERT_TRUE(log.After(2, 0, 100, &out, &last));
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].step(), 3);
  EXPECT_EQ(last, 5);
  out.clear();
  ASSERT_TRUE(log.After(2, 5, 100, &out, &last));
  ASSERT_EQ(out.size(), 1u) << "from_step 5";
  EXPECT_EQ(last, 5);
  out.clear();
  ASSERT_TRUE(log.After(2, 0, 1, &out, &last));
  ASSERT_EQ(out.size(), 1u) << "limit 1";
  EXPECT_EQ(last, 3);
  out.clear();
  ASSERT_TRUE(log.After(5, 0, 100, &out, &last));
  EXPECT_THAT(out, IsEmpty());
}

TEST(StepLog, TakeUnstoredHandsOverEachStepOnceWithTheHighestNumber) {
  StepLog log({});
  log.StartGeneration(1, 1);
  ASSERT_TRUE(log.Add(Record(1, 0), kT0));
  ASSERT_TRUE(log.Add(Record(2, 0), kT0));
  std::vector<v1::StepMetrics> steps;
  EXPECT_TRUE(log.has_unstored());
  EXPECT_EQ(log.TakeUnstored(&steps), 2);
  EXPECT_EQ(steps.size(), 2u);
  EXPECT_FALSE(log.has_unstored());
  ASSERT_TRUE(log.Add(Record(3, 0), kT0));
  steps.clear();
  EXPECT_EQ(log.TakeUnstored(&steps), 3);
  ASSERT_EQ(steps.size(), 1u);
}

TEST(StepLog, StepsInFlightAreBounded) {
  StepLog log({.max_pending = 4});
  log.StartGeneration(1, 2);
  for (int64_t k = 1; k <= 10; ++k) ASSERT_TRUE(log.Add(Record(k, 0), kT0));
  EXPECT_EQ(log.pending(), 4u);
  EXPECT_EQ(Taken(&log).size(), 6u);
}

TEST(StepLog, FirstStepNotTakenIsTheLowestStepStillWaitingOrUntaken) {
  StepLog log(StepLogOptions{});
  log.StartGeneration(1, 2);
  EXPECT_EQ(log.FirstStepNotTaken(), std::nullopt);
  ASSERT_TRUE(log.Add(Record(1, 0), kT0));
  ASSERT_TRUE(log.Add(Record(1, 1), kT0));
  ASSERT_TRUE(log.Add(Record(2, 0), kT0));
  // Step 1 is combined but not taken; step 2 waits for rank 1.
  EXPECT_EQ(log.FirstStepNotTaken(), 1);
  EXPECT_EQ(Taken(&log), (Steps{{1, kTrain}}));
  EXPECT_EQ(log.FirstStepNotTaken(), 2);
  ASSERT_TRUE(log.Add(Record(2, 1), kT0));
  EXPECT_EQ(Taken(&log), (Steps{{2, kTrain}}));
  EXPECT_EQ(log.FirstStepNotTaken(), std::nullopt);

  // Untaken steps of the old generation count after a restart went back.
  ASSERT_TRUE(log.Add(Record(3, 0), kT0));
  log.StartGeneration(2, 2);
  v1::MetricRecord redo = Record(2, 0);
  redo.set_generation(2);
  ASSERT_TRUE(log.Add(redo, kT0));
  EXPECT_EQ(log.FirstStepNotTaken(), 2);
  EXPECT_EQ(Taken(&log), (Steps{{3, kTrain}}));
  EXPECT_EQ(log.FirstStepNotTaken(), 2);
}

TEST(StepLog, RecentTrainStepTimesAreTheSlowestRanksOfTheLastHundredSteps) {
  StepLog log(StepLogOptions{});
  log.StartGeneration(1, 2);
  for (int64_t step = 1; step <= 150; ++step) {
    ASSERT_TRUE(log.Add(Record(step, 0), kT0));
    ASSERT_TRUE(log.Add(Record(step, 1), kT0));
  }
  ASSERT_TRUE(log.Add(Record(150, 0, v1::MetricRecord::EVAL), kT0));
  ASSERT_TRUE(log.Add(Record(150, 1, v1::MetricRecord::EVAL), kT0));
  const std::deque<double>& recent = log.recent_train_step_seconds();
  ASSERT_EQ(recent.size(), StepLog::kRecentTrainSteps);
  // Rank 1 is the slower one (0.2s); evaluations have no step time.
  for (double s : recent) EXPECT_DOUBLE_EQ(s, 0.2);
}

}  // namespace
}  // namespace aidn::coordinator
