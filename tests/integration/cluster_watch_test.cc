// Metrics streams, checkpoint commits and a WatchJob stream that sees it all
// (cluster_test_fixture.h).

#include <algorithm>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_test_fixture.h"

namespace aidn::testing {
namespace {

// Everything a WatchJob stream delivered, and how it ended.
struct Watched {
  std::vector<v1::WatchJobResponse> items;
  grpc::Status status;
};

Watched WatchToEnd(v1::CoordinatorService::Stub* stub, const std::string& token,
                   const v1::WatchJobRequest& request) {
  Watched watched;
  auto context = Context(token, std::chrono::seconds(60));
  std::unique_ptr<grpc::ClientReader<v1::WatchJobResponse>> reader =
      stub->WatchJob(context.get(), request);
  v1::WatchJobResponse item;
  while (reader->Read(&item)) watched.items.push_back(item);
  watched.status = reader->Finish();
  return watched;
}

v1::MetricRecord TrainRecord(int64_t step, double loss) {
  v1::MetricRecord r;
  r.set_kind(v1::MetricRecord::TRAIN);
  r.set_step(step);
  r.set_loss(loss);
  r.set_samples(64);
  r.set_step_seconds(0.01);
  return r;
}

TEST_F(ClusterTest, TrainersStreamMetricsCommitCheckpointsAndAWatcherSeesItAll) {
  ASSERT_NO_FATAL_FAILURE(StartDefaultCoordinator());
  FakeWorker* w1 = AddWorker("w1", 1);
  FakeWorker* w2 = AddWorker("w2", 1);
  std::map<std::string, FakeWorker*> by_id = {{"w1", w1}, {"w2", w2}};
  v1::JobSpec spec = MlpSpec(2);
  spec.mutable_checkpoint()->set_dir("ckpt");
  absl::StatusOr<v1::Job> submitted = Submit(spec);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const std::string job_id = submitted->id();

  // A watcher from the start, on a stub of its own.
  auto watch_stub = CoordinatorStub(cluster().address());
  v1::WatchJobRequest watch;
  watch.set_job_id(job_id);
  watch.set_include_metrics(true);
  Watched watched;
  std::thread watcher([&] { watched = WatchToEnd(watch_stub.get(), admin(), watch); });

  std::vector<std::pair<std::string, v1::TrainerAssignment>> by_rank;
  ASSERT_TRUE(WaitForAssignments(job_id, 1, 2, &by_rank));
  for (const JoinResult& r : JoinAll(by_rank)) ASSERT_TRUE(r.status.ok()) << Describe(r.status);
  ASSERT_TRUE(WaitForState(job_id, v1::Job::RUNNING));

  // Each rank streams steps 1..5 in two batches.
  for (const auto& [worker_id, a] : by_rank) {
    auto context = Context(a.trainer_token());
    v1::StreamMetricsResponse response;
    auto writer = cluster_stub()->StreamMetrics(context.get(), &response);
    for (int64_t first : {1, 4}) {
      v1::StreamMetricsRequest batch;
      batch.set_job_id(job_id);
      batch.set_generation(1);
      batch.set_rank(a.rank());
      for (int64_t step = first; step < first + 3 && step <= 5; ++step) {
        *batch.add_records() = TrainRecord(step, 2.0 / static_cast<double>(step) + a.rank());
      }
      ASSERT_TRUE(writer->Write(batch));
    }
    writer->WritesDone();
    grpc::Status status = writer->Finish();
    ASSERT_TRUE(status.ok()) << Describe(status);
    EXPECT_EQ(response.accepted(), 5);
  }
  // A stream from another generation is fenced off.
  {
    auto context = Context(by_rank[0].second.trainer_token());
    v1::StreamMetricsResponse response;
    auto writer = cluster_stub()->StreamMetrics(context.get(), &response);
    v1::StreamMetricsRequest stale;
    stale.set_job_id(job_id);
    stale.set_generation(7);
    *stale.add_records() = TrainRecord(6, 0.1);
    writer->Write(stale);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }

  // GetMetrics: an inclusive step range, ordered by step, each step the
  // combination of both ranks' records (rank r sent loss 2/step + r).
  {
    v1::GetMetricsRequest request;
    request.set_job_id(job_id);
    request.set_from_step(2);
    request.set_to_step(4);
    v1::GetMetricsResponse response;
    grpc::Status status = coord()->GetMetrics(Context(admin()).get(), request, &response);
    ASSERT_TRUE(status.ok()) << Describe(status);
    ASSERT_EQ(response.steps_size(), 3);
    for (int i = 0; i < 3; ++i) {
      const v1::StepMetrics& step = response.steps(i);
      EXPECT_EQ(step.step(), 2 + i);
      EXPECT_EQ(step.generation(), 1);
      EXPECT_EQ(step.ranks_reported(), 2);
      EXPECT_EQ(step.world_size(), 2);
      EXPECT_DOUBLE_EQ(step.loss(), 2.0 / static_cast<double>(step.step()) + 0.5);
    }
  }

  // Rank 0 writes the checkpoint of step 5; a path with ".." is refused.
  {
    v1::CommitCheckpointRequest request;
    request.set_job_id(job_id);
    request.set_generation(1);
    request.set_rank(0);
    request.set_step(5);
    request.set_path("../escape");
    request.add_writer_ranks(0);
    v1::CommitCheckpointResponse response;
    const std::string& token = by_rank[0].second.rank() == 0 ? by_rank[0].second.trainer_token()
                                                             : by_rank[1].second.trainer_token();
    EXPECT_EQ(
        cluster_stub()->CommitCheckpoint(Context(token).get(), request, &response).error_code(),
        grpc::StatusCode::INVALID_ARGUMENT);
    request.set_path("ckpt/step-00000005");
    request.set_bytes(4096);
    grpc::Status status =
        cluster_stub()->CommitCheckpoint(Context(token).get(), request, &response);
    ASSERT_TRUE(status.ok()) << Describe(status);
    EXPECT_TRUE(response.committed());
    v1::ListCheckpointsRequest list;
    list.set_job_id(job_id);
    v1::ListCheckpointsResponse checkpoints;
    status = coord()->ListCheckpoints(Context(admin()).get(), list, &checkpoints);
    ASSERT_TRUE(status.ok()) << Describe(status);
    ASSERT_EQ(checkpoints.checkpoints_size(), 1);
    EXPECT_TRUE(checkpoints.checkpoints(0).committed());
    EXPECT_EQ(checkpoints.checkpoints(0).step(), 5);
    EXPECT_EQ(checkpoints.checkpoints(0).path(), "ckpt/step-00000005");
    absl::StatusOr<v1::Job> job = GetJob(job_id);
    ASSERT_TRUE(job.ok()) << job.status();
    EXPECT_EQ(job->last_checkpoint_step(), 5);
    EXPECT_EQ(job->last_step(), 5);
  }

  for (const auto& [worker_id, a] : by_rank) {
    grpc::Status status = by_id[worker_id]->ReportExit(a, 0);
    ASSERT_TRUE(status.ok()) << Describe(status);
  }
  ASSERT_TRUE(WaitForState(job_id, v1::Job::SUCCEEDED));

  // The watch ends by itself once the job ended and everything was sent.
  watcher.join();
  ASSERT_TRUE(watched.status.ok()) << Describe(watched.status);
  ASSERT_FALSE(watched.items.empty());
  EXPECT_TRUE(watched.items.front().has_job()) << "the job comes first";
  std::vector<std::string> types;
  std::vector<v1::Job::State> states;
  int records = 0;
  int64_t last_seq = 0;
  for (const v1::WatchJobResponse& item : watched.items) {
    if (item.has_event()) {
      EXPECT_GT(item.event().seq(), last_seq) << "events arrive in order, once";
      last_seq = item.event().seq();
      types.push_back(item.event().type());
    } else if (item.has_job()) {
      states.push_back(item.job().state());
    } else if (item.has_step()) {
      EXPECT_EQ(item.step().step(), records + 1) << "steps arrive in order, once";
      ++records;
    }
  }
  EXPECT_EQ(records, 5);
  for (const char* type :
       {"job.submitted", "job.scheduled", "job.running", "checkpoint.committed", "job.succeeded"}) {
    EXPECT_NE(std::find(types.begin(), types.end(), type), types.end()) << type;
  }
  ASSERT_FALSE(states.empty());
  EXPECT_EQ(states.back(), v1::Job::SUCCEEDED);

  // A watcher that reconnects after the end gets the job and only what came
  // after the event it last saw.
  const int64_t resume_after = last_seq - 1;
  v1::WatchJobRequest again = watch;
  again.set_after_event_seq(resume_after);
  again.set_from_step(6);
  Watched rest = WatchToEnd(coord(), admin(), again);
  ASSERT_TRUE(rest.status.ok()) << Describe(rest.status);
  ASSERT_EQ(rest.items.size(), 2u);
  EXPECT_TRUE(rest.items[0].has_job());
  EXPECT_EQ(rest.items[1].event().seq(), last_seq);

  // Watching an unknown job is NOT_FOUND; a worker token may not watch.
  v1::WatchJobRequest unknown;
  unknown.set_job_id("job-999");
  EXPECT_EQ(WatchToEnd(coord(), admin(), unknown).status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(WatchToEnd(coord(), cluster().worker_token(), watch).status.error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

}  // namespace
}  // namespace aidn::testing
