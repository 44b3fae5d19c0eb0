#include "common/status.h"

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aidn {
namespace {

using ::testing::HasSubstr;

TEST(PosixError, MapsErrnoOntoStatusCodes) {
  struct Case {
    int error_number;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {ENOENT, absl::StatusCode::kNotFound},
      {ENOTDIR, absl::StatusCode::kNotFound},
      {EEXIST, absl::StatusCode::kAlreadyExists},
      {EACCES, absl::StatusCode::kPermissionDenied},
      {EPERM, absl::StatusCode::kPermissionDenied},
      {EROFS, absl::StatusCode::kPermissionDenied},
      {EINVAL, absl::StatusCode::kInvalidArgument},
      {ENAMETOOLONG, absl::StatusCode::kInvalidArgument},
      {EISDIR, absl::StatusCode::kInvalidArgument},
      {ENOSPC, absl::StatusCode::kResourceExhausted},
      {EMFILE, absl::StatusCode::kResourceExhausted},
      {ENFILE, absl::StatusCode::kResourceExhausted},
      {ENOMEM, absl::StatusCode::kResourceExhausted},
      {ETIMEDOUT, absl::StatusCode::kDeadlineExceeded},
      {EAGAIN, absl::StatusCode::kUnavailable},
      {EINTR, absl::StatusCode::kUnavailable},
      {ECONNREFUSED, absl::StatusCode::kUnavailable},
      {ECONNRESET, absl::StatusCode::kUnavailable},
      {EPIPE, absl::StatusCode::kUnavailable},
      {EXDEV, absl::StatusCode::kUnknown},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(PosixError("ctx", c.error_number).code(), c.code)
        << "errno " << c.error_number << " (" << std::strerror(c.error_number) << ")";
  }
}

TEST(PosixError, MessageIsContextColonStrerror) {
  absl::Status status = PosixError("open /tmp/x", ENOENT);
  EXPECT_EQ(status.message(), std::string("open /tmp/x: ") + std::strerror(ENOENT));
}

TEST(PosixError, IsNeverOk) {
  // Even errno 0 (a caller's bug) must not turn a failure into success.
  EXPECT_FALSE(PosixError("x", EXDEV).ok());
  EXPECT_FALSE(PosixError("x", 0).ok());
}

TEST(Annotate, PrefixesMessageAndKeepsCode) {
  absl::Status status = Annotate(absl::NotFoundError("no such job"), "GetJob j-1");
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(status.message(), "GetJob j-1: no such job");
}

TEST(Annotate, NestsOutermostFirst) {
  absl::Status status =
      Annotate(Annotate(absl::InternalError("disk"), "write manifest"), "checkpoint 7");
  EXPECT_EQ(status.message(), "checkpoint 7: write manifest: disk");
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
}

TEST(Annotate, LeavesOkAlone) {
  absl::Status status = Annotate(absl::OkStatus(), "context");
  EXPECT_TRUE(status.ok());
  EXPECT_EQ(status.message(), "");
}

// Helpers for the macros: each records how far it got.
absl::Status ReturnIfError(absl::Status in, int* reached) {
  *reached = 1;
  AIDN_RETURN_IF_ERROR(in);
  *reached = 2;
  return absl::OkStatus();
}

TEST(ReturnIfError, ReturnsTheErrorUnchanged) {
  int reached = 0;
  absl::Status status = ReturnIfError(absl::DataLossError("bad crc"), &reached);
  EXPECT_EQ(reached, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(status.message(), "bad crc");
}

TEST(ReturnIfError, ContinuesOnOk) {
  int reached = 0;
  EXPECT_TRUE(ReturnIfError(absl::OkStatus(), &reached).ok());
  EXPECT_EQ(reached, 2);
}

TEST(ReturnIfError, EvaluatesItsArgumentOnce) {
  int calls = 0;
  auto f = [&]() -> absl::Status {
    ++calls;
    AIDN_RETURN_IF_ERROR([&] {
      ++calls;
      return absl::OkStatus();
    }());
    return absl::OkStatus();
  };
  EXPECT_TRUE(f().ok());
  EXPECT_EQ(calls, 2);
}

TEST(ReturnIfError, WorksInAnIfWithoutBraces) {
  auto f = [](bool check) -> absl::Status {
    if (check)
      AIDN_RETURN_IF_ERROR(absl::AbortedError("x"));
    else
      return absl::CancelledError("else branch");
    return absl::OkStatus();
  };
  EXPECT_EQ(f(true).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(f(false).code(), absl::StatusCode::kCancelled);
}

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x, int* reached) {
  *reached = 1;
  AIDN_ASSIGN_OR_RETURN(int half, Half(x));
  *reached = 2;
  // Two in one scope must not clash.
  AIDN_ASSIGN_OR_RETURN(int quarter, Half(half));
  *reached = 3;
  return quarter;
}

TEST(AssignOrReturn, AssignsTheValue) {
  int reached = 0;
  absl::StatusOr<int> result = Quarter(12, &reached);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(*result, 3);
  EXPECT_EQ(reached, 3);
}

TEST(AssignOrReturn, ReturnsTheErrorAtTheFirstFailure) {
  int reached = 0;
  absl::StatusOr<int> result = Quarter(7, &reached);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(result.status().message(), "odd");
  EXPECT_EQ(reached, 1);

  result = Quarter(6, &reached);  // 6 → 3, then 3 is odd
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reached, 2);
}

absl::StatusOr<std::unique_ptr<std::string>> MakeString(bool ok) {
  if (!ok) return absl::UnavailableError("no");
  return std::make_unique<std::string>("moved");
}

absl::Status TakeMoveOnly(bool ok, std::string* out) {
  std::unique_ptr<std::string> s;
  AIDN_ASSIGN_OR_RETURN(s, MakeString(ok));  // assigns an existing variable
  *out = *s;
  return absl::OkStatus();
}

TEST(AssignOrReturn, MovesMoveOnlyValuesIntoExistingVariables) {
  std::string out;
  EXPECT_TRUE(TakeMoveOnly(true, &out).ok());
  EXPECT_EQ(out, "moved");
  absl::Status status = TakeMoveOnly(false, &out);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(status.message()), HasSubstr("no"));
}

}  // namespace
}  // namespace aidn
