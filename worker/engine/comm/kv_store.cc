#include "worker/engine/comm/kv_store.h"

#include "absl/strings/str_cat.h"

namespace aidn::engine {

absl::Status InMemoryKeyValueStore::Set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryKeyValueStore::Get(const std::string& key,
                                                       std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool found = cv_.wait_for(lock, timeout, [&] { return values_.count(key) > 0; });
  if (!found) {
    return absl::DeadlineExceededError(
        absl::StrCat("key \"", key, "\" was not set within ", timeout.count(), " ms"));
  }
  return values_.at(key);
}

}  // namespace aidn::engine
