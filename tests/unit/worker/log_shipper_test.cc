#include "worker/log_shipper.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::worker {
namespace {

using std::chrono::milliseconds;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::string> Split(LineSplitter* splitter, const std::vector<std::string>& feeds) {
  std::vector<std::string> lines;
  for (const std::string& f : feeds) splitter->Feed(f, &lines);
  return lines;
}

TEST(LineSplitter, SplitsLinesAcrossFeedsAndKeepsThePartialOne) {
  LineSplitter splitter(100);
  EXPECT_THAT(Split(&splitter, {"one\ntw", "o\n\nthr"}), ElementsAre("one", "two", ""));
  std::vector<std::string> rest;
  splitter.Finish(&rest);
  EXPECT_THAT(rest, ElementsAre("thr"));
  splitter.Finish(&rest);
  EXPECT_EQ(rest.size(), 1u);  // nothing partial the second time
}

TEST(LineSplitter, KeepsOnlyTheLastRewriteOfAProgressBar) {
  LineSplitter splitter(100);
  EXPECT_THAT(Split(&splitter, {"start\n\r  0%|", "   |\r 50%|##  |\r", "100%|####|\ndone\r\n"}),
              ElementsAre("start", "100%|####|", "done"));
  // A '\r' at the end of one read and "\n" at the start of the next.
  EXPECT_THAT(Split(&splitter, {"dos line\r", "\nx\r\r\n"}), ElementsAre("dos line", "x"));
  // Output that ends on a rewrite keeps the last one.
  std::vector<std::string> rest = Split(&splitter, {"\r 10%\r 20%"});
  splitter.Finish(&rest);
  EXPECT_THAT(rest, ElementsAre(" 20%"));
}

TEST(LineSplitter, CutsAHugeLineAndMarksIt) {
  LineSplitter splitter(16);
  const std::string huge(100'000, 'x');
  std::vector<std::string> lines =
      Split(&splitter, {"short\n", huge.substr(0, 10), huge, "\nnext\n"});
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "short");
  EXPECT_EQ(lines[1], std::string(16, 'x') + LineSplitter::CutMarker(16));
  EXPECT_THAT(lines[1], HasSubstr("line cut at 16 bytes"));
  EXPECT_EQ(lines[2], "next");
  // Rewrites do not add up past the bound: each starts afresh.
  std::vector<std::string> bar;
  for (int i = 0; i < 100; ++i) splitter.Feed(absl::StrCat("\r", i, "% of 100"), &bar);
  splitter.Feed("\n", &bar);
  EXPECT_THAT(bar, ElementsAre("99% of 100"));
}

// Records every request; fails the next `failures` calls with UNAVAILABLE.
class FakeSink : public LogSink {
 public:
  absl::Status Ship(const v1::ShipLogsRequest& request) override {
    absl::MutexLock lock(&mu_);
    requests_.push_back(request);
    if (failures_ > 0) {
      --failures_;
      return absl::UnavailableError("coordinator restarting");
    }
    for (const v1::LogChunk& c : request.chunks()) {
      for (const v1::LogLine& l : c.lines()) {
        // What a coordinator keeps: each (rank, seq) once.
        auto& lines = stored_[c.rank()];
        if (l.seq() >= static_cast<int64_t>(lines.size())) {
          EXPECT_EQ(l.seq(), static_cast<int64_t>(lines.size())) << "a gap in rank " << c.rank();
          lines.push_back(l.text());
        }
      }
      if (c.complete()) complete_.push_back(c.rank());
    }
    return absl::OkStatus();
  }
  void FailNext(int n) {
    absl::MutexLock lock(&mu_);
    failures_ = n;
  }
  std::vector<std::string> Stored(int rank) {
    absl::MutexLock lock(&mu_);
    return stored_[rank];
  }
  std::vector<int> Complete() {
    absl::MutexLock lock(&mu_);
    return complete_;
  }
  std::vector<v1::ShipLogsRequest> Requests() {
    absl::MutexLock lock(&mu_);
    return requests_;
  }

 private:
  absl::Mutex mu_;
  int failures_ = 0;
  std::vector<v1::ShipLogsRequest> requests_;
  std::map<int, std::vector<std::string>> stored_;
  std::vector<int> complete_;
};

class LogShipperTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("aidn-log-shipper-test-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<LogShipper> MakeShipper(LogShipperOptions options = {}) {
    auto sink = std::make_unique<FakeSink>();
    sink_ = sink.get();
    options.worker_id = "w1";
    return std::make_unique<LogShipper>(options, std::move(sink));
  }
  std::string Path(int rank) { return (dir_ / absl::StrCat("rank-", rank, ".log")).string(); }
  void Write(int rank, const std::string& text) {
    std::ofstream out(Path(rank), std::ios::app | std::ios::binary);
    out << text;
  }
  static RankOutput Rank(int r) { return {.job_id = "job-1", .generation = 2, .rank = r}; }

  std::filesystem::path dir_;
  FakeSink* sink_ = nullptr;
};

TEST_F(LogShipperTest, ShipsCompleteLinesThenThePartialOneOnceTheProcessEnded) {
  auto shipper = MakeShipper();
  shipper->Follow(Rank(0), Path(0));
  shipper->Follow(Rank(1), Path(1));  // its file does not exist yet
  Write(0, "epoch 1\nepoch 2\npartial");
  ASSERT_TRUE(shipper->RunOnce().ok());
  EXPECT_THAT(sink_->Stored(0), ElementsAre("epoch 1", "epoch 2"));
  EXPECT_EQ(shipper->following(), 2u);

  Write(1, "rank one\n");
  Write(0, " line\n");
  ASSERT_TRUE(shipper->RunOnce().ok());
  EXPECT_THAT(sink_->Stored(0), ElementsAre("epoch 1", "epoch 2", "partial line"));
  EXPECT_THAT(sink_->Stored(1), ElementsAre("rank one"));

  Write(0, "no newline at the end");
  shipper->Ended(Rank(0));
  ASSERT_TRUE(shipper->RunOnce().ok());
  EXPECT_THAT(sink_->Stored(0),
              ElementsAre("epoch 1", "epoch 2", "partial line", "no newline at the end"));
  EXPECT_THAT(sink_->Complete(), ElementsAre(0));
  EXPECT_EQ(shipper->following(), 1u);
  const v1::ShipLogsRequest last = sink_->Requests().back();
  EXPECT_EQ(last.worker_id(), "w1");
  ASSERT_EQ(last.chunks_size(), 1);
  EXPECT_EQ(last.chunks(0).job_id(), "job-1");
  EXPECT_EQ(last.chunks(0).generation(), 2);
  EXPECT_EQ(last.chunks(0).lines(0).seq(), 3);
  EXPECT_GT(last.chunks(0).lines(0).time().seconds(), 0);

  // A rank that ended without ever writing is complete as well.
  shipper->Follow(Rank(5), Path(5));
  shipper->Ended(Rank(5));
  ASSERT_TRUE(shipper->RunOnce().ok());
  EXPECT_THAT(sink_->Complete(), ElementsAre(0, 5));
  EXPECT_EQ(shipper->following(), 1u);
}

TEST_F(LogShipperTest, LinesOfAFailedCallAreSentAgainWithTheSameNumbers) {
  auto shipper = MakeShipper();
  shipper->Follow(Rank(0), Path(0));
  Write(0, "a\nb\n");
  sink_->FailNext(2);
  EXPECT_EQ(shipper->RunOnce().code(), absl::StatusCode::kUnavailable);
  Write(0, "c\n");
  EXPECT_EQ(shipper->RunOnce().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(shipper->RunOnce().ok());
  EXPECT_THAT(sink_->Stored(0), ElementsAre("a", "b", "c"));
  // Every attempt carried the same numbers for the same lines.
  for (const v1::ShipLogsRequest& r : sink_->Requests()) {
    ASSERT_EQ(r.chunks_size(), 1);
    EXPECT_EQ(r.chunks(0).lines(0).seq(), 0);
    EXPECT_EQ(r.chunks(0).lines(0).text(), "a");
  }
  // Nothing new: nothing sent.
  const size_t calls = sink_->Requests().size();
  ASSERT_TRUE(shipper->RunOnce().ok());
  EXPECT_EQ(sink_->Requests().size(), calls);
}

TEST_F(LogShipperTest, BatchesAreBoundedAndShipEverything) {
  auto shipper = MakeShipper({.max_batch_lines = 100, .max_batch_bytes = 1000});
  shipper->Follow(Rank(0), Path(0));
  std::string text;
  for (int i = 0; i < 1000; ++i) absl::StrAppend(&text, "line ", i, "\n");
  Write(0, text);
  ASSERT_TRUE(shipper->RunOnce().ok());
  const std::vector<std::string> stored = sink_->Stored(0);
  ASSERT_EQ(stored.size(), 1000u);
  EXPECT_EQ(stored[999], "line 999");
  for (const v1::ShipLogsRequest& r : sink_->Requests()) {
    size_t bytes = 0;
    for (const v1::LogLine& l : r.chunks(0).lines()) bytes += l.text().size();
    EXPECT_LE(r.chunks(0).lines_size(), 100);
    EXPECT_LE(bytes, 1000u);
  }
}

TEST_F(LogShipperTest, ARankFarBehindSkipsAheadAndSaysHowMuch) {
  auto shipper = MakeShipper({.max_backlog_bytes = 2000});
  shipper->Follow(Rank(0), Path(0));
  std::string text;
  for (int i = 0; i < 1000; ++i) absl::StrAppend(&text, "line ", 1000 + i, "\n");  // 10 bytes each
  Write(0, text);
  ASSERT_TRUE(shipper->RunOnce().ok());
  const std::vector<std::string> stored = sink_->Stored(0);
  ASSERT_FALSE(stored.empty());
  // Skipped to 1000 bytes before the end (the half of the bound left to
  // read), then on to the next whole line.
  EXPECT_THAT(stored[0], HasSubstr("[aidn: 9000 bytes of output skipped"));
  EXPECT_EQ(stored[1], "line 1900");
  EXPECT_EQ(stored.back(), "line 1999");
  EXPECT_EQ(stored.size(), 101u);
}

TEST_F(LogShipperTest, ARankFollowedAgainCarriesOnWhereItsFileWasLeft) {
  auto shipper = MakeShipper();
  shipper->Follow(Rank(0), Path(0));
  Write(0, "first run\n");
  shipper->Ended(Rank(0));
  ASSERT_TRUE(shipper->RunOnce().ok());
  EXPECT_EQ(shipper->following(), 0u);
  // Restarted in place: the same file, appended to.
  shipper->Follow(Rank(0), Path(0));
  Write(0, "second run\n");
  ASSERT_TRUE(shipper->RunOnce().ok());
  EXPECT_THAT(sink_->Stored(0), ElementsAre("first run", "second run"));
}

TEST_F(LogShipperTest, ItsThreadShipsUntilStopped) {
  auto shipper = MakeShipper({.poll_interval = milliseconds(10),
                              .backoff = {.initial = milliseconds(10), .max = milliseconds(20)}});
  shipper->Start();
  shipper->Follow(Rank(0), Path(0));
  sink_->FailNext(3);
  Write(0, "x\ny\n");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (sink_->Stored(0).size() < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_THAT(sink_->Stored(0), ElementsAre("x", "y"));
  Write(0, "last words");
  shipper->Ended(Rank(0));
  shipper->Stop(std::chrono::seconds(20));
  EXPECT_THAT(sink_->Stored(0), ElementsAre("x", "y", "last words"));
  EXPECT_THAT(sink_->Complete(), ElementsAre(0));
  EXPECT_EQ(shipper->following(), 0u);
}

TEST_F(LogShipperTest, RefusedBatchesAreDroppedNotSentForever) {
  class Refusing : public LogSink {
   public:
    absl::Status Ship(const v1::ShipLogsRequest&) override {
      ++calls;
      return absl::UnimplementedError("an older coordinator");
    }
    int calls = 0;
  };
  auto sink = std::make_unique<Refusing>();
  Refusing* refusing = sink.get();
  LogShipper shipper({.worker_id = "w1"}, std::move(sink));
  shipper.Follow(Rank(0), Path(0));
  Write(0, "a\n");
  EXPECT_TRUE(shipper.RunOnce().ok());
  EXPECT_TRUE(shipper.RunOnce().ok());
  EXPECT_EQ(refusing->calls, 1);
}

}  // namespace
}  // namespace aidn::worker
