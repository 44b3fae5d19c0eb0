#include "coordinator/step_log.h"

#include <algorithm>

#include "coordinator/step_metrics.h"

namespace aidn::coordinator {

StepLog::StepLog(const StepLogOptions& options) : options_(options) {}

void StepLog::StartGeneration(int64_t generation, int world_size) {
  Expire(Clock::TimePoint::max(), /*everything=*/true);
  generation_ = generation;
  world_size_ = std::max(world_size, 1);
  any_combined_ = false;
  expecting_ = false;
}

void StepLog::ExpectFrom(int64_t first_train_step) {
  expecting_ = true;
  expect_train_ = first_train_step;
}

bool StepLog::Add(const v1::MetricRecord& record, Clock::TimePoint now) {
  const int rank = record.rank();
  const Key key{record.step(), static_cast<int>(record.kind())};
  if (rank < 0 || rank >= world_size_ || (any_combined_ && key <= last_combined_)) {
    ++dropped_;
    return false;
  }
  Pending& p = pending_[key];
  if (p.records.empty()) p.first_seen = now;
  // A record sent twice (a retried batch the coordinator had stored) counts
  // once.
  if (rank < 64) {
    if (p.ranks_seen & (uint64_t{1} << rank)) return true;
    p.ranks_seen |= uint64_t{1} << rank;
  } else if (std::any_of(p.records.begin(), p.records.end(),
                         [rank](const v1::MetricRecord& r) { return r.rank() == rank; })) {
    return true;
  }
  p.records.push_back(record);
  while (pending_.size() > options_.max_pending) Combine(pending_.begin());
  Drain();
  return true;
}

void StepLog::Drain() {
  while (!pending_.empty() &&
         static_cast<int>(pending_.begin()->second.records.size()) >= world_size_ &&
         (!expecting_ || pending_.begin()->first.first <= expect_train_)) {
    Combine(pending_.begin());
  }
}

void StepLog::Expire(Clock::TimePoint now, bool everything) {
  // Steps combine in order, so an old step behind a young one waits for
  // it; in practice the front is the oldest.
  while (!pending_.empty()) {
    auto front = pending_.begin();
    const bool expired = everything || (now != Clock::TimePoint::max() &&
                                        now - front->second.first_seen >= options_.max_wait);
    if (!expired) break;
    Combine(front);
    Drain();
  }
}

void StepLog::Combine(std::map<Key, Pending>::iterator it) {
  std::vector<v1::MetricRecord>& records = it->second.records;
  std::sort(
      records.begin(), records.end(),
      [](const v1::MetricRecord& a, const v1::MetricRecord& b) { return a.rank() < b.rank(); });
  v1::StepMetrics step = CombineRecords(records, world_size_);
  any_combined_ = true;
  last_combined_ = it->first;
  if (expecting_ && it->first.second == static_cast<int>(v1::MetricRecord::TRAIN)) {
    expect_train_ = std::max(expect_train_, it->first.first + 1);
  }
  pending_.erase(it);

  if (step.kind() == v1::MetricRecord::EVAL) {
    last_eval_ = step;
    has_eval_ = true;
  } else {
    last_train_ = step;
    has_train_ = true;
    ++train_steps_;
    train_samples_ += step.samples();
    recent_train_seconds_.push_back(step.step_seconds());
    if (recent_train_seconds_.size() > kRecentTrainSteps) recent_train_seconds_.pop_front();
  }
  unstored_.push_back(step);
  unstored_last_seq_ = next_seq_;
  recent_.push_back(std::move(step));
  ++next_seq_;
  while (recent_.size() > options_.recent_steps) recent_.pop_front();
}

bool StepLog::After(int64_t after_seq, int64_t from_step, size_t limit,
                    std::vector<v1::StepMetrics>* out, int64_t* last) const {
  *last = after_seq;
  if (after_seq + 1 < first_seq()) return false;
  for (int64_t seq = after_seq + 1; seq < next_seq_ && out->size() < limit; ++seq) {
    const v1::StepMetrics& step = recent_[static_cast<size_t>(seq - first_seq())];
    *last = seq;
    if (step.step() >= from_step) out->push_back(step);
  }
  return true;
}

std::optional<int64_t> StepLog::FirstStepNotTaken() const {
  std::optional<int64_t> first;
  if (!pending_.empty()) first = pending_.begin()->first.first;
  // After a new generation started, unstored steps of the old one may lie
  // above the pending ones: look at all of them.
  for (const v1::StepMetrics& s : unstored_) {
    if (!first.has_value() || s.step() < *first) first = s.step();
  }
  return first;
}

int64_t StepLog::TakeUnstored(std::vector<v1::StepMetrics>* out) {
  for (v1::StepMetrics& s : unstored_) out->push_back(std::move(s));
  unstored_.clear();
  return unstored_last_seq_;
}

}  // namespace aidn::coordinator
