#ifndef AIDN_COMMON_DIGEST_H_
#define AIDN_COMMON_DIGEST_H_

// SHA-256 through OpenSSL's libcrypto, for what names a checkpoint: the
// trainer records the manifest's digest with its commit and aidnctl export
// checks it. A library of its own (aidn_digest) so that the engine, which
// some GPU machines build without OpenSSL, does not need it.

#include <string>

namespace aidn {

// Lower-case hex SHA-256 of `bytes`.
std::string Sha256Hex(const std::string& bytes);

}  // namespace aidn

#endif  // AIDN_COMMON_DIGEST_H_
