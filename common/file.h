#ifndef AIDN_COMMON_FILE_H_
#define AIDN_COMMON_FILE_H_

#include <string>

#include "absl/status/status.h"

namespace aidn {

// Writes `contents` to `path` through `path`.tmp and a rename, so a reader
// sees the old file or the whole new one, never a part.
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents);

}  // namespace aidn

#endif  // AIDN_COMMON_FILE_H_
