#ifndef AIDN_COMMON_FILE_H_
#define AIDN_COMMON_FILE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aidn {

// The whole file; the errno's code (NOT_FOUND, ...) naming `path` when it
// cannot be read.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// Writes `contents` to `path` through `path`.tmp and a rename, so a reader
// sees the old file or the whole new one, never a part.
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents);

// A file descriptor closed when it goes out of scope (-1: none).
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd();
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }
  // Closes now and returns close(2)'s result: a deferred write error can
  // surface only here.
  int Close();

 private:
  int fd_;
};

}  // namespace aidn

#endif  // AIDN_COMMON_FILE_H_
