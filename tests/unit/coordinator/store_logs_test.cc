#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

class StoreLogsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = Store::Open({.path = ":memory:"});
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  // Lines seq from..to-1 of one rank, text "<prefix><seq>".
  static v1::LogChunk Chunk(const std::string& job, int64_t generation, int32_t rank, int64_t from,
                            int64_t to, const std::string& prefix = "line ") {
    v1::LogChunk c;
    c.set_job_id(job);
    c.set_generation(generation);
    c.set_rank(rank);
    for (int64_t s = from; s < to; ++s) {
      v1::LogLine* line = c.add_lines();
      line->set_seq(s);
      line->set_text(absl::StrCat(prefix, s));
      line->mutable_time()->set_seconds(1'700'000'000 + s);
    }
    return c;
  }

  int64_t Append(std::vector<v1::LogChunk> chunks, int64_t max_bytes = 0) {
    absl::StatusOr<int64_t> stored = store_->AppendLogs(chunks, max_bytes);
    EXPECT_TRUE(stored.ok()) << stored.status();
    return stored.value_or(-1);
  }

  // "g<gen> r<rank> <text>" of every line the query reads.
  std::vector<std::string> Read(Store::LogQuery query, int tail = 0) {
    if (tail > 0) query.after_id = store_->LogTailStart(query, tail).value_or(-1);
    absl::StatusOr<std::vector<Store::StoredLogLine>> lines = store_->ReadLogs(query, 0);
    EXPECT_TRUE(lines.ok()) << lines.status();
    std::vector<std::string> out;
    if (!lines.ok()) return out;
    for (const Store::StoredLogLine& l : *lines) {
      out.push_back(
          absl::StrCat("g", l.entry.generation(), " r", l.entry.rank(), " ", l.entry.text()));
    }
    return out;
  }

  std::unique_ptr<Store> store_;
};

TEST_F(StoreLogsTest, LinesComeBackInArrivalOrderWithTheirNumbersAndTimes) {
  EXPECT_EQ(Append({Chunk("j", 1, 0, 0, 2), Chunk("j", 1, 1, 0, 1)}), 3);
  EXPECT_EQ(Append({Chunk("j", 1, 0, 2, 3)}), 1);
  EXPECT_THAT(Read({.job_id = "j"}),
              ElementsAre("g1 r0 line 0", "g1 r0 line 1", "g1 r1 line 0", "g1 r0 line 2"));
  auto lines = store_->ReadLogs({.job_id = "j", .rank = 0}, 0);
  ASSERT_TRUE(lines.ok());
  ASSERT_EQ(lines->size(), 3u);
  EXPECT_EQ((*lines)[2].entry.seq(), 2);
  EXPECT_EQ((*lines)[2].entry.time().seconds(), 1'700'000'002);
  EXPECT_LT((*lines)[0].id, (*lines)[1].id);
}

TEST_F(StoreLogsTest, LinesSentAgainAreStoredOnce) {
  EXPECT_EQ(Append({Chunk("j", 1, 0, 0, 3)}), 3);
  // A worker unsure whether its batch went through sends it again, with more.
  EXPECT_EQ(Append({Chunk("j", 1, 0, 1, 5)}), 2);
  EXPECT_EQ(Append({Chunk("j", 1, 0, 0, 5)}), 0);
  EXPECT_THAT(Read({.job_id = "j"}), ElementsAre("g1 r0 line 0", "g1 r0 line 1", "g1 r0 line 2",
                                                 "g1 r0 line 3", "g1 r0 line 4"));
  // Another rank, generation or job numbers its lines on its own.
  EXPECT_EQ(Append({Chunk("j", 2, 0, 0, 1), Chunk("j", 1, 1, 0, 1), Chunk("k", 1, 0, 0, 1)}), 3);
}

TEST_F(StoreLogsTest, FiltersByRankAndGenerationAndTails) {
  Append({Chunk("j", 1, 0, 0, 3), Chunk("j", 1, 1, 0, 3), Chunk("j", 2, 0, 0, 2, "again "),
          Chunk("other", 1, 0, 0, 9)});
  EXPECT_THAT(Read({.job_id = "j", .rank = 1}),
              ElementsAre("g1 r1 line 0", "g1 r1 line 1", "g1 r1 line 2"));
  EXPECT_THAT(Read({.job_id = "j", .generation = 2}),
              ElementsAre("g2 r0 again 0", "g2 r0 again 1"));
  EXPECT_THAT(Read({.job_id = "j", .rank = 0, .generation = 1}, /*tail=*/2),
              ElementsAre("g1 r0 line 1", "g1 r0 line 2"));
  EXPECT_THAT(Read({.job_id = "j"}, /*tail=*/1), ElementsAre("g2 r0 again 1"));
  // A tail longer than what there is reads everything.
  EXPECT_EQ(Read({.job_id = "j", .generation = 2}, /*tail=*/50).size(), 2u);
  EXPECT_THAT(Read({.job_id = "nope"}), IsEmpty());
}

TEST_F(StoreLogsTest, AJobPastItsBoundKeepsItsNewestLinesAndCountsTheDropped) {
  // "line N" for N < 10 is 7 bytes with the newline; 10..99 is 8.
  Append({Chunk("j", 1, 0, 0, 10)}, /*max_bytes=*/1000);
  Append({Chunk("small", 1, 0, 0, 3)}, 1000);
  auto state = store_->LogState("j", 1);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->bytes, 70);
  EXPECT_EQ(state->dropped_lines, 0);

  Append({Chunk("j", 1, 0, 10, 100)}, /*max_bytes=*/400);
  state = store_->LogState("j", 1);
  ASSERT_TRUE(state.ok());
  // Down to 63/64 of the bound, 394 bytes: the newest 49 lines (392 bytes).
  EXPECT_EQ(state->bytes, 392);
  EXPECT_EQ(state->dropped_lines, 100 - 49);
  EXPECT_EQ(state->dropped_bytes, 70 + 90 * 8 - 392);
  std::vector<std::string> kept = Read({.job_id = "j"});
  ASSERT_EQ(kept.size(), 49u);
  EXPECT_EQ(kept.front(), "g1 r0 line 51");
  EXPECT_EQ(kept.back(), "g1 r0 line 99");
  // Other jobs are untouched, and dropped lines are not taken again.
  EXPECT_EQ(Read({.job_id = "small"}).size(), 3u);
  EXPECT_EQ(Append({Chunk("j", 1, 0, 0, 100)}, 400), 0);
}

TEST_F(StoreLogsTest, RanksWhoseOutputEndedAreComplete) {
  v1::LogChunk done = Chunk("j", 2, 1, 0, 1);
  done.set_complete(true);
  Append({Chunk("j", 2, 0, 0, 1), done, Chunk("j", 1, 0, 0, 1)});
  // An empty chunk saying "complete" counts as well (a rank that printed
  // nothing).
  v1::LogChunk empty;
  empty.set_job_id("j");
  empty.set_generation(2);
  empty.set_rank(3);
  empty.set_complete(true);
  Append({empty});
  // A chunk sent again without the flag does not take it back.
  Append({Chunk("j", 2, 1, 0, 1)});
  auto state = store_->LogState("j", 2);
  ASSERT_TRUE(state.ok());
  EXPECT_THAT(state->complete_ranks, ElementsAre(1, 3));
  EXPECT_THAT(store_->LogState("j", 1)->complete_ranks, IsEmpty());
}

TEST_F(StoreLogsTest, DeleteLogsForgetsTheJobsLinesAndCounts) {
  Append({Chunk("j", 1, 0, 0, 50)}, 100);
  Append({Chunk("k", 1, 0, 0, 2)});
  ASSERT_TRUE(store_->DeleteLogs("j").ok());
  EXPECT_THAT(Read({.job_id = "j"}), IsEmpty());
  auto state = store_->LogState("j", 1);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->bytes, 0);
  EXPECT_EQ(state->dropped_lines, 0);
  EXPECT_EQ(Read({.job_id = "k"}).size(), 2u);
  // Deleting again is not an error.
  EXPECT_TRUE(store_->DeleteLogs("j").ok());
}

TEST_F(StoreLogsTest, LinesSurviveReopeningTheFile) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/store_logs_test.db");
  std::remove(path.c_str());
  {
    auto store = Store::Open({.path = path});
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->AppendLogs({Chunk("j", 1, 0, 0, 4)}, 0).ok());
  }
  auto store = Store::Open({.path = path});
  ASSERT_TRUE(store.ok()) << store.status();
  auto lines = (*store)->ReadLogs({.job_id = "j"}, 0);
  ASSERT_TRUE(lines.ok());
  EXPECT_EQ(lines->size(), 4u);
  // The dedup state survived too.
  EXPECT_EQ((*store)->AppendLogs({Chunk("j", 1, 0, 0, 5)}, 0).value_or(-1), 1);
}

}  // namespace
}  // namespace aidn::coordinator
