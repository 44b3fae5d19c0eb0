#include "common/job_paths.h"

#include <filesystem>

#include "absl/strings/str_cat.h"

namespace aidn {

std::vector<NamedPath> AbsoluteJobPaths(const v1::JobSpec& spec) {
  std::vector<NamedPath> named;
  named.push_back({"checkpoint.dir", spec.checkpoint().dir()});
  const v1::DatasetSpec& d = spec.dataset();
  named.push_back({"dataset.dir", d.dir()});
  named.push_back({"dataset.train_images", d.train_images()});
  named.push_back({"dataset.train_labels", d.train_labels()});
  named.push_back({"dataset.test_images", d.test_images()});
  named.push_back({"dataset.test_labels", d.test_labels()});
  for (int i = 0; i < d.files_size(); ++i) {
    named.push_back({absl::StrCat("dataset.files[", i, "]"), d.files(i)});
  }
  named.push_back({"command.working_dir", spec.command().working_dir()});
  std::erase_if(named, [](const NamedPath& n) { return n.path.empty() || n.path[0] != '/'; });
  return named;
}

std::string LexicallyNormal(const std::string& path) {
  std::string text = std::filesystem::path(path).lexically_normal().string();
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  return text;
}

bool PathUnder(const std::string& path, const std::string& root) {
  if (root == "/") return true;
  return path == root || (path.size() > root.size() && path.compare(0, root.size(), root) == 0 &&
                          path[root.size()] == '/');
}

std::optional<PathOutside> FirstPathOutside(
    const v1::JobSpec& spec, const std::vector<std::string>& roots,
    const std::function<std::string(const std::string&)>& normalise) {
  for (NamedPath& named : AbsoluteJobPaths(spec)) {
    std::string resolved = normalise ? normalise(named.path) : LexicallyNormal(named.path);
    bool inside = false;
    for (const std::string& root : roots) inside = inside || PathUnder(resolved, root);
    if (!inside) return PathOutside{std::move(named), std::move(resolved)};
  }
  return std::nullopt;
}

}  // namespace aidn
