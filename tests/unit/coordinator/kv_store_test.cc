#include "coordinator/kv_store.h"

#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace aidn::coordinator {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

// Collects what a WaitFor callback was answered with.
struct KvAnswers {
  std::vector<absl::StatusOr<std::string>> got;
  KvStore::GetCallback Callback() {
    return [this](absl::StatusOr<std::string> v) { got.push_back(std::move(v)); };
  }
};

class KvStoreTest : public ::testing::Test {
 protected:
  Clock::TimePoint Later(int ms) { return clock_.Now() + milliseconds(ms); }

  FakeClock clock_;
  KvStore kv_{KvLimits()};
};

TEST_F(KvStoreTest, GetsWhatWasSet) {
  Deferred d;
  ASSERT_TRUE(kv_.Set("nccl_id", "abc", &d).ok());
  ASSERT_TRUE(kv_.Set("binary", std::string("a\0b", 3), &d).ok());
  EXPECT_EQ(kv_.Get("nccl_id").value_or("?"), "abc");
  EXPECT_EQ(kv_.Get("binary").value_or("?"), std::string("a\0b", 3));
  EXPECT_EQ(kv_.size(), 2u);
}

TEST_F(KvStoreTest, GetOfAnUnsetKeyIsNotFound) {
  EXPECT_EQ(kv_.Get("missing").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(KvStoreTest, SetOverwrites) {
  Deferred d;
  ASSERT_TRUE(kv_.Set("k", "one", &d).ok());
  ASSERT_TRUE(kv_.Set("k", "two", &d).ok());
  EXPECT_EQ(kv_.Get("k").value_or("?"), "two");
  EXPECT_EQ(kv_.size(), 1u);
}

TEST_F(KvStoreTest, WaitForASetKeyIsAnsweredThroughTheDeferred) {
  Deferred d;
  ASSERT_TRUE(kv_.Set("k", "v", &d).ok());
  KvAnswers a;
  kv_.WaitFor("k", Later(1000), a.Callback(), &d);
  EXPECT_TRUE(a.got.empty()) << "callback ran inside WaitFor";
  EXPECT_EQ(kv_.waiters(), 0u);
  d.Run();
  ASSERT_EQ(a.got.size(), 1u);
  EXPECT_EQ(a.got[0].value_or("?"), "v");
}

TEST_F(KvStoreTest, WaiterIsWokenByALaterSetOnlyWhenTheDeferredRuns) {
  KvAnswers a;
  {
    Deferred d;
    kv_.WaitFor("k", Later(1000), a.Callback(), &d);
    d.Run();
    EXPECT_TRUE(a.got.empty()) << "answered before the key was set";
  }
  EXPECT_EQ(kv_.waiters(), 1u);

  Deferred d;
  ASSERT_TRUE(kv_.Set("k", "late", &d).ok());
  EXPECT_TRUE(a.got.empty()) << "callback ran inside Set";
  EXPECT_EQ(kv_.waiters(), 0u);
  d.Run();
  ASSERT_EQ(a.got.size(), 1u);
  EXPECT_EQ(a.got[0].value_or("?"), "late");
}

TEST_F(KvStoreTest, SetWakesEveryWaiterOfTheKeyAndNoOther) {
  KvAnswers a, b, other;
  Deferred d;
  kv_.WaitFor("k", Later(1000), a.Callback(), &d);
  kv_.WaitFor("k", Later(2000), b.Callback(), &d);
  kv_.WaitFor("other", Later(1000), other.Callback(), &d);
  ASSERT_TRUE(kv_.Set("k", "v", &d).ok());
  d.Run();
  ASSERT_EQ(a.got.size(), 1u);
  ASSERT_EQ(b.got.size(), 1u);
  EXPECT_EQ(a.got[0].value_or("?"), "v");
  EXPECT_EQ(b.got[0].value_or("?"), "v");
  EXPECT_TRUE(other.got.empty());
  EXPECT_EQ(kv_.waiters(), 1u);
}

TEST_F(KvStoreTest, AddAndCompareAndSetWakeWaitersToo) {
  KvAnswers counter, cas;
  Deferred d;
  kv_.WaitFor("counter", Later(1000), counter.Callback(), &d);
  kv_.WaitFor("cas", Later(1000), cas.Callback(), &d);
  ASSERT_TRUE(kv_.Add("counter", 7, &d).ok());
  ASSERT_TRUE(kv_.CompareAndSet("cas", /*expect_absent=*/true, "", "first", &d).ok());
  EXPECT_TRUE(counter.got.empty());
  EXPECT_TRUE(cas.got.empty());
  d.Run();
  ASSERT_EQ(counter.got.size(), 1u);
  EXPECT_EQ(counter.got[0].value_or("?"), "7");
  ASSERT_EQ(cas.got.size(), 1u);
  EXPECT_EQ(cas.got[0].value_or("?"), "first");
}

TEST_F(KvStoreTest, ExpireAnswersDeadlineExceededOnlyOnceTheDeadlineIsReached) {
  const Clock::TimePoint deadline = Later(100);
  KvAnswers a;
  Deferred d;
  kv_.WaitFor("k", deadline, a.Callback(), &d);

  kv_.Expire(deadline - milliseconds(1), &d);
  d.Run();
  EXPECT_TRUE(a.got.empty()) << "expired before its deadline";
  EXPECT_EQ(kv_.waiters(), 1u);

  kv_.Expire(deadline + milliseconds(1), &d);
  EXPECT_TRUE(a.got.empty()) << "callback ran inside Expire";
  d.Run();
  ASSERT_EQ(a.got.size(), 1u);
  EXPECT_EQ(a.got[0].status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(a.got[0].status().message(), HasSubstr("k"));
  EXPECT_EQ(kv_.waiters(), 0u);

  // Answered once only: a later set finds no waiter.
  ASSERT_TRUE(kv_.Set("k", "v", &d).ok());
  d.Run();
  EXPECT_EQ(a.got.size(), 1u);
}

TEST_F(KvStoreTest, ExpireLeavesLaterDeadlinesWaiting) {
  KvAnswers early, late;
  Deferred d;
  kv_.WaitFor("k", Later(100), early.Callback(), &d);
  kv_.WaitFor("k", Later(500), late.Callback(), &d);
  clock_.Advance(milliseconds(200));
  kv_.Expire(clock_.Now(), &d);
  d.Run();
  EXPECT_EQ(early.got.size(), 1u);
  EXPECT_TRUE(late.got.empty());
  ASSERT_TRUE(kv_.Set("k", "v", &d).ok());
  d.Run();
  ASSERT_EQ(late.got.size(), 1u);
  EXPECT_EQ(late.got[0].value_or("?"), "v");
}

TEST_F(KvStoreTest, AddCountsFromZeroAndStoresDecimalText) {
  Deferred d;
  EXPECT_EQ(kv_.Add("c", 5, &d).value_or(-1), 5);
  EXPECT_EQ(kv_.Add("c", -7, &d).value_or(-1), -2);
  EXPECT_EQ(kv_.Get("c").value_or("?"), "-2");
  EXPECT_EQ(kv_.Add("zero", 0, &d).value_or(-1), 0);
  EXPECT_EQ(kv_.Get("zero").value_or("?"), "0");
}

TEST_F(KvStoreTest, AddWorksOnAnIntegerWrittenBySet) {
  Deferred d;
  ASSERT_TRUE(kv_.Set("c", "41", &d).ok());
  EXPECT_EQ(kv_.Add("c", 1, &d).value_or(-1), 42);
}

TEST_F(KvStoreTest, AddRefusesAValueThatIsNotAnInteger) {
  Deferred d;
  ASSERT_TRUE(kv_.Set("c", "forty", &d).ok());
  absl::StatusOr<int64_t> v = kv_.Add("c", 1, &d);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv_.Get("c").value_or("?"), "forty");
}

TEST_F(KvStoreTest, AddThatWouldOverflowIsOutOfRangeAndChangesNothing) {
  Deferred d;
  const std::string max = absl::StrCat(std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(kv_.Set("c", max, &d).ok());
  EXPECT_EQ(kv_.Add("c", 1, &d).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(kv_.Get("c").value_or("?"), max);

  const std::string min = absl::StrCat(std::numeric_limits<int64_t>::min());
  ASSERT_TRUE(kv_.Set("m", min, &d).ok());
  EXPECT_EQ(kv_.Add("m", -1, &d).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(kv_.Get("m").value_or("?"), min);
}

TEST_F(KvStoreTest, CompareAndSetExpectingAbsentSwapsOnlyAnUnsetKey) {
  Deferred d;
  absl::StatusOr<CasResult> r = kv_.CompareAndSet("k", true, "", "mine", &d);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->swapped);
  EXPECT_TRUE(r->found);
  EXPECT_EQ(r->current, "mine");

  r = kv_.CompareAndSet("k", true, "", "theirs", &d);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->swapped);
  EXPECT_TRUE(r->found);
  EXPECT_EQ(r->current, "mine");
  EXPECT_EQ(kv_.Get("k").value_or("?"), "mine");
}

TEST_F(KvStoreTest, CompareAndSetSwapsOnAMatch) {
  Deferred d;
  ASSERT_TRUE(kv_.Set("k", "old", &d).ok());
  absl::StatusOr<CasResult> r = kv_.CompareAndSet("k", false, "old", "new", &d);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->swapped);
  EXPECT_TRUE(r->found);
  EXPECT_EQ(r->current, "new");
  EXPECT_EQ(kv_.Get("k").value_or("?"), "new");
}

TEST_F(KvStoreTest, CompareAndSetOnAMismatchReturnsTheCurrentValue) {
  Deferred d;
  ASSERT_TRUE(kv_.Set("k", "actual", &d).ok());
  absl::StatusOr<CasResult> r = kv_.CompareAndSet("k", false, "guess", "new", &d);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->swapped);
  EXPECT_TRUE(r->found);
  EXPECT_EQ(r->current, "actual");
  EXPECT_EQ(kv_.Get("k").value_or("?"), "actual");
}

TEST_F(KvStoreTest, CompareAndSetOfAnUnsetKeyExpectingAValueDoesNotSwap) {
  Deferred d;
  absl::StatusOr<CasResult> r = kv_.CompareAndSet("k", false, "", "new", &d);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->swapped);
  EXPECT_FALSE(r->found);
  EXPECT_EQ(kv_.Get("k").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(KvStoreTest, EmptyKeyIsInvalidForEveryCall) {
  Deferred d;
  EXPECT_EQ(kv_.Set("", "v", &d).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv_.Get("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv_.Add("", 1, &d).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv_.CompareAndSet("", true, "", "v", &d).status().code(),
            absl::StatusCode::kInvalidArgument);
  KvAnswers a;
  kv_.WaitFor("", Later(1000), a.Callback(), &d);
  EXPECT_TRUE(a.got.empty()) << "callback ran inside WaitFor";
  d.Run();
  ASSERT_EQ(a.got.size(), 1u);
  EXPECT_EQ(a.got[0].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv_.waiters(), 0u);
}

TEST_F(KvStoreTest, KeysAndValuesUpToTheLimitsAreAcceptedAndLongerOnesRefused) {
  KvLimits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 16;
  KvStore kv(limits);
  Deferred d;
  EXPECT_TRUE(kv.Set(std::string(8, 'k'), std::string(16, 'v'), &d).ok());
  EXPECT_EQ(kv.Set(std::string(9, 'k'), "v", &d).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.Set("k", std::string(17, 'v'), &d).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.Get(std::string(9, 'k')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.CompareAndSet("k", true, "", std::string(17, 'v'), &d).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.Get("k").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(kv.size(), 1u);
}

TEST_F(KvStoreTest, DefaultLimitsAre1KiBKeysAnd1MiBValues) {
  Deferred d;
  EXPECT_TRUE(kv_.Set(std::string(1024, 'k'), "v", &d).ok());
  EXPECT_EQ(kv_.Set(std::string(1025, 'k'), "v", &d).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(kv_.Set("big", std::string(1 << 20, 'v'), &d).ok());
  EXPECT_EQ(kv_.Set("bigger", std::string((1 << 20) + 1, 'v'), &d).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(KvStoreTest, FullStoreIsResourceExhaustedAndOverwritesCountOnlyTheDifference) {
  KvLimits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 32;
  limits.max_total_bytes = 20;
  KvStore kv(limits);
  Deferred d;
  ASSERT_TRUE(kv.Set("a", std::string(10, 'v'), &d).ok());  // 11 bytes
  EXPECT_EQ(kv.Set("b", std::string(10, 'v'), &d).code(),   // would be 22
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(kv.Get("b").status().code(), absl::StatusCode::kNotFound);
  // Replacing a's value frees its old bytes: 1 + 19 = 20 fits exactly.
  EXPECT_TRUE(kv.Set("a", std::string(19, 'w'), &d).ok());
  EXPECT_EQ(kv.Set("a", std::string(20, 'w'), &d).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(kv.Get("a").value_or("?"), std::string(19, 'w'));
  // Shrinking it makes room again, up to the limit exactly.
  EXPECT_TRUE(kv.Set("a", "", &d).ok());
  EXPECT_TRUE(kv.Set("b", std::string(18, 'v'), &d).ok());
  EXPECT_EQ(kv.Add("c", 1, &d).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(kv.CompareAndSet("c", true, "", "1", &d).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_F(KvStoreTest, CloseAnswersWaitersWithTheGivenStatusAfterTheDeferredRuns) {
  KvAnswers a, b;
  Deferred d;
  kv_.WaitFor("k", Later(1000), a.Callback(), &d);
  kv_.WaitFor("j", Later(1000), b.Callback(), &d);
  kv_.Close(absl::FailedPreconditionError("generation 1 of job-1 ended"), &d);
  EXPECT_TRUE(a.got.empty()) << "callback ran inside Close";
  EXPECT_EQ(kv_.waiters(), 0u);
  d.Run();
  ASSERT_EQ(a.got.size(), 1u);
  ASSERT_EQ(b.got.size(), 1u);
  EXPECT_EQ(a.got[0].status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(a.got[0].status().message(), HasSubstr("generation 1 of job-1 ended"));
  EXPECT_EQ(b.got[0].status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(KvStoreTest, CallsAfterCloseFail) {
  Deferred d;
  ASSERT_TRUE(kv_.Set("k", "v", &d).ok());
  kv_.Close(absl::FailedPreconditionError("closed for the test"), &d);
  EXPECT_EQ(kv_.Set("k", "v", &d).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kv_.Get("k").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kv_.Add("n", 1, &d).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kv_.CompareAndSet("k", true, "", "v", &d).status().code(),
            absl::StatusCode::kFailedPrecondition);
  KvAnswers a;
  kv_.WaitFor("k", Later(1000), a.Callback(), &d);
  EXPECT_TRUE(a.got.empty());
  d.Run();
  ASSERT_EQ(a.got.size(), 1u);
  EXPECT_EQ(a.got[0].status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kv_.waiters(), 0u);
}

TEST_F(KvStoreTest, CallsAfterCloseWithAnotherStatusStillFail) {
  Deferred d;
  kv_.Close(absl::AbortedError("gone"), &d);
  EXPECT_FALSE(kv_.Set("k", "v", &d).ok());
  EXPECT_FALSE(kv_.Get("k").ok());
  EXPECT_FALSE(kv_.Add("n", 1, &d).ok());
  EXPECT_FALSE(kv_.CompareAndSet("k", true, "", "v", &d).ok());
}

TEST_F(KvStoreTest, CloseWithOkStillAnswersWaitersWithAnError) {
  KvAnswers a;
  Deferred d;
  kv_.WaitFor("k", Later(1000), a.Callback(), &d);
  kv_.Close(absl::OkStatus(), &d);
  d.Run();
  ASSERT_EQ(a.got.size(), 1u);
  EXPECT_FALSE(a.got[0].ok());
  EXPECT_FALSE(kv_.Set("k", "v", &d).ok());
}

}  // namespace
}  // namespace aidn::coordinator
