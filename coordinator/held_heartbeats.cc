#include "coordinator/held_heartbeats.h"

#include <utility>

namespace aidn::coordinator {

void HeldHeartbeats::Hold(const std::string& worker_id, Clock::TimePoint deadline, Callback done) {
  held_[worker_id].push_back(Held{deadline, std::move(done)});
  deadlines_.emplace(deadline, worker_id);
}

bool HeldHeartbeats::AnyDue(Clock::TimePoint now) const {
  return !deadlines_.empty() && deadlines_.begin()->first <= now;
}

std::optional<Clock::TimePoint> HeldHeartbeats::NextDeadline() const {
  if (deadlines_.empty()) return std::nullopt;
  return deadlines_.begin()->first;
}

void HeldHeartbeats::AnswerDue(Clock::TimePoint now, const Builder& build, Deferred* deferred) {
  while (AnyDue(now)) {
    const std::string worker_id = std::move(deadlines_.begin()->second);
    deadlines_.erase(deadlines_.begin());
    auto w = held_.find(worker_id);
    if (w == held_.end()) continue;
    std::vector<Held>& held = w->second;
    for (auto it = held.begin(); it != held.end();) {
      if (it->deadline <= now) {
        v1::HeartbeatResponse response = build(worker_id);
        deferred->Add(
            [done = std::move(it->done), response = std::move(response)]() { done(response); });
        it = held.erase(it);
      } else {
        ++it;
      }
    }
    if (held.empty()) held_.erase(w);
  }
}

void HeldHeartbeats::AnswerWorker(const std::string& worker_id, const Builder& build,
                                  Deferred* deferred) {
  auto it = held_.find(worker_id);
  if (it == held_.end()) return;
  std::vector<Held> held = std::move(it->second);
  held_.erase(it);
  for (Held& h : held) {
    v1::HeartbeatResponse response = build(worker_id);
    deferred->Add([done = std::move(h.done), response = std::move(response)]() { done(response); });
  }
}

void HeldHeartbeats::FailWorker(const std::string& worker_id, const absl::Status& status,
                                Deferred* deferred) {
  auto it = held_.find(worker_id);
  if (it == held_.end()) return;
  for (Held& h : it->second) {
    deferred->Add([done = std::move(h.done), status]() { done(status); });
  }
  held_.erase(it);
}

void HeldHeartbeats::FailAll(const absl::Status& status, Deferred* deferred) {
  for (auto& [id, held] : held_) {
    for (Held& h : held) deferred->Add([done = std::move(h.done), status]() { done(status); });
  }
  held_.clear();
}

size_t HeldHeartbeats::held(const std::string& worker_id) const {
  auto it = held_.find(worker_id);
  return it == held_.end() ? 0 : it->second.size();
}

}  // namespace aidn::coordinator
