#include "worker/c10d/store_state.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace aidn::worker::c10d {
namespace {

Delivery Byte(ClientId client, uint8_t value) {
  Delivery delivery{client, {}};
  AppendU8(&delivery.bytes, value);
  return delivery;
}

void RemoveAll(std::vector<ClientId>& clients, ClientId client) {
  clients.erase(std::remove(clients.begin(), clients.end(), client), clients.end());
}

}  // namespace

bool StoreState::Present(const std::string& key) const {
  if (values_.count(key) > 0) return true;
  auto queue = queues_.find(key);
  return queue != queues_.end() && !queue->second.empty();
}

absl::Status StoreState::Reserve(size_t add_bytes, size_t release_bytes) const {
  const size_t after = total_bytes_ - std::min(release_bytes, total_bytes_) + add_bytes;
  if (add_bytes > release_bytes && after > max_total_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the store would hold ", after, " bytes, over its limit of ", max_total_bytes_));
  }
  return absl::OkStatus();
}

// Stores `value` under `key` (the caller has reserved the bytes), notifies
// watchers and releases waiters.
void StoreState::Store(const std::string& key, std::string value, std::vector<Delivery>* out) {
  auto it = values_.find(key);
  const bool created = it == values_.end();
  std::string old_value;
  if (created) {
    total_bytes_ += key.size() + value.size();
    it = values_.emplace(key, std::move(value)).first;
  } else {
    total_bytes_ = total_bytes_ - it->second.size() + value.size();
    old_value = std::exchange(it->second, std::move(value));
  }
  if (watchers_.count(key) > 0) {
    Notify(key, created ? kWatchKeyCreated : kWatchKeyUpdated, old_value, it->second, out);
  }
  Released(key, out);
}

void StoreState::Released(const std::string& key, std::vector<Delivery>* out) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  std::vector<ClientId> clients = std::move(it->second);
  waiters_.erase(it);
  for (ClientId client : clients) {
    auto wait = waits_.find(client);
    if (wait == waits_.end()) continue;
    if (--wait->second.missing == 0) {
      out->push_back(Byte(client, kStopWaiting));
      waits_.erase(wait);
    }
  }
}

void StoreState::ReleaseOne(const std::string& key, std::vector<Delivery>* out) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  const ClientId client = it->second.front();
  it->second.erase(it->second.begin());
  if (it->second.empty()) waiters_.erase(it);
  auto wait = waits_.find(client);
  if (wait != waits_.end() && --wait->second.missing == 0) {
    out->push_back(Byte(client, kStopWaiting));
    waits_.erase(wait);
  }
}

void StoreState::Notify(const std::string& key, uint8_t type, const std::string& old_value,
                        const std::string& new_value, std::vector<Delivery>* out) {
  auto it = watchers_.find(key);
  if (it == watchers_.end()) return;
  for (ClientId client : it->second) {
    Delivery delivery{client, {}};
    AppendU8(&delivery.bytes, type);
    AppendBytes(&delivery.bytes, key);
    AppendBytes(&delivery.bytes, old_value);
    AppendBytes(&delivery.bytes, new_value);
    out->push_back(std::move(delivery));
  }
}

void StoreState::StartWait(ClientId client, const std::vector<std::string>& keys,
                           std::vector<Delivery>* out) {
  CancelWait(client);  // a client has at most one WAIT outstanding
  Wait wait;
  for (const std::string& key : keys) {
    if (Present(key)) continue;
    waiters_[key].push_back(client);
    wait.keys.push_back(key);
    ++wait.missing;
  }
  if (wait.missing == 0) {
    out->push_back(Byte(client, kStopWaiting));
    return;
  }
  waits_.emplace(client, std::move(wait));
}

void StoreState::CancelWait(ClientId client) {
  auto wait = waits_.find(client);
  if (wait == waits_.end()) return;
  for (const std::string& key : wait->second.keys) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) continue;
    RemoveAll(it->second, client);
    if (it->second.empty()) waiters_.erase(it);
  }
  waits_.erase(wait);
}

void StoreState::ForgetClient(ClientId client) {
  CancelWait(client);
  auto watched = watched_.find(client);
  if (watched == watched_.end()) return;
  for (const std::string& key : watched->second) {
    auto it = watchers_.find(key);
    if (it == watchers_.end()) continue;
    RemoveAll(it->second, client);
    if (it->second.empty()) watchers_.erase(it);
  }
  watched_.erase(watched);
}

absl::Status StoreState::Add(ClientId client, const Request& request, std::vector<Delivery>* out) {
  const std::string& key = request.keys[0];
  int64_t sum = request.delta;
  size_t old_size = 0;
  if (auto it = values_.find(key); it != values_.end()) {
    int64_t current = 0;
    if (!absl::SimpleAtoi(it->second, &current)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ADD to key \"", key, "\" whose value is not an integer"));
    }
    if (__builtin_add_overflow(current, request.delta, &sum)) {
      return absl::InvalidArgumentError(absl::StrCat("ADD to key \"", key, "\" overflows"));
    }
    old_size = key.size() + it->second.size();
  }
  std::string value = std::to_string(sum);
  if (auto status = Reserve(key.size() + value.size(), old_size); !status.ok()) return status;
  Delivery reply{client, {}};
  AppendI64(&reply.bytes, sum);
  out->push_back(std::move(reply));
  Store(key, std::move(value), out);
  return absl::OkStatus();
}

absl::Status StoreState::CompareSet(ClientId client, const Request& request,
                                    std::vector<Delivery>* out) {
  const std::string& key = request.keys[0];
  const std::string& expected = request.values[0];
  const std::string& desired = request.values[1];
  Delivery reply{client, {}};
  auto it = values_.find(key);
  const bool swap = it == values_.end() ? expected.empty() : it->second == expected;
  if (!swap) {
    AppendBytes(&reply.bytes, it == values_.end() ? expected : it->second);
    out->push_back(std::move(reply));
    return absl::OkStatus();
  }
  const size_t old_size = it == values_.end() ? 0 : key.size() + it->second.size();
  if (auto status = Reserve(key.size() + desired.size(), old_size); !status.ok()) return status;
  AppendBytes(&reply.bytes, desired);
  out->push_back(std::move(reply));
  Store(key, desired, out);
  return absl::OkStatus();
}

absl::Status StoreState::QueueOp(ClientId client, const Request& request,
                                 std::vector<Delivery>* out) {
  const std::string& key = request.keys[0];
  Delivery reply{client, {}};
  switch (request.op) {
    case Op::kQueuePush: {
      const std::string& value = request.values[0];
      if (auto status = Reserve(key.size() + value.size(), 0); !status.ok()) return status;
      queues_[key].push_back(value);
      total_bytes_ += key.size() + value.size();
      ReleaseOne(key, out);
      return absl::OkStatus();
    }
    case Op::kQueuePop: {
      auto it = queues_.find(key);
      const int64_t size = it == queues_.end() ? 0 : static_cast<int64_t>(it->second.size());
      AppendI64(&reply.bytes, size);
      if (size > 0) {
        AppendBytes(&reply.bytes, it->second.front());
        total_bytes_ -= key.size() + it->second.front().size();
        it->second.pop_front();
        if (it->second.empty()) queues_.erase(it);
      }
      break;
    }
    default: {  // kQueueLen
      auto it = queues_.find(key);
      AppendI64(&reply.bytes, it == queues_.end() ? 0 : static_cast<int64_t>(it->second.size()));
      break;
    }
  }
  out->push_back(std::move(reply));
  return absl::OkStatus();
}

absl::Status StoreState::Apply(ClientId client, const Request& request,
                               std::vector<Delivery>* out) {
  switch (request.op) {
    case Op::kValidate:
      if (request.word != kValidationMagic) {
        return absl::InvalidArgumentError(
            absl::StrCat("VALIDATE with the wrong magic number ", request.word));
      }
      return absl::OkStatus();
    case Op::kPing: {
      Delivery reply{client, {}};
      AppendU32(&reply.bytes, request.word);
      out->push_back(std::move(reply));
      return absl::OkStatus();
    }
    case Op::kSet: {
      const std::string& key = request.keys[0];
      auto it = values_.find(key);
      const size_t old_size = it == values_.end() ? 0 : key.size() + it->second.size();
      if (auto status = Reserve(key.size() + request.values[0].size(), old_size); !status.ok()) {
        return status;
      }
      Store(key, request.values[0], out);
      return absl::OkStatus();
    }
    case Op::kAppend: {
      const std::string& key = request.keys[0];
      auto it = values_.find(key);
      if (auto status =
              Reserve(request.values[0].size() + (it == values_.end() ? key.size() : 0), 0);
          !status.ok()) {
        return status;
      }
      if (it == values_.end()) {
        values_.emplace(key, request.values[0]);
        total_bytes_ += key.size() + request.values[0].size();
      } else {
        it->second += request.values[0];
        total_bytes_ += request.values[0].size();
      }
      Released(key, out);
      return absl::OkStatus();
    }
    case Op::kMultiSet: {
      size_t bytes = 0;  // counted as all new: a conservative check
      for (size_t i = 0; i < request.keys.size(); ++i) {
        bytes += request.keys[i].size() + request.values[i].size();
      }
      if (auto status = Reserve(bytes, 0); !status.ok()) return status;
      for (size_t i = 0; i < request.keys.size(); ++i) {
        Store(request.keys[i], request.values[i], out);
      }
      return absl::OkStatus();
    }
    case Op::kCompareSet:
      return CompareSet(client, request, out);
    case Op::kAdd:
      return Add(client, request, out);
    case Op::kGet:
    case Op::kMultiGet: {
      Delivery reply{client, {}};
      for (const std::string& key : request.keys) {
        auto it = values_.find(key);
        AppendBytes(&reply.bytes, it == values_.end() ? std::string_view() : it->second);
      }
      out->push_back(std::move(reply));
      return absl::OkStatus();
    }
    case Op::kCheck: {
      const bool ready = std::all_of(request.keys.begin(), request.keys.end(),
                                     [this](const std::string& key) { return Present(key); });
      out->push_back(Byte(client, ready ? kCheckReady : kCheckNotReady));
      return absl::OkStatus();
    }
    case Op::kWait:
      StartWait(client, request.keys, out);
      return absl::OkStatus();
    case Op::kCancelWait:
      CancelWait(client);
      out->push_back(Byte(client, kWaitCanceled));
      return absl::OkStatus();
    case Op::kGetNumKeys: {
      Delivery reply{client, {}};
      AppendI64(&reply.bytes, static_cast<int64_t>(values_.size()));
      out->push_back(std::move(reply));
      return absl::OkStatus();
    }
    case Op::kDeleteKey: {
      const std::string& key = request.keys[0];
      auto it = values_.find(key);
      Delivery reply{client, {}};
      AppendI64(&reply.bytes, it == values_.end() ? 0 : 1);
      out->push_back(std::move(reply));
      if (it != values_.end()) {
        total_bytes_ -= key.size() + it->second.size();
        std::string old_value = std::move(it->second);
        values_.erase(it);
        Notify(key, kWatchKeyDeleted, old_value, std::string(), out);
      }
      return absl::OkStatus();
    }
    case Op::kWatchKey: {
      const std::string& key = request.keys[0];
      watchers_[key].push_back(client);
      watched_[client].push_back(key);
      out->push_back(Byte(client, kWatchRegistered));
      return absl::OkStatus();
    }
    case Op::kQueuePush:
    case Op::kQueuePop:
    case Op::kQueueLen:
      return QueueOp(client, request, out);
  }
  return absl::InternalError("unhandled op");
}

}  // namespace aidn::worker::c10d
