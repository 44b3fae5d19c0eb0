// The C++ side of the Python client's manifest tests: the trainer's own
// manifest code (common/checkpoint_manifest.h) on a directory the test names.
//
//   checkpoint_manifest_tool verify DIR        "ok step N", or the error (exit 1)
//   checkpoint_manifest_tool write DIR STEP    MANIFEST over DIR's files (sorted)
//   checkpoint_manifest_tool sha256 FILE       hex SHA-256 of the file's bytes

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "common/checkpoint_manifest.h"
#include "common/crc32c.h"
#include "common/digest.h"

namespace {

int Verify(const std::string& dir) {
  absl::StatusOr<aidn::Manifest> manifest = aidn::VerifyCheckpointDir(dir);
  if (!manifest.ok()) {
    std::cout << manifest.status().message() << "\n";
    return 1;
  }
  std::cout << "ok step " << manifest->step << "\n";
  return 0;
}

int Write(const std::string& dir, int64_t step) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.is_regular_file() && entry.path().filename() != aidn::kManifestName) {
      names.push_back(entry.path().filename().string());
    }
  }
  std::sort(names.begin(), names.end());
  aidn::Manifest manifest;
  manifest.step = step;
  for (const std::string& name : names) {
    absl::StatusOr<aidn::FileChecksum> sum = aidn::ChecksumFile(dir + "/" + name);
    if (!sum.ok()) {
      std::cerr << sum.status().message() << "\n";
      return 1;
    }
    manifest.files.push_back({name, sum->bytes, sum->crc32c});
  }
  std::ofstream(dir + "/" + aidn::kManifestName, std::ios::binary)
      << aidn::FormatManifest(manifest);
  return 0;
}

int Sha256(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  std::cout << aidn::Sha256Hex(bytes.str()) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 2 && args[0] == "verify") return Verify(args[1]);
  if (args.size() == 3 && args[0] == "write") return Write(args[1], std::stoll(args[2]));
  if (args.size() == 2 && args[0] == "sha256") return Sha256(args[1]);
  std::cerr << "usage: checkpoint_manifest_tool verify DIR | write DIR STEP | sha256 FILE\n";
  return 2;
}
