// The cluster protocol end to end against a real aidn-coordinator on
// loopback. The test plays the worker daemons (FakeWorker: register, heartbeat
// on a thread, remember the assignments) and their trainers (rendezvous, KV,
// progress and exit reports), through the generated gRPC stubs.

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "aidn/v1/job.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"
#include "tests/integration/process.h"

namespace aidn::testing {
namespace {

using ::testing::AssertionFailure;
using ::testing::AssertionResult;
using ::testing::AssertionSuccess;
using ::testing::HasSubstr;

// Generous: other agents compile on the same 2 cores.
constexpr std::chrono::milliseconds kLong{20'000};
constexpr std::chrono::milliseconds kHeartbeatEvery{200};

google::protobuf::Duration ProtoMillis(int64_t ms) {
  google::protobuf::Duration d;
  d.set_seconds(ms / 1000);
  d.set_nanos(static_cast<int32_t>((ms % 1000) * 1'000'000));
  return d;
}

std::string Describe(const grpc::Status& status) {
  return absl::StrCat("code ", static_cast<int>(status.error_code()), ": ", status.error_message());
}

std::string TrainerKey(const std::string& job_id, int64_t generation, int32_t rank) {
  return absl::StrCat(job_id, "/", generation, "/", rank);
}

std::string AddressOfRank(int32_t rank) { return absl::StrCat("127.0.0.1:", 29500 + rank); }

// A worker daemon stand-in. Register() once, then Start() heartbeats every
// 200 ms on a background thread until Stop() (or while Pause()d). Like the
// real worker it reports as running every assigned trainer that has not
// exited, re-registers on NOT_FOUND, and reports trainers that drop out of
// its assignment set as stopped by order. Thread-safe.
class FakeWorker {
 public:
  FakeWorker(std::string id, int cpu_slots, std::string token, const std::string& address)
      : id_(std::move(id)), cpu_slots_(cpu_slots), token_(std::move(token)) {
    SetAddress(address);
  }
  ~FakeWorker() { Stop(); }
  FakeWorker(const FakeWorker&) = delete;
  FakeWorker& operator=(const FakeWorker&) = delete;

  const std::string& id() const { return id_; }

  grpc::Status Register() {
    v1::RegisterWorkerRequest request;
    v1::WorkerInfo* info = request.mutable_info();
    info->set_id(id_);
    info->set_hostname(absl::StrCat("host-", id_));
    info->set_address("127.0.0.1");
    info->set_cpu_slots(cpu_slots_);
    info->set_version("cluster-test");
    std::shared_ptr<v1::ClusterService::Stub> stub;
    {
      absl::MutexLock lock(&mu_);
      stub = stub_;
      for (const v1::TrainerStatus& t : RunningLocked()) *request.add_trainers() = t;
    }
    v1::RegisterWorkerResponse response;
    grpc::Status status = stub->RegisterWorker(Context(token_).get(), request, &response);
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      ++registrations_;
      registered_id_ = response.worker_id();
    }
    return status;
  }

  void Start() {
    absl::MutexLock lock(&mu_);
    if (thread_.joinable()) return;
    stop_ = false;
    thread_ = std::thread([this] { Loop(); });
  }

  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }

  // While paused the worker is silent, as if partitioned away.
  void Pause() {
    absl::MutexLock lock(&mu_);
    paused_ = true;
  }
  void Resume() {
    absl::MutexLock lock(&mu_);
    paused_ = false;
  }

  void SetAddress(const std::string& address) {
    std::shared_ptr<v1::ClusterService::Stub> stub = ClusterStub(address);
    absl::MutexLock lock(&mu_);
    stub_ = std::move(stub);
  }

  // The assignments of the latest successful heartbeat.
  std::vector<v1::TrainerAssignment> Assignments() const {
    absl::MutexLock lock(&mu_);
    return assignments_;
  }
  // Every stop order received so far.
  std::vector<v1::StopOrder> Stops() const {
    absl::MutexLock lock(&mu_);
    return stops_;
  }
  int64_t successful_heartbeats() const {
    absl::MutexLock lock(&mu_);
    return successful_heartbeats_;
  }
  int registrations() const {
    absl::MutexLock lock(&mu_);
    return registrations_;
  }
  std::string registered_id() const {
    absl::MutexLock lock(&mu_);
    return registered_id_;
  }

  // The trainer of `assignment` ended: ReportTrainerExit, and stop listing it.
  grpc::Status ReportExit(const v1::TrainerAssignment& assignment, int exit_code,
                          bool permanent = false, const std::string& stderr_tail = "") {
    v1::ReportTrainerExitRequest request;
    request.set_worker_id(id_);
    request.set_job_id(assignment.job_id());
    request.set_generation(assignment.generation());
    request.set_rank(assignment.rank());
    request.set_exit_code(exit_code);
    request.set_permanent(permanent);
    request.set_stderr_tail(stderr_tail);
    std::shared_ptr<v1::ClusterService::Stub> stub;
    {
      absl::MutexLock lock(&mu_);
      exited_.insert(TrainerKey(assignment.job_id(), assignment.generation(), assignment.rank()));
      stub = stub_;
    }
    v1::ReportTrainerExitResponse response;
    return stub->ReportTrainerExit(Context(token_).get(), request, &response);
  }

 private:
  std::vector<v1::TrainerStatus> RunningLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<v1::TrainerStatus> running;
    for (const v1::TrainerAssignment& a : assignments_) {
      if (exited_.contains(TrainerKey(a.job_id(), a.generation(), a.rank()))) continue;
      v1::TrainerStatus t;
      t.set_job_id(a.job_id());
      t.set_generation(a.generation());
      t.set_rank(a.rank());
      t.set_pid(40000 + a.rank());
      running.push_back(std::move(t));
    }
    return running;
  }

  void Loop() {
    while (true) {
      bool paused;
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
        paused = paused_;
      }
      if (!paused) HeartbeatOnce();
      // A heartbeat timer, not a wait for a state.
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::FromChrono(kHeartbeatEvery));
    }
  }

  void HeartbeatOnce() {
    v1::HeartbeatRequest request;
    request.set_worker_id(id_);
    std::shared_ptr<v1::ClusterService::Stub> stub;
    {
      absl::MutexLock lock(&mu_);
      stub = stub_;
      for (const v1::TrainerStatus& t : RunningLocked()) *request.add_trainers() = t;
    }
    v1::HeartbeatResponse response;
    grpc::Status status =
        stub->Heartbeat(Context(token_, std::chrono::seconds(3)).get(), request, &response);
    if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
      Register();
      return;
    }
    if (!status.ok()) return;

    std::vector<v1::TrainerAssignment> dropped;
    {
      absl::MutexLock lock(&mu_);
      std::set<std::string> now;
      for (const v1::TrainerAssignment& a : response.assignments()) {
        now.insert(TrainerKey(a.job_id(), a.generation(), a.rank()));
      }
      for (const v1::TrainerAssignment& a : assignments_) {
        const std::string key = TrainerKey(a.job_id(), a.generation(), a.rank());
        if (!now.contains(key) && !exited_.contains(key)) {
          exited_.insert(key);
          dropped.push_back(a);
        }
      }
      assignments_.assign(response.assignments().begin(), response.assignments().end());
      stops_.insert(stops_.end(), response.stops().begin(), response.stops().end());
      ++successful_heartbeats_;
    }
    // The real worker SIGTERMs a trainer that is no longer listed and reports
    // its end; the answer does not matter here (the generation may be gone).
    for (const v1::TrainerAssignment& a : dropped) {
      v1::ReportTrainerExitRequest exit;
      exit.set_worker_id(id_);
      exit.set_job_id(a.job_id());
      exit.set_generation(a.generation());
      exit.set_rank(a.rank());
      exit.set_signal(SIGTERM);
      exit.set_stopped_by_order(true);
      v1::ReportTrainerExitResponse ignored;
      stub->ReportTrainerExit(Context(token_, std::chrono::seconds(3)).get(), exit, &ignored);
    }
  }

  const std::string id_;
  const int cpu_slots_;
  const std::string token_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  std::shared_ptr<v1::ClusterService::Stub> stub_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<v1::TrainerAssignment> assignments_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::StopOrder> stops_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> exited_ ABSL_GUARDED_BY(mu_);
  int64_t successful_heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
  int registrations_ ABSL_GUARDED_BY(mu_) = 0;
  std::string registered_id_ ABSL_GUARDED_BY(mu_);
};

v1::JobSpec MlpSpec(int32_t world_size) {
  v1::JobSpec spec;
  spec.set_name("cluster-test");
  spec.set_world_size(world_size);
  spec.set_device(v1::JobSpec::CPU);
  spec.mutable_model()->set_name("mlp");
  spec.set_epochs(1);
  return spec;
}

struct JoinResult {
  grpc::Status status;
  v1::JoinRendezvousResponse response;
};

class ClusterTest : public ::testing::Test {
 protected:
  void TearDown() override {
    workers_.clear();
    if (HasFailure() && coordinator_.process != nullptr) {
      std::string log = coordinator_.process->Stderr();
      if (log.size() > 6000) log = log.substr(log.size() - 6000);
      std::cerr << "---- coordinator stderr (tail) ----\n" << log << "\n----\n";
    }
    // Kill the coordinator before its state directory goes; keep the
    // directory of a failed test for a look.
    coordinator_.process.reset();
    if (!HasFailure() && !state_dir_.empty()) {
      std::error_code ignored;
      std::filesystem::remove_all(state_dir_, ignored);
    }
  }

  // Short timeouts so failures show within seconds.
  std::vector<std::string> CoordinatorArgs(const std::string& worker_timeout = "2s") {
    return {absl::StrCat("--worker-timeout=", worker_timeout),
            absl::StrCat("--heartbeat-interval=", kHeartbeatEvery.count(), "ms"),
            "--tick-interval=50ms"};
  }

  void StartCoordinatorWith(std::vector<std::string> args) {
    if (state_dir_.empty()) state_dir_ = MakeTempDir("aidn-cluster-test");
    args_ = args;
    absl::StatusOr<CoordinatorHandle> handle = StartCoordinator(state_dir_, args);
    ASSERT_TRUE(handle.ok()) << handle.status();
    coordinator_ = std::move(handle).value();
    ASSERT_FALSE(coordinator_.admin_token.empty());
    ASSERT_FALSE(coordinator_.worker_token.empty());
    coord_ = CoordinatorStub(coordinator_.address);
    cluster_ = ClusterStub(coordinator_.address);
  }

  void StartDefaultCoordinator() { StartCoordinatorWith(CoordinatorArgs()); }

  // Registers a fake worker with the worker token and starts its heartbeats.
  FakeWorker* AddWorker(const std::string& id, int cpu_slots, const std::string& token = "") {
    auto worker = std::make_unique<FakeWorker>(
        id, cpu_slots, token.empty() ? coordinator_.worker_token : token, coordinator_.address);
    grpc::Status status = worker->Register();
    EXPECT_TRUE(status.ok()) << "RegisterWorker " << id << ": " << Describe(status);
    worker->Start();
    workers_.push_back(std::move(worker));
    return workers_.back().get();
  }

  const std::string& admin() const { return coordinator_.admin_token; }

  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec, const std::string& token = "") {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    v1::SubmitJobResponse response;
    grpc::Status status =
        coord_->SubmitJob(Context(token.empty() ? admin() : token).get(), request, &response);
    if (!status.ok()) return absl::InternalError(absl::StrCat("SubmitJob: ", Describe(status)));
    return response.job();
  }

  absl::StatusOr<v1::Job> GetJob(const std::string& job_id) {
    v1::GetJobRequest request;
    request.set_job_id(job_id);
    v1::Job job;
    grpc::Status status = coord_->GetJob(Context(admin()).get(), request, &job);
    if (!status.ok()) return absl::InternalError(absl::StrCat("GetJob: ", Describe(status)));
    return job;
  }

  std::vector<v1::Event> Events(const std::string& job_id = "") {
    v1::ListEventsRequest request;
    request.set_job_id(job_id);
    request.set_limit(10000);
    v1::ListEventsResponse response;
    grpc::Status status = coord_->ListEvents(Context(admin()).get(), request, &response);
    EXPECT_TRUE(status.ok()) << "ListEvents: " << Describe(status);
    return {response.events().begin(), response.events().end()};
  }

  bool HasEvent(const std::string& type, const std::string& job_id,
                const std::string& worker_id = "") {
    for (const v1::Event& e : Events(job_id)) {
      if (e.type() != type) continue;
      if (!job_id.empty() && e.job_id() != job_id) continue;
      if (!worker_id.empty() && e.worker_id() != worker_id) continue;
      return true;
    }
    return false;
  }

  AssertionResult WaitForEvent(const std::string& type, const std::string& job_id,
                               const std::string& worker_id = "") {
    if (WaitFor([&] { return HasEvent(type, job_id, worker_id); }, kLong)) {
      return AssertionSuccess();
    }
    std::vector<std::string> seen;
    for (const v1::Event& e : Events()) {
      seen.push_back(
          absl::StrCat(e.seq(), " ", e.type(), " job=", e.job_id(), " worker=", e.worker_id()));
    }
    return AssertionFailure() << "no event " << type << " (job " << job_id << ", worker "
                              << worker_id << ") within " << kLong.count() << " ms; events:\n  "
                              << absl::StrJoin(seen, "\n  ");
  }

  std::map<std::string, v1::Worker> Workers() {
    v1::ListWorkersResponse response;
    grpc::Status status =
        coord_->ListWorkers(Context(admin()).get(), v1::ListWorkersRequest(), &response);
    EXPECT_TRUE(status.ok()) << "ListWorkers: " << Describe(status);
    std::map<std::string, v1::Worker> workers;
    for (const v1::Worker& w : response.workers()) workers[w.info().id()] = w;
    return workers;
  }

  // Polls GetJob until `predicate` holds; on failure shows the last job seen.
  AssertionResult WaitForJob(const std::string& job_id,
                             const std::function<bool(const v1::Job&)>& predicate,
                             const std::string& what, v1::Job* out = nullptr) {
    v1::Job last;
    std::string last_error;
    bool ok = WaitFor(
        [&] {
          absl::StatusOr<v1::Job> job = GetJob(job_id);
          if (!job.ok()) {
            last_error = job.status().ToString();
            return false;
          }
          last = *job;
          return predicate(last);
        },
        kLong);
    if (out != nullptr) *out = last;
    if (ok) return AssertionSuccess();
    return AssertionFailure() << job_id << " never became " << what << " within " << kLong.count()
                              << " ms; last seen: " << last.ShortDebugString()
                              << (last_error.empty() ? "" : " last error: ") << last_error;
  }

  AssertionResult WaitForState(const std::string& job_id, v1::Job::State state,
                               v1::Job* out = nullptr) {
    return WaitForJob(
        job_id, [state](const v1::Job& job) { return job.state() == state; },
        v1::Job::State_Name(state), out);
  }

  // Every worker's assignments of `job_id`, keyed by worker id.
  std::map<std::string, std::vector<v1::TrainerAssignment>> AssignmentsOf(
      const std::string& job_id) {
    std::map<std::string, std::vector<v1::TrainerAssignment>> by_worker;
    for (const auto& worker : workers_) {
      for (const v1::TrainerAssignment& a : worker->Assignments()) {
        if (a.job_id() == job_id) by_worker[worker->id()].push_back(a);
      }
    }
    return by_worker;
  }

  std::string DescribeAssignments() {
    std::vector<std::string> lines;
    for (const auto& worker : workers_) {
      for (const v1::TrainerAssignment& a : worker->Assignments()) {
        lines.push_back(absl::StrCat(worker->id(), ": ", a.job_id(), " gen ", a.generation(),
                                     " rank ", a.rank(), "/", a.world_size(), " slot ", a.slot()));
      }
    }
    return lines.empty() ? "(none)" : absl::StrJoin(lines, "; ");
  }

  // Waits until the workers' heartbeats carry exactly the `world_size` ranks
  // of `generation` of the job and nothing of any other generation of it.
  // Returns them by rank, each with the worker that runs it.
  AssertionResult WaitForAssignments(
      const std::string& job_id, int64_t generation, int32_t world_size,
      std::vector<std::pair<std::string, v1::TrainerAssignment>>* by_rank) {
    bool ok = WaitFor(
        [&] {
          std::vector<std::pair<std::string, v1::TrainerAssignment>> found(world_size);
          int count = 0;
          for (const auto& [worker_id, list] : AssignmentsOf(job_id)) {
            for (const v1::TrainerAssignment& a : list) {
              if (a.generation() != generation) return false;
              if (a.rank() < 0 || a.rank() >= world_size) return false;
              if (!found[a.rank()].first.empty()) return false;
              found[a.rank()] = {worker_id, a};
              ++count;
            }
          }
          if (count != world_size) return false;
          if (by_rank != nullptr) *by_rank = std::move(found);
          return true;
        },
        kLong);
    if (ok) return AssertionSuccess();
    return AssertionFailure() << "workers never got the " << world_size << " ranks of " << job_id
                              << " generation " << generation
                              << "; assignments: " << DescribeAssignments();
  }

  JoinResult Join(const v1::TrainerAssignment& a, const std::string& worker_id,
                  int64_t generation_override = -1) {
    v1::JoinRendezvousRequest request;
    request.set_job_id(a.job_id());
    request.set_generation(generation_override >= 0 ? generation_override : a.generation());
    request.set_rank(a.rank());
    request.set_worker_id(worker_id);
    request.set_address(AddressOfRank(a.rank()));
    JoinResult result;
    result.status = cluster_->JoinRendezvous(Context(a.trainer_token(), kLong).get(), request,
                                             &result.response);
    return result;
  }

  // Every rank joins at once, one thread each.
  std::vector<JoinResult> JoinAll(
      const std::vector<std::pair<std::string, v1::TrainerAssignment>>& by_rank) {
    std::vector<JoinResult> results(by_rank.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < by_rank.size(); ++i) {
      threads.emplace_back([&, i] { results[i] = Join(by_rank[i].second, by_rank[i].first); });
    }
    for (std::thread& t : threads) t.join();
    return results;
  }

  // Two 1-slot workers "w1", "w2" and a world_size 2 job past its rendezvous.
  void StartRunningJob(std::string* job_id,
                       std::vector<std::pair<std::string, v1::TrainerAssignment>>* by_rank) {
    AddWorker("w1", 1);
    AddWorker("w2", 1);
    absl::StatusOr<v1::Job> job = Submit(MlpSpec(2));
    ASSERT_TRUE(job.ok()) << job.status();
    *job_id = job->id();
    ASSERT_TRUE(WaitForAssignments(*job_id, 1, 2, by_rank));
    for (const JoinResult& r : JoinAll(*by_rank)) {
      ASSERT_TRUE(r.status.ok()) << "JoinRendezvous: " << Describe(r.status);
    }
    ASSERT_TRUE(WaitForState(*job_id, v1::Job::RUNNING));
  }

  grpc::Status KvSet(const v1::TrainerAssignment& a, const std::string& key,
                     const std::string& value, int64_t generation_override = -1) {
    v1::KvSetRequest request;
    request.set_job_id(a.job_id());
    request.set_generation(generation_override >= 0 ? generation_override : a.generation());
    request.set_key(key);
    request.set_value(value);
    v1::KvSetResponse response;
    return cluster_->KvSet(Context(a.trainer_token()).get(), request, &response);
  }

  grpc::Status KvGet(const v1::TrainerAssignment& a, const std::string& key,
                     std::chrono::milliseconds wait, v1::KvGetResponse* response) {
    v1::KvGetRequest request;
    request.set_job_id(a.job_id());
    request.set_generation(a.generation());
    request.set_key(key);
    *request.mutable_wait() = ProtoMillis(wait.count());
    return cluster_->KvGet(Context(a.trainer_token(), wait + kLong).get(), request, response);
  }

  grpc::Status KvAdd(const v1::TrainerAssignment& a, const std::string& key, int64_t delta,
                     int64_t* value) {
    v1::KvAddRequest request;
    request.set_job_id(a.job_id());
    request.set_generation(a.generation());
    request.set_key(key);
    request.set_delta(delta);
    v1::KvAddResponse response;
    grpc::Status status = cluster_->KvAdd(Context(a.trainer_token()).get(), request, &response);
    *value = response.value();
    return status;
  }

  grpc::Status Cas(const v1::TrainerAssignment& a, const std::string& key, bool expect_absent,
                   const std::string& expected, const std::string& desired,
                   v1::KvCompareAndSetResponse* response) {
    v1::KvCompareAndSetRequest request;
    request.set_job_id(a.job_id());
    request.set_generation(a.generation());
    request.set_key(key);
    request.set_expect_absent(expect_absent);
    request.set_expected(expected);
    request.set_desired(desired);
    return cluster_->KvCompareAndSet(Context(a.trainer_token()).get(), request, response);
  }

  std::string state_dir_;
  std::vector<std::string> args_;
  CoordinatorHandle coordinator_;
  std::unique_ptr<v1::CoordinatorService::Stub> coord_;
  std::unique_ptr<v1::ClusterService::Stub> cluster_;
  std::vector<std::unique_ptr<FakeWorker>> workers_;
};

TEST_F(ClusterTest, TwoWorkersGetOneRankEachAndRendezvousTogether) {
  ASSERT_NO_FATAL_FAILURE(StartDefaultCoordinator());
  FakeWorker* w1 = AddWorker("w1", 1);
  FakeWorker* w2 = AddWorker("w2", 1);
  EXPECT_EQ(w1->registered_id(), "w1");
  EXPECT_EQ(w2->registered_id(), "w2");

  absl::StatusOr<v1::Job> submitted = Submit(MlpSpec(2));
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const std::string job_id = submitted->id();
  EXPECT_EQ(job_id, "job-1");

  std::vector<std::pair<std::string, v1::TrainerAssignment>> by_rank;
  ASSERT_TRUE(WaitForAssignments(job_id, 1, 2, &by_rank));
  // One rank on each worker.
  std::map<std::string, std::vector<v1::TrainerAssignment>> per_worker = AssignmentsOf(job_id);
  ASSERT_EQ(per_worker.size(), 2u) << DescribeAssignments();
  EXPECT_EQ(per_worker["w1"].size(), 1u);
  EXPECT_EQ(per_worker["w2"].size(), 1u);
  EXPECT_NE(by_rank[0].first, by_rank[1].first);
  for (const auto& [worker_id, a] : by_rank) {
    EXPECT_EQ(a.world_size(), 2);
    EXPECT_EQ(a.slot(), 0);
    EXPECT_EQ(a.spec().model().name(), "mlp");
    EXPECT_EQ(a.spec().world_size(), 2);
    EXPECT_FALSE(a.trainer_token().empty());
  }

  v1::Job job;
  ASSERT_TRUE(WaitForState(job_id, v1::Job::SCHEDULED, &job));
  EXPECT_EQ(job.generation(), 1);
  ASSERT_EQ(job.placement_size(), 2);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(job.placement(r).rank(), r);
    EXPECT_EQ(job.placement(r).worker_id(), by_rank[r].first);
  }
  EXPECT_TRUE(HasEvent("job.scheduled", job_id));
  std::map<std::string, v1::Worker> workers = Workers();
  for (const std::string id : {"w1", "w2"}) {
    EXPECT_EQ(workers[id].state(), v1::Worker::ALIVE) << id;
    EXPECT_EQ(workers[id].cpu_slots_used(), 1) << id;
    EXPECT_THAT(workers[id].job_ids(), ::testing::ElementsAre(job_id)) << id;
  }

  // Both trainers join at once and get the same view of the world.
  std::vector<JoinResult> joins = JoinAll(by_rank);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(joins[r].status.ok()) << "rank " << r << ": " << Describe(joins[r].status);
    const v1::JoinRendezvousResponse& answer = joins[r].response;
    EXPECT_EQ(answer.rank(), r);
    EXPECT_EQ(answer.world_size(), 2);
    EXPECT_EQ(answer.generation(), 1);
    EXPECT_EQ(answer.spec().model().name(), "mlp");
    EXPECT_FALSE(answer.has_resume_from());
    ASSERT_EQ(answer.peers_size(), 2);
    for (int p = 0; p < 2; ++p) {
      EXPECT_EQ(answer.peers(p).rank(), p);
      EXPECT_EQ(answer.peers(p).worker_id(), by_rank[p].first);
      EXPECT_EQ(answer.peers(p).address(), AddressOfRank(p));
    }
  }
  ASSERT_TRUE(WaitForState(job_id, v1::Job::RUNNING, &job));
  EXPECT_EQ(job.generation(), 1);
  ASSERT_EQ(job.placement_size(), 2);
  EXPECT_EQ(job.placement(0).address(), AddressOfRank(0));
  EXPECT_EQ(job.placement(1).address(), AddressOfRank(1));
  EXPECT_TRUE(HasEvent("job.running", job_id));

  // A rank that joins again gets the same answer.
  JoinResult again = Join(by_rank[0].second, by_rank[0].first);
  ASSERT_TRUE(again.status.ok()) << Describe(again.status);
  EXPECT_EQ(again.response.peers_size(), 2);
  EXPECT_EQ(again.response.generation(), 1);

  const v1::TrainerAssignment& rank0 = by_rank[0].second;
  const v1::TrainerAssignment& rank1 = by_rank[1].second;

  // KvGet without wait answers at once; with a wait on a key nobody sets it
  // runs into DEADLINE_EXCEEDED.
  v1::KvGetResponse got;
  grpc::Status status = KvGet(rank1, "nccl-id", std::chrono::milliseconds(0), &got);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_FALSE(got.found());
  const auto before = std::chrono::steady_clock::now();
  status = KvGet(rank1, "never-set", std::chrono::milliseconds(300), &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(status);
  EXPECT_GE(std::chrono::steady_clock::now() - before, std::chrono::milliseconds(250));

  // Rank 1 waits for the key before rank 0 sets it.
  grpc::Status waited_status;
  v1::KvGetResponse waited;
  std::thread getter(
      [&] { waited_status = KvGet(rank1, "nccl-id", std::chrono::seconds(15), &waited); });
  // A head start so the get is (very likely) blocked when the set comes;
  // either order must give the value.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::string value("unique\0id", 9);
  status = KvSet(rank0, "nccl-id", value);
  getter.join();
  ASSERT_TRUE(status.ok()) << "KvSet: " << Describe(status);
  ASSERT_TRUE(waited_status.ok()) << "KvGet(wait): " << Describe(waited_status);
  EXPECT_TRUE(waited.found());
  EXPECT_EQ(waited.value(), value);

  // Counters from both ranks add up.
  int64_t counter = 0;
  std::vector<std::thread> adders;
  std::vector<grpc::Status> add_status(2);
  for (int r = 0; r < 2; ++r) {
    adders.emplace_back([&, r] {
      const v1::TrainerAssignment& a = by_rank[r].second;
      for (int i = 0; i < 10; ++i) {
        int64_t ignored = 0;
        grpc::Status s = KvAdd(a, "barrier", r + 1, &ignored);
        if (!s.ok()) add_status[r] = s;
      }
    });
  }
  for (std::thread& t : adders) t.join();
  for (const grpc::Status& s : add_status) ASSERT_TRUE(s.ok()) << "KvAdd: " << Describe(s);
  status = KvAdd(rank0, "barrier", 0, &counter);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(counter, 30);  // 10 * 1 + 10 * 2
  status = KvGet(rank1, "barrier", std::chrono::milliseconds(0), &got);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_TRUE(got.found());
  EXPECT_EQ(got.value(), "30");
  status = KvAdd(rank1, "fresh-counter", -4, &counter);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(counter, -4);

  // Compare-and-set.
  v1::KvCompareAndSetResponse cas;
  status = Cas(rank0, "leader", /*expect_absent=*/true, "", "rank0", &cas);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_TRUE(cas.swapped());
  EXPECT_TRUE(cas.found());
  EXPECT_EQ(cas.current(), "rank0");
  status = Cas(rank1, "leader", /*expect_absent=*/true, "", "rank1", &cas);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_FALSE(cas.swapped());
  EXPECT_TRUE(cas.found());
  EXPECT_EQ(cas.current(), "rank0");
  status = Cas(rank1, "leader", /*expect_absent=*/false, "someone-else", "rank1", &cas);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_FALSE(cas.swapped());
  EXPECT_EQ(cas.current(), "rank0");
  status = Cas(rank1, "leader", /*expect_absent=*/false, "rank0", "rank1", &cas);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_TRUE(cas.swapped());
  EXPECT_EQ(cas.current(), "rank1");
  status = Cas(rank0, "missing-key", /*expect_absent=*/false, "x", "y", &cas);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_FALSE(cas.swapped());
  EXPECT_FALSE(cas.found());
  status = KvGet(rank0, "leader", std::chrono::milliseconds(0), &got);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(got.value(), "rank1");
}

TEST_F(ClusterTest, SilentWorkerRestartsTheJobWithTheNextGeneration) {
  ASSERT_NO_FATAL_FAILURE(StartDefaultCoordinator());
  std::string job_id;
  std::vector<std::pair<std::string, v1::TrainerAssignment>> by_rank;
  ASSERT_NO_FATAL_FAILURE(StartRunningJob(&job_id, &by_rank));
  FakeWorker* w1 = workers_[0].get();
  FakeWorker* w2 = workers_[1].get();

  w2->Pause();
  v1::Job job;
  ASSERT_TRUE(WaitForJob(
      job_id,
      [](const v1::Job& j) { return j.state() == v1::Job::RESTARTING && j.generation() == 2; },
      "RESTARTING with generation 2", &job));
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_TRUE(job.placement().empty()) << job.ShortDebugString();
  EXPECT_EQ(Workers()["w2"].state(), v1::Worker::LOST);
  EXPECT_EQ(Workers()["w1"].state(), v1::Worker::ALIVE);
  EXPECT_TRUE(WaitForEvent("worker.lost", "", "w2"));
  EXPECT_TRUE(WaitForEvent("job.restarting", job_id));

  // Generation 1 is fenced off.
  for (const auto& [worker_id, a] : by_rank) {
    JoinResult late = Join(a, worker_id);
    EXPECT_EQ(late.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << "JoinRendezvous gen 1: " << Describe(late.status);
    grpc::Status status = KvSet(a, "k", "v");
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << "KvSet gen 1: " << Describe(status);
    v1::ReportProgressRequest progress;
    progress.set_job_id(job_id);
    progress.set_generation(1);
    progress.set_rank(a.rank());
    progress.set_step(10);
    v1::ReportProgressResponse progress_response;
    status =
        cluster_->ReportProgress(Context(a.trainer_token()).get(), progress, &progress_response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << "ReportProgress gen 1: " << Describe(status);
  }

  // The surviving worker drops generation 1 and is told to stop it.
  EXPECT_TRUE(WaitFor(
      [&] {
        for (const v1::TrainerAssignment& a : w1->Assignments()) {
          if (a.job_id() == job_id && a.generation() == 1) return false;
        }
        return true;
      },
      kLong))
      << DescribeAssignments();
  EXPECT_TRUE(WaitFor(
      [&] {
        for (const v1::StopOrder& stop : w1->Stops()) {
          if (stop.job_id() == job_id && stop.generation() == 1) return true;
        }
        return false;
      },
      kLong))
      << "w1 got no StopOrder for generation 1";
  // One alive 1-slot worker cannot hold 2 ranks: still waiting.
  ASSERT_TRUE(GetJob(job_id).ok());
  EXPECT_EQ(GetJob(job_id)->state(), v1::Job::RESTARTING);

  // The silent worker comes back: generation 2 is placed on both.
  w2->Resume();
  std::vector<std::pair<std::string, v1::TrainerAssignment>> gen2;
  ASSERT_TRUE(WaitForAssignments(job_id, 2, 2, &gen2));
  EXPECT_NE(gen2[0].first, gen2[1].first);
  ASSERT_TRUE(WaitForState(job_id, v1::Job::SCHEDULED, &job));
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(Workers()["w2"].state(), v1::Worker::ALIVE);

  // And generation 2 rendezvous works.
  for (const JoinResult& r : JoinAll(gen2)) {
    ASSERT_TRUE(r.status.ok()) << Describe(r.status);
    EXPECT_EQ(r.response.generation(), 2);
  }
  EXPECT_TRUE(WaitForState(job_id, v1::Job::RUNNING));
}

TEST_F(ClusterTest, RendezvousTimeoutNamesTheMissingRank) {
  ASSERT_NO_FATAL_FAILURE(StartDefaultCoordinator());
  AddWorker("w1", 1);
  AddWorker("w2", 1);
  v1::JobSpec spec = MlpSpec(2);
  spec.mutable_timeouts()->mutable_rendezvous()->set_seconds(1);
  spec.set_max_restarts(0);
  absl::StatusOr<v1::Job> submitted = Submit(spec);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const std::string job_id = submitted->id();
  std::vector<std::pair<std::string, v1::TrainerAssignment>> by_rank;
  ASSERT_TRUE(WaitForAssignments(job_id, 1, 2, &by_rank));

  // Only rank 0 shows up.
  JoinResult alone = Join(by_rank[0].second, by_rank[0].first);
  ASSERT_EQ(alone.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << Describe(alone.status);
  const std::string& message = alone.status.error_message();
  const size_t missing = message.find("missing");
  ASSERT_NE(missing, std::string::npos) << message;
  EXPECT_THAT(message.substr(missing), HasSubstr("1")) << message;

  v1::Job job;
  ASSERT_TRUE(WaitForState(job_id, v1::Job::FAILED, &job));
  EXPECT_FALSE(job.message().empty());
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_TRUE(WaitForEvent("job.failed", job_id));
  // The failed job's trainers are gone from the workers.
  EXPECT_TRUE(WaitFor([&] { return AssignmentsOf(job_id).empty(); }, kLong))
      << DescribeAssignments();
}

TEST_F(ClusterTest, TrainerExitsDecideTheOutcome) {
  ASSERT_NO_FATAL_FAILURE(StartDefaultCoordinator());
  FakeWorker* w1 = AddWorker("w1", 1);
  FakeWorker* w2 = AddWorker("w2", 1);
  std::map<std::string, FakeWorker*> by_id = {{"w1", w1}, {"w2", w2}};

  // Both ranks exit 0: the job succeeded and the workers run nothing more.
  {
    absl::StatusOr<v1::Job> submitted = Submit(MlpSpec(2));
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    const std::string job_id = submitted->id();
    std::vector<std::pair<std::string, v1::TrainerAssignment>> by_rank;
    ASSERT_TRUE(WaitForAssignments(job_id, 1, 2, &by_rank));
    for (const JoinResult& r : JoinAll(by_rank)) ASSERT_TRUE(r.status.ok()) << Describe(r.status);
    ASSERT_TRUE(WaitForState(job_id, v1::Job::RUNNING));
    for (const auto& [worker_id, a] : by_rank) {
      grpc::Status status = by_id[worker_id]->ReportExit(a, 0);
      ASSERT_TRUE(status.ok()) << Describe(status);
    }
    v1::Job job;
    ASSERT_TRUE(WaitForState(job_id, v1::Job::SUCCEEDED, &job));
    EXPECT_EQ(job.generation(), 1);
    EXPECT_TRUE(WaitForEvent("job.succeeded", job_id));
    EXPECT_TRUE(
        WaitFor([&] { return w1->Assignments().empty() && w2->Assignments().empty(); }, kLong))
        << DescribeAssignments();
    EXPECT_TRUE(WaitFor(
        [&] {
          std::map<std::string, v1::Worker> workers = Workers();
          return workers["w1"].cpu_slots_used() == 0 && workers["w2"].cpu_slots_used() == 0;
        },
        kLong));
  }

  // A non-zero exit restarts the job while restarts remain, then fails it.
  {
    v1::JobSpec spec = MlpSpec(1);
    spec.set_max_restarts(1);
    absl::StatusOr<v1::Job> submitted = Submit(spec);
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    const std::string job_id = submitted->id();
    std::vector<std::pair<std::string, v1::TrainerAssignment>> gen1;
    ASSERT_TRUE(WaitForAssignments(job_id, 1, 1, &gen1));
    grpc::Status status =
        by_id[gen1[0].first]->ReportExit(gen1[0].second, 1, false, "RuntimeError: boom");
    ASSERT_TRUE(status.ok()) << Describe(status);

    v1::Job job;
    ASSERT_TRUE(WaitForJob(
        job_id,
        [](const v1::Job& j) {
          return j.generation() == 2 &&
                 (j.state() == v1::Job::RESTARTING || j.state() == v1::Job::SCHEDULED);
        },
        "restarting with generation 2", &job));
    EXPECT_EQ(job.restarts(), 1);
    EXPECT_TRUE(WaitForEvent("job.restarting", job_id));

    std::vector<std::pair<std::string, v1::TrainerAssignment>> gen2;
    ASSERT_TRUE(WaitForAssignments(job_id, 2, 1, &gen2));
    status = by_id[gen2[0].first]->ReportExit(gen2[0].second, 1, false, "RuntimeError: boom");
    ASSERT_TRUE(status.ok()) << Describe(status);
    ASSERT_TRUE(WaitForState(job_id, v1::Job::FAILED, &job));
    EXPECT_EQ(job.generation(), 2);
    EXPECT_EQ(job.restarts(), 1);
    EXPECT_THAT(absl::AsciiStrToLower(job.message()), HasSubstr("exit")) << job.message();
    EXPECT_TRUE(WaitForEvent("job.failed", job_id));
    EXPECT_TRUE(WaitFor([&] { return AssignmentsOf(job_id).empty(); }, kLong))
        << DescribeAssignments();
  }

  // A permanent failure fails the job at once, restarts or not.
  {
    v1::JobSpec spec = MlpSpec(1);
    spec.set_max_restarts(3);
    absl::StatusOr<v1::Job> submitted = Submit(spec);
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    const std::string job_id = submitted->id();
    std::vector<std::pair<std::string, v1::TrainerAssignment>> gen1;
    ASSERT_TRUE(WaitForAssignments(job_id, 1, 1, &gen1));
    grpc::Status status =
        by_id[gen1[0].first]->ReportExit(gen1[0].second, 78, true, "dataset not found");
    ASSERT_TRUE(status.ok()) << Describe(status);
    v1::Job job;
    ASSERT_TRUE(WaitForState(job_id, v1::Job::FAILED, &job));
    EXPECT_EQ(job.generation(), 1);
    EXPECT_EQ(job.restarts(), 0);
    EXPECT_FALSE(job.message().empty());
    EXPECT_FALSE(HasEvent("job.restarting", job_id));
  }
}

TEST_F(ClusterTest, GangPlacementWaitsForRoom) {
  ASSERT_NO_FATAL_FAILURE(StartDefaultCoordinator());
  AddWorker("w1", 1);
  AddWorker("w2", 1);

  // Three ranks can never fit on two slots: the job waits and says why.
  absl::StatusOr<v1::Job> big = Submit(MlpSpec(3));
  ASSERT_TRUE(big.ok()) << big.status();
  ASSERT_TRUE(WaitForEvent("job.waiting", big->id()));
  v1::Job job;
  ASSERT_TRUE(GetJob(big->id()).ok());
  job = *GetJob(big->id());
  EXPECT_EQ(job.state(), v1::Job::PENDING);
  EXPECT_EQ(job.generation(), 0);
  EXPECT_THAT(job.message(), HasSubstr("3")) << job.message();

  // It does not block a job that fits behind it.
  absl::StatusOr<v1::Job> filler = Submit(MlpSpec(2));
  ASSERT_TRUE(filler.ok()) << filler.status();
  ASSERT_TRUE(WaitForAssignments(filler->id(), 1, 2, nullptr));
  ASSERT_TRUE(WaitForState(filler->id(), v1::Job::SCHEDULED));
  job = *GetJob(big->id());
  EXPECT_EQ(job.state(), v1::Job::PENDING);
  EXPECT_TRUE(AssignmentsOf(big->id()).empty());

  // With the cluster full, a low-priority job and then a high-priority one
  // queue up; when room frees for one of them, the high-priority one goes.
  v1::JobSpec low_spec = MlpSpec(2);
  low_spec.set_name("low");
  absl::StatusOr<v1::Job> low = Submit(low_spec);
  ASSERT_TRUE(low.ok()) << low.status();
  v1::JobSpec high_spec = MlpSpec(2);
  high_spec.set_name("high");
  high_spec.set_priority(5);
  absl::StatusOr<v1::Job> high = Submit(high_spec);
  ASSERT_TRUE(high.ok()) << high.status();
  EXPECT_EQ(GetJob(low->id())->state(), v1::Job::PENDING);
  EXPECT_EQ(GetJob(high->id())->state(), v1::Job::PENDING);

  v1::CancelJobRequest cancel;
  cancel.set_job_id(filler->id());
  cancel.set_reason("make room");
  v1::Job cancelled;
  grpc::Status status = coord_->CancelJob(Context(admin()).get(), cancel, &cancelled);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(cancelled.state(), v1::Job::CANCELLED);

  ASSERT_TRUE(WaitForAssignments(high->id(), 1, 2, nullptr));
  EXPECT_TRUE(WaitForState(high->id(), v1::Job::SCHEDULED));
  EXPECT_EQ(GetJob(low->id())->state(), v1::Job::PENDING);
  EXPECT_EQ(GetJob(big->id())->state(), v1::Job::PENDING);
  EXPECT_TRUE(AssignmentsOf(low->id()).empty());
  EXPECT_TRUE(AssignmentsOf(filler->id()).empty());
}

TEST_F(ClusterTest, AuthRolesAreEnforced) {
  state_dir_ = MakeTempDir("aidn-cluster-test");
  const std::string token_file = state_dir_ + "/tokens.txt";
  const std::string user_token = "user-token-0123456789abcdef";
  WriteFileOrDie(token_file, absl::StrCat("# extra tokens\n\n", user_token, " user alice\n"));
  std::vector<std::string> args = CoordinatorArgs();
  args.push_back(absl::StrCat("--token-file=", token_file));
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith(args));

  v1::ListJobsResponse jobs;
  grpc::Status status = coord_->ListJobs(Context("").get(), v1::ListJobsRequest(), &jobs);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(status);
  status =
      coord_->ListJobs(Context("not-a-real-token-0123456789").get(), v1::ListJobsRequest(), &jobs);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(status);
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_worker_id("w1");
  v1::HeartbeatResponse heartbeat_response;
  status = cluster_->Heartbeat(Context("not-a-real-token-0123456789").get(), heartbeat,
                               &heartbeat_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(status);

  // Worker token: cluster calls only.
  v1::SubmitJobRequest submit;
  *submit.mutable_spec() = MlpSpec(1);
  v1::SubmitJobResponse submitted;
  status = coord_->SubmitJob(Context(coordinator_.worker_token).get(), submit, &submitted);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);
  status = coord_->ListJobs(Context(coordinator_.worker_token).get(), v1::ListJobsRequest(), &jobs);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);

  // User token: coordinator calls only.
  v1::RegisterWorkerRequest reg;
  reg.mutable_info()->set_id("by-user");
  reg.mutable_info()->set_cpu_slots(1);
  v1::RegisterWorkerResponse reg_response;
  status = cluster_->RegisterWorker(Context(user_token).get(), reg, &reg_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);
  absl::StatusOr<v1::Job> a = Submit(MlpSpec(1), user_token);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->owner(), "alice");
  status = coord_->ListJobs(Context(user_token).get(), v1::ListJobsRequest(), &jobs);
  EXPECT_TRUE(status.ok()) << Describe(status);

  // Admin token: everything, RegisterWorker included.
  FakeWorker* worker = AddWorker("w-admin", 2, admin());
  EXPECT_EQ(worker->registered_id(), "w-admin");
  absl::StatusOr<v1::Job> b = Submit(MlpSpec(1));
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<std::pair<std::string, v1::TrainerAssignment>> a_ranks;
  std::vector<std::pair<std::string, v1::TrainerAssignment>> b_ranks;
  ASSERT_TRUE(WaitForAssignments(a->id(), 1, 1, &a_ranks));
  ASSERT_TRUE(WaitForAssignments(b->id(), 1, 1, &b_ranks));
  const v1::TrainerAssignment& a0 = a_ranks[0].second;
  const v1::TrainerAssignment& b0 = b_ranks[0].second;

  // A trainer token is good for its own job's trainer calls, nothing else.
  status = KvSet(a0, "k", "v");
  EXPECT_TRUE(status.ok()) << "own job: " << Describe(status);
  v1::TrainerAssignment a_token_for_b = b0;
  a_token_for_b.set_trainer_token(a0.trainer_token());
  status = KvSet(a_token_for_b, "k", "v");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);
  v1::GetJobRequest get;
  get.set_job_id(a->id());
  v1::Job job;
  status = coord_->GetJob(Context(a0.trainer_token()).get(), get, &job);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);
  v1::ReportTrainerExitRequest exit;
  exit.set_worker_id("w-admin");
  exit.set_job_id(a->id());
  exit.set_generation(1);
  exit.set_rank(0);
  exit.set_exit_code(0);
  v1::ReportTrainerExitResponse exit_response;
  status = cluster_->ReportTrainerExit(Context(a0.trainer_token()).get(), exit, &exit_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(status);
}

TEST_F(ClusterTest, CoordinatorKill9KeepsJobsAndWorkers) {
  // A longer worker timeout: the workers need a moment to find the restarted
  // coordinator on its new port.
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith(CoordinatorArgs("3s")));
  std::string job_id;
  std::vector<std::pair<std::string, v1::TrainerAssignment>> by_rank;
  ASSERT_NO_FATAL_FAILURE(StartRunningJob(&job_id, &by_rank));
  const std::vector<v1::Event> events_before = Events();
  ASSERT_FALSE(events_before.empty());
  const std::string admin_token = coordinator_.admin_token;

  coordinator_.process->Signal(SIGKILL);
  absl::StatusOr<int> exit = coordinator_.process->Wait(std::chrono::seconds(10));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(*exit, 128 + SIGKILL);

  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith(args_));
  EXPECT_EQ(coordinator_.admin_token, admin_token);
  std::vector<int64_t> heartbeats_at_restart;
  for (const auto& worker : workers_) {
    worker->SetAddress(coordinator_.address);
    heartbeats_at_restart.push_back(worker->successful_heartbeats());
  }

  // Let the workers heartbeat to the new coordinator for longer than the
  // worker timeout: a coordinator that lost them would show it by then.
  ASSERT_TRUE(WaitFor(
      [&] {
        for (size_t i = 0; i < workers_.size(); ++i) {
          if (workers_[i]->successful_heartbeats() < heartbeats_at_restart[i] + 20) return false;
        }
        return true;
      },
      kLong))
      << "the workers could not heartbeat to the restarted coordinator";

  v1::Job job;
  ASSERT_TRUE(GetJob(job_id).ok()) << GetJob(job_id).status();
  job = *GetJob(job_id);
  EXPECT_EQ(job.state(), v1::Job::RUNNING) << job.ShortDebugString();
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_FALSE(HasEvent("job.restarting", job_id));
  std::map<std::string, v1::Worker> workers = Workers();
  EXPECT_EQ(workers["w1"].state(), v1::Worker::ALIVE);
  EXPECT_EQ(workers["w2"].state(), v1::Worker::ALIVE);
  // The workers still hold generation 1.
  EXPECT_TRUE(WaitForAssignments(job_id, 1, 2, nullptr));

  // Every event from before is there with the same seq.
  std::map<int64_t, v1::Event> after;
  for (const v1::Event& e : Events()) after[e.seq()] = e;
  for (const v1::Event& e : events_before) {
    auto it = after.find(e.seq());
    ASSERT_NE(it, after.end()) << "event " << e.seq() << " " << e.type() << " is gone";
    EXPECT_EQ(it->second.type(), e.type()) << e.seq();
    EXPECT_EQ(it->second.job_id(), e.job_id()) << e.seq();
    EXPECT_EQ(it->second.worker_id(), e.worker_id()) << e.seq();
  }

  // Job numbering carries on.
  absl::StatusOr<v1::Job> next = Submit(MlpSpec(1));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->id(), "job-2");
}

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
  auto watch_stub = CoordinatorStub(coordinator_.address);
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
    auto writer = cluster_->StreamMetrics(context.get(), &response);
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
    auto writer = cluster_->StreamMetrics(context.get(), &response);
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
    grpc::Status status = coord_->GetMetrics(Context(admin()).get(), request, &response);
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
    EXPECT_EQ(cluster_->CommitCheckpoint(Context(token).get(), request, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    request.set_path("ckpt/step-00000005");
    request.set_bytes(4096);
    grpc::Status status = cluster_->CommitCheckpoint(Context(token).get(), request, &response);
    ASSERT_TRUE(status.ok()) << Describe(status);
    EXPECT_TRUE(response.committed());
    v1::ListCheckpointsRequest list;
    list.set_job_id(job_id);
    v1::ListCheckpointsResponse checkpoints;
    status = coord_->ListCheckpoints(Context(admin()).get(), list, &checkpoints);
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
  Watched rest = WatchToEnd(coord_.get(), admin(), again);
  ASSERT_TRUE(rest.status.ok()) << Describe(rest.status);
  ASSERT_EQ(rest.items.size(), 2u);
  EXPECT_TRUE(rest.items[0].has_job());
  EXPECT_EQ(rest.items[1].event().seq(), last_seq);

  // Watching an unknown job is NOT_FOUND; a worker token may not watch.
  v1::WatchJobRequest unknown;
  unknown.set_job_id("job-999");
  EXPECT_EQ(WatchToEnd(coord_.get(), admin(), unknown).status.error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(WatchToEnd(coord_.get(), coordinator_.worker_token, watch).status.error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

}  // namespace
}  // namespace aidn::testing
