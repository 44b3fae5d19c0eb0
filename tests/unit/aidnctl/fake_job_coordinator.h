#ifndef AIDN_TESTS_UNIT_AIDNCTL_FAKE_JOB_COORDINATOR_H_
#define AIDN_TESTS_UNIT_AIDNCTL_FAKE_JOB_COORDINATOR_H_

// A coordinator over one job's fixed history (its events, step metrics and
// checkpoints), served on loopback, for the tests of watch, metrics, plot
// and export. It honours
// WatchJob's from_step and after_event_seq and GetMetrics' range and limit as
// the real one does, and can break watch streams on cue.

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "aidnctl/commands.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace aidn::ctl::testing {

inline google::protobuf::Timestamp At(double seconds) {
  google::protobuf::Timestamp t;
  t.set_seconds(1'800'000'000 + static_cast<int64_t>(seconds));
  t.set_nanos(static_cast<int32_t>((seconds - static_cast<int64_t>(seconds)) * 1e9));
  return t;
}

// TRAIN step `step` of generation 1, 0.5 s after the previous one.
inline v1::StepMetrics Train(int64_t step, double loss = 0) {
  v1::StepMetrics s;
  s.set_kind(v1::MetricRecord::TRAIN);
  s.set_step(step);
  s.set_generation(1);
  s.set_loss(loss != 0 ? loss : 2.5 - 0.001 * static_cast<double>(step));
  s.set_samples(128);
  s.set_step_seconds(0.04);
  s.set_slowest_rank(1);
  s.set_allreduce_seconds(0.01);
  s.set_samples_per_second(3200);
  s.set_lr(0.05);
  s.set_ranks_reported(2);
  s.set_world_size(2);
  *s.mutable_time() = At(0.5 * static_cast<double>(step));
  s.add_rank_step_seconds(0.03);
  s.add_rank_step_seconds(0.04);
  return s;
}

inline v1::StepMetrics Eval(int64_t step, double accuracy) {
  v1::StepMetrics s;
  s.set_kind(v1::MetricRecord::EVAL);
  s.set_step(step);
  s.set_epoch(1);
  s.set_generation(1);
  s.set_test_loss(0.45);
  s.set_test_accuracy(accuracy);
  s.set_ranks_reported(2);
  s.set_world_size(2);
  *s.mutable_time() = At(0.5 * static_cast<double>(step) + 0.2);
  return s;
}

inline v1::Event MakeEvent(int64_t seq, const std::string& type, const std::string& message) {
  v1::Event e;
  e.set_seq(seq);
  e.set_type(type);
  e.set_message(message);
  e.set_job_id("job-1");
  *e.mutable_time() = At(static_cast<double>(seq));
  return e;
}

class FakeJobCoordinator final : public v1::CoordinatorService::Service {
 public:
  FakeJobCoordinator() {
    running_.set_id("job-1");
    running_.set_state(v1::Job::RUNNING);
    running_.set_generation(1);
    running_.set_total_steps(10);
    running_.mutable_spec()->set_name("fashion");
    running_.mutable_spec()->mutable_model()->set_name("mlp");
    final_ = running_;
    final_.set_state(v1::Job::SUCCEEDED);
    final_.set_message("all ranks finished");
  }

  // The job's history, served by every call.
  v1::Job running_;
  v1::Job final_;
  std::vector<v1::Event> events_;
  std::vector<v1::StepMetrics> steps_;
  // WatchJob call i sends breaks_[i] items (-1: all of them) and then fails
  // with break_code_; calls past the list send everything and end OK.
  std::vector<int> breaks_;
  grpc::StatusCode break_code_ = grpc::StatusCode::UNAVAILABLE;
  // GetMetrics with a limit above this (if > 0) is RESOURCE_EXHAUSTED.
  int max_limit_ = 0;
  // Served by ListCheckpoints, as given (the real one sends oldest first).
  std::vector<v1::Checkpoint> checkpoints_;

  std::vector<v1::WatchJobRequest> watch_requests() {
    absl::MutexLock lock(&mu_);
    return watch_requests_;
  }
  std::vector<v1::GetMetricsRequest> metrics_requests() {
    absl::MutexLock lock(&mu_);
    return metrics_requests_;
  }
  int list_checkpoints_calls() {
    absl::MutexLock lock(&mu_);
    return list_checkpoints_calls_;
  }

  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest* request,
                      v1::Job* response) override {
    if (request->job_id() != final_.id()) return NotFound(request->job_id());
    *response = final_;
    return grpc::Status::OK;
  }

  grpc::Status WatchJob(grpc::ServerContext*, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::WatchJobResponse>* writer) override {
    int limit = -1;
    bool break_at_end = false;
    {
      absl::MutexLock lock(&mu_);
      const size_t call = watch_requests_.size();
      watch_requests_.push_back(*request);
      if (call < breaks_.size()) {
        limit = breaks_[call];
        break_at_end = true;
      }
    }
    if (request->job_id() != final_.id()) return NotFound(request->job_id());
    std::vector<v1::WatchJobResponse> items;
    *items.emplace_back().mutable_job() = running_;
    for (const v1::Event& e : events_) {
      if (e.seq() > request->after_event_seq()) *items.emplace_back().mutable_event() = e;
    }
    if (request->include_metrics()) {
      for (const v1::StepMetrics& s : steps_) {
        if (s.step() >= request->from_step()) *items.emplace_back().mutable_step() = s;
      }
    }
    *items.emplace_back().mutable_job() = final_;
    for (size_t i = 0; i < items.size(); ++i) {
      if (limit >= 0 && static_cast<int>(i) == limit) break;
      if (!writer->Write(items[i])) return grpc::Status::CANCELLED;
    }
    if (break_at_end) return grpc::Status(break_code_, "connection reset by peer");
    return grpc::Status::OK;
  }

  grpc::Status GetMetrics(grpc::ServerContext*, const v1::GetMetricsRequest* request,
                          v1::GetMetricsResponse* response) override {
    {
      absl::MutexLock lock(&mu_);
      metrics_requests_.push_back(*request);
    }
    if (request->job_id() != final_.id()) return NotFound(request->job_id());
    const int limit = request->limit() <= 0 ? 10000 : std::min(request->limit(), 100000);
    if (max_limit_ > 0 && limit > max_limit_) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "message larger than max");
    }
    for (const v1::StepMetrics& s : steps_) {
      if (response->steps_size() >= limit) break;
      if (s.step() < request->from_step()) continue;
      if (request->to_step() > 0 && s.step() > request->to_step()) continue;
      *response->add_steps() = s;
    }
    return grpc::Status::OK;
  }

  grpc::Status ListCheckpoints(grpc::ServerContext*, const v1::ListCheckpointsRequest* request,
                               v1::ListCheckpointsResponse* response) override {
    {
      absl::MutexLock lock(&mu_);
      ++list_checkpoints_calls_;
    }
    if (request->job_id() != final_.id()) return NotFound(request->job_id());
    for (const v1::Checkpoint& c : checkpoints_) *response->add_checkpoints() = c;
    return grpc::Status::OK;
  }

 private:
  static grpc::Status NotFound(const std::string& id) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "job " + id + " not found");
  }

  absl::Mutex mu_;
  std::vector<v1::WatchJobRequest> watch_requests_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::GetMetricsRequest> metrics_requests_ ABSL_GUARDED_BY(mu_);
  int list_checkpoints_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

// The fake on a loopback port, and a CommandEnv that calls it and prints
// into `out`. Start() after filling in the fake's history.
class FakeServer {
 public:
  FakeServer() = default;
  ~FakeServer() {
    if (server_ != nullptr) server_->Shutdown();
  }

  void Start() {
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&fake);
    server_ = builder.BuildAndStart();
    env.options.connection.address = absl::StrCat("127.0.0.1:", port);
    env.options.connection.insecure = true;  // this fake serves plaintext
    env.options.timeout = std::chrono::seconds(10);
    stub_ = NewCoordinatorStub(env.options.connection);
    env.stub = stub_.get();
    env.out = &out;
  }

  FakeJobCoordinator fake;
  CommandEnv env;
  std::ostringstream out;

 private:
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::CoordinatorService::Stub> stub_;
};

}  // namespace aidn::ctl::testing

#endif  // AIDN_TESTS_UNIT_AIDNCTL_FAKE_JOB_COORDINATOR_H_
