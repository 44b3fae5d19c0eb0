#include "coordinator/kv_store.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace aidn::coordinator {

absl::Status KvStore::CheckKey(const std::string& key) const {
  if (!closed_.ok()) return closed_;
  if (key.empty()) return absl::InvalidArgumentError("key: must not be empty");
  if (key.size() > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("key: ", key.size(), " bytes, at most ", limits_.max_key_bytes));
  }
  return absl::OkStatus();
}

absl::Status KvStore::Put(const std::string& key, std::string value, Deferred* deferred) {
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("value: ", value.size(), " bytes, at most ", limits_.max_value_bytes));
  }
  auto it = values_.find(key);
  const size_t old_bytes = it == values_.end() ? 0 : key.size() + it->second.size();
  const size_t new_total = total_bytes_ - old_bytes + key.size() + value.size();
  if (new_total > limits_.max_total_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kv store full: ", limits_.max_total_bytes, " bytes per job generation"));
  }
  total_bytes_ = new_total;
  std::string& slot = values_[key];
  slot = std::move(value);
  for (auto w = waiters_.begin(); w != waiters_.end();) {
    if (w->key == key) {
      deferred->Add([done = std::move(w->done), v = slot]() { done(v); });
      w = waiters_.erase(w);
    } else {
      ++w;
    }
  }
  return absl::OkStatus();
}

absl::Status KvStore::Set(const std::string& key, std::string value, Deferred* deferred) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  return Put(key, std::move(value), deferred);
}

absl::StatusOr<std::string> KvStore::Get(const std::string& key) const {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  auto it = values_.find(key);
  if (it == values_.end()) return absl::NotFoundError(absl::StrCat("key not set: ", key));
  return it->second;
}

void KvStore::WaitFor(const std::string& key, Clock::TimePoint deadline, GetCallback done,
                      Deferred* deferred) {
  if (absl::Status s = CheckKey(key); !s.ok()) {
    deferred->Add([done = std::move(done), s]() { done(s); });
    return;
  }
  auto it = values_.find(key);
  if (it != values_.end()) {
    deferred->Add([done = std::move(done), v = it->second]() { done(v); });
    return;
  }
  waiters_.push_back(Waiter{key, deadline, std::move(done)});
}

absl::StatusOr<int64_t> KvStore::Add(const std::string& key, int64_t delta, Deferred* deferred) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  int64_t value = 0;
  auto it = values_.find(key);
  if (it != values_.end() && !absl::SimpleAtoi(it->second, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("key ", key, " holds a value that is not an integer counter"));
  }
  if (__builtin_add_overflow(value, delta, &value)) {
    return absl::OutOfRangeError(absl::StrCat("counter ", key, " would overflow"));
  }
  if (absl::Status s = Put(key, absl::StrCat(value), deferred); !s.ok()) return s;
  return value;
}

absl::StatusOr<CasResult> KvStore::CompareAndSet(const std::string& key, bool expect_absent,
                                                 const std::string& expected, std::string desired,
                                                 Deferred* deferred) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  auto it = values_.find(key);
  const bool matches =
      expect_absent ? it == values_.end() : (it != values_.end() && it->second == expected);
  CasResult result;
  if (matches) {
    if (absl::Status s = Put(key, std::move(desired), deferred); !s.ok()) return s;
    result.swapped = true;
    it = values_.find(key);
  }
  if (it != values_.end()) {
    result.found = true;
    result.current = it->second;
  }
  return result;
}

void KvStore::Expire(Clock::TimePoint now, Deferred* deferred) {
  for (auto w = waiters_.begin(); w != waiters_.end();) {
    if (w->deadline <= now) {
      deferred->Add([done = std::move(w->done), key = w->key]() {
        done(absl::DeadlineExceededError(absl::StrCat("key ", key, " was not set in time")));
      });
      w = waiters_.erase(w);
    } else {
      ++w;
    }
  }
}

void KvStore::Close(const absl::Status& status, Deferred* deferred) {
  closed_ = status.ok() ? absl::FailedPreconditionError("kv store closed") : status;
  for (Waiter& w : waiters_) {
    deferred->Add([done = std::move(w.done), s = closed_]() { done(s); });
  }
  waiters_.clear();
  values_.clear();
  total_bytes_ = 0;
}

}  // namespace aidn::coordinator
