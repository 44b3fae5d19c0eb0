#ifndef AIDN_TESTS_FUZZ_FUZZ_INPUT_H_
#define AIDN_TESTS_FUZZ_FUZZ_INPUT_H_

// The fuzz input as a file the readers open by path: an anonymous memory
// file (memfd), named /proc/self/fd/N, closed with the object.

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace aidn::fuzz {

class InputFile {
 public:
  InputFile(const uint8_t* data, size_t size) : fd_(memfd_create("aidn-fuzz", MFD_CLOEXEC)) {
    for (size_t done = 0; fd_ >= 0 && done < size;) {
      const ssize_t n = ::write(fd_, data + done, size - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
  }
  ~InputFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

}  // namespace aidn::fuzz

#endif  // AIDN_TESTS_FUZZ_FUZZ_INPUT_H_
