#ifndef AIDN_COMMON_JOB_PATHS_H_
#define AIDN_COMMON_JOB_PATHS_H_

// The paths a job's spec names (checkpoint.dir, the dataset's directory and
// files, a command's working directory), and whether they lie under a set of
// roots. A worker allows absolute paths only under its roots (its
// --allowed-paths, work directory and checkpoint root) and takes relative
// ones under its own directories. The worker checks with links resolved
// (worker/path_policy.h); the coordinator, which sees no worker's files,
// checks the same paths lexically against the roots workers report, to
// refuse a job no worker would run and to place one only where it may run.

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "aidn/v1/job.pb.h"

namespace aidn {

struct NamedPath {
  std::string field;  // "checkpoint.dir", "dataset.files[2]", ...
  std::string path;
};

// Every absolute path `spec` names, in field order.
std::vector<NamedPath> AbsoluteJobPaths(const v1::JobSpec& spec);

// `path` normalised without touching the filesystem: "." and ".." folded,
// repeated and trailing slashes dropped.
std::string LexicallyNormal(const std::string& path);

// Whether `path` is `root` or lies under it (both absolute and normalised).
bool PathUnder(const std::string& path, const std::string& root);

// The first absolute path of `spec` that, after `normalise` (LexicallyNormal
// when null), lies under none of `roots`, with its normalised form as
// `resolved`; nothing when every one lies under some root.
struct PathOutside {
  NamedPath named;
  std::string resolved;
};
std::optional<PathOutside> FirstPathOutside(
    const v1::JobSpec& spec, const std::vector<std::string>& roots,
    const std::function<std::string(const std::string&)>& normalise = nullptr);

}  // namespace aidn

#endif  // AIDN_COMMON_JOB_PATHS_H_
