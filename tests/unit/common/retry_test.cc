#include "common/rpc/retry.h"

#include <chrono>

#include "gtest/gtest.h"

namespace aidn::rpc {
namespace {

using std::chrono::milliseconds;

TEST(Transient, CoordinatorAwayOrBusyIsWorthAnotherCall) {
  for (grpc::StatusCode code : {grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::DEADLINE_EXCEEDED,
                                grpc::StatusCode::RESOURCE_EXHAUSTED, grpc::StatusCode::ABORTED,
                                grpc::StatusCode::CANCELLED}) {
    EXPECT_TRUE(Transient(code)) << code;
    EXPECT_TRUE(Transient(grpc::Status(code, "x"))) << code;
  }
}

TEST(Transient, AnswersThatWillNotChangeAreFinal) {
  for (grpc::StatusCode code :
       {grpc::StatusCode::OK, grpc::StatusCode::INVALID_ARGUMENT, grpc::StatusCode::NOT_FOUND,
        grpc::StatusCode::FAILED_PRECONDITION, grpc::StatusCode::PERMISSION_DENIED,
        grpc::StatusCode::UNIMPLEMENTED}) {
    EXPECT_FALSE(Transient(code)) << code;
  }
}

TEST(Backoff, DoublesUpToTheMaximumAndResets) {
  Backoff backoff({.initial = milliseconds(100), .max = milliseconds(350)});
  EXPECT_EQ(backoff.Next(), milliseconds(100));
  EXPECT_EQ(backoff.Next(), milliseconds(200));
  EXPECT_EQ(backoff.Next(), milliseconds(350));
  EXPECT_EQ(backoff.Next(), milliseconds(350));
  backoff.Reset();
  EXPECT_EQ(backoff.Next(), milliseconds(100));
}

TEST(Backoff, SleepNeverRunsPastTheDeadline) {
  Backoff backoff({.initial = milliseconds(60'000), .max = milliseconds(60'000)});
  const auto start = Backoff::SteadyClock::now();
  EXPECT_FALSE(backoff.FitsBefore(start + milliseconds(10)));
  backoff.Sleep(start + milliseconds(10));
  EXPECT_LT(Backoff::SteadyClock::now() - start, milliseconds(30'000));
}

}  // namespace
}  // namespace aidn::rpc
