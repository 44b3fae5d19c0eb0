// Command jobs on real processes over loopback: a real coordinator, real
// aidn-worker daemons (as root, running users' programs as `nobody`) and
// real PyTorch programs (Debian's python3-torch) as the ranks, launched with
// torchrun's environment contract.
//
// After every test no process of the test's jobs is left.

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster_fixture.h"

namespace aidn::testing {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kJobTimeout{120'000};
constexpr char kPython[] = "/usr/bin/python3";

std::string Script(const std::string& name) {
  return absl::StrCat(AIDN_SOURCE_DIR, "/tests/integration/command_scripts/", name);
}

bool TorchImports() {
  static const bool ok =
      RunCommand({kPython, "-c", "import torch.distributed"}, {}, std::chrono::seconds(60))
          .exit_code == 0;
  return ok;
}

// Pids of live processes whose environment says they belong to `job_id` of
// the coordinator at `coordinator` (other tests run jobs of the same ids).
std::vector<int> ProcessesOfJob(const std::string& coordinator, const std::string& job_id) {
  std::vector<int> pids;
  const std::string needle = absl::StrCat("AIDN_JOB_ID=", job_id);
  const std::string ours = absl::StrCat("AIDN_COORDINATOR=", coordinator);
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return pids;
  while (dirent* entry = readdir(proc)) {
    const int pid = atoi(entry->d_name);
    if (pid <= 0) continue;
    const std::string environ = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/environ"));
    bool job = false;
    bool coordinator_matches = false;
    for (absl::string_view var : absl::StrSplit(environ, '\0')) {
      job = job || var == needle;
      coordinator_matches = coordinator_matches || var == ours;
    }
    if (job && coordinator_matches) pids.push_back(pid);
  }
  closedir(proc);
  return pids;
}

// The JSON each rank of ddp_env.py prints, by rank, from the worker logs.
std::map<int, nlohmann::json> EnvReports(TestCluster& cluster, const std::string& job_id,
                                         int64_t generation) {
  std::map<int, nlohmann::json> reports;
  for (const std::string& worker : cluster.worker_ids()) {
    const std::string dir =
        absl::StrCat(cluster.WorkDir(worker), "/logs/", job_id, "/gen-", generation);
    std::error_code error;
    for (const auto& file : std::filesystem::directory_iterator(dir, error)) {
      for (absl::string_view line : absl::StrSplit(ReadFileOrEmpty(file.path()), '\n')) {
        if (!absl::ConsumePrefix(&line, "DDP_ENV ")) continue;
        nlohmann::json report = nlohmann::json::parse(line, nullptr, false);
        if (report.is_object()) reports[std::stoi(report["RANK"].get<std::string>())] = report;
      }
    }
  }
  return reports;
}

class CommandJobTest : public ClusterFixture {
 protected:
  CommandJobTest() : ClusterFixture("aidn-command-test") {}

  void SetUp() override {
    if (!TorchImports()) GTEST_SKIP() << "/usr/bin/python3 cannot import torch (python3-torch)";
    ClusterFixture::SetUp();
    // The ranks run as nobody: the test's directory must be reachable.
    chmod(cluster().dir().c_str(), 0755);
    const absl::Status started = cluster().StartCoordinator(
        {"--worker-timeout=3s", "--heartbeat-interval=500ms", "--stop-grace=1s"});
    ASSERT_TRUE(started.ok()) << started;
  }

  void TearDown() override {
    for (const std::string& job : jobs_) {
      EXPECT_TRUE(WaitFor([&] { return ProcessesOfJob(cluster().address(), job).empty(); },
                          milliseconds(15'000)))
          << "processes of " << job << " outlived it";
    }
    ClusterFixture::TearDown();
  }

  void StartWorkers(const std::vector<std::string>& ids, std::vector<std::string> args = {}) {
    args.insert(args.begin(), {"--command-user=nobody", "--stop-grace=2s"});
    ASSERT_TRUE(cluster().StartWorkers(ids, {.args = args}));
  }

  v1::JobSpec Spec(const std::vector<std::string>& argv, int world_size = 2) {
    v1::JobSpec spec;
    spec.set_name("command");
    spec.set_world_size(world_size);
    for (const std::string& arg : argv) spec.mutable_command()->add_argv(arg);
    spec.set_max_restarts(0);
    return spec;
  }

  std::string Submit(const v1::JobSpec& spec) {
    absl::StatusOr<std::string> id = cluster().Submit(spec);
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return "";
    jobs_.push_back(*id);
    return *id;
  }

  std::vector<std::string> jobs_;
};

TEST_F(CommandJobTest, TwoRanksOnTwoWorkersGetTorchrunsContractAndSucceed) {
  StartWorkers({"w1", "w2"});
  v1::JobSpec spec = Spec({kPython, Script("ddp_env.py")});
  (*spec.mutable_command()->mutable_env())["USER_VAR"] = "hello";
  const std::string job = Submit(spec);
  ASSERT_FALSE(job.empty());
  v1::Job last;
  ASSERT_TRUE(cluster().WaitForState(job, v1::Job::SUCCEEDED, kJobTimeout, &last));

  std::map<int, nlohmann::json> reports = EnvReports(cluster(), job, 1);
  ASSERT_EQ(reports.size(), 2u) << cluster().EventText(job);
  std::set<std::string> groups;
  for (const auto& [rank, r] : reports) {
    EXPECT_EQ(r["WORLD_SIZE"], "2");
    EXPECT_EQ(r["LOCAL_RANK"], "0") << "one rank per worker";
    EXPECT_EQ(r["LOCAL_WORLD_SIZE"], "1");
    EXPECT_EQ(r["GROUP_WORLD_SIZE"], "2");
    EXPECT_EQ(r["ROLE_RANK"], absl::StrCat(rank));
    EXPECT_EQ(r["ROLE_NAME"], "default");
    EXPECT_EQ(r["TORCHELASTIC_RUN_ID"], job);
    EXPECT_EQ(r["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(r["TORCHELASTIC_MAX_RESTARTS"], "0");
    EXPECT_EQ(r["OMP_NUM_THREADS"], "1");
    EXPECT_EQ(r["PYTHONUNBUFFERED"], "1");
    EXPECT_EQ(r["AIDN_GENERATION"], "1");
    EXPECT_EQ(r["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(r["MASTER_PORT"], reports[0]["MASTER_PORT"]);
    EXPECT_DOUBLE_EQ(r["sum"].get<double>(), 3.0) << "all_reduce over both ranks";
    EXPECT_EQ(r["uid"], 65534) << "run as nobody, never as root";
    EXPECT_EQ(r["user_env"], "hello");
    EXPECT_TRUE(absl::EndsWith(r["cwd"].get<std::string>(), "/jobs/" + job));
    EXPECT_TRUE(absl::StrContains(r["TORCHELASTIC_ERROR_FILE"].get<std::string>(),
                                  absl::StrCat("gen-1/rank-", rank)));
    groups.insert(r["GROUP_RANK"].get<std::string>());
  }
  EXPECT_EQ(groups, (std::set<std::string>{"0", "1"}));
}

TEST_F(CommandJobTest, EveryGenerationGetsANewStore) {
  StartWorkers({"w1", "w2"});
  v1::JobSpec spec = Spec({kPython, Script("ddp_env.py")});
  spec.set_max_restarts(1);
  spec.mutable_timeouts()->mutable_restart_backoff()->set_nanos(100'000'000);
  // Rank 0 looks for the key in the store, then sets it; rank 1 fails
  // generation 1 after the barrier.
  (*spec.mutable_command()->mutable_env())["DDP_ENV_STORE_KEY"] = "left-by-an-earlier-generation";
  (*spec.mutable_command()->mutable_env())["FAIL_IN_GENERATION"] = "1";
  const std::string job = Submit(spec);
  v1::Job last;
  ASSERT_TRUE(cluster().WaitForState(job, v1::Job::SUCCEEDED, kJobTimeout, &last))
      << last.message();
  EXPECT_EQ(last.restarts(), 1);
  std::map<int, nlohmann::json> gen1 = EnvReports(cluster(), job, 1);
  std::map<int, nlohmann::json> gen2 = EnvReports(cluster(), job, 2);
  ASSERT_TRUE(gen1.contains(0) && gen2.contains(0)) << cluster().EventText(job);
  EXPECT_EQ(gen1[0]["saw_key"], false);
  EXPECT_EQ(gen2[0]["saw_key"], false) << "generation 2 read generation 1's store";
  EXPECT_EQ(gen2[0]["TORCHELASTIC_RESTART_COUNT"], "1");
  EXPECT_EQ(gen1[0]["TORCHELASTIC_USE_AGENT_STORE"], "True");
}

TEST_F(CommandJobTest, TwoJobsOnTheSameWorkersNeverShareAStoreOrAPort) {
  StartWorkers({"w1", "w2"}, {"--cpu-slots=2"});
  const std::string a = Submit(Spec({kPython, Script("ddp_env.py")}));
  v1::JobSpec rank0_binds = Spec({kPython, Script("ddp_env.py")});
  rank0_binds.mutable_command()->set_store(v1::CommandSpec::RANK0);
  const std::string b = Submit(rank0_binds);
  for (const std::string& job : {a, b}) {
    v1::Job last;
    ASSERT_TRUE(cluster().WaitForState(job, v1::Job::SUCCEEDED, kJobTimeout, &last))
        << job << ": " << last.message();
  }
  std::map<int, nlohmann::json> ra = EnvReports(cluster(), a, 1);
  std::map<int, nlohmann::json> rb = EnvReports(cluster(), b, 1);
  ASSERT_EQ(ra.size(), 2u);
  ASSERT_EQ(rb.size(), 2u);
  EXPECT_NE(ra[0]["MASTER_PORT"], rb[0]["MASTER_PORT"]);
  EXPECT_EQ(rb[0]["TORCHELASTIC_USE_AGENT_STORE"], "False");
  EXPECT_DOUBLE_EQ(rb[1]["sum"].get<double>(), 3.0);
}

TEST_F(CommandJobTest, AScriptThatRaisesFailsAfterItsRestartsWithTheExceptionNamed) {
  StartWorkers({"w1"});
  v1::JobSpec spec = Spec({kPython, Script("raises.py")}, 1);
  spec.set_max_restarts(1);
  spec.mutable_timeouts()->mutable_restart_backoff()->set_nanos(100'000'000);
  const std::string job = Submit(spec);
  v1::Job last;
  ASSERT_TRUE(cluster().WaitForState(job, v1::Job::FAILED, kJobTimeout, &last));
  EXPECT_EQ(last.restarts(), 1) << last.message();
  EXPECT_TRUE(absl::StrContains(last.message(), "ValueError: loss is nan at step 7"))
      << last.message();
}

TEST_F(CommandJobTest, AProgramThatDoesNotExistFailsAtOnceWithoutRestarts) {
  StartWorkers({"w1"});
  v1::JobSpec spec = Spec({"no-such-program-aidn", "--flag"}, 1);
  spec.set_max_restarts(3);
  const std::string job = Submit(spec);
  v1::Job last;
  ASSERT_TRUE(cluster().WaitForState(job, v1::Job::FAILED, kJobTimeout, &last));
  EXPECT_EQ(last.restarts(), 0) << last.message();
  EXPECT_TRUE(absl::StrContains(last.message(), "\"no-such-program-aidn\" not found on PATH"))
      << last.message();
}

TEST_F(CommandJobTest, AWorkerWithoutCommandJobsIsNotGivenOne) {
  StartWorkers({"w1"}, {"--no-command-jobs"});
  const std::string job = Submit(Spec({kPython, Script("ddp_env.py")}, 1));
  ASSERT_TRUE(cluster().WaitForJob(
      job, [](const v1::Job& j) { return absl::StrContains(j.message(), "run no command jobs"); },
      "a waiting message saying why", milliseconds(30'000)));
  EXPECT_EQ(cluster().GetJob(job).state(), v1::Job::PENDING);
  ASSERT_TRUE(cluster().Cancel(job).ok());
}

TEST_F(CommandJobTest, ARootWorkerWithoutACommandUserRunsNoCommandJobs) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root";
  ASSERT_TRUE(cluster().StartWorkers({"w1"}, {.args = {"--stop-grace=2s"}}));
  const std::string job = Submit(Spec({kPython, Script("ddp_env.py")}, 1));
  ASSERT_TRUE(cluster().WaitForJob(
      job, [](const v1::Job& j) { return absl::StrContains(j.message(), "run no command jobs"); },
      "the job waiting", milliseconds(30'000)));
  EXPECT_TRUE(absl::StrContains(cluster().WorkerLog("w1"), "no --command-user"));
  ASSERT_TRUE(cluster().Cancel(job).ok());
}

TEST_F(CommandJobTest, AJobCannotMakeTheRootWorkerChangeFilesOutsideItsDirectories) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root";
  StartWorkers({"w1"});
  // A root-owned directory the job points its own directories at with links
  // before it fails, hoping the next generation's start hands it over.
  const std::string target = cluster().Path("root-owned");
  std::filesystem::create_directories(target);
  const std::string script = absl::StrCat("rm -rf .aidn && ln -s ", target,
                                          " .aidn; rm -rf ckpt && ln -s ", target, " ckpt; exit 1");
  v1::JobSpec spec = Spec({"/bin/sh", "-c", script}, 1);
  spec.set_max_restarts(1);
  spec.mutable_timeouts()->mutable_restart_backoff()->set_nanos(100'000'000);
  const std::string job = Submit(spec);
  v1::Job last;
  ASSERT_TRUE(cluster().WaitForState(job, v1::Job::FAILED, kJobTimeout, &last));
  struct stat st = {};
  ASSERT_EQ(stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 0u) << "the worker handed a root-owned directory to the job's user";
  EXPECT_TRUE(std::filesystem::is_empty(target));
}

TEST_F(CommandJobTest, ARankThatClosesItsOutputOrPrintsAHundredMegabytesIsFine) {
  StartWorkers({"w1", "w2"});
  // Rank 0 prints 100 MB in 1 MB lines and a last line; rank 1 closes
  // stdout and stderr and goes on working.
  const std::string script =
      "if [ \"$RANK\" = 0 ]; then head -c 104857600 /dev/zero | tr '\\0' x | fold -w 1048576;"
      " echo; echo last-line; else exec 1>&- 2>&-; sleep 1; fi; exit 0";
  const std::string job = Submit(Spec({"/bin/sh", "-c", script}));
  v1::Job last;
  ASSERT_TRUE(cluster().WaitForState(job, v1::Job::SUCCEEDED, kJobTimeout, &last))
      << last.message();
}

}  // namespace
}  // namespace aidn::testing
