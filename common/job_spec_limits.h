#ifndef AIDN_COMMON_JOB_SPEC_LIMITS_H_
#define AIDN_COMMON_JOB_SPEC_LIMITS_H_

// Size limits of a job spec (job.proto's JobSpec): the coordinator refuses a
// spec over them (coordinator/spec.cc), and aidnctl checks them before it
// sends one, so that a spec too large for a call is refused with the field
// named rather than with gRPC's "message larger than max".

#include <cstddef>

namespace aidn::job_spec_limits {

// name.
inline constexpr size_t kMaxNameBytes = 128;
// Every path (dataset.dir and files, checkpoint.dir), and what aidnctl
// allows any other string field.
inline constexpr size_t kMaxPathBytes = 4096;
// labels: how many, and each key's and value's size.
inline constexpr size_t kMaxLabels = 64;
inline constexpr size_t kMaxLabelKeyBytes = 63;
inline constexpr size_t kMaxLabelValueBytes = 256;

}  // namespace aidn::job_spec_limits

#endif  // AIDN_COMMON_JOB_SPEC_LIMITS_H_
