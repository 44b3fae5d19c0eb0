#ifndef AIDN_COMMON_RPC_RETRY_H_
#define AIDN_COMMON_RPC_RETRY_H_

// One retry vocabulary for every client of the coordinator (worker daemon,
// trainer, aidnctl): which failures are worth another call, and how long to
// wait before it.
//
// A failure is transient when the coordinator is away, restarting or busy,
// or the connection died under the call: calling again later may succeed.
// Anything else (unknown job, bad request, fenced generation) will not
// improve by asking again.

#include <chrono>

#include "grpcpp/support/status.h"

namespace aidn::rpc {

// UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, CANCELLED.
bool Transient(grpc::StatusCode code);
inline bool Transient(const grpc::Status& status) { return Transient(status.error_code()); }

struct BackoffOptions {
  // The first wait.
  std::chrono::milliseconds initial{100};
  // Waits double up to this.
  std::chrono::milliseconds max{2000};
};

// Exponential backoff: 100, 200, 400 ... ms up to `max`. Not thread-safe
// (one per retry loop).
class Backoff {
 public:
  using SteadyClock = std::chrono::steady_clock;

  explicit Backoff(const BackoffOptions& options = {});

  // The wait before the next attempt; the one after is twice as long (up to
  // max).
  std::chrono::milliseconds Next();
  // Sleeps for Next(), but never past `deadline`.
  void Sleep(SteadyClock::time_point deadline = SteadyClock::time_point::max());
  // Whether a Next() wait from now still ends before `deadline`.
  bool FitsBefore(SteadyClock::time_point deadline) const;
  // After a success: the next failure waits `initial` again.
  void Reset() { current_ = options_.initial; }
  std::chrono::milliseconds current() const { return current_; }

 private:
  BackoffOptions options_;
  std::chrono::milliseconds current_;
};

}  // namespace aidn::rpc

#endif  // AIDN_COMMON_RPC_RETRY_H_
