// What a trainer rank process gets: LaunchSpecFor and its helpers.
#include "worker/launch.h"

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::worker {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

std::vector<engine::GpuDescription> Gpus(std::vector<int> indices) {
  std::vector<engine::GpuDescription> gpus;
  for (int index : indices) {
    engine::GpuDescription g;
    g.index = index;
    g.name = "test gpu";
    gpus.push_back(g);
  }
  return gpus;
}

LaunchOptions Options() {
  LaunchOptions o;
  o.coordinator = "10.0.0.1:7070";
  o.worker_id = "w1";
  o.address = "10.0.0.2";
  o.work_dir = "/var/lib/aidn";
  o.checkpoint_root = "/var/lib/aidn/checkpoints";
  o.trainer_binary = "/proc/self/exe";
  return o;
}

v1::TrainerAssignment Assignment() {
  v1::TrainerAssignment a;
  a.set_job_id("job-3");
  a.set_generation(2);
  a.set_rank(1);
  a.set_world_size(4);
  a.set_slot(1);
  a.set_trainer_token("secret-trainer-token-0123456789");
  a.mutable_spec()->set_threads_per_rank(2);
  a.mutable_spec()->set_device(v1::JobSpec::CPU);
  return a;
}

TEST(LaunchSpecFor, RunsTheTrainerBinaryUnderAReadableName) {
  absl::StatusOr<LaunchSpec> launch = LaunchSpecFor(Assignment(), Options());
  ASSERT_TRUE(launch.ok()) << launch.status();
  EXPECT_EQ(launch->program, "/proc/self/exe");
  EXPECT_THAT(launch->argv,
              ElementsAre("aidn-trainer", "train", "--coordinator=10.0.0.1:7070", "--job=job-3",
                          "--generation=2", "--rank=1", "--world-size=4", "--worker-id=w1",
                          "--host=10.0.0.2", "--slot=1", "--threads=2",
                          "--work-dir=/var/lib/aidn/jobs/job-3",
                          "--checkpoint-root=/var/lib/aidn/checkpoints",
                          "--cache-dir=/var/lib/aidn/cache"));
}

TEST(LaunchSpecFor, PassesTheLogLevelWhenSet) {
  LaunchOptions o = Options();
  o.trainer_log_level = "debug";
  absl::StatusOr<LaunchSpec> launch = LaunchSpecFor(Assignment(), o);
  ASSERT_TRUE(launch.ok()) << launch.status();
  EXPECT_EQ(launch->argv.back(), "--log-level=debug");
}

TEST(LaunchSpecFor, TellsTheTrainerHowToVerifyTheCoordinator) {
  LaunchOptions o = Options();
  o.tls_ca_file = "/var/lib/aidn/coordinator-ca.pem";
  absl::StatusOr<LaunchSpec> launch = LaunchSpecFor(Assignment(), o);
  ASSERT_TRUE(launch.ok()) << launch.status();
  EXPECT_EQ(launch->argv.back(), "--tls-ca=/var/lib/aidn/coordinator-ca.pem");
  o.insecure = true;
  launch = LaunchSpecFor(Assignment(), o);
  ASSERT_TRUE(launch.ok()) << launch.status();
  EXPECT_EQ(launch->argv.back(), "--insecure");
}

TEST(LaunchSpecFor, PutsTheTokenInTheEnvironmentAndNeverInArgv) {
  LaunchOptions o = Options();
  o.trainer_env = {"OPENBLAS_CORETYPE=SKYLAKEX"};
  absl::StatusOr<LaunchSpec> launch = LaunchSpecFor(Assignment(), o);
  ASSERT_TRUE(launch.ok()) << launch.status();
  EXPECT_THAT(
      launch->env,
      ElementsAre("OPENBLAS_CORETYPE=SKYLAKEX",
                  "AIDN_TRAINER_TOKEN=secret-trainer-token-0123456789",
                  "TORCHELASTIC_ERROR_FILE=/var/lib/aidn/logs/job-3/gen-2/rank-1-error.json"));
  for (const std::string& arg : launch->argv) {
    EXPECT_FALSE(absl::StrContains(arg, "secret-trainer-token")) << arg;
    EXPECT_FALSE(absl::StrContains(absl::AsciiStrToLower(arg), "token")) << arg;
  }
  EXPECT_FALSE(absl::StrContains(launch->log_path, "secret"));
}

TEST(LaunchSpecFor, KeepsLogsAndTheJobDirectoryUnderTheWorkDir) {
  absl::StatusOr<LaunchSpec> launch = LaunchSpecFor(Assignment(), Options());
  ASSERT_TRUE(launch.ok()) << launch.status();
  EXPECT_EQ(launch->log_path, "/var/lib/aidn/logs/job-3/gen-2/rank-1.log");
  EXPECT_EQ(launch->job_dir, "/var/lib/aidn/jobs/job-3");
  EXPECT_THAT(launch->argv, Contains("--work-dir=" + launch->job_dir));
  // Why it failed, beside its log: the exit report's error.
  EXPECT_EQ(launch->error_file, "/var/lib/aidn/logs/job-3/gen-2/rank-1-error.json");
}

TEST(LaunchSpecFor, GivesAGpuTrainerExactlyItsGpu) {
  v1::TrainerAssignment a = Assignment();
  a.mutable_spec()->set_device(v1::JobSpec::GPU);
  LaunchOptions o = Options();
  o.gpus = Gpus({0, 1});
  o.cuda_visible_devices = "5,7";
  absl::StatusOr<LaunchSpec> launch = LaunchSpecFor(a, o);
  ASSERT_TRUE(launch.ok()) << launch.status();
  EXPECT_THAT(launch->env, Contains("CUDA_VISIBLE_DEVICES=7"));
  // A CPU trainer is left with the worker's own setting.
  absl::StatusOr<LaunchSpec> cpu = LaunchSpecFor(Assignment(), o);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  for (const std::string& entry : cpu->env) EXPECT_THAT(entry, Not(StartsWith("CUDA_VISIBLE")));
}

TEST(LaunchSpecFor, UsesOneThreadWhenTheSpecSaysNone) {
  v1::TrainerAssignment a = Assignment();
  a.mutable_spec()->set_threads_per_rank(0);
  absl::StatusOr<LaunchSpec> launch = LaunchSpecFor(a, Options());
  ASSERT_TRUE(launch.ok()) << launch.status();
  EXPECT_THAT(launch->argv, Contains("--threads=1"));
}

// The status LaunchSpecFor gives `a` under `o`: it must be INVALID_ARGUMENT
// and name what is wrong.
void ExpectRefused(const v1::TrainerAssignment& a, const LaunchOptions& o,
                   const std::string& names) {
  absl::StatusOr<LaunchSpec> launch = LaunchSpecFor(a, o);
  ASSERT_FALSE(launch.ok()) << absl::StrJoin(launch->argv, " ");
  EXPECT_EQ(launch.status().code(), absl::StatusCode::kInvalidArgument) << launch.status();
  EXPECT_THAT(launch.status().message(), HasSubstr(names));
}

TEST(LaunchSpecFor, RefusesJobIdsThatWouldLeaveTheWorkDir) {
  const std::vector<std::string> ids = {"", ".", "..", "a/b", "../etc", std::string("a\0b", 3)};
  for (const std::string& id : ids) {
    v1::TrainerAssignment a = Assignment();
    a.set_job_id(id);
    ExpectRefused(a, Options(), "job_id");
  }
}

TEST(LaunchSpecFor, RefusesRanksOutsideTheWorld) {
  v1::TrainerAssignment a = Assignment();
  a.set_rank(4);
  ExpectRefused(a, Options(), "rank");
  a.set_rank(-1);
  ExpectRefused(a, Options(), "rank");
  a = Assignment();
  a.set_world_size(0);
  ExpectRefused(a, Options(), "world_size 0");
  a = Assignment();
  a.set_generation(0);
  ExpectRefused(a, Options(), "generation");
}

TEST(LaunchSpecFor, RefusesAnAssignmentWithoutAToken) {
  v1::TrainerAssignment a = Assignment();
  a.clear_trainer_token();
  ExpectRefused(a, Options(), "trainer_token");
}

TEST(LaunchSpecFor, RefusesAGpuSlotTheWorkerDoesNotHave) {
  v1::TrainerAssignment a = Assignment();
  a.mutable_spec()->set_device(v1::JobSpec::GPU);
  a.set_slot(2);
  LaunchOptions o = Options();
  o.gpus = Gpus({0, 1});
  ExpectRefused(a, o, "GPU slot 2");
}

TEST(LaunchSpecFor, RefusesARelativeWorkDirOrAProgramThatIsNotAPath) {
  LaunchOptions o = Options();
  o.work_dir = "aidn-work";
  ExpectRefused(Assignment(), o, "work_dir");
  o = Options();
  o.trainer_binary = "aidn-worker";
  ExpectRefused(Assignment(), o, "trainer_binary");
}

TEST(TrainerThreadName, SaysRankAndJobInFifteenBytes) {
  EXPECT_EQ(TrainerThreadName("job-3", 1), "aidn-r1-job-3");
  EXPECT_EQ(TrainerThreadName("job-1234567890", 12), "aidn-r12-job-12");
}

TEST(TrainerVisibleDevice, IsTheGpusIndexWhenTheWorkerSeesEveryGpu) {
  EXPECT_EQ(*TrainerVisibleDevice(0, Gpus({0, 1, 2}), ""), "0");
  EXPECT_EQ(*TrainerVisibleDevice(2, Gpus({0, 1, 2}), ""), "2");
}

TEST(TrainerVisibleDevice, MapsThroughTheWorkersOwnList) {
  // The worker runs with CUDA_VISIBLE_DEVICES=3,1: its GPU 0 is physical 3.
  EXPECT_EQ(*TrainerVisibleDevice(0, Gpus({0, 1}), "3,1"), "3");
  EXPECT_EQ(*TrainerVisibleDevice(1, Gpus({0, 1}), "3, 1"), "1");
  EXPECT_EQ(*TrainerVisibleDevice(1, Gpus({0, 1}), "GPU-aaaa,GPU-bbbb"), "GPU-bbbb");
}

TEST(TrainerVisibleDevice, RefusesASlotTheWorkerDoesNotHave) {
  absl::StatusOr<std::string> none = TrainerVisibleDevice(0, {}, "");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("has 0 GPUs"));
  EXPECT_FALSE(TrainerVisibleDevice(-1, Gpus({0}), "").ok());
  absl::StatusOr<std::string> short_list = TrainerVisibleDevice(1, Gpus({0, 1}), "5");
  ASSERT_FALSE(short_list.ok());
  EXPECT_THAT(short_list.status().message(), HasSubstr("CUDA_VISIBLE_DEVICES \"5\""));
}

}  // namespace
}  // namespace aidn::worker
