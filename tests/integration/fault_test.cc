// Fault injection on real processes over loopback: a real coordinator, real
// aidn-worker daemons sharing a checkpoint root (as nodes share storage),
// the trainers they start, and failures made the way they happen: kill -9,
// SIGSTOP, a corrupted file, a coordinator that dies and comes back.
//
// After every test no aidn process of the test is left and no temporary
// checkpoint directory is either.

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"

namespace aidn::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr milliseconds kLong{180'000};

std::string TrainerNeedle(const std::string& job, int64_t generation, int rank) {
  return absl::StrCat("--job=", job, " --generation=", generation, " --rank=", rank, " ");
}

// ||a - b|| / ||b|| over two tensor data sections of float32s.
double RelativeDiff(const std::string& a, const std::string& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i + 4 <= a.size() && i + 4 <= b.size(); i += 4) {
    float x = 0, y = 0;
    std::memcpy(&x, a.data() + i, 4);
    std::memcpy(&y, b.data() + i, 4);
    diff += (static_cast<double>(x) - y) * (static_cast<double>(x) - y);
    norm += static_cast<double>(y) * y;
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

class FaultTest : public ClusterFixture {
 protected:
  FaultTest() : ClusterFixture("aidn-fault-test") {}

  void SetUp() override {
    if (!FashionMnistInstalled()) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
    }
    ClusterFixture::SetUp();
    ckpt_root_ = cluster().Path("ckpt");
    const absl::Status started =
        cluster().StartCoordinator({"--worker-timeout=3s", "--heartbeat-interval=500ms",
                                    "--stop-grace=1s", "--checkpoint-ask-lead=300ms"});
    ASSERT_TRUE(started.ok()) << started;
  }

  // Worker daemons with one CPU slot each; all share the checkpoint root.
  void StartWorkers(const std::vector<std::string>& ids) {
    ASSERT_TRUE(cluster().StartWorkers(
        ids, {.args = {"--checkpoint-root=" + ckpt_root_, "--stop-grace=1s"}}));
  }

  void TearDown() override {
    if (cluster_ == nullptr) return;
    // 8. Nothing of the test is left running, and no unfinished checkpoint
    // directory is left behind.
    StopAllAndExpectNoProcesses();
    std::error_code error;
    for (auto it = fs::recursive_directory_iterator(ckpt_root_, error);
         !error && it != fs::recursive_directory_iterator(); ++it) {
      EXPECT_FALSE(absl::StartsWith(it->path().filename().string(), ".tmp-"))
          << "leaked temporary checkpoint directory " << it->path();
    }
    ClusterFixture::TearDown();
  }

  const std::string& dir() { return cluster().dir(); }

  // Small and quick, but long enough to interrupt: AdamW (moments to
  // restore) and dropout (a generator to restore).
  v1::JobSpec Spec(int world_size, int64_t steps) {
    v1::JobSpec spec;
    spec.set_name("fault-test");
    spec.set_world_size(world_size);
    spec.mutable_model()->set_name("mlp");
    spec.mutable_model()->add_hidden_sizes(128);
    spec.mutable_model()->add_hidden_sizes(64);
    spec.mutable_model()->set_dropout(0.1);
    spec.mutable_optimizer()->set_name("adamw");
    spec.mutable_optimizer()->set_lr(1e-3);
    spec.mutable_optimizer()->set_weight_decay(0.01);
    spec.set_batch_size(32);
    spec.set_max_steps(steps);
    spec.set_seed(7);
    spec.set_max_restarts(3);
    spec.mutable_checkpoint()->set_dir("runs");
    spec.mutable_checkpoint()->set_every_steps(50);
    spec.mutable_checkpoint()->set_keep_last(3);
    spec.mutable_timeouts()->mutable_restart_backoff()->set_nanos(200'000'000);
    return spec;
  }

  std::string Submit(const v1::JobSpec& spec) {
    absl::StatusOr<std::string> id = cluster().Submit(spec);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }
  v1::Job Get(const std::string& id) { return cluster().GetJob(id); }
  v1::Job WaitForEnd(const std::string& id) { return cluster().WaitForEnd(id, kLong); }
  std::string EventText(const std::string& id) { return cluster().EventText(id); }
  std::vector<v1::Checkpoint> Checkpoints(const std::string& id) {
    return cluster().Checkpoints(id);
  }

  std::string JobDir(const std::string& id) const { return absl::StrCat(ckpt_root_, "/runs/", id); }

  // The tensor data of the job's checkpoint of `steps` as aidnctl exports
  // it (a whole checkpoint's model.safetensors, or a sharded one's pieces
  // put together).
  std::string FinalWeights(const std::string& id, int64_t steps) {
    const std::string out = cluster().Path(absl::StrCat(id, "-", steps, ".safetensors"));
    CommandResult exported =
        cluster().Aidnctl({"export", id, "--step", absl::StrCat(steps), "-o", out, "--force"});
    if (exported.exit_code != 0) {
      ADD_FAILURE() << "aidnctl export " << id << ": " << exported.err;
      return "";
    }
    return TensorBytes(out);
  }

  // Waits until a checkpoint of `step` or later is committed.
  bool WaitForCommitted(const std::string& id, int64_t step) {
    bool ended = false;
    WaitFor(
        [&] {
          const v1::Job job = Get(id);
          ended = JobEnded(job);
          return ended || job.last_checkpoint_step() >= step;
        },
        kLong);
    return !ended && Get(id).last_checkpoint_step() >= step;
  }

  std::string TrainerLog(const std::string& worker, const std::string& job, int64_t generation,
                         int rank) const {
    return ReadFileOrEmpty(absl::StrCat(cluster_->WorkDir(worker), "/logs/", job, "/gen-",
                                        generation, "/rank-", rank, ".log"));
  }

  // Every step 1..n present once in the job's metric records.
  ::testing::AssertionResult NoMissingSteps(const std::string& id, int64_t n) {
    std::map<int64_t, int> seen;
    for (const v1::StepMetrics& m : cluster().Metrics(id)) {
      if (m.kind() == v1::MetricRecord::TRAIN) ++seen[m.step()];
    }
    std::vector<int64_t> missing, twice;
    for (int64_t step = 1; step <= n; ++step) {
      auto it = seen.find(step);
      if (it == seen.end()) missing.push_back(step);
      if (it != seen.end() && it->second > 1) twice.push_back(step);
    }
    if (missing.empty() && twice.empty()) return ::testing::AssertionSuccess();
    auto failure = ::testing::AssertionFailure();
    failure << missing.size() << " steps missing (";
    for (size_t i = 0; i < std::min<size_t>(missing.size(), 20); ++i) failure << missing[i] << " ";
    failure << "), " << twice.size() << " recorded twice";
    return failure;
  }

  void KillTrainer(const std::string& job, int64_t generation, int rank, int sig) {
    std::vector<pid_t> pids;
    ASSERT_TRUE(WaitFor(
        [&] {
          pids = ProcessesWith({dir(), TrainerNeedle(job, generation, rank)});
          return pids.size() == 1;
        },
        kLong))
        << "no trainer of rank " << rank;
    ASSERT_EQ(::kill(pids[0], sig), 0);
  }

  std::string ckpt_root_;
};

// 1. kill -9 a trainer mid-run: the job resumes from its last checkpoint and
// ends with weights bitwise equal to an uninterrupted run's, with 1 and 2
// ranks. Retention keeps the newest keep_last checkpoints.
TEST_F(FaultTest, AKilledTrainerResumesFromItsCheckpointAndEndsBitwiseEqual) {
  StartWorkers({"w1", "w2"});
  constexpr int64_t kSteps = 2000;
  for (int world : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(world, " ranks"));
    const std::string reference = Submit(Spec(world, kSteps));
    v1::Job ref = WaitForEnd(reference);
    ASSERT_EQ(ref.state(), v1::Job::SUCCEEDED) << ref.message();
    EXPECT_EQ(ref.restarts(), 0);

    const std::string id = Submit(Spec(world, kSteps));
    ASSERT_TRUE(WaitForCommitted(id, 100));
    KillTrainer(id, 1, world - 1, SIGKILL);
    v1::Job job = WaitForEnd(id);
    ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
    EXPECT_EQ(job.restarts(), 1);
    EXPECT_EQ(job.generation(), 2);
    EXPECT_EQ(job.last_checkpoint_step(), kSteps);

    const std::string a = FinalWeights(reference, kSteps);
    const std::string b = FinalWeights(id, kSteps);
    ASSERT_FALSE(a.empty());
    EXPECT_TRUE(a == b) << "final weights differ from the uninterrupted run's";

    // The second generation resumed from a checkpoint (not from scratch).
    std::string log;
    for (const char* w : {"w1", "w2"}) log += TrainerLog(w, id, 2, 0);
    EXPECT_TRUE(absl::StrContains(log, "resuming from a checkpoint")) << log;
    // keep_last 3: the three newest committed checkpoints, the last at the
    // end, plus the one this generation resumed from; on disk exactly the
    // directories the registry lists.
    std::vector<v1::Checkpoint> checkpoints = Checkpoints(id);
    ASSERT_GE(checkpoints.size(), 3u) << EventText(id);
    ASSERT_LE(checkpoints.size(), 4u) << EventText(id);
    EXPECT_EQ(checkpoints.back().step(), kSteps);
    std::set<std::string> listed, on_disk;
    for (const v1::Checkpoint& c : checkpoints) {
      EXPECT_TRUE(c.committed()) << c.step();
      listed.insert(absl::StrFormat("step-%08d", c.step()));
    }
    for (const auto& e : fs::directory_iterator(JobDir(id))) {
      on_disk.insert(e.path().filename().string());
    }
    EXPECT_EQ(listed, on_disk);

    // The final weights go out as a verified safetensors file.
    const std::string exported = cluster().Path(id + ".safetensors");
    CommandResult export_run = cluster().Aidnctl({"export", id, "-o", exported});
    EXPECT_EQ(export_run.exit_code, 0) << export_run.err;
    EXPECT_EQ(
        ReadFileOrEmpty(exported),
        ReadFileOrEmpty(absl::StrFormat("%s/step-%08d/model.safetensors", JobDir(id), kSteps)));
  }
}

// Damages a checkpoint file: "truncate" cuts it in half, "flip" flips a bit
// in its middle.
void Corrupt(const std::string& file, const std::string& how) {
  if (how == "truncate") {
    fs::resize_file(file, fs::file_size(file) / 2);
    return;
  }
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(fs::file_size(file) / 2));
  char c = 0;
  f.read(&c, 1);
  f.seekp(static_cast<std::streamoff>(fs::file_size(file) / 2));
  c = static_cast<char>(c ^ 0x04);
  f.write(&c, 1);
}

// 5. The newest checkpoint is corrupt (a truncated file; a flipped byte)
// when a trainer dies: the job resumes from the one before, says why, and
// still ends bitwise equal to an uninterrupted run.
TEST_F(FaultTest, ACorruptNewestCheckpointIsSkippedForThePreviousOne) {
  StartWorkers({"w1", "w2"});
  constexpr int64_t kSteps = 300;
  const std::string reference = Submit(Spec(2, kSteps));
  ASSERT_EQ(WaitForEnd(reference).state(), v1::Job::SUCCEEDED);
  for (const std::string corruption : {"truncate", "flip"}) {
    SCOPED_TRACE(corruption);
    const std::string id = Submit(Spec(2, kSteps));
    ASSERT_TRUE(WaitForCommitted(id, 75));
    // Freeze rank 0 (the writer) so the newest committed checkpoint stays
    // the newest while it is damaged.
    std::vector<pid_t> writer;
    ASSERT_TRUE(WaitFor(
        [&] {
          writer = ProcessesWith({dir(), TrainerNeedle(id, 1, 0)});
          return writer.size() == 1;
        },
        kLong, "the writer's trainer"));
    ASSERT_EQ(::kill(writer[0], SIGSTOP), 0);
    ASSERT_TRUE(
        WaitFor([&] { return ProcessState(writer[0]) == 'T'; }, kLong, "the writer stopped"));
    // A commit the writer sent just before it stopped may still land, so
    // every checkpoint on disk newer than `previous` is damaged: whichever
    // of them ends up the newest committed one, the resume must skip it.
    std::vector<v1::Checkpoint> checkpoints = Checkpoints(id);
    int64_t newest = 0, previous = 0;
    for (const v1::Checkpoint& c : checkpoints) {
      if (!c.committed()) continue;
      previous = newest;
      newest = c.step();
    }
    ASSERT_GT(previous, 0) << "need two committed checkpoints";
    int damaged = 0;
    for (const auto& entry : fs::directory_iterator(JobDir(id))) {
      int64_t step = 0;
      const std::string name = entry.path().filename().string();
      if (!absl::StartsWith(name, "step-") || !absl::SimpleAtoi(name.substr(5), &step) ||
          step <= previous) {
        continue;
      }
      const std::string file = entry.path().string() + "/model.safetensors";
      if (!fs::exists(file)) continue;
      Corrupt(file, corruption);
      ++damaged;
    }
    ASSERT_GE(damaged, 1) << "the newest committed checkpoint, step " << newest;
    ASSERT_EQ(::kill(writer[0], SIGKILL), 0);

    v1::Job job = WaitForEnd(id);
    ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
    const std::string events = EventText(id);
    EXPECT_TRUE(absl::StrContains(events, "checkpoint.invalid")) << events;
    EXPECT_TRUE(absl::StrContains(events, "model.safetensors")) << events;
    std::string log;
    for (const char* w : {"w1", "w2"}) log += TrainerLog(w, id, 2, 0);
    EXPECT_TRUE(absl::StrContains(log, absl::StrCat("step=", previous))) << log;
    EXPECT_TRUE(FinalWeights(reference, kSteps) == FinalWeights(id, kSteps))
        << "final weights differ from the uninterrupted run's";
  }
}

// 2. kill -9 a worker daemon: its trainers die with it and the job moves to
// the spare worker within the worker timeout plus a few seconds.
TEST_F(FaultTest, AKilledWorkersRanksMoveToTheSpareWorker) {
  StartWorkers({"w1", "w2", "w3"});
  constexpr int64_t kSteps = 600;
  const std::string id = Submit(Spec(2, kSteps));
  ASSERT_TRUE(WaitForCommitted(id, 50));
  const v1::Job running = Get(id);
  ASSERT_EQ(running.placement_size(), 2);
  std::set<std::string> used;
  for (const v1::RankPlacement& p : running.placement()) used.insert(p.worker_id());
  std::string spare;
  for (const char* w : {"w1", "w2", "w3"}) {
    if (!used.contains(w)) spare = w;
  }
  const std::string victim = running.placement(1).worker_id();
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_NE(cluster().worker(victim), nullptr) << victim;
  cluster().worker(victim)->Signal(SIGKILL);
  ASSERT_TRUE(cluster().worker(victim)->Wait(seconds(10)).ok());
  // Its trainer died with it (PR_SET_PDEATHSIG).
  EXPECT_TRUE(WaitFor(
      [&] {
        return ProcessesWith({dir(), TrainerNeedle(id, 1, 1)}).empty();
      },
      seconds(5)));
  ASSERT_TRUE(WaitFor(
      [&] {
        const v1::Job j = Get(id);
        if (j.generation() < 2 || j.state() != v1::Job::RUNNING) return false;
        for (const v1::RankPlacement& p : j.placement()) {
          if (p.worker_id() == spare) return true;
        }
        return false;
      },
      seconds(30)))
      << EventText(id);
  const double moved_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  EXPECT_LT(moved_s, 3.0 + 10.0) << "worker_timeout 3s";
  v1::Job job = WaitForEnd(id);
  EXPECT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
  EXPECT_EQ(job.restarts(), 1);
  // The root cause is the lost worker, not the healthy rank that failed
  // first on the broken connection; `events JOB` shows the loss. The job
  // may end before the worker's silence reaches worker_timeout (its second
  // generation is short), so the loss is waited for.
  EXPECT_TRUE(WaitFor([&] { return cluster().HasEvent("worker.lost", id, victim); }, seconds(30)))
      << EventText(id);
  auto named = [&] {
    for (const char* type : {"job.restarting", "job.cause"}) {
      for (const std::string& m : cluster().EventMessages(id, type)) {
        if (absl::StrContains(m, absl::StrCat("root cause of generation 1's failure: "
                                              "worker ",
                                              victim, " lost")) ||
            (absl::StartsWith(m, "restart 1 of") &&
             absl::StrContains(m, absl::StrCat(": worker ", victim, " lost")))) {
          return true;
        }
      }
    }
    return false;
  };
  EXPECT_TRUE(WaitFor(named, seconds(30))) << EventText(id);
}

TEST_F(FaultTest, ADrainedWorkersJobMovesAtItsNextCheckpointCountingNoRestart) {
  StartWorkers({"w1", "w2", "w3"});
  // The move comes at the checkpoint the ranks are asked for or at the next
  // periodic one, whichever commits first (the pause test below covers the
  // asked-for one alone).
  constexpr int64_t kSteps = 600;
  const std::string id = Submit(Spec(2, kSteps));
  ASSERT_TRUE(WaitForCommitted(id, 50));
  const v1::Job running = Get(id);
  ASSERT_EQ(running.placement_size(), 2);
  const std::string victim = running.placement(0).worker_id();

  // As an operator before maintenance: drain, and wait until it is empty.
  CommandResult drain = cluster().Aidnctl({"workers", "drain", victim, "--reason", "kernel update",
                                           "--wait", "--wait-timeout", "120s"});
  ASSERT_EQ(drain.exit_code, 0) << drain.err << "\n" << EventText(id);
  EXPECT_THAT(drain.out, HasSubstr("draining " + victim + ": " + id));
  EXPECT_THAT(drain.out, HasSubstr("drained " + victim));
  const v1::Job moved = Get(id);
  EXPECT_EQ(moved.generation(), 2) << EventText(id);
  EXPECT_EQ(moved.restarts(), 0);
  for (const v1::RankPlacement& p : moved.placement()) EXPECT_NE(p.worker_id(), victim);
  EXPECT_FALSE(cluster().EventMessages(id, "job.moving").empty()) << EventText(id);

  CommandResult workers = cluster().Aidnctl({"workers"});
  EXPECT_THAT(workers.out, HasSubstr("ALIVE,drained")) << workers.out;
  // The trainer of generation 1 there has exited.
  EXPECT_TRUE(WaitFor(
      [&] {
        return ProcessesWith({dir(), TrainerNeedle(id, 1, 0)}).empty();
      },
      seconds(10)));

  const v1::Job job = WaitForEnd(id);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_TRUE(NoMissingSteps(id, kSteps));

  // Uncordoned, it takes ranks again.
  CommandResult uncordon = cluster().Aidnctl({"workers", "uncordon", victim});
  ASSERT_EQ(uncordon.exit_code, 0) << uncordon.err;
  EXPECT_THAT(cluster().Aidnctl({"workers"}).out, Not(HasSubstr("drained")));
}

// Paused as before a maintenance window (or at a Slurm allocation's end):
// the ranks checkpoint at a step they agree on, outside the spec's schedule,
// and stop; the job holds no slots until resumed, counts no restart, misses
// no step, and ends with the weights of a run never paused.
TEST_F(FaultTest, APausedJobCheckpointsAtAnAgreedStepAndResumesAsIfNeverPaused) {
  StartWorkers({"w1", "w2"});
  // Steps take a third to half a millisecond, and the agreed step lies
  // about 0.3 s of training ahead (--checkpoint-ask-lead): 600-1,000 steps,
  // well inside the run even when the pause is asked a second or two in.
  constexpr int64_t kSteps = 6000;
  v1::JobSpec spec = Spec(2, kSteps);
  // Only the last step on the schedule: the pause's checkpoint is its own.
  spec.mutable_checkpoint()->set_every_steps(0);
  const std::string reference = Submit(spec);
  const v1::Job ref = WaitForEnd(reference);
  ASSERT_EQ(ref.state(), v1::Job::SUCCEEDED) << ref.message();

  const std::string id = Submit(spec);
  ASSERT_TRUE(cluster().WaitForJob(
      id, [](const v1::Job& j) { return j.state() == v1::Job::RUNNING && j.last_step() >= 100; },
      "RUNNING past step 100", kLong));
  CommandResult pause = cluster().Aidnctl(
      {"pause", id, "--reason", "maintenance", "--wait", "--wait-timeout", "120s"},
      std::chrono::seconds(130));
  ASSERT_EQ(pause.exit_code, 0) << pause.err << "\n" << EventText(id);
  EXPECT_THAT(pause.out, HasSubstr("pausing " + id));
  EXPECT_THAT(pause.out, HasSubstr("paused " + id + " at checkpoint step"));

  const v1::Job paused = Get(id);
  ASSERT_EQ(paused.state(), v1::Job::PAUSED) << paused.message() << "\n" << EventText(id);
  ASSERT_LT(paused.last_checkpoint_step(), kSteps) << "the job ended before the pause";
  EXPECT_THAT(paused.message(), HasSubstr("paused by admin: maintenance"));
  EXPECT_EQ(paused.restarts(), 0);
  EXPECT_EQ(paused.placement_size(), 0);
  EXPECT_FALSE(paused.has_pausing());
  // The step the ranks agreed on is the checkpoint the job stopped at.
  const std::vector<std::string> agreed = cluster().EventMessages(id, "job.checkpoint_agreed");
  ASSERT_EQ(agreed.size(), 1u) << EventText(id);
  EXPECT_THAT(agreed[0],
              HasSubstr(absl::StrCat("at step ", paused.last_checkpoint_step(), " to pause")));
  EXPECT_FALSE(cluster().EventMessages(id, "job.pausing").empty()) << EventText(id);
  // No trainer of it is left, and its slots are free.
  EXPECT_TRUE(WaitFor(
      [&] {
        return ProcessesWith({dir(), "--job=" + id + " "}).empty();
      },
      seconds(15)));
  CommandResult workers = cluster().Aidnctl({"-o", "json", "workers"});
  EXPECT_THAT(workers.out, Not(HasSubstr(id))) << workers.out;
  // Neither a second pause nor a resume of a running job is taken.
  CommandResult again = cluster().Aidnctl({"pause", id});
  EXPECT_NE(again.exit_code, 0);
  EXPECT_THAT(again.err, HasSubstr("already paused"));

  CommandResult resume = cluster().Aidnctl({"resume", id});
  ASSERT_EQ(resume.exit_code, 0) << resume.err;
  EXPECT_THAT(resume.out,
              HasSubstr(absl::StrCat("resumed ", id, ": continues from checkpoint step ",
                                     paused.last_checkpoint_step())));
  const v1::Job job = WaitForEnd(id);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_TRUE(NoMissingSteps(id, kSteps));
  const std::string a = FinalWeights(reference, kSteps);
  ASSERT_FALSE(a.empty());
  EXPECT_TRUE(a == FinalWeights(id, kSteps)) << "final weights differ from the unpaused run's";
  CommandResult resumed_again = cluster().Aidnctl({"resume", id});
  EXPECT_NE(resumed_again.exit_code, 0);
  EXPECT_THAT(resumed_again.err, HasSubstr("has already ended (SUCCEEDED)"));
}

// A job that writes no checkpoints is not paused (it would lose its
// progress); one that waits for slots pauses at once.
TEST_F(FaultTest, PauseRefusesAJobWithoutCheckpointsAndPausesAQueuedOneAtOnce) {
  StartWorkers({"w1"});
  v1::JobSpec spec = Spec(1, 100'000);
  spec.clear_checkpoint();
  const std::string running = Submit(spec);
  ASSERT_TRUE(cluster().WaitForState(running, v1::Job::RUNNING, kLong));
  CommandResult refused = cluster().Aidnctl({"pause", running});
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_THAT(refused.err, HasSubstr("writes no checkpoints"));
  EXPECT_EQ(Get(running).state(), v1::Job::RUNNING);

  // One slot, taken: the next job waits, and pauses without running.
  const std::string queued = Submit(Spec(1, 100));
  ASSERT_TRUE(cluster().WaitForState(queued, v1::Job::PENDING, kLong));
  CommandResult pause = cluster().Aidnctl({"pause", queued});
  ASSERT_EQ(pause.exit_code, 0) << pause.err;
  EXPECT_THAT(pause.out, HasSubstr("paused " + queued));
  EXPECT_EQ(Get(queued).state(), v1::Job::PAUSED);
  // Paused, it is not placed when the slot frees.
  ASSERT_TRUE(cluster().Cancel(running).ok());
  ASSERT_TRUE(cluster().WaitForState(running, v1::Job::CANCELLED, kLong));
  EXPECT_EQ(Get(queued).state(), v1::Job::PAUSED);
  CommandResult resume = cluster().Aidnctl({"resume", queued});
  ASSERT_EQ(resume.exit_code, 0) << resume.err;
  const v1::Job job = WaitForEnd(queued);
  EXPECT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(queued);
}

// 3. A SIGSTOPped trainer is a hang: detected within the progress timeout,
// named, killed (not left behind), and the job recovers.
TEST_F(FaultTest, AStoppedTrainerIsDetectedAsAHangNamedAndKilled) {
  StartWorkers({"w1", "w2"});
  // Long enough that the stop lands mid-training, not after a rank is done
  // (600 steps can all be over, on a busy machine, before the test sees the
  // first commit).
  v1::JobSpec spec = Spec(2, 3000);
  spec.mutable_timeouts()->mutable_progress()->set_seconds(3);
  const std::string id = Submit(spec);
  ASSERT_TRUE(WaitForCommitted(id, 50));
  std::vector<pid_t> pids;
  ASSERT_TRUE(WaitFor(
      [&] {
        pids = ProcessesWith({dir(), TrainerNeedle(id, 1, 1)});
        return pids.size() == 1;
      },
      kLong));
  ASSERT_EQ(::kill(pids[0], SIGSTOP), 0);
  const auto stopped_at = std::chrono::steady_clock::now();
  ASSERT_LT(Get(id).last_step(), 3000) << "the job ended before the stop";
  ASSERT_TRUE(WaitFor([&] { return Get(id).generation() >= 2; }, seconds(30))) << EventText(id);
  const double detected_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped_at).count();
  EXPECT_LT(detected_s, 3.0 + 3.0) << "progress timeout 3s";
  const std::string events = EventText(id);
  EXPECT_TRUE(absl::StrContains(events, "rank 1")) << events;
  // The stopped process is killed, not left behind.
  EXPECT_TRUE(WaitFor(
      [&] {
        return ::kill(pids[0], 0) != 0 || ProcessesWith({dir(), TrainerNeedle(id, 1, 1)}).empty();
      },
      seconds(15)));
  v1::Job job = WaitForEnd(id);
  EXPECT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
}

// 4. kill -9 the coordinator mid-run and start it again at once, or after
// 20 s: the job finishes without a restart and its records miss no step.
TEST_F(FaultTest, ACoordinatorRestartDoesNotRestartTheJobNorLoseSteps) {
  StartWorkers({"w1", "w2"});
  for (int pause_s : {0, 20}) {
    SCOPED_TRACE(absl::StrCat("coordinator away ", pause_s, " s"));
    const int64_t steps = pause_s == 0 ? 1500 : 6000;
    const std::string id = Submit(Spec(2, steps));
    ASSERT_TRUE(WaitForCommitted(id, 50));
    ASSERT_TRUE(cluster().KillCoordinator().ok());
    // The outage itself is the scenario: the coordinator stays away for this
    // long on the real clock (longer than the worker timeout), while the
    // trainers go on training and buffer their records.
    std::this_thread::sleep_for(seconds(pause_s));
    // Same state directory and, so that the workers find it, the same
    // address.
    const absl::Status restarted = cluster().RestartCoordinator(/*same_address=*/true);
    ASSERT_TRUE(restarted.ok()) << restarted;
    v1::Job job = WaitForEnd(id);
    ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
    EXPECT_EQ(job.restarts(), 0) << EventText(id);
    EXPECT_EQ(job.generation(), 1);
    EXPECT_TRUE(NoMissingSteps(id, steps));
    EXPECT_EQ(job.last_checkpoint_step(), steps) << EventText(id);
  }
}

// 6. A job whose trainers always crash fails after exactly max_restarts
// restarts, with growing waits between them, and a job beside it is not
// disturbed.
TEST_F(FaultTest, AnAlwaysCrashingJobFailsAfterMaxRestartsWithBackoff) {
  StartWorkers({"w1", "w2"});
  v1::JobSpec good_spec = Spec(1, 3000);
  const std::string good = Submit(good_spec);
  ASSERT_TRUE(cluster().WaitForState(good, v1::Job::RUNNING, kLong));
  v1::JobSpec bad_spec = Spec(1, 3000);
  bad_spec.set_max_restarts(3);
  const std::string bad = Submit(bad_spec);
  // Every trainer of the bad job is killed as soon as it appears.
  std::atomic<bool> done{false};
  std::thread killer([&] {
    WaitFor(
        [&] {
          for (pid_t pid : ProcessesWith({dir(), "--job=" + bad + " "})) ::kill(pid, SIGKILL);
          return done.load();
        },
        2 * kLong);
  });
  v1::Job job = WaitForEnd(bad);
  done = true;
  killer.join();
  EXPECT_EQ(job.state(), v1::Job::FAILED);
  EXPECT_EQ(job.restarts(), 3) << job.message();
  EXPECT_TRUE(absl::StrContains(job.message(), "max_restarts 3")) << job.message();
  // Backoff 0.2 s, 0.4 s, 0.8 s: the gaps between a failure and the next
  // start grow.
  std::vector<v1::Event> events = cluster().Events(bad);
  std::vector<double> failed_at, scheduled_at;
  for (const v1::Event& e : events) {
    const double t = e.time().seconds() + e.time().nanos() * 1e-9;
    if (e.type() == "job.restarting") failed_at.push_back(t);
    if (e.type() == "job.scheduled" && !failed_at.empty()) scheduled_at.push_back(t);
  }
  ASSERT_EQ(failed_at.size(), 3u) << EventText(bad);
  ASSERT_EQ(scheduled_at.size(), 3u) << EventText(bad);
  for (int k = 0; k < 3; ++k) {
    EXPECT_GE(scheduled_at[k] - failed_at[k], 0.2 * (1 << k) * 0.95) << "restart " << k + 1;
  }
  v1::Job other = WaitForEnd(good);
  EXPECT_EQ(other.state(), v1::Job::SUCCEEDED) << other.message();
  EXPECT_EQ(other.restarts(), 0);
}

// 7. A trainer of an old generation that comes back late is refused and
// exits; it never sees the new generation's store keys.
TEST_F(FaultTest, ALateTrainerOfAnOldGenerationIsRefused) {
  StartWorkers({"w1", "w2"});
  const std::string id = Submit(Spec(2, 3000));
  ASSERT_TRUE(WaitForCommitted(id, 25));
  KillTrainer(id, 1, 1, SIGKILL);
  ASSERT_TRUE(WaitFor(
      [&] { return Get(id).generation() == 2 && Get(id).state() == v1::Job::RUNNING; }, kLong))
      << EventText(id);
  // The store of generation 2 holds Gloo's keys; generation 1 cannot read
  // them, not even with a worker's credential.
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("gloo/0");
  v1::KvGetResponse value;
  grpc::Status s = cluster().cluster()->KvGet(Context(cluster().worker_token()).get(), get, &value);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_FALSE(value.found());
  // A real trainer process of generation 1 starting late exits with the
  // superseded code (75) without joining.
  const std::string work = cluster().Path("late");
  fs::create_directories(work);
  absl::StatusOr<std::unique_ptr<Process>> late = Process::Start(
      {AIDN_WORKER_BIN, "train", "--coordinator=" + cluster().address(), "--job=" + id,
       "--generation=1", "--rank=1", "--world-size=2", "--worker-id=w2", "--work-dir=" + work,
       "--checkpoint-root=" + ckpt_root_, "--tls-ca=" + cluster().coordinator().ca_file},
      {"AIDN_TRAINER_TOKEN=" + cluster().worker_token()}, work + "/out", work + "/err");
  ASSERT_TRUE(late.ok()) << late.status();
  absl::StatusOr<int> code = (*late)->Wait(seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 75) << ReadFileOrEmpty(work + "/err");
  EXPECT_TRUE(absl::StrContains(ReadFileOrEmpty(work + "/err"), "generation"))
      << ReadFileOrEmpty(work + "/err");
  // The job carried on undisturbed.
  v1::Job job = WaitForEnd(id);
  EXPECT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
  EXPECT_EQ(job.restarts(), 1);
}

// 9. A rank killed (kill -9) right after a checkpoint was written, while its
// peer is stopped by the coordinator, loses no metric step: a checkpoint is a
// resume point only once the job's records up to its step are stored, and a
// trainer stopped with SIGTERM sends what it holds first. The same with the
// coordinator killed at that moment too and started again. Every step
// 1..N ends up recorded exactly once.
TEST_F(FaultTest, ARankKilledRightAfterACheckpointLosesNoMetricStep) {
  StartWorkers({"w1", "w2"});
  // Long enough that rank 1 is still training when the first checkpoint
  // lands, however busy the machine.
  constexpr int64_t kSteps = 3000;
  for (bool kill_coordinator : {false, true}) {
    SCOPED_TRACE(kill_coordinator ? "with the coordinator killed too" : "rank only");
    const std::string id = Submit(Spec(2, kSteps));
    // The first checkpoint directory on disk: rank 0 renamed it into place
    // and is sending its commit now.
    const std::string first = absl::StrFormat("%s/step-%08d", JobDir(id), 50);
    ASSERT_TRUE(WaitFor([&] { return fs::exists(first + "/state.txt") || JobEnded(Get(id)); },
                        kLong, "the first checkpoint written"));
    KillTrainer(id, 1, 1, SIGKILL);
    if (kill_coordinator) {
      ASSERT_TRUE(cluster().KillCoordinator().ok());
      const absl::Status restarted = cluster().RestartCoordinator(/*same_address=*/true);
      ASSERT_TRUE(restarted.ok()) << restarted;
    }
    v1::Job job = WaitForEnd(id);
    ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
    EXPECT_GE(job.restarts(), 1) << EventText(id);
    EXPECT_TRUE(NoMissingSteps(id, kSteps)) << EventText(id);
  }
}

// A plain-text corpus with the shape of language (words, sentences, lines),
// made up from a seed so the test needs no package: about `bytes` bytes.
std::string MadeUpCorpus(size_t bytes) {
  static const char* const kWords[] = {
      "the",   "a",  "cat",    "dog",   "sat",     "on",      "mat",   "and",    "ran", "to",
      "house", "of", "with",   "is",    "was",     "red",     "big",   "little", "we",  "saw",
      "it",    "in", "garden", "every", "morning", "quietly", "bread", "river",  "old", "man"};
  std::mt19937_64 rng(3);
  std::string text;
  while (text.size() < bytes) {
    const int words = 3 + static_cast<int>(rng() % 8);
    for (int w = 0; w < words; ++w) {
      std::string word = kWords[rng() % std::size(kWords)];
      if (w == 0) word[0] = static_cast<char>(word[0] - 'a' + 'A');
      text += word;
      text += w + 1 == words ? ".\n" : " ";
    }
  }
  return text;
}

// 9. A language model: a GPT job on text trains (its validation loss falls,
// its records carry tokens and peak memory), a rank killed with SIGKILL
// resumes to weights bitwise equal to an uninterrupted run's (text windows,
// their shifts and dropout seeds included), and aidnctl generates from its
// checkpoint what PyTorch's reading of the export (GPT-2 names, layouts)
// generates too.
TEST_F(FaultTest, AGptJobResumesBitwiseAndItsCheckpointGeneratesText) {
  StartWorkers({"w1", "w2"});
  const std::string corpus = cluster().Path("corpus.txt");
  { std::ofstream(corpus) << MadeUpCorpus(150'000); }
  constexpr int64_t kSteps = 2000;
  auto spec = [&] {
    v1::JobSpec s = Spec(2, kSteps);
    s.set_name("gpt-fault-test");
    s.mutable_model()->Clear();
    s.mutable_model()->set_name("gpt");
    s.mutable_model()->set_config("gpt-nano");  // 2 layers, 2 heads, 32 wide, context 32
    s.mutable_model()->set_dropout(0.1);
    s.mutable_dataset()->set_kind("text");
    s.mutable_dataset()->add_files(corpus);
    s.mutable_dataset()->set_eval_windows(32);
    s.mutable_optimizer()->set_lr(3e-3);
    s.mutable_optimizer()->set_grad_clip_norm(1.0);
    s.set_batch_size(8);
    s.set_eval_every_steps(500);
    s.mutable_checkpoint()->set_every_steps(100);
    return s;
  };
  const std::string reference = Submit(spec());
  const v1::Job ref = WaitForEnd(reference);
  ASSERT_EQ(ref.state(), v1::Job::SUCCEEDED) << ref.message() << "\n" << EventText(reference);

  const std::string id = Submit(spec());
  ASSERT_TRUE(WaitForCommitted(id, 100));
  KillTrainer(id, 1, 1, SIGKILL);
  const v1::Job job = WaitForEnd(id);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
  EXPECT_EQ(job.restarts(), 1);
  const std::string a = FinalWeights(reference, kSteps);
  ASSERT_FALSE(a.empty());
  EXPECT_TRUE(a == FinalWeights(id, kSteps)) << "final weights differ from the uninterrupted run's";

  // Learning: validation loss per byte from about ln 256 = 5.5 down, every
  // 500 steps; every step's record counts its tokens (8 windows of 32 on
  // each of 2 ranks) and the ranks' peak memory.
  std::vector<double> val;
  for (const v1::StepMetrics& m : cluster().Metrics(reference)) {
    if (m.kind() == v1::MetricRecord::EVAL) val.push_back(m.test_loss());
    if (m.kind() != v1::MetricRecord::TRAIN) continue;
    EXPECT_EQ(m.tokens(), 2 * 8 * 32) << "step " << m.step();
    EXPECT_GT(m.tokens_per_second(), 0) << "step " << m.step();
    EXPECT_GT(m.peak_memory_bytes(), 1 << 20) << "step " << m.step();
  }
  ASSERT_GE(val.size(), 4u);  // every 500 steps, and at each epoch's end
  EXPECT_LT(val.back(), val.front());
  EXPECT_LT(val.back(), 3.0) << "validation loss after " << kSteps << " steps";

  // Generation from the job's newest checkpoint: the prompt and 40 bytes.
  CommandResult greedy =
      cluster().Aidnctl({"generate", id, "--greedy", "--length", "40", "--prompt", "The "});
  ASSERT_EQ(greedy.exit_code, 0) << greedy.err;
  EXPECT_EQ(greedy.out.size(), 4u + 40u + 1u) << greedy.out;
  EXPECT_TRUE(absl::StartsWith(greedy.out, "The ")) << greedy.out;
  // Draws are seeded: the same seed, the same text.
  const std::vector<std::string> drawn = {"generate", id,  "--top-k",  "5",
                                          "--seed",   "9", "--length", "60"};
  CommandResult first = cluster().Aidnctl(drawn);
  CommandResult second = cluster().Aidnctl(drawn);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  EXPECT_EQ(first.out, second.out);
  // An export generates as its checkpoint does, here and in PyTorch.
  const std::string exported = cluster().Path("gpt.safetensors");
  ASSERT_EQ(cluster().Aidnctl({"export", id, "-o", exported}).exit_code, 0);
  CommandResult from_file = cluster().Aidnctl(
      {"generate", "--file", exported, "--greedy", "--length", "40", "--prompt", "The "});
  EXPECT_EQ(from_file.out, greedy.out) << from_file.err;
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0) {
    CommandResult torch_run = RunCommand(
        {"/usr/bin/python3", absl::StrCat(AIDN_SOURCE_DIR, "/tests/integration/gpt_torch.py"),
         "generate", exported, "The ", "40"},
        {}, kLong);
    ASSERT_EQ(torch_run.exit_code, 0) << torch_run.err;
    EXPECT_EQ(torch_run.out + "\n", greedy.out);
  }
  // Bad requests say what is wrong.
  CommandResult neither = cluster().Aidnctl({"generate"});
  EXPECT_NE(neither.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(neither.err, "name a job or a --file")) << neither.err;
  CommandResult mlp = cluster().Aidnctl({"generate", "--file", cluster().Path("missing.st")});
  EXPECT_NE(mlp.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(mlp.err, "missing.st")) << mlp.err;
}

// 10. ZeRO-1, ZeRO-2 and FSDP (full_shard and shard_grad_op): a rank
// killed with SIGKILL resumes from a sharded checkpoint (every rank wrote
// its pieces, every rank reads its own back) to weights bitwise equal to an
// uninterrupted run of the same strategy, and those end where DDP's end
// (float rounding of the reduce-scatter and the clipping norm apart).
struct ShardedCase {
  const char* name;
  v1::JobSpec::Strategy strategy;
  v1::FsdpSpec::Sharding sharding;
  // A GPT on text, the sharded runs with activation checkpointing, instead
  // of the MLP.
  bool gpt = false;
};

class ShardedFaultTest : public FaultTest, public ::testing::WithParamInterface<ShardedCase> {};

TEST_P(ShardedFaultTest, ResumesBitwiseAndEndsWhereDdpEnds) {
  StartWorkers({"w1", "w2"});
  const bool gpt = GetParam().gpt;
  const int64_t kSteps = gpt ? 600 : 2000;
  const std::string corpus = cluster().Path("corpus.txt");
  if (gpt) std::ofstream(corpus) << MadeUpCorpus(60'000);
  auto spec = [&](v1::JobSpec::Strategy strategy) {
    v1::JobSpec s = Spec(2, kSteps);
    if (gpt) {
      s.mutable_model()->Clear();
      s.mutable_model()->set_name("gpt");
      s.mutable_model()->set_config("gpt-nano");
      s.mutable_model()->set_dropout(0.1);
      s.mutable_model()->set_activation_checkpointing(strategy != v1::JobSpec::DDP);
      s.mutable_dataset()->set_kind("text");
      s.mutable_dataset()->add_files(corpus);
      s.mutable_dataset()->set_eval_windows(8);
      s.set_batch_size(4);
      s.set_eval_every_steps(200);
    }
    s.set_strategy(strategy);
    if (strategy == v1::JobSpec::FSDP) s.mutable_fsdp()->set_sharding(GetParam().sharding);
    s.set_bucket_mb(0.05);  // several buckets, parameters split between the ranks' shards
    s.mutable_optimizer()->set_grad_clip_norm(1.0);
    return s;
  };
  const v1::JobSpec::Strategy strategy = GetParam().strategy;
  const std::string ddp = Submit(spec(v1::JobSpec::DDP));
  const std::string reference = Submit(spec(strategy));
  for (const std::string& id : {ddp, reference}) {
    const v1::Job job = WaitForEnd(id);
    ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
  }
  const std::string id = Submit(spec(strategy));
  ASSERT_TRUE(WaitForCommitted(id, 100));
  KillTrainer(id, 1, 1, SIGKILL);
  const v1::Job job = WaitForEnd(id);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
  EXPECT_EQ(job.restarts(), 1);
  // Each rank wrote its own files; rank 0's manifest names them all.
  const std::string last = absl::StrFormat("%s/step-%08d", JobDir(id), kSteps);
  for (const char* file :
       {"model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors",
        "optimizer-00000-of-00002.safetensors", "optimizer-00001-of-00002.safetensors"}) {
    EXPECT_TRUE(absl::StrContains(ReadFileOrEmpty(last + "/MANIFEST"), file)) << file;
  }
  EXPECT_FALSE(std::filesystem::exists(last + "/model.safetensors"));
  const std::string sharded = FinalWeights(reference, kSteps);
  ASSERT_FALSE(sharded.empty());
  EXPECT_TRUE(sharded == FinalWeights(id, kSteps))
      << "final weights differ from the uninterrupted run's";
  std::string log;
  for (const char* w : {"w1", "w2"}) log += TrainerLog(w, id, 1, 0) + TrainerLog(w, id, 1, 1);
  EXPECT_TRUE(absl::StrContains(
      log, absl::StrCat("model state sharded strategy=", v1::JobSpec::Strategy_Name(strategy))))
      << log;

  const std::string with_ddp = FinalWeights(ddp, kSteps);
  ASSERT_EQ(with_ddp.size(), sharded.size());
  EXPECT_LT(RelativeDiff(sharded, with_ddp), 1e-5)
      << GetParam().name << " against DDP after " << kSteps << " steps";
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, ShardedFaultTest,
    ::testing::Values(ShardedCase{"Zero1", v1::JobSpec::ZERO1, v1::FsdpSpec::SHARDING_UNSPECIFIED},
                      ShardedCase{"Zero2", v1::JobSpec::ZERO2, v1::FsdpSpec::SHARDING_UNSPECIFIED},
                      ShardedCase{"FsdpFullShard", v1::JobSpec::FSDP, v1::FsdpSpec::FULL_SHARD},
                      ShardedCase{"FsdpShardGradOp", v1::JobSpec::FSDP,
                                  v1::FsdpSpec::SHARD_GRAD_OP},
                      ShardedCase{"FsdpGptActivationCheckpointing", v1::JobSpec::FSDP,
                                  v1::FsdpSpec::FULL_SHARD, /*gpt=*/true}),
    [](const ::testing::TestParamInfo<ShardedCase>& info) { return info.param.name; });

// 12. A GPT split over model-parallel ranks: a pipeline of 2 stages
// (1F1B, each batch of 8 cut into 2 micro-batches), 2 tensor-parallel ranks,
// and both (2 x 2). Each is within 1e-5 of one rank accumulating the same
// micro-batches after 50 steps (1e-4 after 200: float rounding of the
// reordered sums, grown by AdamW); a rank
// killed with SIGKILL resumes from a checkpoint whose pieces each rank wrote
// (the tied wte the first stage, tensor slices by their ranks) and ends
// bitwise where the uninterrupted job ends; every step's samples are counted
// once; evaluations agree with one rank's; one rank goes on from the job's
// checkpoint (checkpoint.resume_from).
//
// Under ZeRO-1 with 2 replicas (of 2 tensor ranks, 2 stages, or 2 x 2),
// each rank's optimizer state is split between the replicas and every rank
// writes its shards' state: the same checks against one rank accumulating
// both replicas' micro-batches.
struct ModelParallelCase {
  const char* name;
  int tensor;
  int pipeline;
  int data = 1;
  bool zero1 = false;
};

class ModelParallelFaultTest : public FaultTest,
                               public ::testing::WithParamInterface<ModelParallelCase> {};

TEST_P(ModelParallelFaultTest, ResumesBitwiseAndEndsWhereOneRankEnds) {
  const int tensor = GetParam().tensor;
  const int stages = GetParam().pipeline;
  const int data = GetParam().data;
  const int world = data * tensor * stages;
  std::vector<std::string> workers;
  for (int w = 1; w <= std::max(2, world); ++w) workers.push_back(absl::StrCat("w", w));
  StartWorkers(workers);
  constexpr int64_t kSteps = 200;
  const std::string corpus = cluster().Path("corpus.txt");
  { std::ofstream(corpus) << MadeUpCorpus(60'000); }
  auto spec = [&](bool parallel) {
    v1::JobSpec s = Spec(parallel ? world : 1, kSteps);
    s.mutable_model()->Clear();
    s.mutable_model()->set_name("gpt");
    s.mutable_model()->set_config("gpt-nano");  // 2 layers, 2 heads
    // No biases: the key third of c_attn's bias has a true gradient of 0,
    // whose rounding noise (summed in another order here) AdamW turns into
    // steps of about lr, as engine_zero_test explains.
    s.mutable_model()->set_bias(false);
    s.mutable_dataset()->set_kind("text");
    s.mutable_dataset()->add_files(corpus);
    s.mutable_dataset()->set_eval_windows(8);
    s.mutable_optimizer()->set_grad_clip_norm(1.0);
    s.set_eval_every_steps(100);
    s.mutable_checkpoint()->set_keep_last(4);  // 50, 100, 150, 200
    if (parallel && stages > 1) {
      s.set_batch_size(8);
      s.mutable_parallel()->set_pipeline(stages);
      s.mutable_parallel()->set_micro_batches(2);
    } else {
      // One rank accumulates every replica's micro-batches.
      s.set_batch_size(4);
      s.set_grad_accum_steps(2 * (parallel ? 1 : data));
    }
    if (parallel) s.mutable_parallel()->set_tensor(tensor);
    if (parallel && GetParam().zero1) s.set_strategy(v1::JobSpec::ZERO1);
    return s;
  };
  const std::string one = Submit(spec(false));
  const std::string reference = Submit(spec(true));
  for (const std::string& id : {one, reference}) {
    const v1::Job job = WaitForEnd(id);
    ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
  }
  const std::string id = Submit(spec(true));
  ASSERT_TRUE(WaitForCommitted(id, 50));
  KillTrainer(id, 1, 1, SIGKILL);
  const v1::Job job = WaitForEnd(id);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
  EXPECT_EQ(job.restarts(), 1);
  const std::string last = absl::StrFormat("%s/step-%08d", JobDir(id), kSteps);
  for (int r = 0; r < world; ++r) {
    const std::string file = absl::StrFormat("model-%05d-of-%05d.safetensors", r, world);
    EXPECT_TRUE(absl::StrContains(ReadFileOrEmpty(last + "/MANIFEST"), file)) << file;
  }
  const std::string split = FinalWeights(reference, kSteps);
  ASSERT_FALSE(split.empty());
  EXPECT_TRUE(split == FinalWeights(id, kSteps))
      << "final weights differ from the uninterrupted run's";
  // Against one rank: within 1e-5 after 50 steps; after 200, AdamW has
  // grown the rounding of the reordered sums (a split GEMM's partial
  // products, the all-reduces) to about 2e-5 in the attention weights.
  const std::string early = FinalWeights(reference, 50);
  const std::string early_single = FinalWeights(one, 50);
  ASSERT_EQ(early.size(), early_single.size());
  EXPECT_LT(RelativeDiff(early, early_single), 1e-5) << "against one rank at step 50";
  const std::string single = FinalWeights(one, kSteps);
  ASSERT_EQ(single.size(), split.size());
  EXPECT_LT(RelativeDiff(split, single), 1e-4) << "against one rank";
  // The checkpoint goes on without model parallelism, on one rank.
  v1::JobSpec on = spec(false);
  on.mutable_checkpoint()->mutable_resume_from()->set_job(reference);
  on.mutable_checkpoint()->mutable_resume_from()->set_step(100);
  const std::string resumed = Submit(on);
  const v1::Job resumed_job = WaitForEnd(resumed);
  ASSERT_EQ(resumed_job.state(), v1::Job::SUCCEEDED) << resumed_job.message() << "\n"
                                                     << EventText(resumed);
  EXPECT_LT(RelativeDiff(FinalWeights(resumed, kSteps), single), 1e-4)
      << "one rank going on from step 100";

  // One rank counts the replica's samples (8 windows of 32 tokens a step);
  // every rank reports the same loss, which is one rank's.
  const std::vector<v1::StepMetrics> a = cluster().Metrics(reference);
  const std::vector<v1::StepMetrics> b = cluster().Metrics(one);
  int evals = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i].kind() == v1::MetricRecord::EVAL) {
      ++evals;
      EXPECT_NEAR(a[i].test_loss(), b[i].test_loss(), 1e-4) << "evaluation at " << a[i].step();
      EXPECT_NEAR(a[i].test_accuracy(), b[i].test_accuracy(), 1e-4)
          << "evaluation at " << a[i].step();
      continue;
    }
    EXPECT_EQ(a[i].tokens(), data * 8 * 32) << "step " << a[i].step();
    EXPECT_NEAR(a[i].loss(), b[i].loss(), 1e-4 * std::max(1.0, b[i].loss()))
        << "step " << a[i].step();
  }
  EXPECT_GE(evals, 2);
  std::string log;
  for (const std::string& w : workers) log += TrainerLog(w, reference, 1, world - 1);
  EXPECT_TRUE(
      absl::StrContains(log, absl::StrCat("model-parallel rank ready replica=", data - 1,
                                          " tensor_rank=", tensor - 1, " stage=", stages - 1)))
      << log;
  if (GetParam().zero1) {
    EXPECT_TRUE(absl::StrContains(log, "optimizer state sharded over the replicas")) << log;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ModelParallelFaultTest,
                         ::testing::Values(ModelParallelCase{"Pipeline2", 1, 2},
                                           ModelParallelCase{"Tensor2", 2, 1},
                                           ModelParallelCase{"Tensor2Pipeline2", 2, 2},
                                           ModelParallelCase{"Zero1Replicas2Tensor2", 2, 1,
                                                             /*data=*/2, /*zero1=*/true},
                                           ModelParallelCase{"Zero1Replicas2Pipeline2", 1, 2,
                                                             /*data=*/2, /*zero1=*/true},
                                           ModelParallelCase{"Zero1Replicas2Tensor2Pipeline2", 2, 2,
                                                             /*data=*/2, /*zero1=*/true}),
                         [](const ::testing::TestParamInfo<ModelParallelCase>& info) {
                           return info.param.name;
                         });

// 11. A job checkpointed by 4 ZeRO-2 ranks goes on at 2 ranks under FSDP
// and at 3 under ZeRO-1 (checkpoint.resume_from, the global batch kept at
// 24): the checkpoint is resharded on load, and both end where the 4 ranks'
// uninterrupted run ends (float rounding of the reductions apart). A
// reference that does not fit is refused at submission, saying why.
TEST_F(FaultTest, AJobCheckpointedAtFourRanksGoesOnAtTwoOrThree) {
  StartWorkers({"w1", "w2", "w3", "w4"});
  constexpr int64_t kHalf = 150, kSteps = 300;
  auto spec = [&](int world, v1::JobSpec::Strategy strategy, int64_t steps) {
    v1::JobSpec s = Spec(world, steps);
    s.mutable_model()->set_dropout(0);  // each rank's draws depend on the world size
    s.set_batch_size(24 / world);
    s.set_strategy(strategy);
    s.set_bucket_mb(0.05);
    return s;
  };
  const std::string first = Submit(spec(4, v1::JobSpec::ZERO2, kHalf));
  const std::string reference = Submit(spec(4, v1::JobSpec::ZERO2, kSteps));
  for (const std::string& id : {first, reference}) {
    const v1::Job job = WaitForEnd(id);
    ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
  }
  v1::JobSpec at2 = spec(2, v1::JobSpec::FSDP, kSteps);
  at2.mutable_checkpoint()->mutable_resume_from()->set_job(first);  // its newest
  v1::JobSpec at3 = spec(3, v1::JobSpec::ZERO1, kSteps);
  at3.mutable_checkpoint()->mutable_resume_from()->set_job(first);
  at3.mutable_checkpoint()->mutable_resume_from()->set_step(kHalf);
  const std::string two = Submit(at2);
  const std::string three = Submit(at3);
  EXPECT_EQ(Get(two).spec().checkpoint().resume_from().step(), kHalf);
  const std::string want = FinalWeights(reference, kSteps);
  ASSERT_FALSE(want.empty());
  for (const auto& [id, world] : {std::pair{two, 2}, std::pair{three, 3}}) {
    const v1::Job job = WaitForEnd(id);
    ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message() << "\n" << EventText(id);
    EXPECT_EQ(job.restarts(), 0);
    const std::string got = FinalWeights(id, kSteps);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_LT(RelativeDiff(got, want), 1e-5) << world << " ranks against 4";
    // It went on from step kHalf: its first record is the step after.
    const std::vector<v1::StepMetrics> metrics = cluster().Metrics(id);
    ASSERT_FALSE(metrics.empty());
    EXPECT_EQ(metrics.front().step(), kHalf + 1);
    std::string log;
    for (const char* w : {"w1", "w2", "w3", "w4"}) log += TrainerLog(w, id, 1, 0);
    EXPECT_TRUE(absl::StrContains(log, absl::StrCat("job=", first, " step=", kHalf))) << log;
    EXPECT_TRUE(absl::StrContains(
        log, absl::StrCat("resharding a checkpoint written_by=4 world_size=", world)))
        << log;
  }

  // What does not fit is refused, and says why.
  auto refused = [&](v1::JobSpec s) {
    absl::StatusOr<std::string> id = cluster().Submit(s);
    return id.ok() ? std::string("accepted") : std::string(id.status().message());
  };
  v1::JobSpec bad = at2;
  bad.mutable_checkpoint()->mutable_resume_from()->set_job("job-999");
  EXPECT_THAT(refused(bad), HasSubstr("there is no job job-999"));
  bad = at2;
  bad.set_batch_size(8);
  EXPECT_THAT(refused(bad), HasSubstr("global batch of 24"));
  bad = at2;
  bad.mutable_checkpoint()->mutable_resume_from()->set_step(7);
  EXPECT_THAT(refused(bad), HasSubstr("no committed, valid checkpoint of step 7 (it has steps 50, "
                                      "100, 150)"));
  bad = at2;
  bad.mutable_model()->clear_hidden_sizes();
  bad.mutable_model()->add_hidden_sizes(64);
  EXPECT_THAT(refused(bad), HasSubstr("trained another model"));
}

}  // namespace
}  // namespace aidn::testing
