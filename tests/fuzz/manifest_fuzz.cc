// Checkpoint manifests (common/checkpoint_manifest.h): what decides whether
// a directory is a checkpoint. Parsed, and what parses formats back to the
// same manifest.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/checkpoint_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto manifest = aidn::ParseManifest(text);
  if (!manifest.ok()) return 0;
  auto again = aidn::ParseManifest(aidn::FormatManifest(*manifest));
  if (!again.ok() || again->step != manifest->step ||
      again->files.size() != manifest->files.size()) {
    std::abort();  // a manifest that does not survive its own format
  }
  return 0;
}
