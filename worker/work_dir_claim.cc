#include "worker/work_dir_claim.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace aidn::worker {
namespace {

bool ValidInstance(const std::string& s) {
  if (s.size() != 32) return false;
  for (const char c : s) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

std::string NewInstance() {
  std::random_device device;  // the kernel's random source
  std::string hex;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&hex, absl::Hex(device(), absl::kZeroPad8));
  return hex;
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkDirClaim>> WorkDirClaim::Take(const std::string& work_dir) {
  const std::string lock_path = absl::StrCat(work_dir, "/worker.lock");
  const int fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return PosixError(lock_path, errno);
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    std::string holder;
    char buffer[32] = {};
    if (pread(fd, buffer, sizeof(buffer) - 1, 0) > 0)
      holder = std::string(absl::StripAsciiWhitespace(buffer));
    close(fd);
    if (error == EWOULDBLOCK) {
      return absl::FailedPreconditionError(
          absl::StrCat("work_dir ", work_dir, " is in use by another aidn-worker",
                       holder.empty() ? "" : absl::StrCat(" (pid ", holder, ")"),
                       "; give each worker a directory of its own (--work-dir)"));
    }
    return PosixError(lock_path, error);
  }
  // The holder's pid, for the message above.
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    const int error = errno;
    close(fd);
    return PosixError(lock_path, error);
  }
  const std::string path = absl::StrCat(work_dir, "/worker.instance");
  std::string instance;
  {
    std::ifstream in(path);
    std::getline(in, instance);
  }
  if (!ValidInstance(instance)) {
    instance = NewInstance();
    const std::string tmp = absl::StrCat(path, ".tmp");
    std::ofstream out(tmp, std::ios::trunc);
    out << instance << "\n";
    out.close();
    if (!out || std::rename(tmp.c_str(), path.c_str()) != 0) {
      const int error = errno;
      close(fd);
      return PosixError(path, error != 0 ? error : EIO);
    }
  }
  return std::unique_ptr<WorkDirClaim>(new WorkDirClaim(fd, std::move(instance)));
}

WorkDirClaim::~WorkDirClaim() { close(fd_); }

}  // namespace aidn::worker
