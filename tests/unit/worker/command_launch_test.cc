// What a command rank process gets: torchrun's environment contract, the
// placement from the agents' rendezvous, and its error file read back.
#include "worker/command_launch.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/files.h"

namespace aidn::worker {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

LaunchOptions CommandOptions() {
  LaunchOptions o;
  o.coordinator = "10.0.0.1:7070";
  o.tls_ca_file = "/var/lib/aidn/coordinator-ca.pem";
  o.worker_id = "w2";
  o.address = "10.0.0.2";
  o.work_dir = "/var/lib/aidn";
  o.checkpoint_root = "/var/lib/aidn/checkpoints";
  o.python_path = "/usr/lib/aidn/python";
  return o;
}

v1::TrainerAssignment CommandAssignment() {
  v1::TrainerAssignment a;
  a.set_job_id("job-3");
  a.set_generation(2);
  a.set_rank(3);
  a.set_world_size(4);
  a.set_slot(2);
  a.set_restarts(1);
  a.set_trainer_token("secret-trainer-token-0123456789");
  v1::JobSpec* spec = a.mutable_spec();
  spec->set_threads_per_rank(4);
  spec->set_max_restarts(5);
  spec->mutable_command()->add_argv("python3");
  spec->mutable_command()->add_argv("train.py");
  spec->mutable_command()->add_argv("--epochs=2");
  (*spec->mutable_command()->mutable_env())["MY_FLAG"] = "on";
  spec->mutable_command()->set_store(v1::CommandSpec::AGENT);
  return a;
}

// Ranks 0,1 on w1 and 2,3 on w2; the store on w1.
v1::JoinRendezvousResponse Rendezvous() {
  v1::JoinRendezvousResponse r;
  for (int rank = 0; rank < 4; ++rank) {
    v1::Peer* p = r.add_peers();
    p->set_rank(rank);
    p->set_worker_id(rank < 2 ? "w1" : "w2");
    if (rank == 0) p->set_address("10.0.0.1:40123");
  }
  return r;
}

std::map<std::string, std::string> EnvMap(const std::vector<std::string>& env) {
  std::map<std::string, std::string> m;
  // Later entries win, as in the child's environment.
  for (const std::string& e : env) m[e.substr(0, e.find('='))] = e.substr(e.find('=') + 1);
  return m;
}

TEST(CommandPlacementOf, DerivesTheNodeGridAndTheStoreFromTheRendezvous) {
  absl::StatusOr<CommandPlacement> p = CommandPlacementOf(Rendezvous(), 3);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->master_addr, "10.0.0.1");
  EXPECT_EQ(p->master_port, 40123);
  EXPECT_EQ(p->local_rank, 1);
  EXPECT_EQ(p->local_world_size, 2);
  EXPECT_EQ(p->group_rank, 1);
  EXPECT_EQ(p->group_world_size, 2);
  EXPECT_FALSE(p->resume_from.has_value());

  p = CommandPlacementOf(Rendezvous(), 0);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->local_rank, 0);
  EXPECT_EQ(p->group_rank, 0);
}

TEST(CommandPlacementOf, RefusesAnAnswerWithoutTheRankOrTheStore) {
  EXPECT_THAT(CommandPlacementOf(Rendezvous(), 7).status().message(), HasSubstr("rank 7"));
  v1::JoinRendezvousResponse r = Rendezvous();
  r.mutable_peers(0)->clear_address();
  EXPECT_THAT(CommandPlacementOf(r, 1).status().message(), HasSubstr("store address"));
  r.mutable_peers(0)->set_address("10.0.0.1");
  EXPECT_THAT(CommandPlacementOf(r, 1).status().message(), HasSubstr("host:port"));
  r.mutable_peers(0)->set_address("[::1]:29500");
  absl::StatusOr<CommandPlacement> v6 = CommandPlacementOf(r, 1);
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->master_addr, "::1");
}

TEST(CommandLaunchSpecFor, GivesEveryRankTorchrunsContract) {
  v1::TrainerAssignment a = CommandAssignment();
  a.mutable_spec()->mutable_checkpoint()->set_dir("ckpt");
  absl::StatusOr<CommandPlacement> p = CommandPlacementOf(Rendezvous(), 3);
  ASSERT_TRUE(p.ok());
  p->resume_from = v1::Checkpoint();
  p->resume_from->set_step(40);
  p->resume_from->set_path("/ckpt/job-3/step-40");
  absl::StatusOr<LaunchSpec> launch = CommandLaunchSpecFor(a, *p, CommandOptions());
  ASSERT_TRUE(launch.ok()) << launch.status();
  EXPECT_EQ(launch->program, "python3");
  EXPECT_EQ(launch->argv, (std::vector<std::string>{"python3", "train.py", "--epochs=2"}));
  EXPECT_EQ(launch->cwd, "/var/lib/aidn/jobs/job-3");
  EXPECT_EQ(launch->log_path, "/var/lib/aidn/logs/job-3/gen-2/rank-3.log");
  const std::map<std::string, std::string> env = EnvMap(launch->env);
  const std::map<std::string, std::string> want = {
      {"RANK", "3"},
      {"LOCAL_RANK", "1"},
      {"WORLD_SIZE", "4"},
      {"LOCAL_WORLD_SIZE", "2"},
      {"GROUP_RANK", "1"},
      {"GROUP_WORLD_SIZE", "2"},
      {"ROLE_RANK", "3"},
      {"ROLE_WORLD_SIZE", "4"},
      {"ROLE_NAME", "default"},
      {"MASTER_ADDR", "10.0.0.1"},
      {"MASTER_PORT", "40123"},
      {"TORCHELASTIC_RUN_ID", "job-3"},
      {"TORCHELASTIC_RESTART_COUNT", "1"},
      {"TORCHELASTIC_MAX_RESTARTS", "5"},
      {"TORCHELASTIC_USE_AGENT_STORE", "True"},
      {"TORCHELASTIC_ERROR_FILE", "/var/lib/aidn/jobs/job-3/.aidn/gen-2/rank-3-error.json"},
      {"OMP_NUM_THREADS", "4"},
      {"PYTHONUNBUFFERED", "1"},
      {"AIDN_COORDINATOR", "10.0.0.1:7070"},
      {"AIDN_TLS_CA", "/var/lib/aidn/coordinator-ca.pem"},
      {"AIDN_INSECURE", ""},
      {"AIDN_JOB_ID", "job-3"},
      {"AIDN_GENERATION", "2"},
      {"AIDN_RANK", "3"},
      {"AIDN_WORLD_SIZE", "4"},
      {"AIDN_WORKER_ID", "w2"},
      {"AIDN_TRAINER_TOKEN", "secret-trainer-token-0123456789"},
      {"AIDN_CHECKPOINT_DIR", "/var/lib/aidn/checkpoints/ckpt/job-3"},
      {"AIDN_RESUME_STEP", "40"},
      {"AIDN_RESUME_PATH", "/ckpt/job-3/step-40"},
      {"MY_FLAG", "on"},
  };
  for (const auto& [name, value] : want) {
    ASSERT_TRUE(env.contains(name)) << name;
    EXPECT_EQ(env.at(name), value) << name;
  }
  EXPECT_EQ(env.at("PYTHONPATH").rfind("/usr/lib/aidn/python", 0), 0u) << env.at("PYTHONPATH");
  EXPECT_FALSE(env.contains("CUDA_VISIBLE_DEVICES"));
  // The token travels in the environment only.
  for (const std::string& arg : launch->argv) EXPECT_THAT(arg, Not(HasSubstr("secret")));
  EXPECT_EQ(launch->make_dirs.back(), "/var/lib/aidn/checkpoints/ckpt/job-3");
}

TEST(CommandLaunchSpecFor, HonoursTheWorkingDirectoryTheStoreModeAndTheUser) {
  v1::TrainerAssignment a = CommandAssignment();
  a.mutable_spec()->mutable_command()->set_working_dir("src/app");
  a.mutable_spec()->mutable_command()->set_store(v1::CommandSpec::RANK0);
  (*a.mutable_spec()->mutable_command()->mutable_env())["PYTHONPATH"] = "/opt/mine";
  LaunchOptions o = CommandOptions();
  o.command_user =
      LaunchOptions::User{.name = "trainer", .uid = 1001, .gid = 1002, .home = "/home/trainer"};
  absl::StatusOr<CommandPlacement> p = CommandPlacementOf(Rendezvous(), 2);
  ASSERT_TRUE(p.ok());
  absl::StatusOr<LaunchSpec> launch = CommandLaunchSpecFor(a, *p, o);
  ASSERT_TRUE(launch.ok()) << launch.status();
  EXPECT_EQ(launch->cwd, "/var/lib/aidn/jobs/job-3/src/app");
  ASSERT_TRUE(launch->run_as.has_value());
  EXPECT_EQ(launch->run_as->uid, 1001u);
  const std::map<std::string, std::string> env = EnvMap(launch->env);
  EXPECT_EQ(env.at("TORCHELASTIC_USE_AGENT_STORE"), "False");
  EXPECT_EQ(env.at("HOME"), "/home/trainer");
  EXPECT_EQ(env.at("USER"), "trainer");
  EXPECT_EQ(env.at("PYTHONPATH"), "/usr/lib/aidn/python:/opt/mine");
  EXPECT_FALSE(env.contains("AIDN_CHECKPOINT_DIR"));
  EXPECT_FALSE(env.contains("AIDN_RESUME_STEP"));

  a.mutable_spec()->mutable_command()->set_working_dir("/abs/dir");
  EXPECT_EQ(CommandLaunchSpecFor(a, *p, o)->cwd, "/abs/dir");
}

TEST(CommandLaunchSpecFor, RefusesAnAssignmentWithoutACommand) {
  v1::TrainerAssignment a = CommandAssignment();
  a.mutable_spec()->clear_command();
  absl::StatusOr<CommandPlacement> p = CommandPlacementOf(Rendezvous(), 3);
  EXPECT_EQ(CommandLaunchSpecFor(a, *p, CommandOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
  a = CommandAssignment();
  a.set_job_id("../etc");
  EXPECT_THAT(CommandLaunchSpecFor(a, *p, CommandOptions()).status().message(),
              HasSubstr("job_id"));
}

TEST(ReadErrorFile, ReadsTorchsRecordFormatAndToleratesAnythingElse) {
  aidn::testing::TempDir dir("aidn-error-file");
  const std::string path = dir / "error.json";
  EXPECT_EQ(ReadErrorFile(path, geteuid()), "");  // none written
  std::ofstream(path) << R"({"message": {"message": "ValueError: loss is nan", )"
                         R"("extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1"}}})";
  EXPECT_EQ(ReadErrorFile(path, geteuid()), "ValueError: loss is nan");
  std::ofstream(path) << R"({"message": "RuntimeError: plain"})";
  EXPECT_EQ(ReadErrorFile(path, geteuid()), "RuntimeError: plain");
  std::ofstream(path) << "not json {";
  EXPECT_EQ(ReadErrorFile(path, geteuid()), "");
  std::ofstream(path) << R"({"message": {"message": ")" << std::string(5000, 'x') << R"("}})";
  EXPECT_EQ(ReadErrorFile(path, geteuid()).size(), 2048u + 3);
  // Another user's file, a link and a FIFO are not read (nor waited on).
  std::ofstream(path) << R"({"message": "RuntimeError: plain"})";
  EXPECT_EQ(ReadErrorFile(path, geteuid() + 1), "");
  const std::string link = dir / "link.json";
  std::filesystem::create_symlink(path, link);
  EXPECT_EQ(ReadErrorFile(link, geteuid()), "");
  const std::string fifo = dir / "fifo.json";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(ReadErrorFile(fifo, geteuid()), "");
}

}  // namespace
}  // namespace aidn::worker
