#ifndef AIDN_COORDINATOR_SPEC_H_
#define AIDN_COORDINATOR_SPEC_H_

// Job specs: defaults and validation, done in full before anything is
// stored. Pure functions; thread-safe.

#include <chrono>
#include <cstdint>

#include "absl/status/status.h"
#include "aidn/v1/job.pb.h"

namespace aidn::coordinator {

struct SpecLimits {
  // Largest world_size accepted (--max-world-size).
  int32_t max_world_size = 1024;
  // Default for timeouts.worker when the spec leaves it unset.
  std::chrono::milliseconds default_worker_timeout{10'000};
  // Default for timeouts.rendezvous.
  std::chrono::milliseconds default_rendezvous_timeout{300'000};
  // Default for max_restarts.
  int32_t default_max_restarts = 3;
};

// Fills every field left unset with its documented default (see job.proto),
// so the stored spec says exactly what runs. Call before ValidateJobSpec.
void ApplyJobSpecDefaults(const SpecLimits& limits, v1::JobSpec* spec);

// OK, or INVALID_ARGUMENT whose message starts with the offending field's
// path in the spec ("optimizer.lr: must be > 0, got -1").
absl::Status ValidateJobSpec(const SpecLimits& limits, const v1::JobSpec& spec);

// A path a spec may name: not empty, at most 4096 bytes, no NUL or control
// character, and no ".." component. `field` prefixes the error.
absl::Status ValidateSpecPath(const char* field, const std::string& path);

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_SPEC_H_
