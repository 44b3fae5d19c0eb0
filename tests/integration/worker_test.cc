// The worker daemon end to end: a real aidn-coordinator and real aidn-worker
// daemons on loopback. The trainers are small shell scripts (given to the
// daemon as --trainer-binary) that exit at once, crash, or sleep until
// killed, so these tests are about supervision, not training.

#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "aidn/v1/job.pb.h"
#include "common/tls.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"

#ifndef AIDN_WORKER_BIN
#error "AIDN_WORKER_BIN must name the aidn-worker binary"
#endif

namespace aidn::testing {
namespace {

using ::testing::AssertionFailure;
using ::testing::AssertionResult;
using ::testing::AssertionSuccess;
using ::testing::HasSubstr;
using ::testing::Not;

// Generous: other agents compile on the same 2 cores.
constexpr std::chrono::milliseconds kLong{30'000};
// "Within a few seconds" for stopping trainers, with room for a loaded
// machine.
constexpr std::chrono::milliseconds kFewSeconds{10'000};

// Trainer stand-ins. Each parses the flags it is given, records them (and
// whether the token arrived in its environment) in its work dir, then acts.
constexpr char kScriptPrologue[] = R"(#!/bin/sh
wd=. rank=x
for a in "$@"; do
  case "$a" in
    --work-dir=*) wd="${a#--work-dir=}" ;;
    --rank=*) rank="${a#--rank=}" ;;
    --generation=*) gen="${a#--generation=}" ;;
  esac
done
echo "$@" > "$wd/rank-$rank.gen-$gen.args"
if [ -n "$AIDN_TRAINER_TOKEN" ]; then echo set > "$wd/rank-$rank.token"; fi
)";
// Exits 0 at once.
constexpr char kExitZero[] = "echo trainer done\nexit 0\n";
// Crashes: exit code 3, "boom" as its last stderr line.
constexpr char kCrash[] = "echo starting\necho boom >&2\nexit 3\n";
// Sleeps until killed, with a grandchild in its process group; writes both
// pids (the file is renamed into place, so it is never read half-written).
constexpr char kSleepWithChild[] = R"(sleep 1000 &
child=$!
echo "$$ $child" > "$wd/rank-$rank.pids.tmp"
mv "$wd/rank-$rank.pids.tmp" "$wd/rank-$rank.pids"
wait
)";
// Sleeps until killed, as a single process.
constexpr char kSleepAlone[] = R"(echo "$$" > "$wd/rank-$rank.pids.tmp"
mv "$wd/rank-$rank.pids.tmp" "$wd/rank-$rank.pids"
exec sleep 1000
)";

std::vector<pid_t> ParsePids(const std::string& text) {
  std::vector<pid_t> pids;
  for (absl::string_view word : absl::StrSplit(text, absl::ByAnyChar(" \n"), absl::SkipEmpty())) {
    int pid = 0;
    if (absl::SimpleAtoi(word, &pid) && pid > 0) pids.push_back(pid);
  }
  return pids;
}

v1::JobSpec Spec(int32_t world_size, int32_t max_restarts = 0) {
  v1::JobSpec spec;
  spec.set_name("worker-test");
  spec.set_world_size(world_size);
  spec.set_device(v1::JobSpec::CPU);
  spec.mutable_model()->set_name("mlp");
  spec.set_epochs(1);
  spec.set_max_restarts(max_restarts);
  return spec;
}

class WorkerTest : public ClusterFixture {
 protected:
  WorkerTest() : ClusterFixture("aidn-worker-test") {}

  void StartCoordinatorWith(const std::vector<std::string>& args,
                            const std::string& state = "state") {
    const absl::Status started = cluster().StartCoordinator(args, state);
    ASSERT_TRUE(started.ok()) << started;
  }

  // Heartbeats every 300 ms; a worker silent for 2 s is lost.
  void StartDefaultCoordinator() {
    StartCoordinatorWith(
        {"--worker-timeout=2s", "--heartbeat-interval=300ms", "--tick-interval=50ms"});
  }

  // Writes a trainer script (prologue + `body`) and returns its path.
  std::string WriteScript(const std::string& name, const std::string& body) {
    const std::string path = cluster().Path(name + ".sh");
    WriteFileOrDie(path, absl::StrCat(kScriptPrologue, body));
    std::filesystem::permissions(path, std::filesystem::perms::owner_all);
    return path;
  }

  // Starts an aidn-worker daemon with one CPU slot.
  Process* StartWorker(const std::string& id, const std::string& trainer_script,
                       const std::vector<std::string>& extra_args = {}) {
    std::vector<std::string> args = {"--work_dir=" + cluster().WorkDir(id),  // underscores work too
                                     "--trainer-binary=" + trainer_script, "--stop-grace=2s",
                                     "--metrics-addr=127.0.0.1:0", "--log-level=debug"};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    const absl::Status started = cluster().StartWorker(id, {.args = args});
    EXPECT_TRUE(started.ok()) << started;
    return cluster().worker(id);
  }

  std::map<std::string, v1::Worker> Workers() { return cluster().Workers(); }
  bool WorkerIs(const std::string& id, v1::Worker::State state) {
    return cluster().WorkerIs(id, state);
  }

  std::string Submit(const v1::JobSpec& spec) {
    absl::StatusOr<std::string> id = cluster().Submit(spec);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }

  v1::Job GetJob(const std::string& job_id) { return cluster().GetJob(job_id); }

  AssertionResult WaitForJobState(const std::string& job_id, v1::Job::State state,
                                  std::chrono::milliseconds timeout = kLong) {
    return cluster().WaitForState(job_id, state, timeout);
  }

  std::vector<std::string> EventLines(const std::string& job_id) {
    std::vector<std::string> lines;
    for (const v1::Event& e : cluster().Events(job_id)) {
      lines.push_back(absl::StrCat(e.seq(), " ", e.type(), " gen=", e.generation(),
                                   " worker=", e.worker_id(), ": ", e.message()));
    }
    return lines;
  }

  std::vector<std::string> EventMessages(const std::string& job_id, const std::string& type) {
    return cluster().EventMessages(job_id, type);
  }

  void Cancel(const std::string& job_id) {
    const absl::Status cancelled = cluster().Cancel(job_id);
    ASSERT_TRUE(cancelled.ok()) << cancelled;
  }

  std::string Log(const std::string& id) { return cluster().WorkerLog(id); }

  // Waits for the pid file a sleeping trainer script writes for `rank` in
  // the job directory of any worker; returns the pids in it.
  std::vector<pid_t> WaitForTrainerPids(const std::string& job_id, int rank) {
    std::vector<pid_t> pids;
    WaitFor(
        [&] {
          for (const std::string& id : cluster().worker_ids()) {
            pids = ParsePids(ReadFileOrEmpty(
                absl::StrCat(cluster().WorkDir(id), "/jobs/", job_id, "/rank-", rank, ".pids")));
            if (!pids.empty()) return true;
          }
          return false;
        },
        kLong);
    return pids;
  }

  AssertionResult WaitForAllDead(const std::vector<pid_t>& pids,
                                 std::chrono::milliseconds timeout = kFewSeconds) {
    if (WaitFor(
            [&] {
              for (pid_t pid : pids) {
                if (!IsDead(pid)) return false;
              }
              return true;
            },
            timeout)) {
      return AssertionSuccess();
    }
    std::vector<pid_t> alive;
    for (pid_t pid : pids) {
      if (!IsDead(pid)) {
        alive.push_back(pid);
        kill(pid, SIGKILL);  // leave nothing behind, even on failure
      }
    }
    return AssertionFailure() << "still running after " << timeout.count()
                              << " ms: " << absl::StrJoin(alive, ", ");
  }
};

TEST_F(WorkerTest, TwoWorkersRegisterAndStayAlive) {
  StartDefaultCoordinator();
  const std::string script = WriteScript("exit0", kExitZero);
  StartWorker("w1", script);
  StartWorker("w2", script, {"--address=127.0.0.2", "--cpu-slots=3"});
  ASSERT_TRUE(WaitFor(
      [&] { return WorkerIs("w1", v1::Worker::ALIVE) && WorkerIs("w2", v1::Worker::ALIVE); },
      kLong));
  std::map<std::string, v1::Worker> workers = Workers();
  EXPECT_EQ(workers["w1"].info().cpu_slots(), 1);
  EXPECT_EQ(workers["w1"].info().address(), "127.0.0.1");
  EXPECT_FALSE(workers["w1"].info().hostname().empty());
  EXPECT_FALSE(workers["w1"].info().version().empty());
  EXPECT_EQ(workers["w2"].info().cpu_slots(), 3);
  EXPECT_EQ(workers["w2"].info().address(), "127.0.0.2");

  // Still alive well past the 2 s worker timeout: they keep heartbeating.
  const int64_t first = workers["w1"].last_heartbeat().seconds();
  ASSERT_TRUE(
      WaitFor([&] { return Workers()["w1"].last_heartbeat().seconds() >= first + 3; }, kLong));
  EXPECT_TRUE(WorkerIs("w1", v1::Worker::ALIVE));
  EXPECT_TRUE(WorkerIs("w2", v1::Worker::ALIVE));
  // The resolved configuration is logged as a table.
  EXPECT_THAT(Log("w1"), HasSubstr("trainer_binary"));
}

// A second worker daemon under a live worker's id (its own directory) is
// refused by the coordinator and says so in its log, while the first keeps
// its registration; once the first is gone (kill -9, then silent past the
// worker timeout) the second, still trying, takes the id. A daemon started
// on a directory another daemon holds does not start, naming the holder.
TEST_F(WorkerTest, ASecondWorkerUnderALiveWorkersIdOrDirectoryIsRefused) {
  StartDefaultCoordinator();
  const std::string script = WriteScript("exit0", kExitZero);
  Process* first = StartWorker("w1", script);
  ASSERT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::ALIVE); }, kLong));
  const std::string instance = Workers()["w1"].info().instance();
  EXPECT_EQ(instance.size(), 32u);

  StartWorker("twin", script, {"--worker-id=w1", "--address=127.0.0.2"});
  ASSERT_TRUE(
      WaitFor([&] { return absl::StrContains(Log("twin"), "belongs to a live worker"); }, kLong))
      << Log("twin");
  std::map<std::string, v1::Worker> workers = Workers();
  EXPECT_EQ(workers.size(), 1u);
  EXPECT_EQ(workers["w1"].info().instance(), instance);
  EXPECT_EQ(workers["w1"].info().address(), "127.0.0.1");
  EXPECT_TRUE(WorkerIs("w1", v1::Worker::ALIVE));

  // The same directory as w1's: refused before it registers anything.
  StartWorker("same-dir", script, {"--work-dir=" + cluster().WorkDir("w1")});
  absl::StatusOr<int> code = cluster().worker("same-dir")->Wait(kLong);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_NE(*code, 0);
  EXPECT_THAT(Log("same-dir"), HasSubstr(absl::StrCat("work_dir ", cluster().WorkDir("w1"),
                                                      " is in use by another aidn-worker (pid ",
                                                      first->pid(), ")")));

  first->Signal(SIGKILL);
  ASSERT_TRUE(first->Wait(kLong).ok());
  ASSERT_TRUE(WaitFor(
      [&] {
        const v1::Worker w = Workers()["w1"];
        return w.state() == v1::Worker::ALIVE && w.info().instance() != instance;
      },
      kLong))
      << Log("twin");
  EXPECT_EQ(Workers()["w1"].info().address(), "127.0.0.2");
}

TEST_F(WorkerTest, ATwoRankJobWhoseTrainersExitZeroSucceeds) {
  StartDefaultCoordinator();
  const std::string script = WriteScript("exit0", kExitZero);
  StartWorker("w1", script);
  StartWorker("w2", script);
  ASSERT_TRUE(WaitFor(
      [&] { return WorkerIs("w1", v1::Worker::ALIVE) && WorkerIs("w2", v1::Worker::ALIVE); },
      kLong));
  const std::string job = Submit(Spec(2));
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(WaitForJobState(job, v1::Job::SUCCEEDED));
  EXPECT_EQ(GetJob(job).generation(), 1);
  std::vector<std::string> exits = EventMessages(job, "trainer.exited");
  EXPECT_EQ(exits.size(), 2u) << absl::StrJoin(exits, "\n");
  for (const std::string& m : exits) EXPECT_THAT(m, HasSubstr("exited with code 0"));

  // One rank per worker (one slot each); each has its log file and was run
  // with the assignment's flags and the token in its environment.
  std::map<int, std::string> args;
  for (const std::string& id : cluster().worker_ids()) {
    for (int rank = 0; rank < 2; ++rank) {
      const std::string log =
          absl::StrCat(cluster().WorkDir(id), "/logs/", job, "/gen-1/rank-", rank, ".log");
      if (!std::filesystem::exists(log)) continue;
      EXPECT_EQ(ReadFileOrEmpty(log), "trainer done\n") << log;
      const std::string job_dir = absl::StrCat(cluster().WorkDir(id), "/jobs/", job);
      args[rank] = ReadFileOrEmpty(absl::StrCat(job_dir, "/rank-", rank, ".gen-1.args"));
      EXPECT_THAT(args[rank], HasSubstr("--work-dir=" + job_dir));
      EXPECT_THAT(args[rank], HasSubstr("--worker-id=" + id));
      EXPECT_EQ(ReadFileOrEmpty(absl::StrCat(job_dir, "/rank-", rank, ".token")), "set\n");
    }
  }
  ASSERT_EQ(args.size(), 2u) << "expected one log file per rank under the work dirs";
  for (const auto& [rank, a] : args) {
    EXPECT_THAT(a,
                HasSubstr(absl::StrCat("train --coordinator=", cluster().address(), " --job=", job,
                                       " --generation=1 --rank=", rank, " --world-size=2")));
    EXPECT_THAT(a, HasSubstr("--host=127.0.0.1 --slot=0 --threads=1"));
    EXPECT_THAT(a, Not(HasSubstr("token")));
  }
}

TEST_F(WorkerTest, ACrashingTrainerIsReportedWithItsCodeAndStderrAndTheJobFailsAfterItsRestarts) {
  StartDefaultCoordinator();
  StartWorker("w1", WriteScript("crash", kCrash));
  ASSERT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::ALIVE); }, kLong));
  const std::string job = Submit(Spec(1, /*max_restarts=*/1));
  ASSERT_TRUE(WaitForJobState(job, v1::Job::FAILED));
  const v1::Job ended = GetJob(job);
  EXPECT_EQ(ended.generation(), 2);
  EXPECT_EQ(ended.restarts(), 1);
  EXPECT_THAT(ended.message(), HasSubstr("code 3"));

  std::vector<std::string> exits = EventMessages(job, "trainer.exited");
  ASSERT_EQ(exits.size(), 2u) << absl::StrJoin(EventLines(job), "\n");
  for (const std::string& m : exits) {
    EXPECT_THAT(m, HasSubstr("code 3"));
    EXPECT_THAT(m, HasSubstr("boom"));
  }
  EXPECT_EQ(EventMessages(job, "job.restarting").size(), 1u);
  // One log per generation.
  const std::string logs = absl::StrCat(cluster().WorkDir("w1"), "/logs/", job);
  EXPECT_EQ(ReadFileOrEmpty(logs + "/gen-1/rank-0.log"), "starting\nboom\n");
  EXPECT_EQ(ReadFileOrEmpty(logs + "/gen-2/rank-0.log"), "starting\nboom\n");
}

TEST_F(WorkerTest, ATrainerExitingWithCode78FailsTheJobAtOnce) {
  StartDefaultCoordinator();
  StartWorker("w1", WriteScript("permanent", "echo 'dataset missing' >&2\nexit 78\n"));
  ASSERT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::ALIVE); }, kLong));
  const std::string job = Submit(Spec(1, /*max_restarts=*/3));
  ASSERT_TRUE(WaitForJobState(job, v1::Job::FAILED));
  EXPECT_EQ(GetJob(job).restarts(), 0);
  EXPECT_THAT(GetJob(job).message(), HasSubstr("dataset missing"));
}

// Mutual TLS: with --tls-client-ca the coordinator takes a worker token only
// over a connection with a client certificate from that CA; users' and
// trainers' calls need none.
TEST_F(WorkerTest, WithATlsClientCaAWorkerNeedsACertificateFromIt) {
  const std::string clients = cluster().Path("clients");
  ASSERT_TRUE(EnsureAutoTls({.dir = clients}).ok());  // a CA for the workers' certificates
  ASSERT_TRUE(IssueClientCertificate(clients, "w1", clients + "/w1.pem", clients + "/w1.key").ok());
  StartCoordinatorWith({"--worker-timeout=2s", "--heartbeat-interval=300ms", "--tick-interval=50ms",
                        "--tls-client-ca=" + clients + "/ca.pem"});
  StartWorker("w2", WriteScript("exit0", kExitZero));  // no certificate
  StartWorker("w1", WriteScript("exit0", kExitZero),
              {"--tls-cert=" + clients + "/w1.pem", "--tls-key=" + clients + "/w1.key"});
  ASSERT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::ALIVE); }, kLong));
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(Log("w2"), "client certificate signed by"); },
                      kLong, "w2 told it needs a certificate"));
  EXPECT_FALSE(Workers().contains("w2"));
  // Work still flows to the worker that has one.
  const std::string job = Submit(Spec(1));
  EXPECT_TRUE(WaitForJobState(job, v1::Job::SUCCEEDED));
}

// A job naming a path outside the roots every worker allows is refused at
// submission, naming the field (the workers report their roots), and no
// worker makes anything there.
TEST_F(WorkerTest, APathOutsideEveryWorkersRootsIsRefusedAtSubmission) {
  StartDefaultCoordinator();
  StartWorker("w1", WriteScript("exit0", kExitZero));
  ASSERT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::ALIVE); }, kLong));
  const std::string outside = absl::StrCat("/tmp/aidn-outside-", getpid());
  v1::JobSpec spec = Spec(1, /*max_restarts=*/3);
  spec.mutable_checkpoint()->set_dir(outside + "/ckpt");
  absl::StatusOr<std::string> job = cluster().Submit(spec);
  ASSERT_FALSE(job.ok());
  EXPECT_THAT(std::string(job.status().message()),
              HasSubstr("checkpoint.dir: " + outside +
                        "/ckpt is outside the paths every alive "
                        "worker allows (w1: /usr/share"));
  EXPECT_FALSE(std::filesystem::exists(outside));
}

// What only the worker can tell: a path under one of its roots that a link
// takes out of it. The job fails when the rank starts, naming the field, and
// nothing is made where the link points.
TEST_F(WorkerTest, ALinkOutOfAnAllowedRootFailsTheJobAndNothingIsMadeThere) {
  StartDefaultCoordinator();
  StartWorker("w1", WriteScript("exit0", kExitZero));
  ASSERT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::ALIVE); }, kLong));
  const std::string outside = absl::StrCat("/tmp/aidn-outside-", getpid());
  ASSERT_TRUE(std::filesystem::create_directory(outside));
  const std::string link = cluster().Path("escape");  // the cluster's directory is a root
  std::filesystem::create_directory_symlink(outside, link);
  v1::JobSpec spec = Spec(1, /*max_restarts=*/3);
  spec.mutable_checkpoint()->set_dir(link + "/ckpt");
  const std::string job = Submit(spec);
  ASSERT_TRUE(WaitForJobState(job, v1::Job::FAILED));
  EXPECT_EQ(GetJob(job).restarts(), 0);
  EXPECT_THAT(GetJob(job).message(),
              HasSubstr("checkpoint.dir: " + link + "/ckpt (" + outside + "/ckpt) is outside"));
  EXPECT_TRUE(std::filesystem::is_empty(outside));
  std::filesystem::remove(outside);
}

TEST_F(WorkerTest, CancellingAJobStopsEveryTrainerWithinSeconds) {
  StartDefaultCoordinator();
  const std::string script = WriteScript("sleep", kSleepWithChild);
  StartWorker("w1", script);
  StartWorker("w2", script);
  ASSERT_TRUE(WaitFor(
      [&] { return WorkerIs("w1", v1::Worker::ALIVE) && WorkerIs("w2", v1::Worker::ALIVE); },
      kLong));
  const std::string job = Submit(Spec(2));
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<pid_t> rank_pids = WaitForTrainerPids(job, rank);
    ASSERT_EQ(rank_pids.size(), 2u) << "rank " << rank << ": trainer and its child";
    pids.insert(pids.end(), rank_pids.begin(), rank_pids.end());
  }
  for (pid_t pid : pids) ASSERT_FALSE(IsDead(pid)) << pid;

  Cancel(job);
  EXPECT_TRUE(WaitForAllDead(pids));
  // Both exits are reported as stopped (SIGTERM), and the job stays cancelled.
  ASSERT_TRUE(WaitFor([&] { return EventMessages(job, "trainer.exited").size() == 2; }, kLong))
      << absl::StrJoin(EventLines(job), "\n");
  for (const std::string& m : EventMessages(job, "trainer.exited")) {
    EXPECT_THAT(m, HasSubstr("killed by signal 15"));
  }
  EXPECT_EQ(GetJob(job).state(), v1::Job::CANCELLED);
}

TEST_F(WorkerTest, KillingTheWorkerDaemonTakesItsTrainersAlongAndTheWorkerIsLost) {
  StartDefaultCoordinator();
  Process* w = StartWorker("w1", WriteScript("sleep", kSleepAlone));
  ASSERT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::ALIVE); }, kLong));
  const std::string job = Submit(Spec(1));
  const std::vector<pid_t> pids = WaitForTrainerPids(job, 0);
  ASSERT_EQ(pids.size(), 1u);
  ASSERT_FALSE(IsDead(pids[0]));

  w->Signal(SIGKILL);
  ASSERT_TRUE(w->Wait(kLong).ok());
  EXPECT_TRUE(WaitForAllDead(pids)) << "the trainer outlived its daemon";
  EXPECT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::LOST); }, kLong));
}

TEST_F(WorkerTest, StoppingTheWorkerDaemonStopsItsTrainersReportsThemAndExitsZero) {
  StartDefaultCoordinator();
  Process* w = StartWorker("w1", WriteScript("sleep", kSleepWithChild));
  ASSERT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::ALIVE); }, kLong));
  const std::string job = Submit(Spec(1));
  const std::vector<pid_t> pids = WaitForTrainerPids(job, 0);
  ASSERT_EQ(pids.size(), 2u);

  w->Signal(SIGTERM);
  absl::StatusOr<int> code = w->Wait(kLong);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_TRUE(WaitForAllDead(pids));
  // The exit was reported before the daemon left, not as stopped by order:
  // the generation fails (no restarts left) instead of waiting for the worker
  // timeout.
  EXPECT_THAT(EventMessages(job, "trainer.exited"),
              ::testing::ElementsAre(HasSubstr("killed by signal 15")));
  EXPECT_TRUE(WaitForJobState(job, v1::Job::FAILED));
}

TEST_F(WorkerTest, TrainersKeepRunningThroughACoordinatorRestart) {
  // A longer worker timeout: the restarted coordinator must hear from the
  // worker (whose retries back off up to 2 s) before it declares it lost.
  const std::vector<std::string> args = {"--worker-timeout=6s", "--heartbeat-interval=300ms",
                                         "--tick-interval=50ms"};
  StartCoordinatorWith(args);
  StartWorker("w1", WriteScript("sleep", kSleepAlone));
  ASSERT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::ALIVE); }, kLong));
  const std::string job = Submit(Spec(1));
  const std::vector<pid_t> pids = WaitForTrainerPids(job, 0);
  ASSERT_EQ(pids.size(), 1u);

  // kill -9 the coordinator; the worker keeps its trainer while it retries.
  ASSERT_TRUE(cluster().KillCoordinator().ok());
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(Log("w1"), "coordinator call failed"); },
                      kLong, "the worker noticing the coordinator was gone"));
  EXPECT_FALSE(IsDead(pids[0]));

  // The same port: the worker's address.
  const absl::Status restarted = cluster().RestartCoordinator(/*same_address=*/true);
  ASSERT_TRUE(restarted.ok()) << restarted;
  const int64_t restarted_at = absl::ToUnixSeconds(absl::Now());
  ASSERT_TRUE(WaitFor(
      [&] {
        v1::Worker worker = Workers()["w1"];
        return worker.state() == v1::Worker::ALIVE &&
               worker.last_heartbeat().seconds() >= restarted_at + 1;
      },
      kLong));
  EXPECT_FALSE(IsDead(pids[0]));
  EXPECT_EQ(GetJob(job).generation(), 1);

  // Orders reach the worker through the new coordinator.
  Cancel(job);
  EXPECT_TRUE(WaitForAllDead(pids));
}

TEST_F(WorkerTest, AWorkerRegistersAgainWithACoordinatorThatForgotIt) {
  // Two coordinators with separate state on the same port, sharing a worker
  // token through --token-file: the second has never heard of the worker.
  const std::string token_file = cluster().Path("tokens");
  WriteFileOrDie(token_file, "worker-test-token-0123456789 worker shared\n");
  const std::vector<std::string> args = {"--worker-timeout=2s", "--heartbeat-interval=300ms",
                                         "--tick-interval=50ms", "--token-file=" + token_file};
  StartCoordinatorWith(args, "state-a");
  WriteFileOrDie(cluster().Path("worker.token"), "worker-test-token-0123456789\n");
  StartWorker("w1", WriteScript("exit0", kExitZero),
              {"--token-file=" + cluster().Path("worker.token")});
  ASSERT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::ALIVE); }, kLong));
  // ALIVE in the coordinator is not enough: the worker must also have read the
  // answer, or a kill right after the coordinator stored it leaves a worker
  // whose first registration simply goes to the second coordinator.
  ASSERT_TRUE(
      WaitFor([&] { return absl::StrContains(Log("w1"), "registered with the coordinator"); },
              kLong, "the worker's registration"));

  const std::string address = cluster().address();
  ASSERT_TRUE(cluster().KillCoordinator().ok());
  std::vector<std::string> fresh_args = args;
  fresh_args.push_back("--listen=" + address);
  // Its database is new, its CA the old one's (which the worker trusts).
  std::filesystem::create_directories(cluster().Path("state-b"));
  std::filesystem::copy(cluster().Path("state-a/tls"), cluster().Path("state-b/tls"));
  StartCoordinatorWith(fresh_args, "state-b");
  ASSERT_TRUE(WaitFor([&] { return WorkerIs("w1", v1::Worker::ALIVE); }, kLong));
  EXPECT_THAT(Log("w1"), HasSubstr("registering again"));

  // And it takes work from the new coordinator: its trainer ran and its exit
  // was reported.
  const std::string job = Submit(Spec(1));
  EXPECT_TRUE(WaitFor(
      [&] {
        std::vector<std::string> exits = EventMessages(job, "trainer.exited");
        return exits.size() == 1 && exits[0].find("exited with code 0") != std::string::npos;
      },
      kLong))
      << absl::StrJoin(EventLines(job), "\n");
}

}  // namespace
}  // namespace aidn::testing
