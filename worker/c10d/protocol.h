#ifndef AIDN_WORKER_C10D_PROTOCOL_H_
#define AIDN_WORKER_C10D_PROTOCOL_H_

// The wire format of PyTorch's c10d TCPStore, as its clients speak it: pure
// framing and parsing, no sockets, so it can be tested and fuzzed alone.
//
// Every request is one command byte followed by its arguments; integers are
// little-endian (the client's native order on every platform aidn runs on),
// strings and byte values are a u64 length then the bytes, key lists a u64
// count then the keys. There is no request id and no error reply: a server
// that cannot serve a request closes the connection.
//
// The command numbering changed twice, so the same byte means different
// things to different PyTorch releases (checked against PyTorch's published
// sources: TCPStore.cpp of 1.13.1 and the TCPStoreBackend.hpp and
// TCPStoreLibUvBackend.cpp of recent 2.x releases):
//
//   byte  kTorch1 (<= 2.0)  kTorch21 (2.1)  kValidated (2.2 onwards)
//    0    SET               SET             VALIDATE (u32 magic 0x3C85F7CE)
//    1    COMPARE_SET       COMPARE_SET     SET
//    2    GET               GET             COMPARE_SET
//    3    ADD               ADD             GET
//    4    CHECK             CHECK           ADD
//    5    WAIT              WAIT            CHECK
//    6    GETNUMKEYS        GETNUMKEYS      WAIT
//    7    WATCH_KEY         DELETE_KEY      GETNUMKEYS
//    8    DELETE_KEY        APPEND          DELETE_KEY
//    9                      MULTI_GET       APPEND
//   10                      MULTI_SET       MULTI_GET
//   11                      CANCEL_WAIT     MULTI_SET
//   12                                      CANCEL_WAIT
//   13                                      PING (u32 nonce, echoed)
//   14..16                                  QUEUE_PUSH, QUEUE_POP, QUEUE_LEN
//
// A kValidated client's first request is VALIDATE, so a connection whose
// first five bytes are 0x00 followed by the magic speaks kValidated (to an
// older client the same bytes would be a SET whose key is about a gigabyte
// long, which no client sends). Clients without the handshake cannot be told
// apart by their bytes: the server is told which of the two to assume.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace aidn::worker::c10d {

enum class Dialect : uint8_t { kTorch1, kTorch21, kValidated };
const char* DialectName(Dialect dialect);

enum class Op : uint8_t {
  kValidate,
  kSet,
  kCompareSet,
  kGet,
  kAdd,
  kCheck,
  kWait,
  kGetNumKeys,
  kWatchKey,
  kDeleteKey,
  kAppend,
  kMultiGet,
  kMultiSet,
  kCancelWait,
  kPing,
  kQueuePush,
  kQueuePop,
  kQueueLen,
};
const char* OpName(Op op);

inline constexpr uint32_t kValidationMagic = 0x3C85F7CE;

// Reply bytes.
inline constexpr uint8_t kCheckReady = 0;
inline constexpr uint8_t kCheckNotReady = 1;
inline constexpr uint8_t kStopWaiting = 0;
inline constexpr uint8_t kWaitCanceled = 1;
// WATCH_KEY (kTorch1): the registration reply, then one update message per
// change of the key: type byte, key, old value, new value.
inline constexpr uint8_t kWatchKeyUpdated = 0;
inline constexpr uint8_t kWatchKeyCreated = 1;
inline constexpr uint8_t kWatchKeyDeleted = 2;
inline constexpr uint8_t kWatchRegistered = 3;

// One parsed request. Which fields are used depends on `op`:
//   keys     every op that names keys (one key, or the list of CHECK, WAIT,
//            MULTI_GET, MULTI_SET)
//   values   SET, APPEND, QUEUE_PUSH: {value}; COMPARE_SET: {expected,
//            desired}; MULTI_SET: one per key
//   delta    ADD
//   word     VALIDATE's magic, PING's nonce
struct Request {
  Op op = Op::kGetNumKeys;
  std::vector<std::string> keys;
  std::vector<std::string> values;
  int64_t delta = 0;
  uint32_t word = 0;
};

// Bounds checked while parsing, before anything is buffered for a field.
struct ParseLimits {
  size_t max_key_bytes = 64 * 1024;
  size_t max_value_bytes = 64 * 1024 * 1024;
  size_t max_keys_per_request = 128 * 1024;
};

// The op that `command` means in `dialect`; INVALID_ARGUMENT naming the byte
// if none.
absl::StatusOr<Op> OpForCommand(Dialect dialect, uint8_t command);
// The command byte of `op` in `dialect`; INVALID_ARGUMENT if the dialect has
// no such op.
absl::StatusOr<uint8_t> CommandForOp(Dialect dialect, Op op);

// The dialect of a connection from its first bytes: kValidated if they are
// VALIDATE with the magic, else `unvalidated`; nullopt while fewer bytes than
// needed to tell have arrived.
std::optional<Dialect> DetectDialect(std::string_view first_bytes, Dialect unvalidated);

// Parses one request from the front of `input`. Returns the number of bytes
// it took (and fills *request), 0 if `input` holds only the beginning of a
// request (nothing is consumed: call again with more bytes), or
// INVALID_ARGUMENT for an unknown command byte, RESOURCE_EXHAUSTED for a
// field over `limits` (both as soon as the offending header has arrived).
absl::StatusOr<size_t> ParseRequest(Dialect dialect, std::string_view input,
                                    const ParseLimits& limits, Request* request);

// The bytes a client sends for `request` (tests and benchmarks speak the
// protocol through this).
absl::StatusOr<std::string> EncodeRequest(Dialect dialect, const Request& request);

// Reply framing.
void AppendU8(std::string* out, uint8_t value);
void AppendU32(std::string* out, uint32_t value);
void AppendI64(std::string* out, int64_t value);
void AppendBytes(std::string* out, std::string_view bytes);  // u64 length, bytes

}  // namespace aidn::worker::c10d

#endif  // AIDN_WORKER_C10D_PROTOCOL_H_
