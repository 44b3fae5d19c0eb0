#ifndef AIDN_TESTS_FUZZ_FUZZ_CLUSTER_H_
#define AIDN_TESTS_FUZZ_FUZZ_CLUSTER_H_

// What the service fuzz targets (grpc_fuzz, web_fuzz) share: a coordinator
// (fake clock, SQLite in memory) holding a small cluster behind a real gRPC
// server: one worker, running and queued jobs of two users, tokens for an
// admin, alice (project "vision"), bob, the worker and the running job's
// trainer; and the state a refused call must leave as it was (its jobs,
// workers, events and checkpoints; a refusal may add only its own audit
// events, whose type ends in ".refused").

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "common/log.h"
#include "coordinator/auth.h"
#include "coordinator/coordinator.h"
#include "coordinator/server.h"
#include "coordinator/store.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/message_differencer.h"

namespace aidn::fuzz {

namespace v1 = aidn::v1;
using aidn::coordinator::Authenticator;
using aidn::coordinator::Coordinator;
using aidn::coordinator::CoordinatorOptions;
using aidn::coordinator::Principal;
using aidn::coordinator::Role;
using aidn::coordinator::Server;
using aidn::coordinator::ServerOptions;
using aidn::coordinator::Store;

// The authorization values the fuzz input picks from ("" sends none).
inline constexpr const char* kTokens[] = {"",
                                          "Bearer nonsense",
                                          "Bearer t-admin",
                                          "Bearer t-alice",
                                          "Bearer t-bob",
                                          "Bearer t-worker",
                                          "Bearer t-trainer"};
inline constexpr size_t kTokenCount = sizeof(kTokens) / sizeof(kTokens[0]);

// Refusals are the point of these targets: logs kept to errors, and
// protobuf's complaints about malformed strings left out.
inline void QuietLogs() {
  aidn::SetMinLogLevel(aidn::LogLevel::kError);
  google::protobuf::SetLogHandler(nullptr);
}

[[noreturn]] inline void Die(const std::string& what) {
  std::fprintf(stderr, "fuzz: %s\n", what.c_str());
  std::abort();
}

// What a refused call must leave as it was.
struct State {
  v1::ListJobsResponse jobs;
  v1::ListWorkersResponse workers;
  v1::ListEventsResponse events;
  std::vector<v1::ListCheckpointsResponse> checkpoints;
};

inline State Snapshot(Coordinator* coordinator) {
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
inline v1::ListEventsResponse WithoutRefusals(const v1::ListEventsResponse& before,
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
inline std::string Compare(const State& a, const State& b) {
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

inline v1::JobSpec SmallSpec(const std::string& project) {
  v1::JobSpec spec;
  spec.set_world_size(1);
  spec.mutable_model()->set_name("mlp");
  if (!project.empty()) (*spec.mutable_labels())["project"] = project;
  return spec;
}

class FuzzCluster {
 public:
  FuzzCluster() {
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
  }
  ~FuzzCluster() {
    coordinator_->Shutdown();
    server_->Shutdown(std::chrono::milliseconds(0));
  }
  FuzzCluster(const FuzzCluster&) = delete;
  FuzzCluster& operator=(const FuzzCluster&) = delete;

  Coordinator* coordinator() { return coordinator_.get(); }
  Server* server() { return server_.get(); }

 private:
  aidn::FakeClock clock_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<Server> server_;
};

}  // namespace aidn::fuzz

#endif  // AIDN_TESTS_FUZZ_FUZZ_CLUSTER_H_
