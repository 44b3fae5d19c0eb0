#include "worker/path_policy.h"

#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace aidn::worker {
namespace {

namespace fs = std::filesystem;

// `path` absolute, normalised, with the links of its existing part resolved.
std::string Resolve(const std::string& path) {
  std::error_code error;
  fs::path resolved = fs::weakly_canonical(fs::path(path), error);
  if (error) resolved = fs::path(path).lexically_normal();
  std::string text = resolved.string();
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  return text;
}

bool Under(const std::string& path, const std::string& root) {
  if (root == "/") return true;
  return path == root || (path.size() > root.size() && path.compare(0, root.size(), root) == 0 &&
                          path[root.size()] == '/');
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
  std::vector<std::pair<std::string, std::string>> named;
  named.emplace_back("checkpoint.dir", spec.checkpoint().dir());
  const v1::DatasetSpec& d = spec.dataset();
  named.emplace_back("dataset.dir", d.dir());
  named.emplace_back("dataset.train_images", d.train_images());
  named.emplace_back("dataset.train_labels", d.train_labels());
  named.emplace_back("dataset.test_images", d.test_images());
  named.emplace_back("dataset.test_labels", d.test_labels());
  for (int i = 0; i < d.files_size(); ++i) {
    named.emplace_back(absl::StrCat("dataset.files[", i, "]"), d.files(i));
  }
  named.emplace_back("command.working_dir", spec.command().working_dir());
  for (const auto& [field, path] : named) {
    // Relative paths are taken under the worker's own directories.
    if (path.empty() || path[0] != '/') continue;
    const std::string resolved = Resolve(path);
    bool inside = false;
    for (const std::string& root : roots) inside = inside || Under(resolved, root);
    if (inside) continue;
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": ", path, resolved == path ? "" : absl::StrCat(" (", resolved, ")"),
                     " is outside the paths this worker allows (", absl::StrJoin(roots, ", "),
                     "); its operator can add a root with --allowed-paths"));
  }
  return absl::OkStatus();
}

}  // namespace aidn::worker
