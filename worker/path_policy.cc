#include "worker/path_policy.h"

#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_paths.h"

namespace aidn::worker {
namespace {

namespace fs = std::filesystem;

// `path` absolute, normalised, with the links of its existing part resolved.
std::string Resolve(const std::string& path) {
  std::error_code error;
  const fs::path resolved = fs::weakly_canonical(fs::path(path), error);
  return LexicallyNormal(error ? path : resolved.string());
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ResolveRoots(const std::vector<std::string>& roots) {
  std::vector<std::string> resolved;
  for (const std::string& root : roots) {
    if (root.empty() || root[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("allowed path \"", root, "\": must be an absolute directory"));
    }
    resolved.push_back(Resolve(root));
  }
  return resolved;
}

absl::Status CheckJobPaths(const v1::JobSpec& spec, const std::vector<std::string>& roots) {
  const std::optional<PathOutside> outside = FirstPathOutside(spec, roots, Resolve);
  if (!outside.has_value()) return absl::OkStatus();
  const NamedPath& n = outside->named;
  return absl::PermissionDeniedError(
      absl::StrCat(n.field, ": ", n.path,
                   outside->resolved == n.path ? "" : absl::StrCat(" (", outside->resolved, ")"),
                   " is outside the paths this worker allows (", absl::StrJoin(roots, ", "),
                   "); its operator can add a root with --allowed-paths"));
}

}  // namespace aidn::worker
