#include "common/status.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace aidn {
namespace {

absl::StatusCode CodeForErrno(int error_number) {
  switch (error_number) {
    case ENOENT:
    case ENOTDIR:
      return absl::StatusCode::kNotFound;
    case EEXIST:
      return absl::StatusCode::kAlreadyExists;
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::StatusCode::kPermissionDenied;
    case EINVAL:
    case ENAMETOOLONG:
    case EISDIR:
      return absl::StatusCode::kInvalidArgument;
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      return absl::StatusCode::kResourceExhausted;
    case ETIMEDOUT:
      return absl::StatusCode::kDeadlineExceeded;
    case EAGAIN:
    case EINTR:
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kUnknown;
  }
}

}  // namespace

absl::Status PosixError(absl::string_view context, int error_number) {
  return absl::Status(CodeForErrno(error_number),
                      absl::StrCat(context, ": ", std::strerror(error_number)));
}

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace aidn
