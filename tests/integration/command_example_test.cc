// The PyTorch DDP example (examples/pytorch-ddp/train.py), unmodified, under
// aidn: the same weights as the same ranks launched by hand, and after a
// rank is killed with kill -9 once a checkpoint exists, one restart that
// resumes from the script's own checkpoint and ends with the weights of an
// uninterrupted run.

#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"

namespace aidn::testing {
namespace {

using std::chrono::milliseconds;

constexpr char kPython[] = "/usr/bin/python3";
constexpr milliseconds kJobTimeout{240'000};
// Short enough for a test, long enough that a kill after the first
// checkpoint lands mid-training.
const std::vector<std::string> kTrainArgs = {"--max-steps=240", "--seed=7", "--log-every=40",
                                             "--threads=1"};

std::string TrainScript() {
  return absl::StrCat(AIDN_SOURCE_DIR, "/examples/pytorch-ddp/train.py");
}

bool TorchAndDataPresent() {
  return FashionMnistInstalled() &&
         RunCommand({kPython, "-c", "import torch.distributed"}, {}, std::chrono::seconds(60))
                 .exit_code == 0;
}

// "rank 0: done at step N, weights DIGEST" -> DIGEST.
std::string Digest(const std::string& output, int rank = 0) {
  const std::string needle = absl::StrCat("rank ", rank, ": done at step ");
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (!absl::ConsumePrefix(&line, needle)) continue;
    const size_t at = line.find("weights ");
    if (at != absl::string_view::npos) return std::string(line.substr(at + 8));
  }
  return "";
}

// The script launched by hand: 2 ranks with MASTER_ADDR/MASTER_PORT/RANK/
// WORLD_SIZE, as under Slurm. Rank 0's output.
std::string RunByHand(const std::string& dir) {
  const std::string port = absl::StrCat(29000 + (getpid() % 5000));
  std::vector<std::unique_ptr<Process>> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<std::string> argv = {kPython, TrainScript()};
    argv.insert(argv.end(), kTrainArgs.begin(), kTrainArgs.end());
    const std::string out = absl::StrCat(dir, "/by-hand-", rank, ".log");
    absl::StatusOr<std::unique_ptr<Process>> p =
        Process::Start(argv,
                       {absl::StrCat("RANK=", rank), "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                        "MASTER_PORT=" + port, "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1"},
                       out, out);
    if (!p.ok()) return "";
    ranks.push_back(*std::move(p));
  }
  for (auto& p : ranks) (void)p->Wait(kJobTimeout);
  return ReadFileOrEmpty(dir + "/by-hand-0.log");
}

// The output of `rank` in `generation` on any worker.
std::string RankLog(TestCluster& cluster, const std::string& job, int64_t generation, int rank) {
  for (const std::string& w : cluster.worker_ids()) {
    const std::string path = absl::StrCat(cluster.WorkDir(w), "/logs/", job, "/gen-", generation,
                                          "/rank-", rank, ".log");
    if (std::filesystem::exists(path)) return ReadFileOrEmpty(path);
  }
  return "";
}

// The pid of a live process whose environment has all of `vars`.
std::optional<int> ProcessWithEnv(const std::vector<std::string>& vars) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    int pid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &pid)) continue;
    const std::string environ = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/environ"));
    const std::vector<std::string> have = absl::StrSplit(environ, '\0');
    bool all = true;
    for (const std::string& v : vars) {
      all = all && std::find(have.begin(), have.end(), v) != have.end();
    }
    if (all) return pid;
  }
  return std::nullopt;
}

class CommandExampleTest : public ClusterFixture {
 protected:
  CommandExampleTest() : ClusterFixture("aidn-command-example") {}

  void SetUp() override {
    if (!TorchAndDataPresent()) {
      GTEST_SKIP() << "needs /usr/bin/python3 with torch and Debian's dataset-fashion-mnist";
    }
    ClusterFixture::SetUp();
    chmod(cluster().dir().c_str(), 0755);  // the ranks run as nobody
    ASSERT_TRUE(cluster()
                    .StartCoordinator(
                        {"--worker-timeout=3s", "--heartbeat-interval=500ms", "--stop-grace=1s"})
                    .ok());
    ASSERT_TRUE(cluster().StartWorkers({"w1", "w2"},
                                       {.args = {"--command-user=nobody", "--stop-grace=2s"}}));
  }

  v1::JobSpec Spec(const std::vector<std::string>& extra) {
    v1::JobSpec spec;
    spec.set_name("pytorch-ddp");
    spec.set_world_size(2);
    spec.set_max_restarts(2);
    spec.mutable_timeouts()->mutable_restart_backoff()->set_nanos(200'000'000);
    spec.mutable_command()->add_argv(kPython);
    spec.mutable_command()->add_argv(TrainScript());
    for (const std::string& a : kTrainArgs) spec.mutable_command()->add_argv(a);
    for (const std::string& a : extra) spec.mutable_command()->add_argv(a);
    return spec;
  }

  // The weights digest of the run by hand, once per test program.
  static std::string ByHandDigest(const std::string& dir) {
    static const std::string* digest = new std::string(Digest(RunByHand(dir)));
    return *digest;
  }
};

TEST_F(CommandExampleTest, TheUnmodifiedScriptTrainsAsItDoesLaunchedByHand) {
  const std::string by_hand = ByHandDigest(cluster().dir());
  ASSERT_FALSE(by_hand.empty()) << ReadFileOrEmpty(cluster().Path("by-hand-0.log"));
  absl::StatusOr<std::string> job = cluster().Submit(Spec({}));
  ASSERT_TRUE(job.ok()) << job.status();
  v1::Job last;
  ASSERT_TRUE(cluster().WaitForState(*job, v1::Job::SUCCEEDED, kJobTimeout, &last))
      << last.message();
  EXPECT_EQ(last.restarts(), 0);
  const std::string log = RankLog(cluster(), *job, 1, 0);
  EXPECT_EQ(Digest(log), by_hand) << log;
  EXPECT_EQ(Digest(RankLog(cluster(), *job, 1, 1), 1), by_hand);
}

TEST_F(CommandExampleTest, AKilledRankResumesFromTheScriptsCheckpointWithTheSameWeights) {
  const std::string by_hand = ByHandDigest(cluster().dir());
  ASSERT_FALSE(by_hand.empty());
  // Both workers see the same directory, as nodes share storage.
  const std::string shared = cluster().Path("shared");
  std::filesystem::create_directories(shared);
  chmod(shared.c_str(), 0777);
  const std::string checkpoint = shared + "/model.pt";
  absl::StatusOr<std::string> job =
      cluster().Submit(Spec({"--checkpoint=" + checkpoint, "--checkpoint-every=40"}));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(WaitFor([&] { return std::filesystem::exists(checkpoint); }, kJobTimeout))
      << RankLog(cluster(), *job, 1, 0);
  std::optional<int> rank1 =
      ProcessWithEnv({"AIDN_JOB_ID=" + *job, "AIDN_COORDINATOR=" + cluster().address(), "RANK=1"});
  ASSERT_TRUE(rank1.has_value());
  ASSERT_EQ(kill(*rank1, SIGKILL), 0);

  v1::Job last;
  ASSERT_TRUE(cluster().WaitForState(*job, v1::Job::SUCCEEDED, kJobTimeout, &last))
      << last.message() << "\n"
      << cluster().EventText(*job);
  EXPECT_EQ(last.restarts(), 1) << cluster().EventText(*job);
  EXPECT_TRUE(absl::StrContains(cluster().EventText(*job), "rank 1 on worker"))
      << cluster().EventText(*job);
  const std::string resumed = RankLog(cluster(), *job, 2, 0);
  EXPECT_TRUE(absl::StrContains(resumed, "resumed from " + checkpoint)) << resumed;
  EXPECT_EQ(Digest(resumed), by_hand) << resumed;
}

TEST_F(CommandExampleTest, AStoppedRankOfAReportingScriptIsAHangNamed) {
  v1::JobSpec spec;
  spec.set_name("pytorch-ddp-aidn");
  spec.set_world_size(2);
  spec.set_max_restarts(0);
  spec.mutable_timeouts()->mutable_progress()->set_seconds(4);
  spec.mutable_command()->add_argv(kPython);
  spec.mutable_command()->add_argv(
      absl::StrCat(AIDN_SOURCE_DIR, "/examples/pytorch-ddp/train_aidn.py"));
  for (const char* a : {"--max-steps=100000", "--threads=1", "--log-every=1000"}) {
    spec.mutable_command()->add_argv(a);
  }
  absl::StatusOr<std::string> job = cluster().Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  // Its reports arrive: it is judged by progress from now on.
  ASSERT_TRUE(WaitFor([&] { return cluster().Metrics(*job).size() >= 5; }, kJobTimeout))
      << RankLog(cluster(), *job, 1, 0);
  std::optional<int> rank1 =
      ProcessWithEnv({"AIDN_JOB_ID=" + *job, "AIDN_COORDINATOR=" + cluster().address(), "RANK=1"});
  ASSERT_TRUE(rank1.has_value());
  ASSERT_EQ(kill(*rank1, SIGSTOP), 0);
  v1::Job last;
  ASSERT_TRUE(cluster().WaitForState(*job, v1::Job::FAILED, kJobTimeout, &last));
  const std::vector<std::string> hangs = cluster().EventMessages(*job, "job.hang");
  ASSERT_EQ(hangs.size(), 1u) << cluster().EventText(*job);
  EXPECT_TRUE(absl::StrContains(hangs[0], "rank 1")) << hangs[0];
  // The stopped rank is killed, not left behind.
  EXPECT_TRUE(WaitFor([&] { return kill(*rank1, 0) != 0; }, milliseconds(15'000)));
}

}  // namespace
}  // namespace aidn::testing
