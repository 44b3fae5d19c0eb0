#ifndef AIDN_WORKER_C10D_WIRE_CLIENT_H_
#define AIDN_WORKER_C10D_WIRE_CLIENT_H_

// A blocking c10d TCPStore client at the byte level: requests are encoded by
// protocol.h, replies read field by field with a deadline. For tests and
// benchmarks, which must send exactly the bytes PyTorch's clients send (and
// some that they never would). One connection; not thread-safe.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "worker/c10d/protocol.h"

namespace aidn::worker::c10d {

class WireClient {
 public:
  // Connects to a numeric `host`:`port` within `timeout`.
  static absl::StatusOr<std::unique_ptr<WireClient>> Connect(const std::string& host, int port,
                                                             std::chrono::milliseconds timeout);
  ~WireClient();
  WireClient(const WireClient&) = delete;
  WireClient& operator=(const WireClient&) = delete;

  // Sends bytes as they are, all of them.
  absl::Status SendRaw(std::string_view bytes);
  absl::Status Send(Dialect dialect, const Request& request);

  // Reads exactly `n` bytes: DEADLINE_EXCEEDED if they have not all arrived
  // within `timeout`, UNAVAILABLE if the server closed the connection first.
  absl::StatusOr<std::string> ReadExactly(size_t n, std::chrono::milliseconds timeout);
  absl::StatusOr<uint8_t> ReadU8(std::chrono::milliseconds timeout);
  absl::StatusOr<uint32_t> ReadU32(std::chrono::milliseconds timeout);
  absl::StatusOr<int64_t> ReadI64(std::chrono::milliseconds timeout);
  // A u64 length and that many bytes.
  absl::StatusOr<std::string> ReadBytes(std::chrono::milliseconds timeout);
  // True if nothing at all arrives within `timeout` (the connection stays
  // open and silent).
  bool Silent(std::chrono::milliseconds timeout);
  // True if the server closes the connection within `timeout` (bytes that
  // arrive before the close are discarded).
  bool WaitClosed(std::chrono::milliseconds timeout);

 private:
  explicit WireClient(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace aidn::worker::c10d

#endif  // AIDN_WORKER_C10D_WIRE_CLIENT_H_
