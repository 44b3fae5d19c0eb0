// A network partition, made with a network namespace the test creates: one
// worker daemon (and so its trainers) runs inside it, joined to the host by
// a veth pair on a private /30; the coordinator listens on the host end.
// Its link is cut mid-job and mended later.
//
// Needs root (ip netns, ip link); skips, saying so, where the kernel or the
// container does not allow network namespaces.

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_manifest.h"
#include "common/digest.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/support/files.h"
#include "tests/support/netns.h"
#include "tests/support/process.h"
#include "tests/support/wait.h"

namespace aidn::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr milliseconds kLong{180'000};

class PartitionTest : public ClusterFixture {
 protected:
  PartitionTest() : ClusterFixture("aidn-partition-test") {}

  void SetUp() override {
    if (!FashionMnistInstalled()) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
    }
    std::string why;
    netns_ = Netns::Create(&why);
    if (netns_ == nullptr) GTEST_SKIP() << "cannot make a network namespace here: " << why;
    ClusterFixture::SetUp();
    const absl::Status started =
        cluster().StartCoordinator({"--listen=" + netns_->host_ip() + ":0", "--worker-timeout=3s",
                                    "--heartbeat-interval=500ms", "--stop-grace=1s"});
    ASSERT_TRUE(started.ok()) << started;
  }

  void TearDown() override {
    StopAllAndExpectNoProcesses();
    ClusterFixture::TearDown();
    netns_.reset();
  }

  std::unique_ptr<Netns> netns_;
};

TEST_F(PartitionTest, ACutOffWorkerIsReplacedAndItsTrainerIsFencedWhenTheLinkReturns) {
  const std::string ckpt = cluster().Path("ckpt");
  const std::vector<std::string> args = {"--checkpoint-root=" + ckpt, "--stop-grace=1s"};
  // The job starts on the worker in the namespace; the spare joins after.
  ASSERT_TRUE(cluster().StartWorker("cut", {.args = args, .wrapper = netns_->Exec()}).ok());
  ASSERT_TRUE(cluster().WaitForAliveWorkers(1));
  v1::JobSpec spec;
  spec.set_name("partition");
  spec.set_world_size(1);
  spec.mutable_model()->set_name("mlp");
  spec.mutable_model()->add_hidden_sizes(256);
  spec.set_batch_size(64);
  spec.set_max_steps(1'000'000);  // cancelled once the test has seen enough
  spec.set_seed(3);
  spec.set_max_restarts(5);
  spec.mutable_checkpoint()->set_dir("runs");
  spec.mutable_checkpoint()->set_every_steps(200);
  spec.mutable_checkpoint()->set_keep_last(3);
  spec.mutable_timeouts()->mutable_restart_backoff()->set_nanos(200'000'000);
  absl::StatusOr<std::string> submitted = cluster().Submit(spec);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const std::string job = *submitted;
  ASSERT_TRUE(cluster().WaitForJob(
      job, [](const v1::Job& j) { return j.last_checkpoint_step() >= 400; },
      "two checkpoints committed by generation 1", kLong));
  ASSERT_TRUE(cluster().StartWorker("spare", {.args = args, .wrapper = {}}).ok());
  ASSERT_TRUE(cluster().WaitForAliveWorkers(2));
  const std::string gen1 = absl::StrCat("--job=", job, " --generation=1 ");
  ASSERT_EQ(ProcessesWith({cluster().dir(), gen1}).size(), 1u);

  // The cut: found within the worker timeout (3 s, and the tick), and the
  // job goes on on the spare as generation 2.
  ASSERT_TRUE(netns_->SetLink(false));
  const auto cut_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(cluster().WaitForEvent("worker.lost", "", seconds(20), "cut"));
  EXPECT_LT(std::chrono::steady_clock::now() - cut_at, seconds(10));
  v1::Job job2;
  ASSERT_TRUE(cluster().WaitForJob(
      job, [](const v1::Job& j) { return j.generation() == 2 && j.state() == v1::Job::RUNNING; },
      "generation 2 running", kLong, &job2));
  ASSERT_EQ(job2.placement_size(), 1);
  EXPECT_EQ(job2.placement(0).worker_id(), "spare");
  // Generation 1 knows nothing of it: it trains on behind the cut.
  EXPECT_EQ(ProcessesWith({cluster().dir(), gen1}).size(), 1u);
  const int64_t resumed = job2.last_checkpoint_step();
  ASSERT_TRUE(cluster().WaitForJob(
      job, [&](const v1::Job& j) { return j.last_checkpoint_step() >= resumed + 400; },
      "generation 2 committing checkpoints", kLong));

  // The link comes back: the old trainer is refused as superseded and
  // exits; the worker is back too.
  ASSERT_TRUE(netns_->SetLink(true));
  EXPECT_TRUE(WaitFor(
      [&] {
        return ProcessesWith({cluster().dir(), gen1}).empty();
      },
      seconds(60), "generation 1's trainer fenced and gone"));
  ASSERT_TRUE(cluster().WaitForAliveWorkers(2, seconds(60)));
  EXPECT_EQ(cluster().GetJob(job).generation(), 2);
  ASSERT_TRUE(cluster().WaitForJob(
      job, [&](const v1::Job& j) { return j.last_checkpoint_step() >= resumed + 800; },
      "generation 2 going on", kLong));
  ASSERT_TRUE(cluster().Cancel(job, "seen enough").ok());
  ASSERT_TRUE(cluster().WaitForState(job, v1::Job::CANCELLED, kLong));

  // Nothing lost: one combined record per step from 1 on, none missing.
  const std::vector<v1::StepMetrics> steps = cluster().Metrics(job);
  ASSERT_FALSE(steps.empty());
  int64_t expect = 1;
  for (const v1::StepMetrics& s : steps) {
    if (s.kind() != v1::MetricRecord::TRAIN) continue;
    ASSERT_EQ(s.step(), expect) << "a step missing or twice";
    ++expect;
  }
  // Every checkpoint the registry holds is the one its generation committed:
  // generation 1 wrote on behind the cut, and none of it took their place.
  const std::vector<v1::Checkpoint> checkpoints = cluster().Checkpoints(job);
  ASSERT_FALSE(checkpoints.empty());
  for (const v1::Checkpoint& c : checkpoints) {
    if (!c.committed()) continue;
    EXPECT_EQ(Sha256Hex(ReadFileOrEmpty(c.path() + "/" + kManifestName)), c.manifest_sha256())
        << "step " << c.step() << " at " << c.path();
    EXPECT_THAT(ReadFileOrEmpty(c.path() + "/state.txt"),
                ::testing::HasSubstr(absl::StrCat("generation ", c.generation(), "\n")))
        << "step " << c.step();
  }
  // The worker behind the cut reported its trainer's end once back.
  EXPECT_TRUE(cluster().WaitForEvent("trainer.exited", job, seconds(30), "cut"));
}

}  // namespace
}  // namespace aidn::testing
