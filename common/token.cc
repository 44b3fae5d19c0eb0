#include "common/token.h"

#include <sys/random.h>

#include <cerrno>

#include "common/status.h"

namespace aidn {

absl::StatusOr<std::string> RandomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t filled = 0;
  while (filled < bytes) {
    ssize_t n = ::getrandom(raw.data() + filled, bytes - filled, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("getrandom", errno);
    }
    filled += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes * 2);
  for (unsigned char c : raw) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 0xf]);
  }
  return out;
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return diff == 0;
}

}  // namespace aidn
