#ifndef AIDN_COMMON_TOKEN_H_
#define AIDN_COMMON_TOKEN_H_

// Secrets: bearer tokens and their comparison.

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace aidn {

// `bytes` bytes from the kernel's CSPRNG (getrandom), as lowercase hex.
absl::StatusOr<std::string> RandomHex(size_t bytes);

// Compares in time that depends only on the lengths, not on where the
// strings first differ.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

}  // namespace aidn

#endif  // AIDN_COMMON_TOKEN_H_
