#include "coordinator/coordinator.h"

#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace aidn::coordinator {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using std::chrono::milliseconds;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;
using ::testing::UnorderedElementsAre;
using v1::Job;

constexpr milliseconds kWorkerTimeout{10'000};
constexpr milliseconds kHeartbeatInterval{2'000};

google::protobuf::Duration Dur(milliseconds ms) {
  google::protobuf::Duration d;
  d.set_seconds(ms.count() / 1000);
  d.set_nanos(static_cast<int32_t>(ms.count() % 1000) * 1'000'000);
  return d;
}

v1::JobSpec Spec(int world_size) {
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
bool InOrder(const std::vector<std::string>& all, const std::vector<std::string>& wanted) {
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
  FakeClock clock_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<Coordinator> coord_;
};

// --- Submission ---------------------------------------------------------

TEST_F(CoordinatorTest, SubmitRefusesAnInvalidSpecAndStoresNothing) {
  absl::StatusOr<Job> job = c().SubmitJob(Spec(0), "alice");
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(job.status().message()), StartsWith("world_size"));

  v1::JobSpec bad_model = Spec(1);
  bad_model.mutable_model()->set_name("transformer");
  EXPECT_EQ(c().SubmitJob(bad_model, "alice").status().code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<v1::ListJobsResponse> list = c().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->jobs_size(), 0);
  EXPECT_THAT(Events(""), IsEmpty());
  // Refused specs used up no job number.
  EXPECT_EQ(Submit(Spec(1)), "job-1");
}

TEST_F(CoordinatorTest, SubmitFillsDefaultsAndNumbersJobsFromOne) {
  absl::StatusOr<Job> first = c().SubmitJob(Spec(2), "alice");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->id(), "job-1");
  EXPECT_EQ(first->state(), Job::PENDING);
  EXPECT_EQ(first->generation(), 0);
  EXPECT_EQ(first->restarts(), 0);
  EXPECT_EQ(first->owner(), "alice");
  EXPECT_TRUE(first->has_created_at());
  const v1::JobSpec& spec = first->spec();
  EXPECT_EQ(spec.device(), v1::JobSpec::CPU);
  EXPECT_EQ(spec.threads_per_rank(), 1);
  EXPECT_EQ(spec.batch_size(), 64);
  EXPECT_EQ(spec.optimizer().name(), "sgd");
  EXPECT_TRUE(spec.has_max_restarts());
  EXPECT_EQ(spec.max_restarts(), 3);
  EXPECT_EQ(spec.timeouts().rendezvous().seconds(), 300);
  EXPECT_EQ(spec.timeouts().worker().seconds(), 10);

  EXPECT_EQ(Submit(Spec(1)), "job-2");
  absl::StatusOr<v1::ListJobsResponse> list = c().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->jobs_size(), 2);
  EXPECT_EQ(list->jobs(0).id(), "job-2");  // newest first
  EXPECT_EQ(list->jobs(1).id(), "job-1");
  EXPECT_EQ(Get("job-1").spec().batch_size(), 64);
  EXPECT_THAT(Events("job-1"), Contains("job.submitted"));
}

TEST_F(CoordinatorTest, GetOfAnUnknownJobIsNotFound) {
  EXPECT_EQ(c().GetJob("job-9").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, JobWithoutWorkersStaysPendingSayingWhy) {
  const std::string id = Submit(Spec(2));
  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::PENDING);
  EXPECT_THAT(job.message(), HasSubstr("needs 2"));
  EXPECT_THAT(Events(id), ElementsAre("job.submitted", "job.waiting"));
  // Ticking does not repeat the same reason.
  c().Tick();
  c().Tick();
  EXPECT_THAT(Events(id), ElementsAre("job.submitted", "job.waiting"));
  EXPECT_EQ(Get(id).state(), Job::PENDING);
  EXPECT_EQ(Get(id).generation(), 0);
}

// --- Workers, scheduling, heartbeats -------------------------------------

TEST_F(CoordinatorTest, RegisterWorkerValidatesAndAnswersTheIntervals) {
  v1::RegisterWorkerRequest request;
  for (const std::string& bad :
       std::vector<std::string>{"", "has space", "slash/y", std::string(64, 'a')}) {
    request.mutable_info()->set_id(bad);
    EXPECT_EQ(c().RegisterWorker(request).status().code(), absl::StatusCode::kInvalidArgument)
        << "\"" << bad << "\"";
  }
  request.mutable_info()->set_id("node-1.rack_2");
  request.mutable_info()->set_cpu_slots(-1);
  EXPECT_EQ(c().RegisterWorker(request).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c().ListWorkers().workers_size(), 0);

  request.mutable_info()->set_cpu_slots(4);
  absl::StatusOr<v1::RegisterWorkerResponse> r = c().RegisterWorker(request);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->worker_id(), "node-1.rack_2");
  EXPECT_EQ(r->heartbeat_interval().seconds(), 2);
  EXPECT_EQ(r->worker_timeout().seconds(), 10);
  v1::Worker w = WorkerNamed("node-1.rack_2");
  EXPECT_EQ(w.state(), v1::Worker::ALIVE);
  EXPECT_EQ(w.info().cpu_slots(), 4);
  EXPECT_THAT(Events(""), Contains("worker.registered"));
}

TEST_F(CoordinatorTest, HeartbeatFromAnUnknownWorkerIsNotFound) {
  EXPECT_EQ(Beat("ghost").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, TwoOneSlotWorkersGetATwoRankJobScheduled) {
  const std::string id = Submit(Spec(2));
  ASSERT_TRUE(Register("w1", 1).ok());
  EXPECT_EQ(Get(id).state(), Job::PENDING);
  ASSERT_TRUE(Register("w2", 1).ok());

  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_EQ(job.generation(), 1);
  ASSERT_EQ(job.placement_size(), 2);
  EXPECT_EQ(job.placement(0).rank(), 0);
  EXPECT_EQ(job.placement(1).rank(), 1);
  EXPECT_EQ(job.placement(0).slot(), 0);
  EXPECT_EQ(job.placement(1).slot(), 0);
  EXPECT_THAT(
      (std::vector<std::string>{job.placement(0).worker_id(), job.placement(1).worker_id()}),
      UnorderedElementsAre("w1", "w2"));
  EXPECT_TRUE(InOrder(Events(id), {"job.submitted", "job.waiting", "job.scheduled"}));

  v1::Worker w1 = WorkerNamed("w1");
  EXPECT_EQ(w1.cpu_slots_used(), 1);
  EXPECT_THAT(w1.job_ids(), ElementsAre(id));
}

TEST_F(CoordinatorTest, HeartbeatReturnsEveryAssignmentOfTheWorker) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  absl::StatusOr<v1::HeartbeatResponse> before = Beat("w1");
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->assignments_size(), 0);
  EXPECT_EQ(before->heartbeat_interval().seconds(), 2);

  const std::string id = Submit(Spec(2));
  const Job job = Get(id);
  std::set<int> ranks;
  for (const char* w : {"w1", "w2"}) {
    absl::StatusOr<v1::HeartbeatResponse> r = Beat(w);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_GT(r->assignments_version(), before->assignments_version());
    ASSERT_EQ(r->assignments_size(), 1) << w;
    const v1::TrainerAssignment& a = r->assignments(0);
    EXPECT_EQ(a.job_id(), id);
    EXPECT_EQ(a.generation(), 1);
    EXPECT_EQ(a.world_size(), 2);
    EXPECT_EQ(WorkerOf(id, a.rank()), w);
    EXPECT_EQ(a.slot(), 0);
    EXPECT_TRUE(MessageDifferencer::Equals(a.spec(), job.spec()));
    ranks.insert(a.rank());
    // The trainer token is known to the authenticator, scoped to this job.
    absl::StatusOr<Principal> p = auth_->Authenticate("Bearer " + a.trainer_token());
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->role, Role::kTrainer);
    EXPECT_EQ(p->job_id, id);
    // Complete each time: a second heartbeat lists it again.
    absl::StatusOr<v1::HeartbeatResponse> again = Beat(w);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->assignments_size(), 1);
  }
  EXPECT_THAT(ranks, ElementsAre(0, 1));
}

TEST_F(CoordinatorTest, MultiThreadRanksTakeConsecutiveSlots) {
  ASSERT_TRUE(Register("w1", 4).ok());
  v1::JobSpec spec = Spec(2);
  spec.set_threads_per_rank(2);
  const std::string id = Submit(spec);
  Job job = Get(id);
  ASSERT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_EQ(job.placement(0).slot(), 0);
  EXPECT_EQ(job.placement(1).slot(), 2);
  EXPECT_EQ(WorkerNamed("w1").cpu_slots_used(), 4);
  // Nothing is left for another rank.
  const std::string other = Submit(Spec(1));
  EXPECT_EQ(Get(other).state(), Job::PENDING);
}

TEST_F(CoordinatorTest, GpuJobsGoToWorkersWithGpus) {
  ASSERT_TRUE(Register("cpu-only", 8).ok());
  v1::JobSpec spec = Spec(1);
  spec.set_device(v1::JobSpec::GPU);
  const std::string id = Submit(spec);
  EXPECT_EQ(Get(id).state(), Job::PENDING);
  ASSERT_TRUE(Register("gpu-box", 0, /*gpus=*/2).ok());
  Job job = Get(id);
  ASSERT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_EQ(job.placement(0).worker_id(), "gpu-box");
  EXPECT_EQ(WorkerNamed("gpu-box").gpus_used(), 1);
}

// --- Rendezvous ---------------------------------------------------------

TEST_F(CoordinatorTest, RendezvousOfAllRanksRunsTheJobAndAnswersEveryoneAlike) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));
  JoinAnswer r1 = Join(id, 1, 1);
  EXPECT_FALSE(r1.done());
  EXPECT_EQ(Get(id).state(), Job::SCHEDULED);
  JoinAnswer r0 = Join(id, 1, 0);
  ASSERT_TRUE(r0.done());
  ASSERT_TRUE(r1.done());
  ASSERT_TRUE(r0.get().ok()) << r0.get().status();
  ASSERT_TRUE(r1.get().ok()) << r1.get().status();
  EXPECT_EQ(r0.get()->rank(), 0);
  EXPECT_EQ(r1.get()->rank(), 1);
  for (const JoinAnswer* a : {&r0, &r1}) {
    const v1::JoinRendezvousResponse resp = *a->get();
    EXPECT_EQ(resp.world_size(), 2);
    EXPECT_EQ(resp.generation(), 1);
    EXPECT_FALSE(resp.has_resume_from());
    EXPECT_EQ(resp.spec().world_size(), 2);
    ASSERT_EQ(resp.peers_size(), 2);
    for (int p = 0; p < 2; ++p) {
      EXPECT_EQ(resp.peers(p).rank(), p);
      EXPECT_EQ(resp.peers(p).address(), Address(p));
      EXPECT_EQ(resp.peers(p).worker_id(), WorkerOf(id, p));
    }
  }
  v1::JoinRendezvousResponse r1_as_0 = *r1.get();
  r1_as_0.set_rank(0);
  EXPECT_TRUE(MessageDifferencer::Equals(r1_as_0, *r0.get()));

  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::RUNNING);
  EXPECT_TRUE(job.has_started_at());
  EXPECT_EQ(job.placement(0).address(), Address(0));
  EXPECT_THAT(Events(id), Contains("job.running"));
}

TEST_F(CoordinatorTest, RankThatJoinsAgainAfterCompletionGetsTheSameAnswer) {
  const std::string id = RunningJobOnTwoWorkers();
  JoinAnswer again = Join(id, 1, 1);
  ASSERT_TRUE(again.done());
  ASSERT_TRUE(again.get().ok()) << again.get().status();
  EXPECT_EQ(again.get()->rank(), 1);
  EXPECT_EQ(again.get()->peers_size(), 2);
  EXPECT_EQ(again.get()->peers(0).address(), Address(0));
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
}

TEST_F(CoordinatorTest, JoinWithARankOutOfRangeIsInvalid) {
  ASSERT_TRUE(Register("w1", 2).ok());
  const std::string id = Submit(Spec(2));
  v1::JoinRendezvousRequest request;
  request.set_job_id(id);
  request.set_generation(1);
  request.set_rank(2);
  JoinAnswer answer;
  c().JoinRendezvous(request, answer.Callback());
  ASSERT_TRUE(answer.done());
  EXPECT_EQ(answer.get().status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, RendezvousTimeoutAnswersTheWaiterNamingTheMissingRank) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_rendezvous() = Dur(milliseconds(1000));
  const std::string id = Submit(spec);
  JoinAnswer r0 = Join(id, 1, 0);

  clock_.Advance(milliseconds(500));
  c().Tick();
  EXPECT_FALSE(r0.done()) << "timed out early";

  clock_.Advance(milliseconds(600));
  c().Tick();
  ASSERT_TRUE(r0.done());
  EXPECT_EQ(r0.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r0.get().status().message(), HasSubstr("missing ranks 1"));
  EXPECT_THAT(r0.get().status().message(), HasSubstr("timed out after 1s"));

  // The generation failed; there is room, so the next one is placed after
  // the restart backoff.
  Job job = Get(id);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.generation(), 2);
  PassBackoff(id);
  job = Get(id);
  EXPECT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_TRUE(InOrder(Events(id), {"rendezvous.timeout", "job.restarting", "job.scheduled"}));
  // The old generation's rendezvous is closed.
  JoinAnswer late = Join(id, 1, 1);
  ASSERT_TRUE(late.done());
  EXPECT_EQ(late.get().status().code(), absl::StatusCode::kFailedPrecondition);
}

// --- Fencing ------------------------------------------------------------

TEST_F(CoordinatorTest, TrainerCallsFromAnotherGenerationAreFencedOff) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  ASSERT_EQ(Get(id).generation(), 2);
  PassBackoff(id);
  ASSERT_EQ(Get(id).state(), Job::SCHEDULED);

  for (int64_t gen : {int64_t{1}, int64_t{3}}) {
    SCOPED_TRACE(absl::StrCat("generation ", gen));
    v1::KvSetRequest set;
    set.set_job_id(id);
    set.set_generation(gen);
    set.set_key("k");
    set.set_value("v");
    absl::Status s = c().KvSet(set);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    if (gen == 1) {
      EXPECT_THAT(s.message(), HasSubstr("generation 1 of job-1 is superseded by 2"));
    }

    v1::KvAddRequest add;
    add.set_job_id(id);
    add.set_generation(gen);
    add.set_key("n");
    add.set_delta(1);
    EXPECT_EQ(c().KvAdd(add).status().code(), absl::StatusCode::kFailedPrecondition);

    v1::KvCompareAndSetRequest cas;
    cas.set_job_id(id);
    cas.set_generation(gen);
    cas.set_key("k");
    cas.set_expect_absent(true);
    EXPECT_EQ(c().KvCompareAndSet(cas).status().code(), absl::StatusCode::kFailedPrecondition);

    v1::KvGetRequest get;
    get.set_job_id(id);
    get.set_generation(gen);
    get.set_key("k");
    Async<v1::KvGetResponse> got;
    c().KvGet(get, got.Callback());
    ASSERT_TRUE(got.done());
    EXPECT_EQ(got.get().status().code(), absl::StatusCode::kFailedPrecondition);

    v1::ReportProgressRequest progress;
    progress.set_job_id(id);
    progress.set_generation(gen);
    progress.set_rank(0);
    progress.set_step(10);
    EXPECT_EQ(c().ReportProgress(progress).status().code(), absl::StatusCode::kFailedPrecondition);

    v1::StreamMetricsRequest metrics;
    metrics.set_job_id(id);
    metrics.set_generation(gen);
    metrics.add_records()->set_step(1);
    EXPECT_EQ(c().AppendMetrics(metrics).code(), absl::StatusCode::kFailedPrecondition);

    v1::CommitCheckpointRequest commit;
    commit.set_job_id(id);
    commit.set_generation(gen);
    commit.set_rank(0);
    commit.set_step(10);
    commit.set_path("ckpt/10");
    commit.add_writer_ranks(0);
    EXPECT_EQ(c().CommitCheckpoint(commit).status().code(), absl::StatusCode::kFailedPrecondition);

    JoinAnswer join = Join(id, gen, 0);
    ASSERT_TRUE(join.done());
    EXPECT_EQ(join.get().status().code(), absl::StatusCode::kFailedPrecondition);
  }
  // The current generation is served.
  v1::KvSetRequest set;
  set.set_job_id(id);
  set.set_generation(2);
  set.set_key("k");
  EXPECT_TRUE(c().KvSet(set).ok());
  EXPECT_EQ(Get(id).generation(), 2);
  EXPECT_EQ(Get(id).state(), Job::SCHEDULED);
}

TEST_F(CoordinatorTest, TrainerCallsForUnknownOrEndedJobsAreRefused) {
  v1::KvSetRequest set;
  set.set_job_id("job-77");
  set.set_generation(1);
  set.set_key("k");
  EXPECT_EQ(c().KvSet(set).code(), absl::StatusCode::kNotFound);

  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(c().CancelJob(id, "").ok());
  set.set_job_id(id);
  EXPECT_EQ(c().KvSet(set).code(), absl::StatusCode::kFailedPrecondition);
  JoinAnswer join = Join(id, 1, 0);
  ASSERT_TRUE(join.done());
  EXPECT_EQ(join.get().status().code(), absl::StatusCode::kFailedPrecondition);
}

// --- Failures -----------------------------------------------------------

TEST_F(CoordinatorTest, SilentWorkerIsLostAndItsJobRestartsWhenCapacityReturns) {
  const std::string id = RunningJobOnTwoWorkers();
  // w2 keeps beating; w1 goes silent past the worker timeout.
  clock_.Advance(milliseconds(6000));
  ASSERT_TRUE(Beat("w2").ok());
  clock_.Advance(milliseconds(3000));
  c().Tick();
  EXPECT_EQ(WorkerNamed("w1").state(), v1::Worker::ALIVE) << "lost before its timeout";
  EXPECT_EQ(Get(id).state(), Job::RUNNING);

  clock_.Advance(milliseconds(2000));  // w1 silent 11s, w2 5s
  c().Tick();
  EXPECT_EQ(WorkerNamed("w1").state(), v1::Worker::LOST);
  EXPECT_EQ(WorkerNamed("w2").state(), v1::Worker::ALIVE);
  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::RESTARTING) << job.message();
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.placement_size(), 0);
  // The event says why it restarted.
  EXPECT_THAT(job.message(), HasSubstr("restart 1 of 3 in 1s: worker w1 lost"));
  std::string restart_reason;
  for (const v1::Event& e : EventList(id)) {
    if (e.type() == "job.restarting") restart_reason = e.message();
  }
  EXPECT_THAT(restart_reason, HasSubstr("worker w1 lost"));
  bool lost_event = false;
  for (const v1::Event& e : EventList("")) {
    if (e.type() == "worker.lost" && e.worker_id() == "w1") lost_event = true;
    EXPECT_FALSE(e.type() == "worker.lost" && e.worker_id() == "w2");
  }
  EXPECT_TRUE(lost_event);

  // w2 is told to stop the old generation and runs nothing.
  absl::StatusOr<v1::HeartbeatResponse> w2 = Beat("w2");
  ASSERT_TRUE(w2.ok()) << w2.status();
  EXPECT_EQ(w2->assignments_size(), 0);
  ASSERT_EQ(w2->stops_size(), 1);
  EXPECT_EQ(w2->stops(0).job_id(), id);
  EXPECT_EQ(w2->stops(0).generation(), 1);

  // Only one slot is alive: once the backoff ran out, the job still cannot be
  // placed, and its message says what it waits for.
  clock_.Advance(BackoffOf(id));
  c().Tick();
  EXPECT_EQ(Get(id).state(), Job::RESTARTING);
  EXPECT_THAT(Get(id).message(), HasSubstr("needs 2"));

  // w1 comes back: the job is placed again, as generation 2.
  absl::StatusOr<v1::HeartbeatResponse> w1 = Beat("w1");
  ASSERT_TRUE(w1.ok()) << w1.status();
  EXPECT_EQ(WorkerNamed("w1").state(), v1::Worker::ALIVE);
  job = Get(id);
  EXPECT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
  ASSERT_EQ(w1->assignments_size(), 1);
  EXPECT_EQ(w1->assignments(0).generation(), 2);
  EXPECT_THAT(Events(""), Contains("worker.back"));
  RunJob(id);
}

TEST_F(CoordinatorTest, WorkerSilentPastTheJobsOwnTimeoutFailsTheGeneration) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_worker() = Dur(milliseconds(3000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  clock_.Advance(milliseconds(2000));
  ASSERT_TRUE(Beat("w2").ok());
  clock_.Advance(milliseconds(2000));  // w1 silent 4s: past the job's 3s
  c().Tick();
  EXPECT_EQ(WorkerNamed("w1").state(), v1::Worker::ALIVE);
  Job job = Get(id);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
  // Generation 2 is not put back on the silent worker (that would fail it
  // again at the next tick and burn every restart within a second).
  EXPECT_EQ(job.state(), Job::RESTARTING);
  // Past the restart backoff (1s), w2 alone is not enough.
  for (int i = 0; i < 15; ++i) {
    clock_.Advance(milliseconds(100));
    ASSERT_TRUE(Beat("w2").ok());
    c().Tick();
  }
  job = Get(id);
  EXPECT_EQ(job.state(), Job::RESTARTING);
  EXPECT_EQ(job.restarts(), 1);
  // Once it is heard from again, it gets the job back.
  ASSERT_TRUE(Beat("w1").ok());
  c().Tick();
  job = Get(id);
  EXPECT_EQ(job.state(), Job::SCHEDULED);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
}

TEST_F(CoordinatorTest, NonZeroExitRestartsTheJobAsTheNextGeneration) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(Exit(id, 1, 1, 3).ok());
  Job job = Get(id);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.generation(), 2);
  // It waits out the restart backoff even though there is room.
  EXPECT_EQ(job.state(), Job::RESTARTING);
  EXPECT_THAT(job.message(), StartsWith("restart 1 of 3 in 1s: rank 1 on worker"));
  // Both workers get their stop orders with their next heartbeat (and are
  // heard from after the failure, which a restart placed on them needs).
  clock_.Advance(milliseconds(100));
  for (const char* w : {"w1", "w2"}) {
    absl::StatusOr<v1::HeartbeatResponse> r = Beat(w);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->assignments_size(), 0) << w;
    ASSERT_EQ(r->stops_size(), 1) << w;
    EXPECT_EQ(r->stops(0).generation(), 1);
  }
  clock_.Advance(milliseconds(899));
  c().Tick();
  EXPECT_EQ(Get(id).state(), Job::RESTARTING) << "placed before its backoff ran out";
  clock_.Advance(milliseconds(1));
  c().Tick();
  job = Get(id);
  EXPECT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_TRUE(
      InOrder(Events(id), {"job.running", "trainer.exited", "job.restarting", "job.scheduled"}));
  for (const char* w : {"w1", "w2"}) {
    absl::StatusOr<v1::HeartbeatResponse> r = Beat(w);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->assignments_size(), 1) << w;
    EXPECT_EQ(r->assignments(0).generation(), 2);
  }
  RunJob(id);
}

TEST_F(CoordinatorTest, ARestartAvoidsAWorkerOfTheFailedGenerationNotHeardFromSince) {
  ASSERT_TRUE(Register("w3", 1).ok());  // the spare
  const std::string id = RunningJobOnTwoWorkers();
  // w2 died with its trainer; the survivor on w1 fails the generation first.
  clock_.Advance(milliseconds(500));
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  clock_.Advance(milliseconds(100));
  ASSERT_TRUE(Beat("w1").ok());
  ASSERT_TRUE(Beat("w3").ok());
  clock_.Advance(BackoffOf(id));
  ASSERT_TRUE(Beat("w1").ok());
  ASSERT_TRUE(Beat("w3").ok());
  c().Tick();
  const Job job = Get(id);
  ASSERT_EQ(job.state(), Job::SCHEDULED) << job.message();
  std::set<std::string> on;
  for (const v1::RankPlacement& p : job.placement()) on.insert(p.worker_id());
  EXPECT_EQ(on, (std::set<std::string>{"w1", "w3"}));
}

TEST_F(CoordinatorTest, DeathBySignalCountsAsAFailure) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(Exit(id, 1, 0, 0, false, false, /*signal=*/9).ok());
  EXPECT_EQ(Get(id).generation(), 2);
  EXPECT_EQ(Get(id).restarts(), 1);
}

TEST_F(CoordinatorTest, ExitsOnAStopOrderOrFromAnOldGenerationChangeNothing) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(Exit(id, 1, 0, 143, false, /*stopped_by_order=*/true).ok());
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  EXPECT_EQ(Get(id).generation(), 1);

  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());  // a real failure: generation 2
  ASSERT_EQ(Get(id).generation(), 2);
  ASSERT_TRUE(Exit(id, 1, 1, 1).ok());  // late news of generation 1
  EXPECT_EQ(Get(id).generation(), 2);
  EXPECT_EQ(Get(id).restarts(), 1);
  PassBackoff(id);
  EXPECT_EQ(Get(id).state(), Job::SCHEDULED);
}

TEST_F(CoordinatorTest, JobFailsForGoodOnceMaxRestartsAreUsedUp) {
  v1::JobSpec spec = Spec(2);
  spec.set_max_restarts(1);
  const std::string id = RunningJobOnTwoWorkers(spec);
  const std::string token = Beat("w1")->assignments(0).trainer_token();
  ASSERT_TRUE(Exit(id, 1, 0, 3).ok());
  PassBackoff(id);
  ASSERT_EQ(Get(id).state(), Job::SCHEDULED);
  RunJob(id);
  ASSERT_TRUE(Exit(id, 2, 1, 4).ok());

  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::FAILED);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_THAT(job.message(), HasSubstr("max_restarts 1"));
  EXPECT_THAT(job.message(), HasSubstr("exited with code 4"));
  EXPECT_TRUE(job.has_finished_at());
  EXPECT_THAT(Events(id), Contains("job.failed"));
  // The job's token dies with it, and its slots are free again.
  EXPECT_EQ(auth_->Authenticate("Bearer " + token).status().code(),
            absl::StatusCode::kUnauthenticated);
  const std::string next = Submit(Spec(2));
  EXPECT_EQ(Get(next).state(), Job::SCHEDULED);
}

TEST_F(CoordinatorTest, MaxRestartsZeroFailsAtTheFirstFailure) {
  v1::JobSpec spec = Spec(2);
  spec.set_max_restarts(0);
  const std::string id = RunningJobOnTwoWorkers(spec);
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  EXPECT_EQ(Get(id).state(), Job::FAILED);
  EXPECT_EQ(Get(id).restarts(), 0);
}

TEST_F(CoordinatorTest, PermanentFailureFailsTheJobAtOnce) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(Exit(id, 1, 0, 78, /*permanent=*/true).ok());
  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::FAILED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_THAT(job.message(), HasSubstr("permanent"));
  EXPECT_THAT(job.message(), HasSubstr("exited with code 78"));
  for (const char* w : {"w1", "w2"}) {
    absl::StatusOr<v1::HeartbeatResponse> r = Beat(w);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->assignments_size(), 0);
    EXPECT_EQ(r->stops_size(), 1);
  }
}

TEST_F(CoordinatorTest, AllRanksExitingZeroSucceedsTheJob) {
  const std::string id = RunningJobOnTwoWorkers();
  const std::string token = Beat("w1")->assignments(0).trainer_token();
  ASSERT_TRUE(Exit(id, 1, 0, 0).ok());
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  // The same rank reporting twice is not two ranks.
  ASSERT_TRUE(Exit(id, 1, 0, 0).ok());
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  ASSERT_TRUE(Exit(id, 1, 1, 0).ok());
  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::SUCCEEDED) << job.message();
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_TRUE(job.has_finished_at());
  EXPECT_THAT(Events(id), Contains("job.succeeded"));
  EXPECT_FALSE(auth_->Authenticate("Bearer " + token).ok());
  absl::StatusOr<v1::HeartbeatResponse> r = Beat("w1");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->assignments_size(), 0);
  EXPECT_EQ(WorkerNamed("w1").cpu_slots_used(), 0);
  // The late exit of an ended job changes nothing.
  ASSERT_TRUE(Exit(id, 1, 1, 1).ok());
  EXPECT_EQ(Get(id).state(), Job::SUCCEEDED);
}

TEST_F(CoordinatorTest, RanksThatAllExitZeroBeforeTheRendezvousEndedSucceedTheJob) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));
  ASSERT_EQ(Get(id).state(), Job::SCHEDULED);
  ASSERT_TRUE(Exit(id, 1, 0, 0).ok());
  ASSERT_TRUE(Exit(id, 1, 1, 0).ok());
  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::SUCCEEDED) << job.message();
  EXPECT_EQ(WorkerNamed("w1").cpu_slots_used(), 0);
}

TEST_F(CoordinatorTest, ReportTrainerExitOfAnUnknownJobIsNotFound) {
  v1::ReportTrainerExitRequest request;
  request.set_job_id("job-5");
  EXPECT_EQ(c().ReportTrainerExit(request).code(), absl::StatusCode::kNotFound);
}

// --- Cancel -------------------------------------------------------------

TEST_F(CoordinatorTest, CancelOfARunningJobStopsItsTrainers) {
  const std::string id = RunningJobOnTwoWorkers();
  absl::StatusOr<Job> cancelled = c().CancelJob(id, "no longer needed");
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), Job::CANCELLED);
  EXPECT_THAT(cancelled->message(), HasSubstr("no longer needed"));
  EXPECT_EQ(Get(id).state(), Job::CANCELLED);
  EXPECT_THAT(Events(id), Contains("job.cancelled"));
  for (const char* w : {"w1", "w2"}) {
    absl::StatusOr<v1::HeartbeatResponse> r = Beat(w);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->assignments_size(), 0) << w;
    ASSERT_EQ(r->stops_size(), 1) << w;
    EXPECT_EQ(r->stops(0).job_id(), id);
    EXPECT_EQ(r->stops(0).generation(), 1);
    // A stop order is delivered once.
    EXPECT_EQ(Beat(w)->stops_size(), 0);
  }
}

TEST_F(CoordinatorTest, CancelOfAPendingJobNeedsNoStopOrders) {
  ASSERT_TRUE(Register("w1", 1).ok());
  const std::string id = Submit(Spec(2));
  ASSERT_EQ(Get(id).state(), Job::PENDING);
  ASSERT_TRUE(c().CancelJob(id, "").ok());
  EXPECT_EQ(Get(id).state(), Job::CANCELLED);
  EXPECT_EQ(Beat("w1")->stops_size(), 0);
}

TEST_F(CoordinatorTest, CancelOfAnEndedOrUnknownJobIsRefused) {
  const std::string id = Submit(Spec(1));
  ASSERT_TRUE(c().CancelJob(id, "").ok());
  absl::StatusOr<Job> again = c().CancelJob(id, "");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c().CancelJob("job-99", "").status().code(), absl::StatusCode::kNotFound);
}

// --- Queue order --------------------------------------------------------

TEST_F(CoordinatorTest, HigherPriorityJobsAreScheduledFirst) {
  ASSERT_TRUE(Register("w1", 2).ok());
  const std::string running = Submit(Spec(2));
  const std::string low = Submit(Spec(2));
  v1::JobSpec urgent_spec = Spec(2);
  urgent_spec.set_priority(5);
  const std::string urgent = Submit(urgent_spec);
  ASSERT_EQ(Get(running).state(), Job::SCHEDULED);
  EXPECT_EQ(Get(low).state(), Job::PENDING);
  EXPECT_EQ(Get(urgent).state(), Job::PENDING);

  ASSERT_TRUE(c().CancelJob(running, "").ok());
  EXPECT_EQ(Get(urgent).state(), Job::SCHEDULED);
  EXPECT_EQ(Get(low).state(), Job::PENDING);
  ASSERT_TRUE(c().CancelJob(urgent, "").ok());
  EXPECT_EQ(Get(low).state(), Job::SCHEDULED);
}

TEST_F(CoordinatorTest, JobBiggerThanTheClusterDoesNotBlockLaterJobs) {
  ASSERT_TRUE(Register("w1", 2).ok());
  const std::string huge = Submit(Spec(5));
  const std::string small = Submit(Spec(1));
  Job job = Get(huge);
  EXPECT_EQ(job.state(), Job::PENDING);
  EXPECT_THAT(job.message(), HasSubstr("needs 5"));
  EXPECT_THAT(job.message(), HasSubstr("has 2"));
  EXPECT_THAT(Events(huge), Contains("job.waiting"));
  EXPECT_EQ(Get(small).state(), Job::SCHEDULED);
}

TEST_F(CoordinatorTest, JobWaitingForRoomBlocksLaterJobsOfTheSamePriority) {
  ASSERT_TRUE(Register("w1", 3).ok());
  const std::string first = Submit(Spec(2));
  const std::string waiting = Submit(Spec(2));
  const std::string behind = Submit(Spec(1));  // would fit the free slot
  ASSERT_EQ(Get(first).state(), Job::SCHEDULED);
  EXPECT_EQ(Get(waiting).state(), Job::PENDING);
  EXPECT_THAT(Events(waiting), Contains("job.waiting"));
  EXPECT_EQ(Get(behind).state(), Job::PENDING) << "backfilled past a waiting job";
  c().Tick();
  EXPECT_EQ(Get(behind).state(), Job::PENDING);

  // A higher priority goes ahead of the waiting job.
  v1::JobSpec urgent_spec = Spec(1);
  urgent_spec.set_priority(1);
  const std::string urgent = Submit(urgent_spec);
  EXPECT_EQ(Get(urgent).state(), Job::SCHEDULED);

  // Room again: the waiting job first, in submission order.
  ASSERT_TRUE(c().CancelJob(first, "").ok());
  EXPECT_EQ(Get(waiting).state(), Job::SCHEDULED);
  EXPECT_EQ(Get(behind).state(), Job::PENDING);
}

// --- KV -----------------------------------------------------------------

TEST_F(CoordinatorTest, KvSetGetAddAndCompareAndSetWorkWithinAGeneration) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::KvSetRequest set;
  set.set_job_id(id);
  set.set_generation(1);
  set.set_key("nccl/unique_id");
  set.set_value(std::string("\x01\x00\x02", 3));
  ASSERT_TRUE(c().KvSet(set).ok());

  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("nccl/unique_id");
  Async<v1::KvGetResponse> got;
  c().KvGet(get, got.Callback());
  ASSERT_TRUE(got.done());
  ASSERT_TRUE(got.get().ok()) << got.get().status();
  EXPECT_TRUE(got.get()->found());
  EXPECT_EQ(got.get()->value(), std::string("\x01\x00\x02", 3));

  get.set_key("unset");
  Async<v1::KvGetResponse> missing;
  c().KvGet(get, missing.Callback());
  ASSERT_TRUE(missing.done());
  ASSERT_TRUE(missing.get().ok()) << missing.get().status();
  EXPECT_FALSE(missing.get()->found());

  v1::KvAddRequest add;
  add.set_job_id(id);
  add.set_generation(1);
  add.set_key("barrier");
  add.set_delta(1);
  EXPECT_EQ(c().KvAdd(add)->value(), 1);
  EXPECT_EQ(c().KvAdd(add)->value(), 2);

  v1::KvCompareAndSetRequest cas;
  cas.set_job_id(id);
  cas.set_generation(1);
  cas.set_key("leader");
  cas.set_expect_absent(true);
  cas.set_desired("rank0");
  absl::StatusOr<v1::KvCompareAndSetResponse> r = c().KvCompareAndSet(cas);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->swapped());
  cas.set_desired("rank1");
  r = c().KvCompareAndSet(cas);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->swapped());
  EXPECT_TRUE(r->found());
  EXPECT_EQ(r->current(), "rank0");

  set.set_key("");
  EXPECT_EQ(c().KvSet(set).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, KvGetWithWaitIsAnsweredByALaterKvSet) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("gloo/rank1");
  *get.mutable_wait() = Dur(milliseconds(5000));
  Async<v1::KvGetResponse> got;
  c().KvGet(get, got.Callback());
  EXPECT_FALSE(got.done());
  c().Tick();
  EXPECT_FALSE(got.done());

  v1::KvSetRequest set;
  set.set_job_id(id);
  set.set_generation(1);
  set.set_key("gloo/rank1");
  set.set_value("10.0.0.2:4000");
  ASSERT_TRUE(c().KvSet(set).ok());
  ASSERT_TRUE(got.done());
  ASSERT_TRUE(got.get().ok()) << got.get().status();
  EXPECT_TRUE(got.get()->found());
  EXPECT_EQ(got.get()->value(), "10.0.0.2:4000");
  EXPECT_EQ(got.calls(), 1);
}

TEST_F(CoordinatorTest, KvGetWaitRunsOutAfterItsTime) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("never");
  *get.mutable_wait() = Dur(milliseconds(1000));
  Async<v1::KvGetResponse> got;
  c().KvGet(get, got.Callback());
  clock_.Advance(milliseconds(500));
  c().Tick();
  EXPECT_FALSE(got.done());
  clock_.Advance(milliseconds(600));
  c().Tick();
  ASSERT_TRUE(got.done());
  EXPECT_EQ(got.get().status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(CoordinatorTest, KvStoreEndsWithItsGeneration) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::KvSetRequest set;
  set.set_job_id(id);
  set.set_generation(1);
  set.set_key("k");
  set.set_value("gen1");
  ASSERT_TRUE(c().KvSet(set).ok());
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("waited-for");
  *get.mutable_wait() = Dur(milliseconds(5000));
  Async<v1::KvGetResponse> waiting;
  c().KvGet(get, waiting.Callback());
  ASSERT_FALSE(waiting.done());

  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  ASSERT_TRUE(waiting.done()) << "a waiter of the failed generation was left hanging";
  EXPECT_FALSE(waiting.get().ok());
  PassBackoff(id);

  get.set_generation(2);
  get.set_key("k");
  get.clear_wait();
  Async<v1::KvGetResponse> fresh;
  c().KvGet(get, fresh.Callback());
  ASSERT_TRUE(fresh.done());
  ASSERT_TRUE(fresh.get().ok()) << fresh.get().status();
  EXPECT_FALSE(fresh.get()->found()) << "generation 2 sees generation 1's keys";
}

// --- Long-poll heartbeats -----------------------------------------------

TEST_F(CoordinatorTest, HeldHeartbeatIsAnsweredWhenAJobIsScheduledOntoTheWorker) {
  ASSERT_TRUE(Register("w1", 2).ok());
  absl::StatusOr<v1::HeartbeatResponse> first = Beat("w1");
  ASSERT_TRUE(first.ok()) << first.status();
  Async<v1::HeartbeatResponse> held =
      HeldBeat("w1", first->assignments_version(), milliseconds(1000));
  EXPECT_FALSE(held.done());
  c().Tick();
  EXPECT_FALSE(held.done());

  const std::string id = Submit(Spec(1));
  ASSERT_TRUE(held.done());
  ASSERT_TRUE(held.get().ok()) << held.get().status();
  ASSERT_EQ(held.get()->assignments_size(), 1);
  EXPECT_EQ(held.get()->assignments(0).job_id(), id);
  EXPECT_GT(held.get()->assignments_version(), first->assignments_version());
  EXPECT_EQ(held.calls(), 1);
}

TEST_F(CoordinatorTest, HeldHeartbeatIsAnsweredOnceMaxWaitHasPassed) {
  ASSERT_TRUE(Register("w1", 2).ok());
  absl::StatusOr<v1::HeartbeatResponse> first = Beat("w1");
  ASSERT_TRUE(first.ok()) << first.status();
  Async<v1::HeartbeatResponse> held =
      HeldBeat("w1", first->assignments_version(), milliseconds(1000));
  clock_.Advance(milliseconds(500));
  c().Tick();
  EXPECT_FALSE(held.done());
  clock_.Advance(milliseconds(600));
  c().Tick();
  ASSERT_TRUE(held.done());
  ASSERT_TRUE(held.get().ok()) << held.get().status();
  EXPECT_EQ(held.get()->assignments_size(), 0);
  EXPECT_EQ(held.get()->assignments_version(), first->assignments_version());
  c().Tick();
  EXPECT_EQ(held.calls(), 1);
}

TEST_F(CoordinatorTest, HeldHeartbeatOfAWorkerAChangeDoesNotConcernStaysHeld) {
  // w2 has no slots: the job can only go to w1.
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 0).ok());
  absl::StatusOr<v1::HeartbeatResponse> first1 = Beat("w1");
  absl::StatusOr<v1::HeartbeatResponse> first2 = Beat("w2");
  ASSERT_TRUE(first1.ok()) << first1.status();
  ASSERT_TRUE(first2.ok()) << first2.status();
  Async<v1::HeartbeatResponse> held1 =
      HeldBeat("w1", first1->assignments_version(), milliseconds(1000));
  Async<v1::HeartbeatResponse> held2 =
      HeldBeat("w2", first2->assignments_version(), milliseconds(1000));

  const std::string id = Submit(Spec(1));
  ASSERT_TRUE(held1.done());
  ASSERT_TRUE(held1.get().ok()) << held1.get().status();
  ASSERT_EQ(held1.get()->assignments_size(), 1);
  EXPECT_FALSE(held2.done()) << "w2 was woken by a job placed on w1";

  // At its deadline w2 is answered with the new version, and nothing for it.
  clock_.Advance(milliseconds(1100));
  c().Tick();
  ASSERT_TRUE(held2.done());
  ASSERT_TRUE(held2.get().ok()) << held2.get().status();
  EXPECT_EQ(held2.get()->assignments_size(), 0);
  EXPECT_EQ(held2.get()->assignments_version(), held1.get()->assignments_version());

  // Ending the job wakes w1 (its stop order), not w2.
  Async<v1::HeartbeatResponse> again1 =
      HeldBeat("w1", held1.get()->assignments_version(), milliseconds(1000));
  Async<v1::HeartbeatResponse> again2 =
      HeldBeat("w2", held2.get()->assignments_version(), milliseconds(1000));
  ASSERT_FALSE(again1.done());
  ASSERT_TRUE(c().CancelJob(id, "").ok());
  ASSERT_TRUE(again1.done());
  ASSERT_TRUE(again1.get().ok()) << again1.get().status();
  EXPECT_EQ(again1.get()->stops_size(), 1);
  EXPECT_FALSE(again2.done()) << "w2 was woken by a job ending on w1";
  clock_.Advance(milliseconds(1100));
  c().Tick();
  EXPECT_TRUE(again2.done());
}

TEST_F(CoordinatorTest, HeartbeatWithAnOutdatedVersionIsAnsweredAtOnce) {
  ASSERT_TRUE(Register("w1", 2).ok());
  absl::StatusOr<v1::HeartbeatResponse> first = Beat("w1");
  ASSERT_TRUE(first.ok());
  Submit(Spec(1));
  Async<v1::HeartbeatResponse> r = HeldBeat("w1", first->assignments_version(), milliseconds(1000));
  ASSERT_TRUE(r.done());
  ASSERT_TRUE(r.get().ok());
  EXPECT_EQ(r.get()->assignments_size(), 1);
}

// --- Watch --------------------------------------------------------------

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

TEST_F(CoordinatorTest, PollWatchSendsTheJobThenEventsAfterTheCursorThenFinishes) {
  const std::string id = Submit(Spec(2));  // no workers: submitted, waiting
  std::vector<v1::Event> events = EventList(id);
  ASSERT_GE(events.size(), 2u);
  ASSERT_EQ(events[0].type(), "job.submitted");

  v1::WatchJobRequest request;
  request.set_job_id(id);
  WatchCursor cursor;
  cursor.last_event_seq = events[0].seq();
  absl::StatusOr<WatchBatch> batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_GE(batch->items.size(), 2u);
  ASSERT_TRUE(batch->items[0].has_job());
  EXPECT_EQ(batch->items[0].job().state(), Job::PENDING);
  for (size_t i = 1; i < batch->items.size(); ++i) {
    ASSERT_TRUE(batch->items[i].has_event());
    EXPECT_GT(batch->items[i].event().seq(), events[0].seq());
  }
  EXPECT_EQ(batch->items[1].event().type(), "job.waiting");
  EXPECT_FALSE(batch->finished);

  // Nothing new: nothing sent, not finished.
  batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok());
  EXPECT_THAT(batch->items, IsEmpty());
  EXPECT_FALSE(batch->finished);

  ASSERT_TRUE(c().CancelJob(id, "").ok());
  std::vector<v1::WatchJobResponse> after;
  bool finished = false;
  for (int polls = 0; polls < 10 && !finished; ++polls) {
    batch = c().PollWatch(request, &cursor);
    ASSERT_TRUE(batch.ok()) << batch.status();
    for (auto& item : batch->items) after.push_back(item);
    finished = batch->finished;
  }
  ASSERT_TRUE(finished) << "the watch never finished";
  bool saw_cancelled_job = false;
  bool saw_cancelled_event = false;
  for (const v1::WatchJobResponse& item : after) {
    if (item.has_job() && item.job().state() == Job::CANCELLED) saw_cancelled_job = true;
    if (item.has_event() && item.event().type() == "job.cancelled") saw_cancelled_event = true;
  }
  EXPECT_TRUE(saw_cancelled_job);
  EXPECT_TRUE(saw_cancelled_event);
  // Once finished it stays finished with nothing more to send.
  batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok());
  EXPECT_TRUE(batch->finished);
  EXPECT_THAT(batch->items, IsEmpty());
}

TEST_F(CoordinatorTest, StepsAreCombinedOnceEveryRankReported) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(SendSteps(id, 0, 1, 3).ok());
  EXPECT_EQ(Get(id).last_step(), 3);
  v1::GetMetricsRequest get;
  get.set_job_id(id);
  absl::StatusOr<v1::GetMetricsResponse> none = c().GetMetrics(get);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->steps_size(), 0) << "rank 1 has not reported yet";

  ASSERT_TRUE(SendSteps(id, 1, 1, 2).ok());
  absl::StatusOr<v1::GetMetricsResponse> two = c().GetMetrics(get);
  ASSERT_TRUE(two.ok()) << two.status();
  ASSERT_EQ(two->steps_size(), 2);
  const v1::StepMetrics& s = two->steps(1);
  EXPECT_EQ(s.step(), 2);
  EXPECT_EQ(s.generation(), 1);
  EXPECT_EQ(s.ranks_reported(), 2);
  EXPECT_EQ(s.world_size(), 2);
  EXPECT_DOUBLE_EQ(s.loss(), 0.5 + 0.5);  // mean of 1/2 and 1/2 + 1
  EXPECT_EQ(s.samples(), 128);
  EXPECT_DOUBLE_EQ(s.step_seconds(), 0.02);
  EXPECT_EQ(s.slowest_rank(), 1);
  EXPECT_DOUBLE_EQ(s.samples_per_second(), 128 / 0.02);
  EXPECT_THAT(s.rank_step_seconds(), ElementsAre(0.01, 0.02));

  // Range and refusals.
  get.set_from_step(2);
  get.set_to_step(2);
  absl::StatusOr<v1::GetMetricsResponse> one = c().GetMetrics(get);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->steps_size(), 1);
  get.set_from_step(-1);
  EXPECT_EQ(c().GetMetrics(get).status().code(), absl::StatusCode::kInvalidArgument);
  get.set_job_id("job-404");
  get.set_from_step(0);
  EXPECT_EQ(c().GetMetrics(get).status().code(), absl::StatusCode::kNotFound);
  v1::StreamMetricsRequest bad;
  bad.set_job_id(id);
  bad.set_generation(1);
  bad.set_rank(2);
  EXPECT_EQ(c().AppendMetrics(bad).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, AStepStillMissingARankIsCombinedAfterTheWait) {
  options_.step_log.max_wait = milliseconds(5000);
  Open(":memory:");
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(SendSteps(id, 0, 1, 2).ok());
  ASSERT_TRUE(SendSteps(id, 1, 1, 1).ok());
  v1::GetMetricsRequest get;
  get.set_job_id(id);
  ASSERT_EQ(c().GetMetrics(get)->steps_size(), 1);
  clock_.Advance(milliseconds(4000));
  c().Tick();
  EXPECT_EQ(c().GetMetrics(get)->steps_size(), 1);
  clock_.Advance(milliseconds(1500));
  c().Tick();
  absl::StatusOr<v1::GetMetricsResponse> after = c().GetMetrics(get);
  ASSERT_TRUE(after.ok());
  ASSERT_EQ(after->steps_size(), 2);
  EXPECT_EQ(after->steps(1).ranks_reported(), 1);
  EXPECT_DOUBLE_EQ(after->steps(1).loss(), 0.5);
  // Rank 1's record of step 2 comes too late: dropped, step 2 unchanged.
  ASSERT_TRUE(SendSteps(id, 1, 2, 2).ok());
  EXPECT_EQ(c().GetMetrics(get)->steps(1).ranks_reported(), 1);
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr("aidn_metric_records_dropped_total 1\n"));
}

TEST_F(CoordinatorTest, PollWatchReadsStoredStepsBackThenFollowsMemoryWithoutGapsOrRepeats) {
  options_.step_log.recent_steps = 4;
  Open(":memory:");
  const std::string id = RunningJobOnTwoWorkers();
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 1, 10).ok());
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 10, 10, v1::MetricRecord::EVAL).ok());

  v1::WatchJobRequest request;
  request.set_job_id(id);
  request.set_include_metrics(true);
  request.set_from_step(3);
  WatchCursor cursor;
  absl::StatusOr<WatchBatch> batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(batch->items.front().has_job());
  using Steps = std::vector<std::pair<int64_t, int>>;
  const int kTrain = v1::MetricRecord::TRAIN, kEval = v1::MetricRecord::EVAL;
  Steps expected;
  for (int64_t k = 3; k <= 10; ++k) expected.emplace_back(k, kTrain);
  expected.emplace_back(10, kEval);
  EXPECT_EQ(StepItems(*batch), expected);

  // New steps come from memory, once each.
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 11, 12).ok());
  batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok());
  EXPECT_EQ(StepItems(*batch), (Steps{{11, kTrain}, {12, kTrain}}));
  batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok());
  EXPECT_THAT(StepItems(*batch), IsEmpty());

  // Ten steps while this watcher was away: more than the 4 memory holds,
  // so the rest is read back from the store.
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 13, 22).ok());
  Steps got;
  for (int i = 0; i < 3; ++i) {
    batch = c().PollWatch(request, &cursor);
    ASSERT_TRUE(batch.ok());
    for (const auto& item : StepItems(*batch)) got.push_back(item);
  }
  Steps later;
  for (int64_t k = 13; k <= 22; ++k) later.emplace_back(k, kTrain);
  EXPECT_EQ(got, later);
  EXPECT_FALSE(batch->finished);

  // Once the job ended and everything was sent, the watch is finished.
  for (int rank : {0, 1}) ASSERT_TRUE(Exit(id, 1, rank, 0).ok());
  ASSERT_EQ(Get(id).state(), Job::SUCCEEDED);
  bool finished = false;
  for (int i = 0; i < 5 && !finished; ++i) {
    batch = c().PollWatch(request, &cursor);
    ASSERT_TRUE(batch.ok());
    EXPECT_THAT(StepItems(*batch), IsEmpty());
    finished = batch->finished;
  }
  EXPECT_TRUE(finished);
}

TEST_F(CoordinatorTest, ProgressCarriesTotalStepsAndEpochToTheJob) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::ReportProgressRequest progress;
  progress.set_job_id(id);
  progress.set_generation(1);
  progress.set_rank(0);
  progress.set_step(40);
  progress.set_epoch(2);
  progress.set_total_steps(300);
  v1::WatchJobRequest request;
  request.set_job_id(id);
  WatchCursor cursor;
  ASSERT_TRUE(c().PollWatch(request, &cursor).ok());
  ASSERT_TRUE(c().ReportProgress(progress).ok());
  const Job job = Get(id);
  EXPECT_EQ(job.total_steps(), 300);
  EXPECT_EQ(job.last_step(), 40);
  EXPECT_EQ(job.epoch(), 2);
  // Watchers see the new total.
  absl::StatusOr<WatchBatch> batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok());
  ASSERT_FALSE(batch->items.empty());
  EXPECT_EQ(batch->items.front().job().total_steps(), 300);
  progress.set_total_steps(-1);
  EXPECT_EQ(c().ReportProgress(progress).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, RegistryShowsJobsRanksAndWorkersAndForgetsFinishedJobsAfterRetention) {
  options_.metrics_retention = milliseconds(60'000);
  Open(":memory:");
  const std::string id = RunningJobOnTwoWorkers();
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 1, 5).ok());
  for (int rank : {0, 1}) ASSERT_TRUE(SendSteps(id, rank, 5, 5, v1::MetricRecord::EVAL).ok());
  v1::ReportProgressRequest progress;
  progress.set_job_id(id);
  progress.set_generation(1);
  progress.set_rank(1);
  progress.set_step(5);
  progress.set_total_steps(50);
  ASSERT_TRUE(c().ReportProgress(progress).ok());

  std::string text = c().registry()->Serialize();
  const std::string job = absl::StrCat("job_id=\"", id, "\"");
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_step{", job, "} 5\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_total_steps{", job, "} 50\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_loss{", job, "} 0.7\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_test_accuracy{", job, "} 0.85")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_state{", job, ",state=\"RUNNING\"} 1\n")));
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("aidn_rank_step_seconds_count{", job, ",rank=\"1\"} 5\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_rank_last_progress_age_seconds{", job,
                                           ",rank=\"1\"} 0\n")));
  EXPECT_THAT(text, HasSubstr("aidn_jobs{state=\"RUNNING\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("aidn_worker_up{worker_id=\"w1\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("aidn_worker_slots_used{kind=\"cpu\",worker_id=\"w2\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("aidn_metric_records_total 12\n"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_rank_straggler{", job, ",rank=\"1\"} 0\n")));

  for (int rank : {0, 1}) ASSERT_TRUE(Exit(id, 1, rank, 0).ok());
  clock_.Advance(milliseconds(30'000));
  text = c().registry()->Serialize();
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_state{", job, ",state=\"SUCCEEDED\"} 1\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("aidn_job_step{", job, "} 5\n")));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("aidn_rank_last_progress_age_seconds{")));
  EXPECT_THAT(text, HasSubstr("aidn_worker_slots_used{kind=\"cpu\",worker_id=\"w2\"} 0\n"));

  clock_.Advance(milliseconds(31'000));
  text = c().registry()->Serialize();
  EXPECT_THAT(text, ::testing::Not(HasSubstr(job)));
  EXPECT_THAT(text, HasSubstr("aidn_jobs{state=\"SUCCEEDED\"} 1\n"));
  // The steps are still in the store.
  c().Tick();
  v1::GetMetricsRequest get;
  get.set_job_id(id);
  EXPECT_EQ(c().GetMetrics(get)->steps_size(), 6);
}

TEST_F(CoordinatorTest, SubscribersAreNotifiedOutsideTheLockAndCanPull) {
  EXPECT_EQ(c().Subscribe("job-404", nullptr).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));
  PullingWatcher watcher(&c(), id);
  ASSERT_TRUE(c().Subscribe(id, &watcher).ok());
  RunJob(id);
  EXPECT_GT(watcher.notified(), 0);
  ASSERT_TRUE(c().CancelJob(id, "").ok());
  c().Unsubscribe(id, &watcher);
  const int notified = watcher.notified();
  Submit(Spec(1));
  c().Tick();
  EXPECT_EQ(watcher.notified(), notified) << "notified after Unsubscribe";

  std::vector<Job::State> states;
  std::vector<std::string> types;
  for (const v1::WatchJobResponse& item : watcher.items()) {
    if (item.has_job()) states.push_back(item.job().state());
    if (item.has_event()) types.push_back(item.event().type());
  }
  ASSERT_FALSE(watcher.items().empty());
  EXPECT_TRUE(watcher.items()[0].has_job());
  EXPECT_THAT(states, Contains(Job::RUNNING));
  EXPECT_THAT(states, Contains(Job::CANCELLED));
  EXPECT_TRUE(InOrder(types, {"job.running", "job.cancelled"}));
}

// --- Checkpoints --------------------------------------------------------

v1::CommitCheckpointRequest Commit(const std::string& job_id, int64_t generation, int rank,
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

TEST_F(CoordinatorTest, CheckpointCommitsOnceEveryWriterReportedAndIsResumedFrom) {
  const std::string id = RunningJobOnTwoWorkers();
  absl::StatusOr<v1::CommitCheckpointResponse> r =
      c().CommitCheckpoint(Commit(id, 1, 0, 100, {0, 1}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->committed());
  absl::StatusOr<v1::ListCheckpointsResponse> list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->checkpoints_size(), 1);
  EXPECT_FALSE(list->checkpoints(0).committed());

  r = c().CommitCheckpoint(Commit(id, 1, 1, 100, {0, 1}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->committed());
  list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->checkpoints_size(), 1);
  const v1::Checkpoint& cp = list->checkpoints(0);
  EXPECT_TRUE(cp.committed());
  EXPECT_EQ(cp.step(), 100);
  EXPECT_EQ(cp.generation(), 1);
  EXPECT_EQ(cp.path(), "ckpt/step-100");
  EXPECT_THAT(cp.ranks_reported(), UnorderedElementsAre(0, 1));
  EXPECT_EQ(Get(id).last_checkpoint_step(), 100);
  EXPECT_THAT(Events(id), Contains("checkpoint.committed"));

  // A later checkpoint only half written is not resumed from.
  ASSERT_TRUE(c().CommitCheckpoint(Commit(id, 1, 0, 200, {0, 1})).ok());

  ASSERT_TRUE(Exit(id, 1, 1, 1).ok());
  ASSERT_EQ(Get(id).generation(), 2);
  PassBackoff(id);
  std::vector<JoinAnswer> answers = RunJob(id);
  for (const JoinAnswer& a : answers) {
    ASSERT_TRUE(a.get().ok());
    ASSERT_TRUE(a.get()->has_resume_from());
    EXPECT_EQ(a.get()->resume_from().step(), 100);
    EXPECT_TRUE(a.get()->resume_from().committed());
  }
}

TEST_F(CoordinatorTest, CheckpointCommitValidatesItsRequest) {
  const std::string id = RunningJobOnTwoWorkers();
  EXPECT_EQ(c().CommitCheckpoint(Commit(id, 1, 0, 10, {})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c().CommitCheckpoint(Commit(id, 1, 1, 10, {0})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c().CommitCheckpoint(Commit(id, 1, 0, 10, {0, 5})).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::CommitCheckpointRequest bad_path = Commit(id, 1, 0, 10, {0});
  bad_path.set_path("../escape");
  EXPECT_EQ(c().CommitCheckpoint(bad_path).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c().ListCheckpoints(id)->checkpoints_size(), 0);
  EXPECT_EQ(c().ListCheckpoints("job-404").status().code(), absl::StatusCode::kNotFound);
}

// --- Progress -----------------------------------------------------------

TEST_F(CoordinatorTest, ReportProgressRaisesLastStep) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::ReportProgressRequest p;
  p.set_job_id(id);
  p.set_generation(1);
  p.set_rank(1);
  p.set_step(42);
  ASSERT_TRUE(c().ReportProgress(p).ok());
  EXPECT_EQ(Get(id).last_step(), 42);
  p.set_step(7);
  ASSERT_TRUE(c().ReportProgress(p).ok());
  EXPECT_EQ(Get(id).last_step(), 42);
  p.set_rank(2);
  EXPECT_EQ(c().ReportProgress(p).status().code(), absl::StatusCode::kInvalidArgument);
}

// --- Persistence --------------------------------------------------------

TEST_F(CoordinatorTest, StateSurvivesARestartOnTheSameFile) {
  TempDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  Open(path);
  ASSERT_NE(coord_, nullptr);
  const std::string running = RunningJobOnTwoWorkers();
  const std::string token = Beat("w1")->assignments(0).trainer_token();
  const std::string waiting = Submit(Spec(5));
  const std::string cancelled = Submit(Spec(1));
  ASSERT_TRUE(c().CancelJob(cancelled, "").ok());
  const Job running_before = Get(running);
  const std::vector<v1::Event> events_before = EventList("");

  Open(path);
  ASSERT_NE(coord_, nullptr);
  Job job = Get(running);
  EXPECT_EQ(job.state(), Job::RUNNING);
  EXPECT_EQ(job.generation(), 1);
  EXPECT_TRUE(MessageDifferencer::Equals(job, running_before)) << job.DebugString() << "\nvs\n"
                                                               << running_before.DebugString();
  EXPECT_EQ(Get(waiting).state(), Job::PENDING);
  EXPECT_EQ(Get(cancelled).state(), Job::CANCELLED);

  const std::vector<v1::Event> events_after = EventList("");
  ASSERT_GE(events_after.size(), events_before.size());
  for (size_t i = 0; i < events_before.size(); ++i) {
    EXPECT_EQ(events_after[i].seq(), events_before[i].seq());
    EXPECT_EQ(events_after[i].type(), events_before[i].type());
  }

  // The running job's trainers can carry on: their token works and a retried
  // join gets the same peers.
  absl::StatusOr<Principal> p = auth_->Authenticate("Bearer " + token);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->role, Role::kTrainer);
  EXPECT_EQ(p->job_id, running);
  JoinAnswer rejoin = Join(running, 1, 1);
  ASSERT_TRUE(rejoin.done());
  ASSERT_TRUE(rejoin.get().ok()) << rejoin.get().status();
  ASSERT_EQ(rejoin.get()->peers_size(), 2);
  EXPECT_EQ(rejoin.get()->peers(0).address(), Address(0));
  EXPECT_EQ(rejoin.get()->rank(), 1);

  // Workers are known again, and numbering goes on.
  EXPECT_EQ(c().ListWorkers().workers_size(), 2);
  EXPECT_EQ(Submit(Spec(1)), "job-4");
  absl::StatusOr<v1::HeartbeatResponse> r = Beat("w1");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->assignments_size(), 1);
  EXPECT_EQ(r->assignments(0).job_id(), running);
  EXPECT_EQ(r->assignments(0).trainer_token(), token);
}

TEST_F(CoordinatorTest, WorkersThatDoNotComeBackAfterARestartAreLost) {
  TempDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  Open(path);
  ASSERT_NE(coord_, nullptr);
  const std::string id = RunningJobOnTwoWorkers();
  clock_.Advance(milliseconds(60'000));  // the coordinator was down a while
  Open(path);
  ASSERT_NE(coord_, nullptr);
  // A full worker timeout from the restart, not from the last heartbeat.
  c().Tick();
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  clock_.Advance(milliseconds(5000));
  ASSERT_TRUE(Beat("w1").ok());
  clock_.Advance(milliseconds(6000));
  c().Tick();
  EXPECT_EQ(WorkerNamed("w1").state(), v1::Worker::ALIVE);
  EXPECT_EQ(WorkerNamed("w2").state(), v1::Worker::LOST);
  EXPECT_EQ(Get(id).generation(), 2);
}

// --- Checkpoint verification and retention ------------------------------

TEST_F(CoordinatorTest, ACheckpointReportedInvalidIsMarkedNamedInAnEventAndNotResumedFrom) {
  const std::string id = RunningJobOnTwoWorkers();
  for (int64_t step : {10, 20}) {
    absl::StatusOr<v1::CommitCheckpointResponse> r =
        c().CommitCheckpoint(Commit(id, 1, 0, step, {0}));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->committed());
  }
  ASSERT_EQ(Get(id).last_checkpoint_step(), 20);
  ASSERT_TRUE(Exit(id, 1, 1, 1).ok());
  PassBackoff(id);
  std::vector<JoinAnswer> answers = RunJob(id);
  ASSERT_TRUE(answers[0].get().ok());
  ASSERT_EQ(answers[0].get()->resume_from().step(), 20);

  // Rank 0 of generation 2 finds step 20 truncated.
  v1::ReportCheckpointInvalidRequest bad;
  bad.set_job_id(id);
  bad.set_generation(2);
  bad.set_rank(0);
  bad.set_step(20);
  bad.set_reason("model.safetensors: size 1024, manifest says 1086784");
  ASSERT_TRUE(c().ReportCheckpointInvalid(bad).ok());
  absl::StatusOr<v1::ListCheckpointsResponse> list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->checkpoints_size(), 2);
  EXPECT_EQ(list->checkpoints(0).invalid_reason(), "");
  EXPECT_EQ(list->checkpoints(1).invalid_reason(),
            "model.safetensors: size 1024, manifest says 1086784");
  EXPECT_EQ(Get(id).last_checkpoint_step(), 10);
  std::vector<std::string> messages;
  for (const v1::Event& e : EventList(id)) {
    if (e.type() == "checkpoint.invalid") messages.push_back(e.message());
  }
  EXPECT_THAT(messages, ElementsAre("step 20 (ckpt/step-20) failed verification on rank 0: "
                                    "model.safetensors: size 1024, manifest says 1086784"));

  // Rank 1 finds the same: nothing changes, no second event.
  bad.set_rank(1);
  bad.set_reason("manifest.json: missing");
  ASSERT_TRUE(c().ReportCheckpointInvalid(bad).ok());
  EXPECT_EQ(c().ListCheckpoints(id)->checkpoints(1).invalid_reason(),
            "model.safetensors: size 1024, manifest says 1086784");
  int invalid_events = 0;
  for (const std::string& type : Events(id)) invalid_events += type == "checkpoint.invalid";
  EXPECT_EQ(invalid_events, 1);

  // Refusals: an unknown step, another generation, a rank out of range.
  bad.set_step(30);
  EXPECT_EQ(c().ReportCheckpointInvalid(bad).code(), absl::StatusCode::kNotFound);
  bad.set_step(10);
  bad.set_generation(1);
  EXPECT_EQ(c().ReportCheckpointInvalid(bad).code(), absl::StatusCode::kFailedPrecondition);
  bad.set_generation(2);
  bad.set_rank(2);
  EXPECT_EQ(c().ReportCheckpointInvalid(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c().ListCheckpoints(id)->checkpoints(0).invalid_reason(), "");

  // The next generation resumes from step 10 only.
  ASSERT_TRUE(Exit(id, 2, 0, 1).ok());
  PassBackoff(id);
  answers = RunJob(id);
  for (const JoinAnswer& a : answers) {
    ASSERT_TRUE(a.get().ok());
    EXPECT_EQ(a.get()->resume_from().step(), 10);
    ASSERT_EQ(a.get()->resume_candidates_size(), 1);
    EXPECT_EQ(a.get()->resume_candidates(0).step(), 10);
  }
}

TEST_F(CoordinatorTest, JoinOffersEveryValidCommittedCheckpointNewestFirst) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));
  // A fresh start has nothing to resume from.
  for (const JoinAnswer& a : RunJob(id)) {
    ASSERT_TRUE(a.get().ok());
    EXPECT_FALSE(a.get()->has_resume_from());
    EXPECT_EQ(a.get()->resume_candidates_size(), 0);
  }
  for (int64_t step : {10, 20, 30}) {
    ASSERT_TRUE(c().CommitCheckpoint(Commit(id, 1, 0, step, {0, 1})).ok());
    ASSERT_TRUE(c().CommitCheckpoint(Commit(id, 1, 1, step, {0, 1})).ok());
  }
  ASSERT_TRUE(c().CommitCheckpoint(Commit(id, 1, 0, 40, {0, 1})).ok());  // half written
  v1::ReportCheckpointInvalidRequest bad;
  bad.set_job_id(id);
  bad.set_generation(1);
  bad.set_rank(1);
  bad.set_step(30);
  bad.set_reason("optimizer.bin: crc32c 0x1234abcd, manifest says 0x1234abce");
  ASSERT_TRUE(c().ReportCheckpointInvalid(bad).ok());

  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  PassBackoff(id);
  for (const JoinAnswer& a : RunJob(id)) {
    ASSERT_TRUE(a.get().ok());
    ASSERT_TRUE(a.get()->has_resume_from());
    EXPECT_EQ(a.get()->resume_from().step(), 20);
    std::vector<int64_t> steps;
    const absl::StatusOr<v1::JoinRendezvousResponse> answer = a.get();
    for (const v1::Checkpoint& cp : answer->resume_candidates()) steps.push_back(cp.step());
    EXPECT_THAT(steps, ElementsAre(20, 10));
  }
}

TEST_F(CoordinatorTest, RetentionKeepsTheNewestKeepLastAndAnswersTheRetiredSteps) {
  v1::JobSpec spec = Spec(2);
  spec.mutable_checkpoint()->set_dir("ckpt");
  spec.mutable_checkpoint()->set_every_steps(10);
  spec.mutable_checkpoint()->set_keep_last(2);
  const std::string id = RunningJobOnTwoWorkers(spec);
  std::vector<std::vector<int64_t>> retired;
  for (int64_t step : {10, 20, 30, 40}) {
    // Rank 1's report completes each one: it is told what to delete.
    absl::StatusOr<v1::CommitCheckpointResponse> r =
        c().CommitCheckpoint(Commit(id, 1, 0, step, {0, 1}));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(r->retired_steps(), IsEmpty()) << "retired before the commit completed";
    r = c().CommitCheckpoint(Commit(id, 1, 1, step, {0, 1}));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->committed());
    retired.emplace_back(r->retired_steps().begin(), r->retired_steps().end());
  }
  EXPECT_THAT(retired, ElementsAre(IsEmpty(), IsEmpty(), ElementsAre(10), ElementsAre(20)));
  absl::StatusOr<v1::ListCheckpointsResponse> list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok()) << list.status();
  std::vector<int64_t> kept;
  for (const v1::Checkpoint& cp : list->checkpoints()) kept.push_back(cp.step());
  EXPECT_THAT(kept, ElementsAre(30, 40));
  EXPECT_EQ(Get(id).last_checkpoint_step(), 40);
  // A commit reported again retires nothing more.
  absl::StatusOr<v1::CommitCheckpointResponse> again =
      c().CommitCheckpoint(Commit(id, 1, 1, 40, {0, 1}));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->committed());
  EXPECT_THAT(again->retired_steps(), IsEmpty());
}

TEST_F(CoordinatorTest, RetentionNeverRetiresTheCheckpointBeingResumedFrom) {
  v1::JobSpec spec = Spec(2);
  spec.mutable_checkpoint()->set_keep_last(1);
  const std::string id = RunningJobOnTwoWorkers(spec);
  ASSERT_TRUE(c().CommitCheckpoint(Commit(id, 1, 0, 10, {0})).ok());
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  PassBackoff(id);
  RunJob(id);  // generation 2 resumes from step 10
  absl::StatusOr<v1::CommitCheckpointResponse> r = c().CommitCheckpoint(Commit(id, 2, 0, 20, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->retired_steps(), IsEmpty()) << "retired the checkpoint being resumed from";
  r = c().CommitCheckpoint(Commit(id, 2, 0, 30, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->retired_steps(), ElementsAre(20));
  // Generation 3 resumes from 30; 10 goes with the next commit.
  ASSERT_TRUE(Exit(id, 2, 1, 1).ok());
  PassBackoff(id);
  RunJob(id);
  r = c().CommitCheckpoint(Commit(id, 3, 0, 40, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->retired_steps(), ElementsAre(10));
  std::vector<int64_t> kept;
  const absl::StatusOr<v1::ListCheckpointsResponse> list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok()) << list.status();
  for (const v1::Checkpoint& cp : list->checkpoints()) kept.push_back(cp.step());
  EXPECT_THAT(kept, ElementsAre(30, 40));
}

TEST_F(CoordinatorTest, RetentionDropsInvalidAndAbandonedCheckpointsBehindTheNewestValidOne) {
  const std::string id = RunningJobOnTwoWorkers();  // keep_last 3
  ASSERT_TRUE(c().CommitCheckpoint(Commit(id, 1, 0, 10, {0})).ok());
  ASSERT_TRUE(c().CommitCheckpoint(Commit(id, 1, 0, 20, {0})).ok());
  ASSERT_TRUE(c().CommitCheckpoint(Commit(id, 1, 0, 25, {0, 1})).ok());  // never completed
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  PassBackoff(id);
  RunJob(id);
  v1::ReportCheckpointInvalidRequest bad;
  bad.set_job_id(id);
  bad.set_generation(2);
  bad.set_rank(0);
  bad.set_step(20);
  bad.set_reason("model.safetensors: missing");
  ASSERT_TRUE(c().ReportCheckpointInvalid(bad).ok());
  // Generation 2 goes on from 10 and writes 15: the invalid 20 and the
  // abandoned 25 are newer, so they stay for now.
  absl::StatusOr<v1::CommitCheckpointResponse> r = c().CommitCheckpoint(Commit(id, 2, 0, 15, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->retired_steps(), IsEmpty());
  r = c().CommitCheckpoint(Commit(id, 2, 0, 30, {0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->retired_steps(), ElementsAre(20, 25));
  std::vector<int64_t> kept;
  const absl::StatusOr<v1::ListCheckpointsResponse> list = c().ListCheckpoints(id);
  ASSERT_TRUE(list.ok()) << list.status();
  for (const v1::Checkpoint& cp : list->checkpoints()) kept.push_back(cp.step());
  EXPECT_THAT(kept, ElementsAre(10, 15, 30));
}

// --- Restart backoff ----------------------------------------------------

TEST_F(CoordinatorTest, RestartsWaitTwiceAsLongEachTimeAndSaySo) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_restart_backoff() = Dur(milliseconds(2000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  for (int restart = 1; restart <= 3; ++restart) {
    SCOPED_TRACE(absl::StrCat("restart ", restart));
    const milliseconds wait(2000 << (restart - 1));
    ASSERT_TRUE(Exit(id, restart, 0, 1).ok());
    Job job = Get(id);
    ASSERT_EQ(job.state(), Job::RESTARTING);
    const std::string expected =
        absl::StrCat("restart ", restart, " of 3 in ", wait.count() / 1000, "s: rank 0 on worker ");
    EXPECT_THAT(job.message(), StartsWith(expected));
    std::string event;
    for (const v1::Event& e : EventList(id)) {
      if (e.type() == "job.restarting") event = e.message();
    }
    EXPECT_THAT(event, StartsWith(expected));
    clock_.Advance(wait - milliseconds(1));
    for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
    c().Tick();
    EXPECT_EQ(Get(id).state(), Job::RESTARTING) << "placed before its backoff ran out";
    clock_.Advance(milliseconds(1));
    c().Tick();
    ASSERT_EQ(Get(id).state(), Job::SCHEDULED);
    RunJob(id);
  }
  // The fourth failure is one too many: it fails at once.
  ASSERT_TRUE(Exit(id, 4, 0, 1).ok());
  EXPECT_EQ(Get(id).state(), Job::FAILED);
}

TEST_F(CoordinatorTest, RestartBackoffStopsGrowingAtFiveMinutes) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_restart_backoff() = Dur(milliseconds(200'000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  EXPECT_THAT(Get(id).message(), StartsWith("restart 1 of 3 in 200s:"));
  clock_.Advance(milliseconds(200'000));
  for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
  c().Tick();
  RunJob(id);
  ASSERT_TRUE(Exit(id, 2, 0, 1).ok());
  EXPECT_THAT(Get(id).message(), StartsWith("restart 2 of 3 in 300s:"));
}

TEST_F(CoordinatorTest, JobsBesideOneThatKeepsFailingRunUndisturbed) {
  // Three 1-slot workers: a 1-rank job that crashes, a 1-rank job beside it,
  // and a third waiting for room.
  for (const char* w : {"w1", "w2", "w3"}) ASSERT_TRUE(Register(w, 1).ok());
  v1::JobSpec crashing = Spec(1);
  crashing.set_max_restarts(1);
  crashing.set_priority(10);
  const std::string bad = Submit(crashing);
  const std::string good = Submit(Spec(1));
  RunJob(bad);
  RunJob(good);
  ASSERT_TRUE(Exit(bad, 1, 0, 1).ok());
  ASSERT_EQ(Get(bad).state(), Job::RESTARTING);
  // While it backs off, a job submitted later is placed at once.
  const std::string later = Submit(Spec(1));
  EXPECT_EQ(Get(later).state(), Job::SCHEDULED);
  PassBackoff(bad);
  RunJob(bad);
  // Its last failure ends it at once, with no wait.
  ASSERT_TRUE(Exit(bad, 2, 0, 1).ok());
  EXPECT_EQ(Get(bad).state(), Job::FAILED);
  const Job job = Get(good);
  EXPECT_EQ(job.state(), Job::RUNNING);
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.restarts(), 0);
  absl::StatusOr<v1::HeartbeatResponse> r = Beat(WorkerOf(good, 0));
  ASSERT_TRUE(r.ok());
  for (const v1::StopOrder& stop : r->stops()) EXPECT_NE(stop.job_id(), good);
}

// --- Hangs --------------------------------------------------------------

TEST_F(CoordinatorTest, AHangIsCaughtThoughBeatsGoOnAndTheSilentRankIsNamed) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(5000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  // Rank 1 stops (SIGSTOP) after step 49; rank 0 finishes step 50 and
  // waits in the allreduce of step 51, beating all along.
  ASSERT_TRUE(Progress(id, 1, 1, 49, 2012).ok());
  ASSERT_TRUE(Progress(id, 1, 0, 50, 2013).ok());
  for (int s = 1; s <= 5; ++s) {
    clock_.Advance(milliseconds(1000));
    ASSERT_TRUE(Progress(id, 1, 0, 50, 2013).ok());
    for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
    c().Tick();
    ASSERT_EQ(Get(id).state(), Job::RUNNING) << "hang declared after " << s << "s";
  }
  clock_.Advance(milliseconds(100));
  c().Tick();
  const Job job = Get(id);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
  const std::string expected =
      "no progress for 5s at step 50: rank 1 silent for 5.1s (last beat at step 49, collective "
      "2012); rank 0 waiting at step 50, collective 2013";
  std::string hang;
  for (const v1::Event& e : EventList(id)) {
    if (e.type() == "job.hang") hang = e.message();
  }
  EXPECT_EQ(hang, expected);
  EXPECT_THAT(job.message(), HasSubstr(expected));
  EXPECT_TRUE(InOrder(Events(id), {"job.hang", "job.restarting"}));
}

TEST_F(CoordinatorTest, AHangWhereEveryRankBeatsNamesTheRanksBehind) {
  v1::JobSpec spec = Spec(3);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(5000));
  for (const char* w : {"w1", "w2", "w3"}) ASSERT_TRUE(Register(w, 1).ok());
  const std::string id = Submit(spec);
  RunJob(id);
  for (int s = 0; s <= 5; ++s) {
    ASSERT_TRUE(Progress(id, 1, 0, 50, 2013).ok());
    ASSERT_TRUE(Progress(id, 1, 1, 50, 2012).ok());
    ASSERT_TRUE(Progress(id, 1, 2, 50, 2013).ok());
    for (const char* w : {"w1", "w2", "w3"}) ASSERT_TRUE(Beat(w).ok());
    clock_.Advance(milliseconds(1000));
  }
  c().Tick();
  std::string hang;
  for (const v1::Event& e : EventList(id)) {
    if (e.type() == "job.hang") hang = e.message();
  }
  EXPECT_EQ(hang,
            "no progress for 5s at step 50: rank 1 behind at step 50, collective 2012; ranks 0, "
            "2 waiting at step 50, collective 2013");
  EXPECT_EQ(Get(id).generation(), 2);
}

TEST_F(CoordinatorTest, ARankThatNeverBeatIsNamedAsSilent) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(5000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  auto hang = [&] {
    std::string text;
    for (const v1::Event& e : EventList(id)) {
      if (e.type() == "job.hang") text = e.message();
    }
    return text;
  };
  // Until every rank has beaten once, the ranks are still setting up: the
  // 5s timeout is stretched to the automatic minimum of 60s.
  for (int s = 1; s <= 60; ++s) {
    clock_.Advance(milliseconds(1000));
    ASSERT_TRUE(Progress(id, 1, 0, 0, 0).ok());
    for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
    c().Tick();
    ASSERT_EQ(hang(), "") << "at " << s << "s";
  }
  // (rank 0's first beat, at step 0, was its first advance, at 1s.)
  clock_.Advance(milliseconds(1100));
  c().Tick();
  EXPECT_THAT(hang(), HasSubstr("rank 1 silent for"));
  EXPECT_THAT(hang(), HasSubstr("(no beat yet); rank 0 waiting at step 0, collective 0"));
}

TEST_F(CoordinatorTest, ARankThatBeatOnceAndStoppedIsCaughtWithinTheSpecsTimeout) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(5000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  ASSERT_TRUE(Progress(id, 1, 0, 0, 0).ok());
  ASSERT_TRUE(Progress(id, 1, 1, 0, 0).ok());
  clock_.Advance(milliseconds(5100));
  ASSERT_TRUE(Progress(id, 1, 0, 0, 0).ok());
  c().Tick();
  std::string hang;
  for (const v1::Event& e : EventList(id)) {
    if (e.type() == "job.hang") hang = e.message();
  }
  EXPECT_EQ(hang,
            "no progress for 5s at step 0: rank 1 silent for 5.1s (last beat at step 0, "
            "collective 0); rank 0 waiting at step 0, collective 0");
}

TEST_F(CoordinatorTest, EveryStepTakenPushesTheProgressDeadlineBack) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(5000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  for (int64_t step = 1; step <= 10; ++step) {
    clock_.Advance(milliseconds(4000));
    ASSERT_TRUE(Progress(id, 1, static_cast<int>(step % 2), step, step * 10).ok());
    for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
    c().Tick();
    ASSERT_EQ(Get(id).state(), Job::RUNNING) << "at step " << step;
  }
  EXPECT_EQ(Get(id).restarts(), 0);
}

TEST_F(CoordinatorTest, AutomaticProgressTimeoutIsTenMedianStepsButAtLeastAMinute) {
  const std::string id = RunningJobOnTwoWorkers();
  auto run_until = [&](milliseconds total) {
    for (milliseconds t(0); t < total; t += milliseconds(5000)) {
      clock_.Advance(milliseconds(5000));
      for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
      c().Tick();
    }
  };
  // No step times yet: a minute.
  ASSERT_TRUE(Progress(id, 1, 0, 1, 1).ok());
  ASSERT_TRUE(Progress(id, 1, 1, 1, 1).ok());
  run_until(milliseconds(60'000));
  ASSERT_EQ(Get(id).state(), Job::RUNNING);
  clock_.Advance(milliseconds(100));
  c().Tick();
  ASSERT_EQ(Get(id).generation(), 2) << "no hang after 60.1s";
  PassBackoff(id);
  RunJob(id);

  // Steps of 9s (the slower rank's): 90s.
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 2, rank, 1, 9, 4.5 * (rank + 1)).ok());
  ASSERT_TRUE(Progress(id, 2, 0, 9, 9).ok());
  run_until(milliseconds(90'000));
  ASSERT_EQ(Get(id).state(), Job::RUNNING) << Get(id).message();
  clock_.Advance(milliseconds(100));
  c().Tick();
  EXPECT_EQ(Get(id).generation(), 3);
}

// --- Stragglers ---------------------------------------------------------

TEST_F(CoordinatorTest, ASlowRankIsReportedAsAStragglerOnceAndAsRecoveredLater) {
  for (const char* w : {"w1", "w2", "w3"}) ASSERT_TRUE(Register(w, 1).ok());
  const std::string id = Submit(Spec(3));
  RunJob(id);
  auto count = [&](const std::string& type) {
    int n = 0;
    for (const std::string& t : Events(id)) n += t == type;
    return n;
  };
  const std::string gauge = absl::StrCat("aidn_rank_straggler{job_id=\"", id, "\",rank=\"2\"} ");
  // 19 steps each: too few to judge.
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 1, 19, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 1, 19, 0.20).ok());
  c().Tick();
  EXPECT_EQ(count("rank.straggler"), 0);
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr(gauge + "0\n"));

  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 20, 20, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 20, 20, 0.20).ok());
  c().Tick();
  ASSERT_EQ(count("rank.straggler"), 1);
  for (const v1::Event& e : EventList(id)) {
    if (e.type() != "rank.straggler") continue;
    EXPECT_EQ(e.worker_id(), WorkerOf(id, 2));
    EXPECT_THAT(e.message(), StartsWith("rank 2: median compute time 0.2s over its last 20 steps"));
    EXPECT_THAT(e.message(), HasSubstr("(2.00x)"));
  }
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr(gauge + "1\n"));
  EXPECT_THAT(c().registry()->Serialize(),
              HasSubstr(absl::StrCat("aidn_rank_straggler{job_id=\"", id, "\",rank=\"0\"} 0\n")));

  // Still slow: no second event. Then it catches up.
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 21, 30, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 21, 30, 0.20).ok());
  c().Tick();
  EXPECT_EQ(count("rank.straggler"), 1);
  EXPECT_EQ(count("rank.recovered"), 0);
  // 1.4x is not recovered (hysteresis: below 1.2x), and a state lasts at
  // least a window (50) of the rank's own steps, so noise does not flap.
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 31, 60, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 31, 60, 0.14).ok());
  c().Tick();
  EXPECT_EQ(count("rank.recovered"), 0);
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 61, 69, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 61, 69, 0.11).ok());
  c().Tick();
  EXPECT_EQ(count("rank.recovered"), 0) << "within a window of the last change";
  for (int rank : {0, 1}) ASSERT_TRUE(SendTimedSteps(id, 1, rank, 70, 100, 0.10).ok());
  ASSERT_TRUE(SendTimedSteps(id, 1, 2, 70, 100, 0.11).ok());
  c().Tick();
  EXPECT_EQ(count("rank.recovered"), 1);
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr(gauge + "0\n"));
  // Nothing restarted.
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  EXPECT_EQ(Get(id).generation(), 1);
}

// --- Coordinator restart ------------------------------------------------

TEST_F(CoordinatorTest, IncarnationIsFixedForAProcessAndNewAfterARestart) {
  TempDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  Open(path);
  const std::string id = RunningJobOnTwoWorkers();
  absl::StatusOr<v1::ReportProgressResponse> a = Progress(id, 1, 0, 1, 1);
  absl::StatusOr<v1::ReportProgressResponse> b = Progress(id, 1, 1, 1, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_FALSE(a->incarnation().empty());
  EXPECT_EQ(a->incarnation(), b->incarnation());
  EXPECT_EQ(a->incarnation(), c().incarnation());
  absl::StatusOr<v1::StreamMetricsResponse> receipt = c().MetricsReceipt(id);
  ASSERT_TRUE(receipt.ok()) << receipt.status();
  EXPECT_EQ(receipt->incarnation(), a->incarnation());
  Open(path);
  absl::StatusOr<v1::ReportProgressResponse> after = Progress(id, 1, 0, 2, 2);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_NE(after->incarnation(), a->incarnation());
  EXPECT_EQ(c().MetricsReceipt("job-404").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, DurableStepIsTheLastStepBelowWhichEverythingIsStored) {
  const std::string id = RunningJobOnTwoWorkers();
  auto durable = [&]() -> int64_t {
    c().FlushSteps();  // the ticker's batched flush
    absl::StatusOr<v1::StreamMetricsResponse> r = c().MetricsReceipt(id);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->durable_step() : -1;
  };
  EXPECT_EQ(durable(), 0);
  ASSERT_TRUE(SendSteps(id, 0, 1, 5).ok());
  ASSERT_TRUE(SendSteps(id, 1, 1, 3).ok());
  EXPECT_EQ(durable(), 3) << "steps 4 and 5 wait for rank 1";
  ASSERT_TRUE(SendSteps(id, 1, 4, 5).ok());
  EXPECT_EQ(durable(), 5);
  // An evaluation at step 5 that only rank 0 sent holds step 5 back.
  ASSERT_TRUE(SendSteps(id, 0, 5, 5, v1::MetricRecord::EVAL).ok());
  EXPECT_EQ(durable(), 4);
  ASSERT_TRUE(SendSteps(id, 1, 5, 5, v1::MetricRecord::EVAL).ok());
  EXPECT_EQ(durable(), 5);
}

// Receipts do not wait for a flush (they run on gRPC's callback threads),
// so what a flush has taken but not yet stored, or failed to store, must
// not count as durable: the sender would drop records the store never got.
TEST_F(CoordinatorTest, AStepIsNotDurableWhileAnyOfItsRowsIsInFlightOrFailedToStore) {
  enum Mode { kPass, kBlock, kFail };
  std::atomic<int> mode{kPass};
  absl::Notification entered, release;
  put_steps_hook_ = [&]() -> absl::Status {
    if (mode == kBlock) {
      entered.Notify();
      release.WaitForNotification();
    }
    if (mode == kFail) return absl::UnavailableError("injected write failure");
    return absl::OkStatus();
  };
  Open(":memory:");
  const std::string id = RunningJobOnTwoWorkers();
  auto durable = [&]() -> int64_t {
    absl::StatusOr<v1::StreamMetricsResponse> r = c().MetricsReceipt(id);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->durable_step() : -1;
  };
  ASSERT_TRUE(SendSteps(id, 0, 1, 5).ok());
  ASSERT_TRUE(SendSteps(id, 1, 1, 5).ok());
  c().FlushSteps();
  EXPECT_EQ(durable(), 5);

  // Step 5's evaluation, combined, taken by a flush that is still writing
  // it: step 5's TRAIN row is stored, its EVAL row is not.
  ASSERT_TRUE(SendSteps(id, 0, 5, 5, v1::MetricRecord::EVAL).ok());
  ASSERT_TRUE(SendSteps(id, 1, 5, 5, v1::MetricRecord::EVAL).ok());
  mode = kBlock;
  std::thread flush([&] { c().FlushSteps(); });
  entered.WaitForNotification();
  EXPECT_EQ(durable(), 4) << "step 5's EVAL row is being written";
  mode = kPass;
  release.Notify();
  flush.join();
  EXPECT_EQ(durable(), 5);

  // A failed write keeps its steps not durable until a flush stores them.
  ASSERT_TRUE(SendSteps(id, 0, 6, 7).ok());
  ASSERT_TRUE(SendSteps(id, 1, 6, 7).ok());
  mode = kFail;
  c().FlushSteps();
  EXPECT_EQ(durable(), 5);
  mode = kPass;
  c().FlushSteps();
  EXPECT_EQ(durable(), 7);
}

TEST_F(CoordinatorTest, ARunningJobGoesOnAcrossACoordinatorRestart) {
  TempDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  Open(path);
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(8000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  ASSERT_TRUE(c().CommitCheckpoint(Commit(id, 1, 0, 4, {0})).ok());
  ASSERT_TRUE(SendSteps(id, 0, 1, 8).ok());
  ASSERT_TRUE(SendSteps(id, 1, 1, 5).ok());
  ASSERT_TRUE(Progress(id, 1, 0, 8, 80).ok());
  ASSERT_TRUE(Progress(id, 1, 1, 5, 50).ok());
  c().FlushSteps();
  absl::StatusOr<v1::StreamMetricsResponse> receipt = c().MetricsReceipt(id);
  ASSERT_TRUE(receipt.ok());
  ASSERT_EQ(receipt->durable_step(), 5);
  const std::string old_incarnation = receipt->incarnation();

  // Down for 6s: with the 8s progress timeout counted from before, the job
  // would hang 2s after the restart.
  clock_.Advance(milliseconds(6000));
  Open(path);
  ASSERT_NE(coord_, nullptr);
  c().Tick();
  ASSERT_EQ(Get(id).state(), Job::RUNNING);

  // The trainers carry on: each sends again what it was not told is durable
  // (rank 0 from step 1, as if it missed the last receipt), then new steps.
  ASSERT_TRUE(SendSteps(id, 0, 1, 10).ok());
  ASSERT_TRUE(SendSteps(id, 1, 6, 10).ok());
  absl::StatusOr<v1::ReportProgressResponse> beat = Progress(id, 1, 0, 10, 100);
  ASSERT_TRUE(beat.ok()) << beat.status();
  EXPECT_NE(beat->incarnation(), old_incarnation);
  ASSERT_TRUE(Progress(id, 1, 1, 10, 100).ok());
  absl::StatusOr<v1::CommitCheckpointResponse> commit =
      c().CommitCheckpoint(Commit(id, 1, 0, 8, {0}));
  ASSERT_TRUE(commit.ok()) << commit.status();
  EXPECT_TRUE(commit->committed());
  for (int s = 0; s < 6; ++s) {
    clock_.Advance(milliseconds(1000));
    for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
    c().Tick();
  }

  const Job job = Get(id);
  EXPECT_EQ(job.state(), Job::RUNNING) << job.message();
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.last_checkpoint_step(), 8);
  c().FlushSteps();
  receipt = c().MetricsReceipt(id);
  ASSERT_TRUE(receipt.ok());
  EXPECT_EQ(receipt->durable_step(), 10);
  // Every step once, combined from both ranks.
  v1::GetMetricsRequest get;
  get.set_job_id(id);
  absl::StatusOr<v1::GetMetricsResponse> steps = c().GetMetrics(get);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->steps_size(), 10);
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(steps->steps(i).step(), i + 1);
    EXPECT_EQ(steps->steps(i).ranks_reported(), 2) << "step " << i + 1;
    EXPECT_DOUBLE_EQ(steps->steps(i).loss(), 1.0 / (i + 1) + 0.5);
  }
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr("aidn_metric_records_dropped_total 0\n"));
  for (const std::string& type : Events(id)) {
    EXPECT_NE(type, "job.restarting");
    EXPECT_NE(type, "job.hang");
  }
}

// --- Threads and re-entrance --------------------------------------------

TEST_F(CoordinatorTest, CallbacksRunOutsideTheLockSoTheyMayCallBackIn) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));

  // Rank 0's callback asks for the job, as a service handler might.
  std::optional<Job::State> seen_from_callback;
  v1::JoinRendezvousRequest request;
  request.set_job_id(id);
  request.set_generation(1);
  request.set_rank(0);
  c().JoinRendezvous(request, [&](absl::StatusOr<v1::JoinRendezvousResponse> r) {
    ASSERT_TRUE(r.ok()) << r.status();
    absl::StatusOr<Job> job = c().GetJob(id);
    ASSERT_TRUE(job.ok());
    seen_from_callback = job->state();
  });
  EXPECT_FALSE(seen_from_callback.has_value());
  JoinAnswer r1 = Join(id, 1, 1);
  EXPECT_TRUE(r1.done());
  ASSERT_TRUE(seen_from_callback.has_value()) << "rank 0 was not answered";
  EXPECT_EQ(*seen_from_callback, Job::RUNNING);

  // A KV waiter that writes another key when it wakes.
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("ping");
  *get.mutable_wait() = Dur(milliseconds(5000));
  bool woke = false;
  c().KvGet(get, [&](absl::StatusOr<v1::KvGetResponse> r) {
    ASSERT_TRUE(r.ok()) << r.status();
    v1::KvSetRequest pong;
    pong.set_job_id(id);
    pong.set_generation(1);
    pong.set_key("pong");
    pong.set_value(r->value());
    EXPECT_TRUE(c().KvSet(pong).ok());
    woke = true;
  });
  v1::KvSetRequest ping;
  ping.set_job_id(id);
  ping.set_generation(1);
  ping.set_key("ping");
  ping.set_value("hello");
  ASSERT_TRUE(c().KvSet(ping).ok());
  ASSERT_TRUE(woke);
  get.set_key("pong");
  get.clear_wait();
  Async<v1::KvGetResponse> pong;
  c().KvGet(get, pong.Callback());
  ASSERT_TRUE(pong.get().ok());
  EXPECT_EQ(pong.get()->value(), "hello");
}

TEST_F(CoordinatorTest, RanksJoiningFromManyThreadsAllGetTheSameAnswer) {
  constexpr int kRanks = 8;
  for (int w = 0; w < kRanks; ++w) ASSERT_TRUE(Register(absl::StrCat("w", w), 1).ok());
  const std::string id = Submit(Spec(kRanks));
  ASSERT_EQ(Get(id).state(), Job::SCHEDULED);
  std::vector<std::string> worker_of;
  for (int r = 0; r < kRanks; ++r) worker_of.push_back(WorkerOf(id, r));

  std::vector<JoinAnswer> answers(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      v1::KvAddRequest add;
      add.set_job_id(id);
      add.set_generation(1);
      add.set_key("arrived");
      add.set_delta(1);
      EXPECT_TRUE(c().KvAdd(add).ok());
      v1::JoinRendezvousRequest request;
      request.set_job_id(id);
      request.set_generation(1);
      request.set_rank(r);
      request.set_worker_id(worker_of[r]);
      request.set_address(Address(r));
      c().JoinRendezvous(request, answers[r].Callback());
    });
  }
  for (std::thread& t : threads) t.join();

  // The last join answered everyone before it returned.
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(answers[r].done()) << "rank " << r;
    ASSERT_TRUE(answers[r].get().ok()) << answers[r].get().status();
    EXPECT_EQ(answers[r].get()->rank(), r);
    v1::JoinRendezvousResponse as_rank0 = *answers[r].get();
    as_rank0.set_rank(0);
    EXPECT_TRUE(MessageDifferencer::Equals(as_rank0, *answers[0].get())) << "rank " << r;
    EXPECT_EQ(answers[r].calls(), 1);
  }
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("arrived");
  Async<v1::KvGetResponse> arrived;
  c().KvGet(get, arrived.Callback());
  ASSERT_TRUE(arrived.get().ok());
  EXPECT_EQ(arrived.get()->value(), absl::StrCat(kRanks));
}

// --- Shutdown -----------------------------------------------------------

TEST_F(CoordinatorTest, ShutdownAnswersParkedCallsWithUnavailable) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));
  JoinAnswer join = Join(id, 1, 0);
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("never");
  *get.mutable_wait() = Dur(milliseconds(5000));
  Async<v1::KvGetResponse> kv;
  c().KvGet(get, kv.Callback());
  absl::StatusOr<v1::HeartbeatResponse> first = Beat("w1");
  ASSERT_TRUE(first.ok());
  Async<v1::HeartbeatResponse> held =
      HeldBeat("w1", first->assignments_version(), milliseconds(1000));
  ASSERT_FALSE(join.done());
  ASSERT_FALSE(kv.done());
  ASSERT_FALSE(held.done());

  c().Shutdown();
  ASSERT_TRUE(join.done());
  ASSERT_TRUE(kv.done());
  ASSERT_TRUE(held.done());
  EXPECT_EQ(join.get().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(held.get().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(kv.get().status().code(), absl::StatusCode::kUnavailable) << kv.get().status();

  // New calls are refused.
  JoinAnswer late = Join(id, 1, 1);
  ASSERT_TRUE(late.done());
  EXPECT_EQ(late.get().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Beat("w2").status().code(), absl::StatusCode::kUnavailable);
  v1::WatchJobRequest watch;
  watch.set_job_id(id);
  WatchCursor cursor;
  EXPECT_EQ(c().PollWatch(watch, &cursor).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace aidn::coordinator
