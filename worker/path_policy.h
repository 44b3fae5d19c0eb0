#ifndef AIDN_WORKER_PATH_POLICY_H_
#define AIDN_WORKER_PATH_POLICY_H_

// Which paths a job may make a worker read or write. A job names paths in
// its spec (checkpoint.dir, the dataset's files, a command's working
// directory); the worker, often running as root, reads and creates them. So
// every absolute one must lie under a root its operator allowed
// (--allowed-paths, by default /usr/share where Debian's datasets are) or
// under the worker's own directories (its work directory and checkpoint
// root); relative ones are taken under those already. Symbolic links are
// followed first, so a link inside a root that points out of it is out.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "aidn/v1/job.pb.h"

namespace aidn::worker {

// The roots made absolute, normalised and with links resolved.
// INVALID_ARGUMENT for a relative or empty one.
absl::StatusOr<std::vector<std::string>> ResolveRoots(const std::vector<std::string>& roots);

// OK when every absolute path `spec` names lies under one of `roots`
// (ResolveRoots'); otherwise PERMISSION_DENIED naming the first field that
// does not, its path and the roots ("checkpoint.dir: /etc/aidn is outside
// the paths this worker allows (...); its operator can add a root with
// --allowed-paths"). Nothing is created or opened.
absl::Status CheckJobPaths(const v1::JobSpec& spec, const std::vector<std::string>& roots);

}  // namespace aidn::worker

#endif  // AIDN_WORKER_PATH_POLICY_H_
