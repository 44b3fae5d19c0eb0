// The ranks' output end to end: a real coordinator, a real aidn-worker
// running a 2-rank built-in job on Debian's Fashion-MNIST, and the real
// aidnctl reading it back. What `aidnctl logs` prints is compared with the
// rank log files on the worker, line for line.

#include <sys/stat.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"

namespace aidn::testing {
namespace {

using ::testing::HasSubstr;

constexpr std::chrono::milliseconds kJobTimeout{180'000};

class LogsTest : public ClusterFixture {
 protected:
  LogsTest() : ClusterFixture("aidn-logs-test") {}

  void SetUp() override {
    if (!FashionMnistInstalled()) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
    }
    ClusterFixture::SetUp();
    // Command ranks run as nobody: the test's directory must be reachable.
    chmod(cluster().dir().c_str(), 0755);
    ASSERT_TRUE(cluster()
                    .StartCoordinator({"--worker-timeout=5s", "--heartbeat-interval=500ms",
                                       "--tick-interval=50ms"})
                    .ok());
    ASSERT_TRUE(
        cluster().StartWorkers({"w1"}, {.cpu_slots = 2, .args = {"--command-user=nobody"}}));
  }

  std::string Submit(int64_t steps) {
    v1::JobSpec spec;
    spec.set_name("logs-test");
    spec.set_world_size(2);
    spec.set_device(v1::JobSpec::CPU);
    spec.mutable_model()->set_name("mlp");
    spec.mutable_dataset()->set_dir(kFashionMnist);
    spec.mutable_optimizer()->set_name("sgd");
    spec.mutable_optimizer()->set_lr(0.05);
    spec.set_batch_size(64);
    spec.set_max_steps(steps);
    spec.set_seed(1);
    spec.set_max_restarts(0);
    absl::StatusOr<std::string> id = cluster().Submit(spec);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or("");
  }

  // The lines of rank `rank`'s output file on the worker.
  std::vector<std::string> FileLines(const std::string& job_id, int rank) {
    const std::string text = ReadFileOrEmpty(
        absl::StrCat(cluster().WorkDir("w1"), "/logs/", job_id, "/gen-1/rank-", rank, ".log"));
    std::vector<std::string> lines = absl::StrSplit(text, '\n');
    if (!lines.empty() && lines.back().empty()) lines.pop_back();
    return lines;
  }

  // The lines of `out` prefixed "[rank N] ", without the prefix.
  static std::vector<std::string> RankLines(const std::string& out, int rank) {
    const std::string prefix = absl::StrCat("[rank ", rank, "] ");
    std::vector<std::string> lines;
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      if (absl::ConsumePrefix(&line, prefix)) lines.emplace_back(line);
    }
    return lines;
  }

  // Every line of `out` carries a rank prefix (or is empty at the end).
  static ::testing::AssertionResult AllPrefixed(const std::string& out) {
    for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
      if (!absl::StartsWith(line, "[rank 0] ") && !absl::StartsWith(line, "[rank 1] ")) {
        return ::testing::AssertionFailure() << "unprefixed line: " << line;
      }
    }
    return ::testing::AssertionSuccess();
  }

  // `aidnctl logs JOB` shows, per rank, exactly the lines of the files.
  void ExpectLogsMatchFiles(const std::string& id) {
    // The job ended; --follow returns once its ranks' output is all in.
    const CommandResult all = cluster().Aidnctl({"logs", id, "--follow"}, kJobTimeout);
    ASSERT_EQ(all.exit_code, 0) << Describe(all);
    EXPECT_TRUE(AllPrefixed(all.out));
    for (int rank : {0, 1}) {
      SCOPED_TRACE(absl::StrCat("rank ", rank));
      const std::vector<std::string> file = FileLines(id, rank);
      ASSERT_FALSE(file.empty());
      EXPECT_EQ(RankLines(all.out, rank), file);
      const CommandResult one = cluster().Aidnctl({"logs", id, "--rank", absl::StrCat(rank)});
      ASSERT_EQ(one.exit_code, 0) << Describe(one);
      EXPECT_EQ(RankLines(one.out, rank), file);
      EXPECT_TRUE(RankLines(one.out, 1 - rank).empty());
    }
  }
};

TEST_F(LogsTest, BothRanksLinesArePrefixedAndFollowEndsWithTheJob) {
  const std::string id = Submit(600);
  ASSERT_FALSE(id.empty());
  // Started while the job runs: it prints until the job ended and every
  // rank's output is in, then exits 0.
  CommandResult followed;
  std::thread follower([&] {
    followed = cluster().Aidnctl({"logs", id, "--follow"}, kJobTimeout);
  });
  const v1::Job job = cluster().WaitForEnd(id, kJobTimeout);
  follower.join();
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
  ASSERT_EQ(followed.exit_code, 0) << Describe(followed);
  EXPECT_TRUE(AllPrefixed(followed.out));
  for (int rank : {0, 1}) {
    EXPECT_THAT(RankLines(followed.out, rank).back(), HasSubstr("training finished"))
        << followed.out;
  }
  ExpectLogsMatchFiles(id);

  // --tail, and --generation all with the generation in the prefix.
  const CommandResult tail = cluster().Aidnctl({"logs", id, "--tail", "3"});
  ASSERT_EQ(tail.exit_code, 0) << Describe(tail);
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(tail.out, '\n', absl::SkipEmpty())).size(), 3u)
      << tail.out;
  const CommandResult gens = cluster().Aidnctl({"logs", id, "--generation", "all", "--rank", "1"});
  ASSERT_EQ(gens.exit_code, 0) << Describe(gens);
  EXPECT_TRUE(absl::StartsWith(gens.out, "[gen 1 rank 1] ")) << gens.out;
  // Bad input is named.
  const CommandResult unknown = cluster().Aidnctl({"logs", "job-999"});
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_THAT(unknown.err, HasSubstr("job-999"));
}

TEST_F(LogsTest, ACoordinatorRestartMidJobLosesNoLine) {
  const std::string id = Submit(4000);
  ASSERT_FALSE(id.empty());
  // Some progress lines are in before the coordinator goes.
  ASSERT_TRUE(WaitFor(
      [&] {
        const CommandResult r = cluster().Aidnctl({"logs", id});
        return absl::StrContains(r.out, "samples/s");
      },
      kJobTimeout, "a progress line stored"));
  ASSERT_TRUE(cluster().KillCoordinator().ok());
  // The outage is the scenario: the ranks print while their lines cannot
  // be shipped. It lasts until rank 0 has printed a few more (however
  // loaded the machine), else the test would show nothing.
  const size_t lines_at_kill = FileLines(id, 0).size();
  ASSERT_TRUE(WaitFor([&] { return FileLines(id, 0).size() >= lines_at_kill + 3; }, kJobTimeout,
                      "rank 0 printing during the outage"));
  const absl::Status restarted = cluster().RestartCoordinator(/*same_address=*/true);
  ASSERT_TRUE(restarted.ok()) << restarted;
  const v1::Job job = cluster().WaitForEnd(id, kJobTimeout);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << cluster().EventText(id);
  ExpectLogsMatchFiles(id);
}

// A user's own program (a command job): a progress bar rewritten with
// carriage returns arrives as its last state, a line longer than 16 KiB is
// cut and marked, and a last line without a newline arrives too.
TEST_F(LogsTest, ACommandJobsProgressBarsAndHugeLinesStayReadable) {
  v1::JobSpec spec;
  spec.set_name("logs-command");
  spec.set_world_size(2);
  spec.set_max_restarts(0);
  for (const char* arg :
       {"/bin/sh", "-c",
        "echo \"start $RANK\"; printf '\\r 10%%|#   |\\r 50%%|##  |\\r100%%|####|\\n';"
        " head -c 40000 /dev/zero | tr '\\0' y; echo; printf 'done %s' \"$RANK\""}) {
    spec.mutable_command()->add_argv(arg);
  }
  absl::StatusOr<std::string> id = cluster().Submit(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  const v1::Job job = cluster().WaitForEnd(*id, kJobTimeout);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
  const CommandResult logs = cluster().Aidnctl({"logs", *id, "--follow"});
  ASSERT_EQ(logs.exit_code, 0) << Describe(logs);
  for (int rank : {0, 1}) {
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    const std::vector<std::string> lines = RankLines(logs.out, rank);
    ASSERT_EQ(lines.size(), 4u) << logs.out.substr(0, 2000);
    EXPECT_EQ(lines[0], absl::StrCat("start ", rank));
    EXPECT_EQ(lines[1], "100%|####|");
    EXPECT_EQ(lines[2], std::string(16384, 'y') + " [aidn: line cut at 16384 bytes]");
    EXPECT_EQ(lines[3], absl::StrCat("done ", rank));
  }
}

}  // namespace
}  // namespace aidn::testing
