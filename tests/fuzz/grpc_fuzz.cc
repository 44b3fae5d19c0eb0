// The coordinator's gRPC services as any client may call them: a method, a
// bearer token and request bytes, all from the fuzz input, through a real
// gRPC server (an in-process channel, so no socket) into the real service
// and coordinator code. The coordinator holds a small cluster: one worker,
// running and queued jobs of two users, a trainer token for one of them.
//
// After every call the service refused (any status but OK, and not our own
// cancellation of a call that waits), the coordinator's state must be
// exactly as it was: its jobs, workers, events and checkpoints. The one
// thing a refusal may add is its own audit record: new events whose type
// ends in ".refused" (a second worker asking for a live worker's id).
//
// Input: byte 0 picks the method, byte 1 the token, the rest is the request
// message (serialized protobuf, for streaming calls the one message sent).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "common/log.h"
#include "coordinator/auth.h"
#include "coordinator/coordinator.h"
#include "coordinator/server.h"
#include "coordinator/store.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace {

namespace v1 = aidn::v1;
using aidn::coordinator::Authenticator;
using aidn::coordinator::Coordinator;
using aidn::coordinator::CoordinatorOptions;
using aidn::coordinator::Principal;
using aidn::coordinator::Role;
using aidn::coordinator::Server;
using aidn::coordinator::ServerOptions;
using aidn::coordinator::Store;

constexpr const char* kMethods[] = {
    "/aidn.v1.CoordinatorService/SubmitJob",
    "/aidn.v1.CoordinatorService/GetJob",
    "/aidn.v1.CoordinatorService/ListJobs",
    "/aidn.v1.CoordinatorService/CancelJob",
    "/aidn.v1.CoordinatorService/WatchJob",
    "/aidn.v1.CoordinatorService/ListWorkers",
    "/aidn.v1.CoordinatorService/ListCheckpoints",
    "/aidn.v1.CoordinatorService/ListEvents",
    "/aidn.v1.CoordinatorService/GetMetrics",
    "/aidn.v1.CoordinatorService/ReadLogs",
    "/aidn.v1.ClusterService/RegisterWorker",
    "/aidn.v1.ClusterService/Heartbeat",
    "/aidn.v1.ClusterService/ReportTrainerExit",
    "/aidn.v1.ClusterService/JoinRendezvous",
    "/aidn.v1.ClusterService/KvSet",
    "/aidn.v1.ClusterService/KvGet",
    "/aidn.v1.ClusterService/KvAdd",
    "/aidn.v1.ClusterService/KvCompareAndSet",
    "/aidn.v1.ClusterService/ReportProgress",
    "/aidn.v1.ClusterService/StreamMetrics",
    "/aidn.v1.ClusterService/CommitCheckpoint",
    "/aidn.v1.ClusterService/ReportCheckpointInvalid",
    "/aidn.v1.ClusterService/ShipLogs",
    "/aidn.v1.CoordinatorService/SetWorkerScheduling",
    "/aidn.v1.CoordinatorService/RemoveWorker",
    "/aidn.v1.CoordinatorService/PauseJob",
    "/aidn.v1.CoordinatorService/ResumeJob",
};
constexpr size_t kMethodCount = sizeof(kMethods) / sizeof(kMethods[0]);

// "" sends no authorization at all.
constexpr const char* kTokens[] = {"",
                                   "Bearer nonsense",
                                   "Bearer t-admin",
                                   "Bearer t-alice",
                                   "Bearer t-bob",
                                   "Bearer t-worker",
                                   "Bearer t-trainer"};
constexpr size_t kTokenCount = sizeof(kTokens) / sizeof(kTokens[0]);

// A call that has not finished after this long is waiting for something
// (a held heartbeat, a rendezvous, a key, a watch): it is cancelled.
constexpr std::chrono::milliseconds kWait{50};
// Rebuilt once the fuzzer has made this many jobs, so calls stay cheap.
constexpr int kMaxJobs = 64;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "grpc_fuzz: %s\n", what.c_str());
  std::abort();
}

// What a refused call must leave as it was.
struct State {
  v1::ListJobsResponse jobs;
  v1::ListWorkersResponse workers;
  v1::ListEventsResponse events;
  std::vector<v1::ListCheckpointsResponse> checkpoints;
};

State Snapshot(Coordinator* coordinator) {
  State s;
  v1::ListJobsRequest all;
  all.set_page_size(1000);
  absl::StatusOr<v1::ListJobsResponse> jobs = coordinator->ListJobs(all);
  if (!jobs.ok()) Die("ListJobs: " + jobs.status().ToString());
  s.jobs = *std::move(jobs);
  s.workers = coordinator->ListWorkers();
  v1::ListEventsRequest events;
  events.set_limit(10000);
  absl::StatusOr<v1::ListEventsResponse> listed = coordinator->ListEvents(events);
  if (!listed.ok()) Die("ListEvents: " + listed.status().ToString());
  s.events = *std::move(listed);
  for (const v1::Job& job : s.jobs.jobs()) {
    absl::StatusOr<v1::ListCheckpointsResponse> c = coordinator->ListCheckpoints(job.id());
    if (!c.ok()) Die("ListCheckpoints: " + c.status().ToString());
    s.checkpoints.push_back(*std::move(c));
  }
  return s;
}

// `after`'s events less those a refusal may record: the ones past
// `before`'s last whose type ends in ".refused".
v1::ListEventsResponse WithoutRefusals(const v1::ListEventsResponse& before,
                                       const v1::ListEventsResponse& after) {
  const int64_t last = before.events().empty() ? 0 : before.events().rbegin()->seq();
  v1::ListEventsResponse kept = after;
  kept.clear_events();
  for (const v1::Event& e : after.events()) {
    if (e.seq() > last && e.type().ends_with(".refused")) continue;
    *kept.add_events() = e;
  }
  return kept;
}

// Empty when equal, else the first difference.
std::string Compare(const State& a, const State& b) {
  using google::protobuf::util::MessageDifferencer;
  std::string diff;
  MessageDifferencer d;
  d.ReportDifferencesToString(&diff);
  if (!d.Compare(a.jobs, b.jobs)) return "jobs: " + diff;
  if (!d.Compare(a.workers, b.workers)) return "workers: " + diff;
  if (!d.Compare(a.events, WithoutRefusals(a.events, b.events))) return "events: " + diff;
  if (a.checkpoints.size() != b.checkpoints.size()) return "checkpoint lists";
  for (size_t i = 0; i < a.checkpoints.size(); ++i) {
    if (!d.Compare(a.checkpoints[i], b.checkpoints[i])) return "checkpoints: " + diff;
  }
  return "";
}

// One call over the generic stub: one request message, every answer read.
class Call final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Call(grpc::GenericStub* stub, const char* method, const char* token, const uint8_t* data,
       size_t size) {
    if (token[0] != '\0') context_.AddMetadata("authorization", token);
    grpc::Slice slice(data, size);
    request_ = grpc::ByteBuffer(&slice, 1);
    stub->PrepareBidiStreamingCall(&context_, method, grpc::StubOptions(), this);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartRead(&response_);
    StartCall();
  }

  // The call's status; `waited` when it had to be cancelled.
  grpc::Status Finish(bool* waited) {
    std::future<void> done = done_.get_future();
    *waited = done.wait_for(kWait) != std::future_status::ready;
    if (*waited) context_.TryCancel();
    done.wait();
    return status_;
  }

  void OnReadDone(bool ok) override {
    if (ok) StartRead(&response_);
  }
  void OnDone(const grpc::Status& status) override {
    status_ = status;
    done_.set_value();
  }

 private:
  grpc::ClientContext context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  grpc::Status status_;
  std::promise<void> done_;
};

v1::JobSpec SmallSpec(const std::string& project) {
  v1::JobSpec spec;
  spec.set_world_size(1);
  spec.mutable_model()->set_name("mlp");
  if (!project.empty()) (*spec.mutable_labels())["project"] = project;
  return spec;
}

// A coordinator (fake clock, SQLite in memory) and its server.
class Cluster {
 public:
  Cluster() {
    auth_ = Authenticator::CreateEmpty();
    auth_->AddToken("t-admin", Principal{.role = Role::kAdmin, .name = "admin"});
    auth_->AddToken("t-alice",
                    Principal{.role = Role::kUser, .name = "alice", .projects = {"vision"}});
    auth_->AddToken("t-bob", Principal{.role = Role::kUser, .name = "bob"});
    auth_->AddToken("t-worker", Principal{.role = Role::kWorker, .name = "worker"});
    auto store = Store::Open({.path = ":memory:"});
    if (!store.ok()) Die(store.status().ToString());
    CoordinatorOptions options;
    options.clock = &clock_;
    auto coordinator = Coordinator::Create(options, *std::move(store), auth_.get());
    if (!coordinator.ok()) Die(coordinator.status().ToString());
    coordinator_ = *std::move(coordinator);

    // One worker with one slot: alice's first job runs, the rest queue.
    v1::RegisterWorkerRequest reg;
    reg.mutable_info()->set_id("w1");
    reg.mutable_info()->set_address("127.0.0.1");
    reg.mutable_info()->set_cpu_slots(1);
    reg.mutable_info()->set_runs_commands(true);
    if (auto r = coordinator_->RegisterWorker(reg); !r.ok()) Die(r.status().ToString());
    auto running = coordinator_->SubmitJob(SmallSpec(""), "alice");
    if (!running.ok()) Die(running.status().ToString());
    auth_->AddToken("t-trainer", Principal{.role = Role::kTrainer,
                                           .name = "trainer:" + running->id(),
                                           .job_id = running->id()});
    for (const auto& [owner, project] :
         {std::pair<std::string, std::string>{"bob", ""}, {"bob", "vision"}, {"alice", ""}}) {
      if (auto j = coordinator_->SubmitJob(SmallSpec(project), owner); !j.ok()) {
        Die(j.status().ToString());
      }
    }
    coordinator_->Tick();  // places the first job

    ServerOptions server_options;
    server_options.listen = "127.0.0.1:0";
    auto server = Server::Start(server_options, coordinator_.get(), auth_.get());
    if (!server.ok()) Die(server.status().ToString());
    server_ = *std::move(server);
    stub_ = std::make_unique<grpc::GenericStub>(server_->InProcessChannel());
  }
  ~Cluster() {
    coordinator_->Shutdown();
    server_->Shutdown(std::chrono::milliseconds(0));
  }

  void RunOne(const uint8_t* data, size_t size) {
    const char* method = kMethods[data[0] % kMethodCount];
    const char* token = kTokens[data[1] % kTokenCount];
    const State before = Snapshot(coordinator_.get());
    jobs_ = before.jobs.jobs_size();
    bool waited = false;
    grpc::Status status;
    {
      Call call(stub_.get(), method, token, data + 2, size - 2);
      status = call.Finish(&waited);
    }
    // A call that waited says nothing about refusal, and may still act after
    // its cancellation: the call after it is not judged either.
    const bool judge = !status.ok() && !waited && !after_wait_;
    after_wait_ = waited;
    if (!judge) return;
    const State after = Snapshot(coordinator_.get());
    if (std::string diff = Compare(before, after); !diff.empty()) {
      Die(std::string("a refused call changed the coordinator's state: ") + method + " with " +
          (token[0] == '\0' ? "no token" : token) + " refused (" +
          std::to_string(status.error_code()) + ": " + status.error_message() + ") but " + diff);
    }
  }

  // How many jobs the coordinator held before the last call.
  int jobs() const { return jobs_; }

 private:
  aidn::FakeClock clock_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<grpc::GenericStub> stub_;
  int jobs_ = 0;
  bool after_wait_ = false;
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Refusals are the point here: keep the logs to errors, and protobuf's
  // complaints about malformed strings out.
  aidn::SetMinLogLevel(aidn::LogLevel::kError);
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Cluster* cluster = new Cluster();  // lives for the process
  if (size < 2) return 0;
  cluster->RunOne(data, size);
  if (cluster->jobs() > kMaxJobs) {
    delete cluster;
    cluster = new Cluster();
  }
  return 0;
}
