// Command jobs' specs: defaults and validation, through the same entry
// points as every spec (ApplyJobSpecDefaults, ValidateJobSpec).
#include "coordinator/command_spec.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "coordinator/spec.h"

namespace aidn::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using v1::JobSpec;

JobSpec CommandJob() {
  JobSpec spec;
  spec.set_world_size(2);
  spec.mutable_command()->add_argv("python3");
  spec.mutable_command()->add_argv("train.py");
  ApplyJobSpecDefaults(SpecLimits(), &spec);
  return spec;
}

absl::Status Validate(const JobSpec& spec) { return ValidateJobSpec(SpecLimits(), spec); }

void ExpectInvalid(const JobSpec& spec, const std::string& prefix, const std::string& what = "") {
  absl::Status status = Validate(spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), StartsWith(prefix));
  if (!what.empty()) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(what));
  }
}

TEST(CommandSpec, DefaultsLeaveTheBuiltInTrainersFieldsUnset) {
  JobSpec spec = CommandJob();
  EXPECT_TRUE(Validate(spec).ok()) << Validate(spec);
  EXPECT_EQ(spec.command().store(), v1::CommandSpec::AGENT);
  EXPECT_FALSE(spec.has_model());
  EXPECT_FALSE(spec.has_dataset());
  EXPECT_FALSE(spec.has_optimizer());
  EXPECT_EQ(spec.batch_size(), 0);
  // What every job has is still filled in.
  EXPECT_EQ(spec.device(), JobSpec::CPU);
  EXPECT_EQ(spec.threads_per_rank(), 1);
  EXPECT_TRUE(spec.has_max_restarts());
  EXPECT_TRUE(spec.timeouts().has_rendezvous());
  EXPECT_EQ(spec.checkpoint().keep_last(), 3);
}

TEST(CommandSpec, RefusesAnEmptyProgram) {
  JobSpec spec = CommandJob();
  spec.mutable_command()->clear_argv();
  ExpectInvalid(spec, "command.argv:", "required");
  spec.mutable_command()->add_argv("");
  ExpectInvalid(spec, "command.argv[0]:", "empty");
}

TEST(CommandSpec, RefusesParentDirectoriesInTheProgramAndTheWorkingDirectory) {
  JobSpec spec = CommandJob();
  spec.mutable_command()->set_argv(0, "../bin/python3");
  ExpectInvalid(spec, "command.argv[0]:", "\"..\"");
  spec = CommandJob();
  spec.mutable_command()->set_working_dir("src/../../etc");
  ExpectInvalid(spec, "command.working_dir:", "\"..\"");
  spec.mutable_command()->set_working_dir("src/app");
  EXPECT_TRUE(Validate(spec).ok());
}

TEST(CommandSpec, RefusesBadEnvironmentNamesAndAidnsOwnVariables) {
  for (const std::string name : {"1ABC", "A-B", "A B", "", "A=B"}) {
    JobSpec spec = CommandJob();
    (*spec.mutable_command()->mutable_env())[name] = "x";
    ExpectInvalid(spec, "command.env:", "must match");
  }
  for (const std::string name : {"RANK", "MASTER_PORT", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                                 "AIDN_TRAINER_TOKEN", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"}) {
    JobSpec spec = CommandJob();
    (*spec.mutable_command()->mutable_env())[name] = "x";
    ExpectInvalid(spec, absl::StrCat("command.env.", name, ":"), "cannot be overridden");
  }
  JobSpec spec = CommandJob();
  (*spec.mutable_command()->mutable_env())["NCCL_DEBUG"] = "INFO";
  (*spec.mutable_command()->mutable_env())["_private"] = "";
  EXPECT_TRUE(Validate(spec).ok()) << Validate(spec);
}

TEST(CommandSpec, RefusesOversizedAndNulStrings) {
  JobSpec spec = CommandJob();
  spec.mutable_command()->add_argv(std::string(kMaxCommandStringBytes + 1, 'a'));
  ExpectInvalid(spec, "command.argv[2]:", "at most 4096 bytes");
  spec = CommandJob();
  spec.mutable_command()->add_argv(std::string("a\0b", 3));
  ExpectInvalid(spec, "command.argv[2]:", "NUL");
  spec = CommandJob();
  for (int i = 0; i < kMaxCommandArgs; ++i) spec.mutable_command()->add_argv("x");
  ExpectInvalid(spec, "command.argv:", "at most 1024 entries");
  spec = CommandJob();
  for (int i = 0; i <= kMaxCommandEnv; ++i) {
    (*spec.mutable_command()->mutable_env())[absl::StrCat("V", i)] = "x";
  }
  ExpectInvalid(spec, "command.env:", "at most 256 entries");
  spec = CommandJob();
  for (int i = 0; i < 100; ++i) spec.mutable_command()->add_argv(std::string(4000, 'a'));
  ExpectInvalid(spec, "command:", "together");
}

TEST(CommandSpec, RefusesTheBuiltInTrainersFields) {
  JobSpec spec = CommandJob();
  spec.mutable_model()->set_name("mlp");
  ExpectInvalid(spec, "model:", "must leave it unset");
  spec = CommandJob();
  spec.set_batch_size(64);
  ExpectInvalid(spec, "batch_size:");
  spec = CommandJob();
  spec.mutable_optimizer()->set_name("sgd");
  ExpectInvalid(spec, "optimizer:");
  spec = CommandJob();
  spec.set_precision(JobSpec::BF16);
  ExpectInvalid(spec, "precision:");
  spec = CommandJob();
  spec.mutable_checkpoint()->mutable_resume_from()->set_job("job-1");
  ExpectInvalid(spec, "checkpoint.resume_from:", "its own checkpoints");
}

TEST(CommandSpec, StoreModeMustBeKnown) {
  JobSpec spec = CommandJob();
  spec.mutable_command()->set_store(static_cast<v1::CommandSpec::Store>(9));
  ExpectInvalid(spec, "command.store:");
  spec.mutable_command()->set_store(v1::CommandSpec::RANK0);
  EXPECT_TRUE(Validate(spec).ok());
}

TEST(CommandSpec, CommonFieldsAreStillValidated) {
  JobSpec spec = CommandJob();
  spec.set_world_size(0);
  ExpectInvalid(spec, "world_size:");
  spec = CommandJob();
  spec.mutable_checkpoint()->set_dir("../x");
  ExpectInvalid(spec, "checkpoint.dir:");
}

}  // namespace
}  // namespace aidn::coordinator
