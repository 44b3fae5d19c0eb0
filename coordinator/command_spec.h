#ifndef AIDN_COORDINATOR_COMMAND_SPEC_H_
#define AIDN_COORDINATOR_COMMAND_SPEC_H_

// Command jobs (JobSpec.command, a user's own program as the rank process):
// their defaults and validation. Pure functions; ValidateJobSpec
// (coordinator/spec.h) calls them for a spec with a command.

#include "absl/status/status.h"
#include "aidn/v1/job.pb.h"

namespace aidn::coordinator {

// Limits of JobSpec.command.
inline constexpr int kMaxCommandArgs = 1024;
inline constexpr int kMaxCommandEnv = 256;
inline constexpr size_t kMaxCommandStringBytes = 4096;
// argv and env together.
inline constexpr size_t kMaxCommandTotalBytes = 256 * 1024;

// The defaults of a command job: command.store AGENT; the built-in trainer's
// fields (model, dataset, optimizer, ...) stay unset, since nothing uses them.
void ApplyCommandDefaults(v1::JobSpec* spec);

// OK, or INVALID_ARGUMENT naming the field: an empty argv or argv[0], a
// string over its size or with a NUL byte, a ".." component in argv[0] or
// working_dir, an env name that is not [A-Za-z_][A-Za-z0-9_]* or is one aidn
// sets itself (RANK, MASTER_PORT, TORCHELASTIC_*, AIDN_*, ...), or a
// built-in trainer field (model, dataset, optimizer, ...) that is set.
absl::Status ValidateCommandSpec(const v1::JobSpec& spec);

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_COMMAND_SPEC_H_
