// The test support itself: a helper that passed no matter what would hide
// every failure of the tests built on it.

#include <signal.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/files.h"
#include "tests/support/process.h"
#include "tests/support/wait.h"

namespace aidn::testing {
namespace {

using ::testing::HasSubstr;

TEST(WaitFor, ReturnsAsSoonAsThePredicateHolds) {
  int calls = 0;
  EXPECT_TRUE(WaitFor([&] { return ++calls == 3; }, std::chrono::minutes(5)));
  EXPECT_EQ(calls, 3);
}

TEST(WaitFor, FailsAtTheDeadlineSayingWhatWasAwaited) {
  int calls = 0;
  const ::testing::AssertionResult result = WaitFor(
      [&] {
        ++calls;
        return false;
      },
      std::chrono::milliseconds(60), "the flag", [] { return std::string("it stayed down"); });
  EXPECT_FALSE(result);
  EXPECT_THAT(result.message(), HasSubstr("the flag did not happen within 60 ms"));
  EXPECT_THAT(result.message(), HasSubstr("it stayed down"));
  EXPECT_GE(calls, 2) << "asked at the start and at the deadline";
}

TEST(WaitFor, SeesAStateSetByAnotherThread) {
  std::atomic<bool> flag{false};
  absl::Notification go;
  std::thread setter([&] {
    go.WaitForNotification();
    flag = true;
  });
  go.Notify();
  EXPECT_TRUE(WaitFor([&] { return flag.load(); }, std::chrono::minutes(5), "the flag"));
  setter.join();
}

TEST(TempDir, IsRemovedWithEverythingInItUnlessKept) {
  std::string removed, kept;
  {
    TempDir dir("aidn-support-test");
    removed = dir.path();
    ASSERT_TRUE(std::filesystem::is_directory(removed));
    std::filesystem::create_directories(dir / "a/b");
    WriteFileOrDie(dir / "a/b/file", "contents");
    EXPECT_EQ(ReadFileOrEmpty(dir / "a/b/file"), "contents");
  }
  EXPECT_FALSE(std::filesystem::exists(removed));
  {
    TempDir dir("aidn-support-test");
    kept = dir.path();
    dir.Keep();
  }
  EXPECT_TRUE(std::filesystem::is_directory(kept));
  RemoveTree(kept);
  EXPECT_FALSE(std::filesystem::exists(kept));
  EXPECT_EQ(ReadFileOrEmpty(kept + "/missing"), "");
}

TEST(RunCommand, GivesTheExitCodeAndBothStreams) {
  const CommandResult r = RunCommand({"/bin/sh", "-c", "echo out; echo err >&2; exit 3"});
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.out, "out\n");
  EXPECT_EQ(r.err, "err\n");
  EXPECT_EQ(RunCommand({"/nonexistent/program"}).exit_code, -1);
}

TEST(RunCommand, KillsACommandThatOutlivesItsTimeout) {
  const CommandResult r =
      RunCommand({"/bin/sh", "-c", "exec sleep 1000"}, {}, std::chrono::milliseconds(100));
  EXPECT_EQ(r.exit_code, 128 + SIGKILL);
}

TEST(Process, RunsUntilSignalledAndReportsHow) {
  TempDir dir("aidn-support-test");
  auto process = Process::Start({"/bin/sh", "-c", "echo $MARK; exec sleep 1000"}, {"MARK=here"},
                                dir / "out", dir / "err");
  ASSERT_TRUE(process.ok()) << process.status();
  EXPECT_TRUE((*process)->Running());
  EXPECT_FALSE((*process)->Wait(std::chrono::milliseconds(0)).ok());
  ASSERT_TRUE(WaitFor([&] { return (*process)->Stdout() == "here\n"; }, std::chrono::minutes(1),
                      "the child's output"));
  const pid_t pid = (*process)->pid();
  EXPECT_FALSE(IsDead(pid));
  (*process)->Signal(SIGSTOP);
  EXPECT_TRUE(WaitFor([&] { return ProcessState(pid) == 'T'; }, std::chrono::minutes(1),
                      "the child stopped"));
  (*process)->Signal(SIGCONT);
  (*process)->Signal(SIGTERM);
  absl::StatusOr<int> code = (*process)->Wait(std::chrono::minutes(1));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGTERM);
  EXPECT_FALSE((*process)->Running());
  EXPECT_TRUE(IsDead(pid));
}

TEST(ProcessesWith, FindsAProcessByItsArguments) {
  TempDir dir("aidn-support-test");
  const std::string needle = dir / "marker";
  auto process =
      Process::Start({"/bin/sh", "-c", "sleep 1000; :", needle}, {}, dir / "out", dir / "err");
  ASSERT_TRUE(process.ok()) << process.status();
  EXPECT_TRUE(WaitFor([&] { return ProcessesWith({needle}).size() == 1; }, std::chrono::minutes(1),
                      "the sleeping child"));
  process->reset();  // SIGKILLs and reaps it
  EXPECT_TRUE(ProcessesWith({needle}).empty());
}

}  // namespace
}  // namespace aidn::testing
