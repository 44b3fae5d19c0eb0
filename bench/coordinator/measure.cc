#include "bench/coordinator/measure.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace aidn::bench {

Summary Summarize(std::vector<float> ms) {
  Summary s;
  s.count = ms.size();
  if (ms.empty()) return s;
  std::sort(ms.begin(), ms.end());
  auto at = [&](double q) {
    return static_cast<double>(ms[std::min(ms.size() - 1, static_cast<size_t>(q * ms.size()))]);
  };
  s.p50 = at(0.50);
  s.p99 = at(0.99);
  s.max = ms.back();
  return s;
}

double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

void Latencies::Add(Clock::time_point start, double ms) {
  if (!window_->Contains(start)) return;
  std::lock_guard<std::mutex> lock(mu_);
  ms_.push_back(static_cast<float>(ms));
}

void Latencies::Fail(Clock::time_point start, grpc::StatusCode code) {
  std::lock_guard<std::mutex> lock(mu_);
  ++failures_[code];
  if (window_->Contains(start)) ++window_failures_;
}

size_t Latencies::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ms_.size();
}

Summary Latencies::Since(size_t from) const {
  std::vector<float> copy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (from < ms_.size()) copy.assign(ms_.begin() + static_cast<std::ptrdiff_t>(from), ms_.end());
  }
  return Summarize(std::move(copy));
}

int64_t Latencies::window_failures() const {
  std::lock_guard<std::mutex> lock(mu_);
  return window_failures_;
}

std::string Latencies::FailureText() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [code, n] : failures_) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", n, " x code ", static_cast<int>(code));
  }
  return out.empty() ? "none" : out;
}

google::protobuf::Duration ToProto(milliseconds ms) {
  google::protobuf::Duration d;
  d.set_seconds(ms.count() / 1000);
  d.set_nanos(static_cast<int32_t>(ms.count() % 1000) * 1'000'000);
  return d;
}

milliseconds FromProto(const google::protobuf::Duration& d) {
  return milliseconds(d.seconds() * 1000 + d.nanos() / 1'000'000);
}

}  // namespace aidn::bench
