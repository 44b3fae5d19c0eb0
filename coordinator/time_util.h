#ifndef AIDN_COORDINATOR_TIME_UTIL_H_
#define AIDN_COORDINATOR_TIME_UTIL_H_

// Conversions between the coordinator's times and their protobuf forms, and
// the way durations are written in messages ("10s", "1.5s").

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "google/protobuf/duration.pb.h"
#include "google/protobuf/timestamp.pb.h"

namespace aidn::coordinator {

inline google::protobuf::Timestamp ToProto(absl::Time t) {
  google::protobuf::Timestamp ts;
  const int64_t nanos = absl::ToUnixNanos(t);
  ts.set_seconds(nanos / 1'000'000'000);
  ts.set_nanos(static_cast<int32_t>(nanos % 1'000'000'000));
  return ts;
}

inline absl::Time FromProto(const google::protobuf::Timestamp& t) {
  return absl::FromUnixSeconds(t.seconds()) + absl::Nanoseconds(t.nanos());
}

inline std::chrono::milliseconds ToMillis(const google::protobuf::Duration& d) {
  return std::chrono::milliseconds(d.seconds() * 1000 + d.nanos() / 1'000'000);
}

inline void SetDuration(google::protobuf::Duration* d, std::chrono::milliseconds ms) {
  d->set_seconds(ms.count() / 1000);
  d->set_nanos(static_cast<int32_t>(ms.count() % 1000) * 1'000'000);
}

inline std::string FormatMillis(std::chrono::milliseconds ms) {
  if (ms.count() % 1000 == 0) return absl::StrCat(ms.count() / 1000, "s");
  return absl::StrCat(static_cast<double>(ms.count()) / 1000.0, "s");
}

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_TIME_UTIL_H_
