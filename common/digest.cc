#include "common/digest.h"

#include <openssl/sha.h>

#include "absl/strings/str_format.h"

namespace aidn {

std::string Sha256Hex(const std::string& bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  std::string hex;
  for (unsigned char b : digest) absl::StrAppendFormat(&hex, "%02x", b);
  return hex;
}

}  // namespace aidn
