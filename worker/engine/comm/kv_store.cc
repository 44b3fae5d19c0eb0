#include "worker/engine/comm/kv_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <fstream>
#include <iterator>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace aidn::engine {
namespace {

absl::Status NotSetWithin(const std::string& key, std::chrono::milliseconds timeout) {
  return absl::DeadlineExceededError(
      absl::StrCat("key \"", key, "\" was not set within ", timeout.count(), " ms"));
}

}  // namespace

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
  if (!found) return NotSetWithin(key, timeout);
  return values_.at(key);
}

std::string FileKeyValueStore::PathOf(const std::string& key) const {
  // Letters and digits as they are, every other byte as %XX: distinct keys
  // get distinct names, and none holds a '/'.
  std::string name;
  for (const char c : key) {
    if (absl::ascii_isalnum(static_cast<unsigned char>(c))) {
      name.push_back(c);
    } else {
      absl::StrAppend(&name, "%", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
    }
  }
  return absl::StrCat(directory_, "/", name);
}

absl::Status FileKeyValueStore::Set(const std::string& key, const std::string& value) {
  static std::atomic<uint64_t> counter{0};
  const std::string path = PathOf(key);
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid(), ".", counter.fetch_add(1));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(value.data(), static_cast<std::streamsize>(value.size()));
    out.close();
    if (!out) return absl::UnavailableError(absl::StrCat("store: writing ", tmp, " failed"));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return PosixError(absl::StrCat("store: rename to ", path), err);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FileKeyValueStore::Get(const std::string& key,
                                                   std::chrono::milliseconds timeout) {
  const std::string path = PathOf(key);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::chrono::microseconds pause{100};
  while (true) {
    std::ifstream in(path, std::ios::binary);
    if (in) return std::string(std::istreambuf_iterator<char>(in), {});
    if (std::chrono::steady_clock::now() >= deadline) return NotSetWithin(key, timeout);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

}  // namespace aidn::engine
