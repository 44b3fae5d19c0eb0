// The worker's Supervisor against real child processes (/bin/sh scripts).

#include "worker/supervisor.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::worker {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using SteadyClock = std::chrono::steady_clock;

// Generous: other builds share the machine's cores.
constexpr std::chrono::milliseconds kLong{10'000};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Polls `predicate` every 10 ms until true (→ true) or `timeout` passes.
template <typename Predicate>
bool WaitFor(Predicate predicate, std::chrono::milliseconds timeout = kLong) {
  const auto deadline = SteadyClock::now() + timeout;
  while (true) {
    if (predicate()) return true;
    if (SteadyClock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Gone, or a zombie (dead, waiting for a parent that is not us to reap it).
bool IsDead(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  return stat.empty() ||
         (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z');
}

// Reads a pid the script wrote to `path` (waiting for it to appear).
pid_t ReadPidFile(const std::string& path) {
  pid_t pid = 0;
  WaitFor([&] {
    const std::string text = ReadFile(path);
    int value = 0;
    if (text.empty() || text.back() != '\n') return false;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &value)) return false;
    pid = value;
    return true;
  });
  return pid;
}

class SupervisorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = getenv("TMPDIR");
    std::string templ = absl::StrCat(tmp != nullptr && tmp[0] != '\0' ? tmp : "/tmp",
                                     "/aidn-supervisor-test-XXXXXX");
    ASSERT_NE(mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override {
    std::error_code ignored;
    if (!HasFailure()) std::filesystem::remove_all(dir_, ignored);
  }

  ChildSpec Script(const std::string& script, const std::string& log_name = "child.log") {
    return {.argv = {"/bin/sh", "-c", script}, .log_path = dir_ + "/" + log_name};
  }

  // Reaps until child `id` is reported (or `timeout` passes).
  std::optional<ChildExit> WaitForExit(Supervisor& supervisor, Supervisor::ChildId id,
                                       std::chrono::milliseconds timeout = kLong) {
    std::optional<ChildExit> found;
    WaitFor(
        [&] {
          for (ChildExit& e : supervisor.Reap()) {
            if (e.id == id) found = std::move(e);
          }
          return found.has_value();
        },
        timeout);
    return found;
  }

  std::string dir_;
};

TEST_F(SupervisorTest, ReportsTheExitCodeOfAChildThatExits) {
  Supervisor supervisor;
  absl::StatusOr<Supervisor::ChildId> id = supervisor.Start(Script("exit 3"));
  ASSERT_TRUE(id.ok()) << id.status();
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->exit_code, 3);
  EXPECT_EQ(exit->signal, 0);
  EXPECT_FALSE(exit->stopped);
  EXPECT_GT(exit->pid, 0);
  EXPECT_TRUE(supervisor.Running().empty());
}

TEST_F(SupervisorTest, RunsTheProgramUnderTheNameGivenAsArgvZero) {
  Supervisor supervisor;
  absl::StatusOr<Supervisor::ChildId> id =
      supervisor.Start({.program = "/bin/sh",
                        .argv = {"aidn-trainer", "-c", "sleep 1000; exit 0"},
                        .log_path = dir_ + "/child.log"});
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_EQ(supervisor.Running().size(), 1u);
  const pid_t pid = supervisor.Running()[0].pid;
  // What `ps -ef` shows: the name, not the program's path.
  EXPECT_THAT(ReadFile(absl::StrCat("/proc/", pid, "/cmdline")),
              StartsWith(std::string("aidn-trainer\0-c\0", 16)));
  ASSERT_TRUE(supervisor.Stop(*id, std::chrono::milliseconds(0)).ok());
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_TRUE(exit->stopped);
}

TEST_F(SupervisorTest, LooksUpAProgramWithoutASlashOnPath) {
  Supervisor supervisor;
  absl::StatusOr<Supervisor::ChildId> id =
      supervisor.Start({.argv = {"sh", "-c", "echo found"},
                        .env = {"PATH=/nonexistent:/bin:/usr/bin"},
                        .log_path = dir_ + "/l"});
  ASSERT_TRUE(id.ok()) << id.status();
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->exit_code, 0);
  EXPECT_THAT(exit->log_tail, HasSubstr("found"));

  id = supervisor.Start({.argv = {"no-such-program-aidn"},
                         .env = {"PATH=/nonexistent:/bin"},
                         .log_path = dir_ + "/l"});
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(id.status().message(), HasSubstr("\"no-such-program-aidn\" not found on PATH"));
  EXPECT_THAT(id.status().message(), HasSubstr("/nonexistent:/bin"));
  EXPECT_TRUE(supervisor.Running().empty());
}

TEST_F(SupervisorTest, RunsAChildInItsWorkingDirectory) {
  Supervisor supervisor;
  std::filesystem::create_directories(dir_ + "/wd");
  absl::StatusOr<Supervisor::ChildId> id = supervisor.Start(
      {.argv = {"/bin/sh", "-c", "pwd"}, .log_path = dir_ + "/l", .cwd = dir_ + "/wd"});
  ASSERT_TRUE(id.ok()) << id.status();
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_THAT(exit->log_tail, HasSubstr(dir_ + "/wd"));

  id = supervisor.Start(
      {.argv = {"/bin/sh", "-c", "pwd"}, .log_path = dir_ + "/l", .cwd = dir_ + "/missing"});
  ASSERT_FALSE(id.ok());
  EXPECT_THAT(id.status().message(), HasSubstr("working directory " + dir_ + "/missing"));
  EXPECT_TRUE(supervisor.Running().empty());
}

TEST_F(SupervisorTest, RunsAChildAsAnotherUser) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to change user";
  Supervisor supervisor;
  absl::StatusOr<Supervisor::ChildId> id =
      supervisor.Start({.argv = {"/bin/sh", "-c", "echo uid=$(id -u) gid=$(id -g) groups=$(id -G)"},
                        .log_path = dir_ + "/l",
                        .run_as = ChildSpec::RunAs{.uid = 65534, .gid = 65534}});
  ASSERT_TRUE(id.ok()) << id.status();
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_THAT(exit->log_tail, HasSubstr("uid=65534 gid=65534 groups=65534"));

  // The directories it needs are made by the child as that user, and the
  // file to remove is removed as that user: one root owns stays.
  const std::string shared = dir_ + "/shared";
  std::filesystem::create_directories(shared);
  chmod(shared.c_str(), 0777);
  chmod(dir_.c_str(), 0755);
  const std::string root_file = dir_ + "/root-owned";
  std::ofstream(root_file) << "x";
  id = supervisor.Start({.argv = {"/bin/sh", "-c", "true"},
                         .log_path = dir_ + "/l",
                         .run_as = ChildSpec::RunAs{.uid = 65534, .gid = 65534},
                         .make_dirs = {shared + "/a/b"},
                         .remove_file = root_file});
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitForExit(supervisor, *id).has_value());
  struct stat st = {};
  ASSERT_EQ(stat((shared + "/a/b").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 65534u);
  EXPECT_TRUE(std::filesystem::exists(root_file)) << "removed with root's rights";
  // A directory it may not create fails the start, naming the step.
  id = supervisor.Start({.argv = {"/bin/sh", "-c", "true"},
                         .log_path = dir_ + "/l",
                         .run_as = ChildSpec::RunAs{.uid = 65534, .gid = 65534},
                         .make_dirs = {dir_ + "/not-writable/x"}});
  ASSERT_FALSE(id.ok());
  EXPECT_THAT(id.status().message(), HasSubstr("creating the process's directories"));
}

TEST_F(SupervisorTest, ReportsTheSignalThatKilledAChild) {
  Supervisor supervisor;
  absl::StatusOr<Supervisor::ChildId> id = supervisor.Start(Script("kill -KILL $$"));
  ASSERT_TRUE(id.ok()) << id.status();
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->signal, SIGKILL);
  EXPECT_EQ(exit->exit_code, 0);
}

TEST_F(SupervisorTest, KeepsTheLastTwentyLinesOfTheLogAsTheTail) {
  Supervisor supervisor;
  absl::StatusOr<Supervisor::ChildId> id = supervisor.Start(
      Script("i=1; while [ $i -le 30 ]; do echo line $i; i=$((i+1)); done; echo boom >&2; exit 1"));
  ASSERT_TRUE(id.ok()) << id.status();
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->exit_code, 1);
  std::vector<std::string> lines = absl::StrSplit(exit->log_tail, '\n');
  ASSERT_EQ(lines.size(), 20u) << exit->log_tail;
  EXPECT_EQ(lines.front(), "line 12");
  EXPECT_EQ(lines[18], "line 30");
  EXPECT_EQ(lines.back(), "boom");
  // stdout and stderr both went to the log file.
  EXPECT_THAT(ReadFile(dir_ + "/child.log"), StartsWith("line 1\n"));
}

TEST_F(SupervisorTest, BoundsTheTailInBytesAndDropsAPartialFirstLine) {
  Supervisor supervisor({.log_tail_lines = 20, .log_tail_max_bytes = 25});
  absl::StatusOr<Supervisor::ChildId> id =
      supervisor.Start(Script("echo aaaaaaaaaaaaaaaaaaaa; echo bbbbbbbbbb; echo cccccccccc"));
  ASSERT_TRUE(id.ok()) << id.status();
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  // The last 25 bytes are "aa\nbbbbbbbbbb\ncccccccccc\n"; the partial "aa" goes.
  EXPECT_EQ(exit->log_tail, "bbbbbbbbbb\ncccccccccc");
}

TEST_F(SupervisorTest, CreatesTheLogDirectoryAndAppendsToTheLog) {
  Supervisor supervisor;
  const std::string log = "logs/job-1/gen-1/rank-0.log";
  for (const char* word : {"first", "second"}) {
    absl::StatusOr<Supervisor::ChildId> id =
        supervisor.Start(Script(absl::StrCat("echo ", word), log));
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(WaitForExit(supervisor, *id).has_value());
  }
  EXPECT_EQ(ReadFile(dir_ + "/" + log), "first\nsecond\n");
}

TEST_F(SupervisorTest, PassesExtraEnvironmentToTheChild) {
  Supervisor supervisor;
  ChildSpec spec = Script("echo \"token=$AIDN_TEST_TOKEN home=${HOME:+set}\"");
  spec.env = {"AIDN_TEST_TOKEN=s3cret"};
  absl::StatusOr<Supervisor::ChildId> id = supervisor.Start(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  // The extra variable is there, and the daemon's own environment too.
  EXPECT_EQ(exit->log_tail,
            getenv("HOME") != nullptr ? "token=s3cret home=set" : "token=s3cret home=");
}

TEST_F(SupervisorTest, RefusesAProgramThatCannotBeExecuted) {
  Supervisor supervisor;
  absl::StatusOr<Supervisor::ChildId> missing =
      supervisor.Start({.argv = {dir_ + "/no-such-program"}, .log_path = dir_ + "/x.log"});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_THAT(missing.status().message(), HasSubstr("no-such-program"));

  // A file that is not executable.
  const std::string data = dir_ + "/data.txt";
  std::ofstream(data) << "not a program\n";
  absl::StatusOr<Supervisor::ChildId> not_executable =
      supervisor.Start({.argv = {data}, .log_path = dir_ + "/x.log"});
  EXPECT_FALSE(not_executable.ok());
  EXPECT_THAT(not_executable.status().message(), HasSubstr("exec " + data));
  EXPECT_TRUE(supervisor.Running().empty());
  EXPECT_TRUE(supervisor.Reap().empty());
}

TEST_F(SupervisorTest, StopEndsAChildWithSigterm) {
  Supervisor supervisor;
  absl::StatusOr<Supervisor::ChildId> id = supervisor.Start(Script("exec sleep 1000"));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_EQ(supervisor.Running().size(), 1u);
  EXPECT_FALSE(supervisor.Running()[0].stopping);

  ASSERT_TRUE(supervisor.Stop(*id, std::chrono::seconds(60)).ok());
  EXPECT_TRUE(supervisor.Running()[0].stopping);
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->signal, SIGTERM);
  EXPECT_TRUE(exit->stopped);
  EXPECT_FALSE(exit->killed_after_grace);
}

TEST_F(SupervisorTest, StopOfAnUnknownChildIsNotFound) {
  Supervisor supervisor;
  EXPECT_EQ(supervisor.Stop(42, std::chrono::seconds(1)).code(), absl::StatusCode::kNotFound);
}

TEST_F(SupervisorTest, EscalatesToSigkillAfterTheGraceWhenAChildIgnoresSigterm) {
  FakeClock clock;
  Supervisor supervisor({.clock = &clock});
  // SIG_IGN is inherited by the sleeps too, so nobody in the group dies of
  // SIGTERM.
  absl::StatusOr<Supervisor::ChildId> id = supervisor.Start(
      Script("trap '' TERM; echo ready; while true; do sleep 1; done", "stubborn.log"));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitFor([&] { return ReadFile(dir_ + "/stubborn.log") == "ready\n"; }));

  ASSERT_TRUE(supervisor.Stop(*id, std::chrono::seconds(5)).ok());
  // Within the grace it is left alone: it survives SIGTERM.
  EXPECT_FALSE(WaitForExit(supervisor, *id, std::chrono::milliseconds(300)).has_value());
  clock.Advance(std::chrono::seconds(4));
  EXPECT_FALSE(WaitForExit(supervisor, *id, std::chrono::milliseconds(100)).has_value());

  clock.Advance(std::chrono::seconds(2));
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->signal, SIGKILL);
  EXPECT_TRUE(exit->stopped);
  EXPECT_TRUE(exit->killed_after_grace);
}

TEST_F(SupervisorTest, StopWithZeroGraceKillsAtOnce) {
  Supervisor supervisor;
  absl::StatusOr<Supervisor::ChildId> id =
      supervisor.Start(Script("trap '' TERM; echo ready; while true; do sleep 1; done"));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitFor([&] { return ReadFile(dir_ + "/child.log") == "ready\n"; }));
  ASSERT_TRUE(supervisor.Stop(*id, std::chrono::milliseconds(0)).ok());
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->signal, SIGKILL);
}

TEST_F(SupervisorTest, StopSignalsTheWholeProcessGroup) {
  FakeClock clock;
  Supervisor supervisor({.clock = &clock});
  // The child survives SIGTERM (a handler, so its own children still get the
  // default action) and keeps a grandchild in its group.
  const std::string pid_file = dir_ + "/grandchild.pid";
  absl::StatusOr<Supervisor::ChildId> id =
      supervisor.Start(Script(absl::StrCat("trap 'echo got-term' TERM; sleep 1000 & echo $! > ",
                                           pid_file, "; while true; do sleep 0.05; done"),
                              "group.log"));
  ASSERT_TRUE(id.ok()) << id.status();
  const pid_t grandchild = ReadPidFile(pid_file);
  ASSERT_GT(grandchild, 0);
  // Until it has exec'd sleep, the forked shell still runs the child's trap
  // handler and would swallow the signal.
  ASSERT_TRUE(
      WaitFor([&] { return ReadFile(absl::StrCat("/proc/", grandchild, "/comm")) == "sleep\n"; }));

  ASSERT_TRUE(supervisor.Stop(*id, std::chrono::seconds(60)).ok());
  // SIGTERM reached the grandchild, not only the child...
  EXPECT_TRUE(WaitFor([&] { return IsDead(grandchild); })) << "grandchild " << grandchild;
  EXPECT_TRUE(
      WaitFor([&] { return ReadFile(dir_ + "/group.log").find("got-term") != std::string::npos; }));
  // ...while the child itself lives on until the grace has passed.
  EXPECT_TRUE(supervisor.Reap().empty());
  clock.Advance(std::chrono::seconds(61));
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->signal, SIGKILL);
}

TEST_F(SupervisorTest, KillsWhatIsLeftOfTheGroupWhenTheChildExitsByItself) {
  Supervisor supervisor;
  const std::string pid_file = dir_ + "/grandchild.pid";
  absl::StatusOr<Supervisor::ChildId> id = supervisor.Start(
      Script(absl::StrCat("sleep 1000 & echo $! > ", pid_file, "; exec sleep 0.3")));
  ASSERT_TRUE(id.ok()) << id.status();
  const pid_t grandchild = ReadPidFile(pid_file);
  ASSERT_GT(grandchild, 0);

  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->exit_code, 0);
  EXPECT_FALSE(exit->stopped);
  EXPECT_TRUE(WaitFor([&] { return IsDead(grandchild); })) << "grandchild " << grandchild;
  if (!IsDead(grandchild)) kill(grandchild, SIGKILL);  // leave nothing behind, even on failure
}

TEST_F(SupervisorTest, LeavesNoZombieBehind) {
  Supervisor supervisor;
  absl::StatusOr<Supervisor::ChildId> id = supervisor.Start(Script("exit 0"));
  ASSERT_TRUE(id.ok()) << id.status();
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  int status = 0;
  EXPECT_EQ(waitpid(exit->pid, &status, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
  EXPECT_TRUE(IsDead(exit->pid));
}

TEST_F(SupervisorTest, ChildStartsWithDefaultSignalHandlingWhateverTheDaemonBlocks) {
  // The daemon blocks SIGTERM (sigwait) and ignores SIGPIPE; its trainers
  // must still die of SIGTERM.
  sigset_t term, old_mask;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &term, &old_mask), 0);
  struct sigaction ignore = {}, old_pipe = {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGPIPE, &ignore, &old_pipe), 0);

  Supervisor supervisor;
  absl::StatusOr<Supervisor::ChildId> id = supervisor.Start(Script("exec sleep 1000"));
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  sigaction(SIGPIPE, &old_pipe, nullptr);
  ASSERT_TRUE(id.ok()) << id.status();

  ASSERT_TRUE(supervisor.Stop(*id, std::chrono::seconds(60)).ok());
  std::optional<ChildExit> exit = WaitForExit(supervisor, *id);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->signal, SIGTERM);
}

TEST_F(SupervisorTest, StopAllAndWaitEndsEveryChild) {
  Supervisor supervisor;
  std::vector<Supervisor::ChildId> ids;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<Supervisor::ChildId> id =
        supervisor.Start(Script("exec sleep 1000", absl::StrCat("c", i, ".log")));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  std::vector<ChildExit> exits = supervisor.StopAllAndWait(std::chrono::seconds(60));
  ASSERT_EQ(exits.size(), 3u);
  for (const ChildExit& e : exits) {
    EXPECT_EQ(e.signal, SIGTERM);
    EXPECT_TRUE(e.stopped);
  }
  EXPECT_TRUE(supervisor.Running().empty());
}

TEST_F(SupervisorTest, DestructorKillsAndReapsChildrenStillRunning) {
  pid_t pid = 0;
  {
    Supervisor supervisor;
    absl::StatusOr<Supervisor::ChildId> id = supervisor.Start(Script("exec sleep 1000"));
    ASSERT_TRUE(id.ok()) << id.status();
    pid = supervisor.Running().at(0).pid;
    ASSERT_FALSE(IsDead(pid));
  }
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, WNOHANG), -1);  // reaped already
  EXPECT_TRUE(IsDead(pid));
}

TEST_F(SupervisorTest, ChildrenDieWhenTheSupervisingProcessIsKilled) {
  // A stand-in daemon (a forked copy of this test) starts a child, reports
  // its pid and is SIGKILLed: PR_SET_PDEATHSIG must take the child along.
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const std::string log = dir_ + "/orphan.log";
  const pid_t daemon = fork();
  ASSERT_GE(daemon, 0);
  if (daemon == 0) {
    close(pipe_fds[0]);
    Supervisor* supervisor = new Supervisor();  // never destroyed: no cleanup runs
    absl::StatusOr<Supervisor::ChildId> id =
        supervisor->Start({.argv = {"/bin/sh", "-c", "exec sleep 1000"}, .log_path = log});
    pid_t child = id.ok() ? supervisor->Running().at(0).pid : 0;
    if (write(pipe_fds[1], &child, sizeof(child)) != sizeof(child)) _exit(1);
    while (true) pause();
  }
  close(pipe_fds[1]);
  pid_t child = 0;
  ASSERT_EQ(read(pipe_fds[0], &child, sizeof(child)), static_cast<ssize_t>(sizeof(child)));
  close(pipe_fds[0]);
  ASSERT_GT(child, 0);
  ASSERT_FALSE(IsDead(child));

  ASSERT_EQ(kill(daemon, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(daemon, &status, 0), daemon);
  EXPECT_TRUE(WaitFor([&] { return IsDead(child); }))
      << "child " << child << " outlived its parent";
  if (!IsDead(child)) kill(child, SIGKILL);
}

}  // namespace
}  // namespace aidn::worker
