#ifndef AIDN_COORDINATOR_SPEC_CHECKS_H_
#define AIDN_COORDINATOR_SPEC_CHECKS_H_

// The checks job-spec validation is made of (spec.cc, command_spec.cc,
// gpt_spec.cc): each answers INVALID_ARGUMENT whose message starts with the
// field's path in the spec.

#include <cmath>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace aidn::coordinator {

inline absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// Quoted and escaped, so a control character in user input cannot garble
// the message or a log line.
inline std::string Quote(absl::string_view s) {
  return absl::StrCat("\"", absl::CHexEscape(s), "\"");
}

inline absl::Status CheckIntRange(absl::string_view field, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    return Invalid(field, absl::StrCat("must be between ", lo, " and ", hi, ", got ", v));
  }
  return absl::OkStatus();
}

// [lo, hi) or [lo, hi] for a finite double; NaN fails every comparison and so
// every range.
inline absl::Status CheckRealRange(absl::string_view field, double v, double lo, double hi,
                                   bool hi_inclusive) {
  bool ok = std::isfinite(v) && v >= lo && (hi_inclusive ? v <= hi : v < hi);
  if (!ok) {
    return Invalid(field, absl::StrCat("must be a finite number in [", lo, ", ", hi,
                                       hi_inclusive ? "]" : ")", ", got ", v));
  }
  return absl::OkStatus();
}

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_SPEC_CHECKS_H_
