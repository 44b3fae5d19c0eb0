#include "common/file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace aidn {

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return PosixError(absl::StrCat("write ", tmp), errno);
    out << contents;
    if (!out.flush()) return PosixError(absl::StrCat("write ", tmp), errno);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    std::remove(tmp.c_str());
    return PosixError(absl::StrCat("rename ", tmp, " to ", path), error);
  }
  return absl::OkStatus();
}

ScopedFd::~ScopedFd() {
  if (fd_ >= 0) ::close(fd_);
}

int ScopedFd::Close() {
  const int rc = ::close(fd_);
  fd_ = -1;
  return rc;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return PosixError(path, errno);
  std::string contents;
  char buffer[1 << 14];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      return PosixError(path, error);
    }
    contents.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return contents;
}

}  // namespace aidn
