// The rendezvous stores of one process (InMemoryKeyValueStore) and of one
// host (FileKeyValueStore): bytes round-trip, a get waits for the set, a
// missing key times out naming it.

#include "worker/engine/comm/kv_store.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;

class KeyValueStoreTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "memory") {
      store_ = std::make_unique<InMemoryKeyValueStore>();
    } else {
      dir_ = absl::StrCat(::testing::TempDir(), "/kv-", getpid());
      std::filesystem::remove_all(dir_);
      std::filesystem::create_directories(dir_);
      store_ = std::make_unique<FileKeyValueStore>(dir_);
    }
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  std::string dir_;
  std::unique_ptr<KeyValueStore> store_;
};

TEST_P(KeyValueStoreTest, KeepsBytesAndDistinguishesKeys) {
  const std::string bytes("a\0/\xff z", 6);
  ASSERT_TRUE(store_->Set("gloo/0", bytes).ok());
  ASSERT_TRUE(store_->Set("gloo%2f0", "other").ok());
  EXPECT_EQ(store_->Get("gloo/0", std::chrono::milliseconds(0)).value_or(""), bytes);
  EXPECT_EQ(store_->Get("gloo%2f0", std::chrono::milliseconds(0)).value_or(""), "other");
  ASSERT_TRUE(store_->Set("gloo/0", "again").ok());
  EXPECT_EQ(store_->Get("gloo/0", std::chrono::milliseconds(0)).value_or(""), "again");
}

TEST_P(KeyValueStoreTest, AGetWaitsForTheSet) {
  absl::StatusOr<std::string> got;
  std::thread getter([&] { got = store_->Get("later", std::chrono::seconds(30)); });
  ASSERT_TRUE(store_->Set("later", "ok").ok());
  getter.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "ok");
}

TEST_P(KeyValueStoreTest, AMissingKeyTimesOutNamingIt) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::string> got = store_->Get("never", std::chrono::milliseconds(100));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  EXPECT_THAT(got.status().message(), HasSubstr("\"never\""));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
}

INSTANTIATE_TEST_SUITE_P(Stores, KeyValueStoreTest, ::testing::Values("memory", "file"));

}  // namespace
}  // namespace aidn::engine
