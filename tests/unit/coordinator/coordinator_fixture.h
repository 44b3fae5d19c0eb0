#ifndef AIDN_TESTS_UNIT_COORDINATOR_COORDINATOR_FIXTURE_H_
#define AIDN_TESTS_UNIT_COORDINATOR_COORDINATOR_FIXTURE_H_

// The fixture of the Coordinator-level tests (a coordinator over an
// in-memory or on-disk store, driven by a FakeClock), shared by the test
// files of its components.

#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "coordinator/coordinator.h"

namespace aidn::coordinator::test_util {

using std::chrono::milliseconds;
using v1::Job;

constexpr milliseconds kWorkerTimeout{10'000};
constexpr milliseconds kHeartbeatInterval{2'000};

inline google::protobuf::Duration Dur(milliseconds ms) {
  google::protobuf::Duration d;
  d.set_seconds(ms.count() / 1000);
  d.set_nanos(static_cast<int32_t>(ms.count() % 1000) * 1'000'000);
  return d;
}

inline v1::JobSpec Spec(int world_size) {
  v1::JobSpec spec;
  spec.set_world_size(world_size);
  spec.mutable_model()->set_name("mlp");
  return spec;
}

// The answer to a call that takes a callback: whether it came, how often,
// and what it was. Shared so a late answer never writes to a dead object.
template <typename T>
class Async {
 public:
  std::function<void(absl::StatusOr<T>)> Callback() {
    std::shared_ptr<State> state = state_;
    return [state](absl::StatusOr<T> v) {
      absl::MutexLock lock(&state->mu);
      state->calls++;
      state->result = std::move(v);
    };
  }
  bool done() const {
    absl::MutexLock lock(&state_->mu);
    return state_->calls > 0;
  }
  int calls() const {
    absl::MutexLock lock(&state_->mu);
    return state_->calls;
  }
  // Blocks until answered or `timeout` passed; whether it was answered.
  bool WaitDone(absl::Duration timeout) const {
    absl::MutexLock lock(&state_->mu);
    State* state = state_.get();
    return state->mu.AwaitWithTimeout(absl::Condition(
                                          +[](State* s) { return s->calls > 0; }, state),
                                      timeout);
  }
  absl::StatusOr<T> get() const {
    absl::MutexLock lock(&state_->mu);
    if (!state_->result.has_value()) return absl::InternalError("not answered (yet)");
    return *state_->result;
  }

 private:
  struct State {
    absl::Mutex mu;
    int calls = 0;
    std::optional<absl::StatusOr<T>> result;
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

using JoinAnswer = Async<v1::JoinRendezvousResponse>;

// True if `wanted` appear in `all` in this order (others may come between).
inline bool InOrder(const std::vector<std::string>& all, const std::vector<std::string>& wanted) {
  size_t i = 0;
  for (const std::string& s : all) {
    if (i < wanted.size() && s == wanted[i]) ++i;
  }
  return i == wanted.size();
}

// A fresh directory under the test's temp dir, removed afterwards.
class TempDir {
 public:
  TempDir() {
    std::string templ = ::testing::TempDir() + "/aidn_coord_XXXXXX";
    EXPECT_NE(::mkdtemp(templ.data()), nullptr);
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override { Open(":memory:"); }

  // (Re)builds the coordinator over the database at `path`, with a fresh
  // authenticator, as a restarted process would.
  void Open(const std::string& path) {
    coord_.reset();
    auth_ = Authenticator::CreateEmpty();
    absl::StatusOr<std::unique_ptr<Store>> store =
        Store::Open({.path = path, .before_put_steps = put_steps_hook_});
    ASSERT_TRUE(store.ok()) << store.status();
    CoordinatorOptions options = options_;
    options.clock = &clock_;
    options.heartbeat_interval = kHeartbeatInterval;
    options.worker_timeout = kWorkerTimeout;
    absl::StatusOr<std::unique_ptr<Coordinator>> c =
        Coordinator::Create(options, std::move(*store), auth_.get());
    ASSERT_TRUE(c.ok()) << c.status();
    coord_ = std::move(*c);
  }

  Coordinator& c() { return *coord_; }
  // StoreOptions::before_put_steps of the next Open.
  std::function<absl::Status()> put_steps_hook_;

  absl::Status Register(const std::string& id, int cpu_slots, int gpus = 0) {
    v1::RegisterWorkerRequest request;
    request.mutable_info()->set_id(id);
    request.mutable_info()->set_hostname(id + ".local");
    request.mutable_info()->set_cpu_slots(cpu_slots);
    for (int g = 0; g < gpus; ++g) request.mutable_info()->add_gpus()->set_index(g);
    return c().RegisterWorker(request).status();
  }

  // A heartbeat answered at once (no max_wait).
  absl::StatusOr<v1::HeartbeatResponse> Beat(const std::string& worker_id) {
    v1::HeartbeatRequest request;
    request.set_worker_id(worker_id);
    Async<v1::HeartbeatResponse> answer;
    c().Heartbeat(request, answer.Callback());
    if (!answer.done()) return absl::InternalError("heartbeat without max_wait was held");
    return answer.get();
  }

  Async<v1::HeartbeatResponse> HeldBeat(const std::string& worker_id, int64_t version,
                                        milliseconds max_wait) {
    v1::HeartbeatRequest request;
    request.set_worker_id(worker_id);
    request.set_assignments_version(version);
    *request.mutable_max_wait() = Dur(max_wait);
    Async<v1::HeartbeatResponse> answer;
    c().Heartbeat(request, answer.Callback());
    return answer;
  }

  std::string Submit(const v1::JobSpec& spec) {
    absl::StatusOr<Job> job = c().SubmitJob(spec, "alice");
    if (!job.ok()) {
      ADD_FAILURE() << "SubmitJob: " << job.status();
      return "";
    }
    return job->id();
  }

  Job Get(const std::string& job_id) {
    absl::StatusOr<Job> job = c().GetJob(job_id);
    if (!job.ok()) {
      ADD_FAILURE() << "GetJob " << job_id << ": " << job.status();
      return Job();
    }
    return *job;
  }

  std::string WorkerOf(const std::string& job_id, int rank) {
    const Job job = Get(job_id);
    for (const v1::RankPlacement& p : job.placement()) {
      if (p.rank() == rank) return p.worker_id();
    }
    return "";
  }

  std::vector<v1::Event> EventList(const std::string& job_id) {
    v1::ListEventsRequest request;
    request.set_job_id(job_id);
    absl::StatusOr<v1::ListEventsResponse> r = c().ListEvents(request);
    if (!r.ok()) {
      ADD_FAILURE() << "ListEvents: " << r.status();
      return {};
    }
    return {r->events().begin(), r->events().end()};
  }

  std::vector<std::string> Events(const std::string& job_id) {
    std::vector<std::string> types;
    for (const v1::Event& e : EventList(job_id)) types.push_back(e.type());
    return types;
  }

  v1::Worker WorkerNamed(const std::string& id) {
    const v1::ListWorkersResponse workers = c().ListWorkers();
    for (const v1::Worker& w : workers.workers()) {
      if (w.info().id() == id) return w;
    }
    ADD_FAILURE() << "no worker " << id;
    return v1::Worker();
  }

  static std::string Address(int rank) { return absl::StrCat("10.1.0.", rank, ":2950", rank); }

  JoinAnswer Join(const std::string& job_id, int64_t generation, int rank) {
    v1::JoinRendezvousRequest request;
    request.set_job_id(job_id);
    request.set_generation(generation);
    request.set_rank(rank);
    request.set_worker_id(WorkerOf(job_id, rank));
    request.set_address(Address(rank));
    JoinAnswer answer;
    c().JoinRendezvous(request, answer.Callback());
    return answer;
  }

  // Every rank of the current generation joins; the job must be RUNNING.
  std::vector<JoinAnswer> RunJob(const std::string& job_id) {
    const Job job = Get(job_id);
    EXPECT_EQ(job.state(), Job::SCHEDULED) << job.message();
    std::vector<JoinAnswer> answers;
    for (int r = 0; r < job.spec().world_size(); ++r) {
      answers.push_back(Join(job_id, job.generation(), r));
    }
    for (const JoinAnswer& a : answers) {
      EXPECT_TRUE(a.done());
      EXPECT_TRUE(a.get().ok()) << a.get().status();
    }
    EXPECT_EQ(Get(job_id).state(), Job::RUNNING);
    return answers;
  }

  absl::Status Exit(const std::string& job_id, int64_t generation, int rank, int exit_code,
                    bool permanent = false, bool stopped_by_order = false, int signal = 0) {
    v1::ReportTrainerExitRequest request;
    request.set_worker_id(WorkerOf(job_id, rank));
    request.set_job_id(job_id);
    request.set_generation(generation);
    request.set_rank(rank);
    request.set_exit_code(exit_code);
    request.set_signal(signal);
    request.set_permanent(permanent);
    request.set_stopped_by_order(stopped_by_order);
    request.set_stderr_tail("loading data\nTraceback: boom\n");
    return c().ReportTrainerExit(request);
  }

  // The wait before the job's latest restart (the spec's restart backoff,
  // doubled for each restart before).
  milliseconds BackoffOf(const std::string& job_id) {
    const Job job = Get(job_id);
    const google::protobuf::Duration& b = job.spec().timeouts().restart_backoff();
    milliseconds delay(b.seconds() * 1000 + b.nanos() / 1'000'000);
    for (int k = 1; k < job.restarts(); ++k) delay *= 2;
    return delay;
  }

  // Lets the restart backoff of the job run out, and ticks: it is placed
  // again if there is room.
  // Waits out the restart backoff. The alive workers heartbeat meanwhile,
  // as real ones do when their stop orders come: a restart is placed on a
  // worker of the failed generation only once it was heard from after the
  // failure.
  void PassBackoff(const std::string& job_id) {
    EXPECT_EQ(Get(job_id).state(), Job::RESTARTING);
    clock_.Advance(BackoffOf(job_id));
    const v1::ListWorkersResponse workers = c().ListWorkers();
    for (const v1::Worker& w : workers.workers()) {
      if (w.state() == v1::Worker::ALIVE) (void)Beat(w.info().id());
    }
    c().Tick();
  }

  // Two 1-slot workers and a running 2-rank job on them.
  std::string RunningJobOnTwoWorkers(v1::JobSpec spec = Spec(2)) {
    EXPECT_TRUE(Register("w1", 1).ok());
    EXPECT_TRUE(Register("w2", 1).ok());
    const std::string id = Submit(spec);
    RunJob(id);
    return id;
  }

  // Rank `rank` of generation 1 sends TRAIN records of steps [first, last];
  // rank r's loss at step k is 1/k + r.
  absl::Status SendSteps(const std::string& job_id, int rank, int64_t first, int64_t last,
                         v1::MetricRecord::Kind kind = v1::MetricRecord::TRAIN) {
    v1::StreamMetricsRequest request;
    request.set_job_id(job_id);
    request.set_generation(1);
    request.set_rank(rank);
    for (int64_t step = first; step <= last; ++step) {
      v1::MetricRecord* r = request.add_records();
      r->set_kind(kind);
      r->set_step(step);
      r->set_epoch(1);
      r->set_loss(1.0 / static_cast<double>(step) + rank);
      r->set_samples(64);
      r->set_step_seconds(0.01 * (rank + 1));
      r->set_allreduce_seconds(0.002);
      if (kind == v1::MetricRecord::EVAL) r->set_test_accuracy(0.8 + 0.1 * rank);
    }
    return c().AppendMetrics(request);
  }

  // Rank `rank` of `generation` sends TRAIN records of steps [first, last],
  // each taking `seconds`.
  absl::Status SendTimedSteps(const std::string& job_id, int64_t generation, int rank,
                              int64_t first, int64_t last, double seconds) {
    v1::StreamMetricsRequest request;
    request.set_job_id(job_id);
    request.set_generation(generation);
    request.set_rank(rank);
    for (int64_t step = first; step <= last; ++step) {
      v1::MetricRecord* r = request.add_records();
      r->set_kind(v1::MetricRecord::TRAIN);
      r->set_step(step);
      r->set_epoch(1);
      r->set_loss(1.0);
      r->set_samples(64);
      r->set_step_seconds(seconds);
    }
    return c().AppendMetrics(request);
  }

  // Every rank of generation `generation` of the job reports the TRAIN
  // steps up to `step` it has not reported yet, and they are flushed to
  // the store: a checkpoint at `step` may commit.
  void MetricsDurableThrough(const std::string& job_id, int64_t generation, int64_t step) {
    int64_t& sent = metrics_sent_[{job_id, generation}];
    if (step > sent) {
      const int world = Get(job_id).spec().world_size();
      for (int rank = 0; rank < world; ++rank) {
        (void)SendTimedSteps(job_id, generation, rank, sent + 1, step, 0.01);
      }
      sent = step;
    }
    c().FlushSteps();
  }

  // CommitCheckpoint once the job's metrics up to the step are durable.
  absl::StatusOr<v1::CommitCheckpointResponse> CommitDurable(
      const v1::CommitCheckpointRequest& request) {
    MetricsDurableThrough(request.job_id(), request.generation(), request.step());
    return c().CommitCheckpoint(request);
  }

  // A progress beat.
  absl::StatusOr<v1::ReportProgressResponse> Progress(const std::string& job_id, int64_t generation,
                                                      int rank, int64_t step,
                                                      int64_t collective_seq) {
    v1::ReportProgressRequest request;
    request.set_job_id(job_id);
    request.set_generation(generation);
    request.set_rank(rank);
    request.set_step(step);
    request.set_epoch(1);
    request.set_collective_seq(collective_seq);
    return c().ReportProgress(request);
  }

  // Every step item of `batch`, as (step, kind).
  static std::vector<std::pair<int64_t, int>> StepItems(const WatchBatch& batch) {
    std::vector<std::pair<int64_t, int>> out;
    for (const v1::WatchJobResponse& item : batch.items) {
      if (item.has_step()) out.emplace_back(item.step().step(), item.step().kind());
    }
    return out;
  }

  CoordinatorOptions options_;
  // MetricsDurableThrough: the last step sent per (job, generation).
  std::map<std::pair<std::string, int64_t>, int64_t> metrics_sent_;
  FakeClock clock_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<Coordinator> coord_;
};

// A CommitCheckpoint request of `rank` for the checkpoint at `step`.
inline v1::CommitCheckpointRequest Commit(const std::string& job_id, int64_t generation, int rank,
                                          int64_t step, std::vector<int> writers) {
  v1::CommitCheckpointRequest r;
  r.set_job_id(job_id);
  r.set_generation(generation);
  r.set_rank(rank);
  r.set_step(step);
  r.set_path(absl::StrCat("ckpt/step-", step));
  r.set_bytes(1000);
  r.set_manifest_sha256("ab12");
  for (int w : writers) r.add_writer_ranks(w);
  return r;
}

// Pulls from inside Notify(), as the WatchJob stream does: that only works
// if Notify() is never called under the coordinator's mutex.
class PullingWatcher final : public WatchSubscriber {
 public:
  PullingWatcher(Coordinator* c, const std::string& job_id) : c_(c) { request_.set_job_id(job_id); }
  void Notify() override {
    absl::MutexLock lock(&mu_);
    ++notified_;
    absl::StatusOr<WatchBatch> batch = c_->PollWatch(request_, &cursor_);
    if (!batch.ok()) return;
    for (auto& item : batch->items) items_.push_back(std::move(item));
    finished_ = finished_ || batch->finished;
  }
  int notified() {
    absl::MutexLock lock(&mu_);
    return notified_;
  }
  std::vector<v1::WatchJobResponse> items() {
    absl::MutexLock lock(&mu_);
    return items_;
  }

 private:
  Coordinator* const c_;
  v1::WatchJobRequest request_;
  absl::Mutex mu_;
  WatchCursor cursor_ ABSL_GUARDED_BY(mu_);
  int notified_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<v1::WatchJobResponse> items_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aidn::coordinator::test_util

#endif  // AIDN_TESTS_UNIT_COORDINATOR_COORDINATOR_FIXTURE_H_
