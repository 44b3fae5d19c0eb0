#ifndef AIDN_COMMON_STATUS_H_
#define AIDN_COMMON_STATUS_H_

// Status helpers. Bookworm's Abseil (20220623) has absl::Status and
// absl::StatusOr but no ABSL_RETURN_IF_ERROR, so aidn carries its own macros.

#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aidn {

// An error from a failed POSIX call, with the errno mapped onto a status code
// (ENOENT → NOT_FOUND, EACCES → PERMISSION_DENIED, ...) and the message
// "<context>: <strerror>".
absl::Status PosixError(absl::string_view context, int error_number);

// Prefixes a non-OK status' message with "<context>: ", keeping its code.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace aidn

#define AIDN_STATUS_CONCAT_INNER_(a, b) a##b
#define AIDN_STATUS_CONCAT_(a, b) AIDN_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define AIDN_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status aidn_status_ = (expr);        \
    if (!aidn_status_.ok()) return aidn_status_; \
  } while (false)

// `lhs` = the value of `rexpr` (an absl::StatusOr<T>), or returns its status.
#define AIDN_ASSIGN_OR_RETURN(lhs, rexpr) \
  AIDN_ASSIGN_OR_RETURN_IMPL_(AIDN_STATUS_CONCAT_(aidn_statusor_, __LINE__), lhs, rexpr)
#define AIDN_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                \
  if (!statusor.ok()) return statusor.status();           \
  lhs = std::move(statusor).value()

#endif  // AIDN_COMMON_STATUS_H_
