// Pure parts of the worker daemon and its coordinator link.
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/coordinator_link.h"
#include "worker/daemon.h"

namespace aidn::worker {
namespace {

using ::testing::HasSubstr;

DaemonOptions Valid() {
  DaemonOptions o;
  o.token = "worker-token-0123456789";
  o.worker_id = "w1";
  return o;
}

TEST(ValidateDaemonOptions, AcceptsTheDefaultsWithAnIdAndAToken) {
  EXPECT_TRUE(ValidateDaemonOptions(Valid()).ok());
}

TEST(ValidateDaemonOptions, NamesTheFieldItRefuses) {
  DaemonOptions o = Valid();
  o.worker_id = "w/1";
  EXPECT_THAT(ValidateDaemonOptions(o).message(), HasSubstr("worker_id"));
  o = Valid();
  o.token.clear();
  EXPECT_THAT(ValidateDaemonOptions(o).message(), HasSubstr("token"));
  o = Valid();
  o.trainer_binary = "aidn-worker";
  EXPECT_THAT(ValidateDaemonOptions(o).message(), HasSubstr("trainer_binary"));
  o = Valid();
  o.backoff_max = std::chrono::milliseconds(10);  // below backoff_initial
  EXPECT_EQ(ValidateDaemonOptions(o).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ExitReportRetryable, RetriesWhatTheCoordinatorMayAnswerDifferentlyLater) {
  for (grpc::StatusCode code :
       {grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::DEADLINE_EXCEEDED,
        grpc::StatusCode::RESOURCE_EXHAUSTED, grpc::StatusCode::ABORTED,
        grpc::StatusCode::CANCELLED, grpc::StatusCode::INTERNAL, grpc::StatusCode::UNKNOWN}) {
    EXPECT_TRUE(ExitReportRetryable(code)) << code;
  }
}

TEST(ExitReportRetryable, DropsWhatWillNotChange) {
  for (grpc::StatusCode code :
       {grpc::StatusCode::NOT_FOUND, grpc::StatusCode::INVALID_ARGUMENT,
        grpc::StatusCode::FAILED_PRECONDITION, grpc::StatusCode::PERMISSION_DENIED,
        grpc::StatusCode::UNAUTHENTICATED}) {
    EXPECT_FALSE(ExitReportRetryable(code)) << code;
  }
}

}  // namespace
}  // namespace aidn::worker
