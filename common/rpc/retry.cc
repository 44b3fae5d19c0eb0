#include "common/rpc/retry.h"

#include <algorithm>
#include <thread>

namespace aidn::rpc {

using std::chrono::milliseconds;

bool Transient(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::CANCELLED:
      return true;
    default:
      return false;
  }
}

Backoff::Backoff(const BackoffOptions& options)
    : options_(options), current_(std::max(options.initial, milliseconds(0))) {}

milliseconds Backoff::Next() {
  const milliseconds wait = current_;
  current_ =
      std::min(std::max(current_ * 2, milliseconds(1)), std::max(options_.max, options_.initial));
  return wait;
}

void Backoff::Sleep(SteadyClock::time_point deadline) {
  milliseconds wait = Next();
  if (deadline != SteadyClock::time_point::max()) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - SteadyClock::now());
    wait = std::min(wait, std::max(left, milliseconds(0)));
  }
  if (wait.count() > 0) std::this_thread::sleep_for(wait);
}

bool Backoff::FitsBefore(SteadyClock::time_point deadline) const {
  return SteadyClock::now() + current_ <= deadline;
}

}  // namespace aidn::rpc
