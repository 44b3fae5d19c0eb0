// Tests of aidnctl's answers out: tables, describe, and formatting helpers.

#include "aidnctl/output.h"

#include <string>

#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::ctl {
namespace {

using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// Tables.

const absl::Time kNow = absl::FromUnixSeconds(1'800'000'000);

void SetTime(google::protobuf::Timestamp* timestamp, absl::Time time) {
  timestamp->set_seconds(absl::ToUnixSeconds(time));
}

google::protobuf::RepeatedPtrField<v1::Job> TwoJobs() {
  google::protobuf::RepeatedPtrField<v1::Job> jobs;
  v1::Job* first = jobs.Add();
  first->set_id("job-7f3a");
  first->mutable_spec()->set_name("fashion-mnist-mlp");
  first->mutable_spec()->set_world_size(2);
  first->set_state(v1::Job::RUNNING);
  first->set_generation(1);
  SetTime(first->mutable_created_at(), kNow - absl::Minutes(5));
  v1::Job* second = jobs.Add();
  second->set_id("job-1");
  second->mutable_spec()->set_name("cnn");
  second->mutable_spec()->set_world_size(16);
  second->set_state(v1::Job::RESTARTING);
  second->set_generation(12);
  second->set_restarts(3);
  second->set_message("worker w2 lost;\nwaiting for slots");
  SetTime(second->mutable_created_at(), kNow - absl::Hours(50));
  return jobs;
}

TEST(JobsTable, AlignsEveryColumnUnderItsHeader) {
  const std::string table = JobsTable(TwoJobs(), kNow);
  const std::vector<std::string> lines = absl::StrSplit(table, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << table;
  EXPECT_EQ(lines[0],
            "ID         NAME                STATE        WORLD   GEN   RESTARTS   AGE   MESSAGE");
  EXPECT_EQ(lines[1], "job-7f3a   fashion-mnist-mlp   RUNNING      2       1     0          5m");
  EXPECT_EQ(lines[2],
            "job-1      cnn                 RESTARTING   16      12    3          2d    worker w2 "
            "lost; waiting for slots");
  for (const char* header : {"NAME", "STATE", "WORLD", "GEN", "RESTARTS", "AGE"}) {
    const size_t column = lines[0].find(header);
    EXPECT_EQ(lines[1][column - 1], ' ');
    EXPECT_NE(lines[1][column], ' ') << header;
    EXPECT_NE(lines[2][column], ' ') << header;
  }
}

TEST(JobsTable, PrintsStateNamesWithoutPrefixes) {
  const std::string table = JobsTable(TwoJobs(), kNow);
  EXPECT_THAT(table, HasSubstr(" RUNNING "));
  EXPECT_THAT(table, Not(HasSubstr("STATE_")));
  EXPECT_THAT(table, Not(HasSubstr("Job.")));
  EXPECT_EQ(StateName(v1::Job::SUCCEEDED), "SUCCEEDED");
  EXPECT_EQ(StateName(v1::Job::STATE_UNSPECIFIED), "UNKNOWN");
  EXPECT_EQ(StateName(v1::Worker::LOST), "LOST");
}

TEST(FormatTable, PadsShortRowsAndLeavesNoTrailingBlanks) {
  EXPECT_EQ(FormatTable({"A", "BB", "C"}, {{"xxx", "y"}, {"1", "2", "3"}}),
            "A     BB   C\n"
            "xxx   y\n"
            "1     2    3\n");
  EXPECT_EQ(FormatTable({"SEQ", "TYPE"}, {}), "SEQ   TYPE\n");
}

TEST(WorkersTable, ShowsSlotsUsedOfTotal) {
  google::protobuf::RepeatedPtrField<v1::Worker> workers;
  v1::Worker* worker = workers.Add();
  worker->mutable_info()->set_id("node-1");
  worker->mutable_info()->set_address("10.0.0.5");
  worker->mutable_info()->set_cpu_slots(8);
  worker->mutable_info()->add_gpus()->set_index(0);
  worker->set_state(v1::Worker::ALIVE);
  worker->set_cpu_slots_used(2);
  worker->add_job_ids("job-a");
  worker->add_job_ids("job-b");
  SetTime(worker->mutable_last_heartbeat(), kNow - absl::Seconds(3));
  EXPECT_EQ(WorkersTable(workers, kNow),
            "ID       ADDRESS    STATE   CPU(USED/TOTAL)   GPUS   JOBS          LAST-HEARTBEAT\n"
            "node-1   10.0.0.5   ALIVE   2/8               0/1    job-a,job-b   3s\n");
}

TEST(EventsTable, PrintsUtcTimesAndADashForClusterEvents) {
  google::protobuf::RepeatedPtrField<v1::Event> events;
  v1::Event* event = events.Add();
  event->set_seq(41);
  SetTime(event->mutable_time(), absl::FromUnixSeconds(0));
  event->set_type("worker.registered");
  event->set_message("node-1 with 8 slots");
  EXPECT_EQ(EventsTable(events),
            "SEQ   TIME   JOB   TYPE                MESSAGE\n"
            "41    -      -     worker.registered   node-1 with 8 slots\n");
  SetTime(events[0].mutable_time(), absl::FromUnixSeconds(1'800'000'000));
  EXPECT_THAT(EventsTable(events), HasSubstr("2027-01-15T08:00:00Z"));
}

TEST(CheckpointsTable, ShowsCommitStateTimeSizeAndWhyOneIsInvalid) {
  google::protobuf::RepeatedPtrField<v1::Checkpoint> checkpoints;
  v1::Checkpoint* done = checkpoints.Add();
  done->set_step(500);
  done->set_generation(1);
  done->set_committed(true);
  done->set_bytes(3 * 1024 * 1024 / 2);
  done->set_path("/ckpt/step-500");
  SetTime(done->mutable_created_at(), kNow);
  v1::Checkpoint* invalid = checkpoints.Add();
  invalid->set_step(750);
  invalid->set_generation(1);
  invalid->set_committed(true);
  invalid->set_bytes(2048);
  invalid->set_path("/ckpt/step-750");
  SetTime(invalid->mutable_created_at(), kNow + absl::Minutes(1));
  invalid->set_invalid_reason(
      "model.safetensors: CRC-32C 1a2b3c4d, the manifest says 5e6f7a8b\n(found by rank 0 of "
      "generation 2 while resuming)");
  v1::Checkpoint* partial = checkpoints.Add();
  partial->set_step(1000);
  partial->set_generation(2);
  partial->add_ranks_reported(0);
  partial->add_ranks_expected(0);
  partial->add_ranks_expected(1);
  partial->set_bytes(100);
  partial->set_path("/ckpt/step-1000");
  EXPECT_EQ(CheckpointsTable(checkpoints),
            "STEP   GEN   COMMITTED   CREATED                BYTES    PATH              NOTE\n"
            "500    1     yes         2027-01-15T08:00:00Z   1.5MiB   /ckpt/step-500\n"
            "750    1     yes         2027-01-15T08:01:00Z   2.0KiB   /ckpt/step-750    invalid: "
            "model.safetensors: CRC-32C 1a2b3c4d, the manifest says 5e6f7a8b (found by ran...\n"
            "1000   2     no(1/2)     -                      100B     /ckpt/step-1000\n");
}

TEST(DescribeJob, ShowsFieldsSpecAndPlacement) {
  v1::Job job = TwoJobs()[0];
  job.mutable_spec()->set_max_restarts(3);
  (*job.mutable_spec()->mutable_labels())["team"] = "ml";
  v1::RankPlacement* rank = job.add_placement();
  rank->set_rank(0);
  rank->set_worker_id("node-1");
  rank->set_address("10.0.0.5:40001");
  absl::StatusOr<std::string> text = DescribeJob(job, kNow);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_THAT(*text, HasSubstr("ID:              job-7f3a\n"));
  EXPECT_THAT(*text, HasSubstr("State:           RUNNING\n"));
  EXPECT_THAT(*text, HasSubstr("Labels:          team=ml\n"));
  EXPECT_THAT(*text, HasSubstr("Restarts:        0 of 3 allowed\n"));
  EXPECT_THAT(*text, HasSubstr("(5m ago)"));
  EXPECT_THAT(*text, HasSubstr("Spec:\n  name: fashion-mnist-mlp\n  world_size: 2\n"));
  EXPECT_THAT(*text, HasSubstr("Placement:\n  RANK   WORKER   SLOT   ADDRESS\n"
                               "  0      node-1   0      10.0.0.5:40001\n"));
}

TEST(DescribeJob, SaysNoneWhenThereIsNoCheckpointYet) {
  v1::Job job = TwoJobs()[0];
  absl::StatusOr<std::string> text = DescribeJob(job, kNow);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_THAT(*text, HasSubstr("Last checkpoint: none\n"));
  job.set_last_checkpoint_step(500);
  text = DescribeJob(job, kNow);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_THAT(*text, HasSubstr("Last checkpoint: step 500\n"));
}

TEST(OutputHelpers, FormatAgesBytesAndSingleLines) {
  EXPECT_EQ(FormatAge(absl::Seconds(59)), "59s");
  EXPECT_EQ(FormatAge(absl::Minutes(90)), "90m");
  EXPECT_EQ(FormatAge(absl::Hours(47)), "47h");
  EXPECT_EQ(FormatAge(absl::Hours(72)), "3d");
  EXPECT_EQ(FormatAge(-absl::Seconds(4)), "0s");
  EXPECT_EQ(FormatBytes(1023), "1023B");
  EXPECT_EQ(FormatBytes(int64_t{5} << 30), "5.0GiB");
  EXPECT_EQ(OneLine("  a\n\tb  c "), "a b c");
  EXPECT_EQ(OneLine("abcdefghij", 8), "abcde...");
  EXPECT_TRUE(ParseOutputFormat("JSON").ok());
  EXPECT_FALSE(ParseOutputFormat("xml").ok());
}

}  // namespace
}  // namespace aidn::ctl
