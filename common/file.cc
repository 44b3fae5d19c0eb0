#include "common/file.h"

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

}  // namespace aidn
