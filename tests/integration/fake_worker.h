#ifndef AIDN_TESTS_INTEGRATION_FAKE_WORKER_H_
#define AIDN_TESTS_INTEGRATION_FAKE_WORKER_H_

// A stand-in for the worker daemon, for tests of the cluster protocol that
// play the workers and their trainers themselves through the generated
// stubs.

#include <csignal>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "tests/integration/cluster_fixture.h"

namespace aidn::testing {

// How often a FakeWorker heartbeats.
inline constexpr std::chrono::milliseconds kHeartbeatEvery{200};

inline google::protobuf::Duration ProtoMillis(int64_t ms) {
  google::protobuf::Duration d;
  d.set_seconds(ms / 1000);
  d.set_nanos(static_cast<int32_t>((ms % 1000) * 1'000'000));
  return d;
}

inline std::string TrainerKey(const std::string& job_id, int64_t generation, int32_t rank) {
  return absl::StrCat(job_id, "/", generation, "/", rank);
}

inline std::string AddressOfRank(int32_t rank) { return absl::StrCat("127.0.0.1:", 29500 + rank); }

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

}  // namespace aidn::testing

#endif  // AIDN_TESTS_INTEGRATION_FAKE_WORKER_H_
