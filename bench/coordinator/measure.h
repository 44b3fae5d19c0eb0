#ifndef AIDN_BENCH_COORDINATOR_MEASURE_H_
#define AIDN_BENCH_COORDINATOR_MEASURE_H_

// What coordinator_load measures with: the measurement window, client-side
// latencies by kind of call, and their percentiles.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "google/protobuf/duration.pb.h"
#include "grpcpp/support/status.h"

namespace aidn::bench {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

// The measurement window, as steady-clock nanoseconds; calls that start in
// it are counted. Thread-safe.
class Window {
 public:
  void Open() { start_ns_ = Now(); }
  void Close() { end_ns_ = Now(); }
  bool Contains(Clock::time_point t) const {
    const int64_t ns = t.time_since_epoch().count();
    return ns >= start_ns_.load() && ns < end_ns_.load();
  }

 private:
  static int64_t Now() { return Clock::now().time_since_epoch().count(); }
  std::atomic<int64_t> start_ns_{INT64_MAX};
  std::atomic<int64_t> end_ns_{INT64_MAX};
};

struct Summary {
  size_t count = 0;
  double p50 = 0, p99 = 0, max = 0;
};

Summary Summarize(std::vector<float> ms);

double MsSince(Clock::time_point start);

// Client-side latencies of one kind of call, in milliseconds, and its
// failures by status code. Thread-safe.
class Latencies {
 public:
  explicit Latencies(const Window* window) : window_(window) {}

  // A call started at `start` answered after `ms` (counted if it started in
  // the window).
  void Add(Clock::time_point start, double ms);
  // ... answered now.
  void Add(Clock::time_point start) { Add(start, MsSince(start)); }
  void Fail(Clock::time_point start, grpc::StatusCode code);
  size_t size() const;
  // The samples from index `from` on.
  Summary Since(size_t from) const;
  int64_t window_failures() const;
  // Failures of the whole run by code: "3 x code 14, 1 x code 4", or "none".
  std::string FailureText() const;

 private:
  const Window* const window_;
  mutable std::mutex mu_;
  std::vector<float> ms_;
  std::map<grpc::StatusCode, int64_t> failures_;
  int64_t window_failures_ = 0;
};

google::protobuf::Duration ToProto(milliseconds ms);
milliseconds FromProto(const google::protobuf::Duration& d);

}  // namespace aidn::bench

#endif  // AIDN_BENCH_COORDINATOR_MEASURE_H_
