// A coordinator that has run many jobs: one real aidn-coordinator on
// loopback runs --jobs short jobs (submit, one rank joins, it exits 0), from
// --threads clients at once, on simulated workers that heartbeat. At every
// tenth of the jobs it prints the coordinator's resident memory, how many
// jobs it holds in memory, and how long a ListJobs page and a GetJob of
// the first job take (medians).
//
// bench/job_history.sh runs it twice: with finished jobs kept in memory
// (--job-retention far longer than the run, as every job was before
// retention existed) and with a short --job-retention, and prints the ratio.

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "bench/coordinator/coordinator_process.h"
#include "tests/integration/cluster_fixture.h"

ABSL_FLAG(int, jobs, 100'000, "jobs to run");
ABSL_FLAG(int, threads, 8, "clients submitting and running jobs at once");
ABSL_FLAG(int, workers, 4, "simulated workers (64 slots each)");
ABSL_FLAG(std::string, job_retention, "1000h", "the coordinator's --job-retention");
ABSL_FLAG(std::string, label, "", "a name for this run in the output");

namespace aidn::bench {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The value of an unlabelled series on the coordinator's /metrics.
std::string Series(const testing::CoordinatorHandle& c, const std::string& name) {
  testing::CommandResult r =
      testing::RunCommand({"curl", "-s", absl::StrCat("http://", c.metrics_address, "/metrics")});
  const std::string text = "\n" + r.out;
  const size_t at = text.find("\n" + name + " ");
  if (at == std::string::npos) return "?";
  const size_t start = at + name.size() + 2;
  return text.substr(start, text.find('\n', start) - start);
}

// One job from submission to success: 3 calls. The first call that failed.
grpc::Status RunOneJob(v1::CoordinatorService::Stub* users, v1::ClusterService::Stub* cluster,
                       const testing::CoordinatorHandle& c, int n) {
  v1::JobSpec spec;
  spec.set_name(absl::StrCat("short-", n));
  spec.set_world_size(1);
  spec.mutable_model()->set_name("mlp");
  spec.set_epochs(1);
  v1::SubmitJobRequest submit;
  *submit.mutable_spec() = spec;
  v1::SubmitJobResponse submitted;
  grpc::Status s = users->SubmitJob(testing::Context(c.admin_token).get(), submit, &submitted);
  if (!s.ok()) return s;
  const v1::Job& job = submitted.job();
  if (job.placement_size() != 1) {
    return grpc::Status(grpc::StatusCode::INTERNAL, job.id() + " was not placed: " + job.message());
  }
  v1::JoinRendezvousRequest join;
  join.set_job_id(job.id());
  join.set_generation(job.generation());
  join.set_rank(0);
  join.set_worker_id(job.placement(0).worker_id());
  join.set_address("127.0.0.1:1");
  v1::JoinRendezvousResponse joined;
  s = cluster->JoinRendezvous(testing::Context(c.worker_token).get(), join, &joined);
  if (!s.ok()) return s;
  v1::ReportTrainerExitRequest exit;
  exit.set_worker_id(job.placement(0).worker_id());
  exit.set_job_id(job.id());
  exit.set_generation(job.generation());
  exit.set_rank(0);
  exit.set_exit_code(0);
  v1::ReportTrainerExitResponse exited;
  return cluster->ReportTrainerExit(testing::Context(c.worker_token).get(), exit, &exited);
}

int Run() {
  RaiseFileLimit();
  const int jobs = absl::GetFlag(FLAGS_jobs);
  const int threads = absl::GetFlag(FLAGS_threads);
  const int workers = absl::GetFlag(FLAGS_workers);
  const std::string label = absl::GetFlag(FLAGS_label);
  const std::string dir = absl::StrCat("/tmp/aidn-job-history-", getpid());
  std::filesystem::remove_all(dir);
  absl::StatusOr<testing::CoordinatorHandle> started = testing::StartCoordinator(
      dir, {absl::StrCat("--job-retention=", absl::GetFlag(FLAGS_job_retention)),
            "--metrics-retention=10s", "--log-level=warning"});
  if (!started.ok()) {
    std::fprintf(stderr, "could not start the coordinator: %s\n",
                 started.status().ToString().c_str());
    return 1;
  }
  testing::CoordinatorHandle c = *std::move(started);
  const pid_t pid = c.process->pid();

  auto cluster = testing::ClusterStub(c.address);
  for (int w = 0; w < workers; ++w) {
    v1::RegisterWorkerRequest reg;
    reg.mutable_info()->set_id(absl::StrCat("sim-", w));
    reg.mutable_info()->set_hostname("127.0.0.1");
    reg.mutable_info()->set_cpu_slots(64);
    v1::RegisterWorkerResponse registered;
    const grpc::Status s =
        cluster->RegisterWorker(testing::Context(c.worker_token).get(), reg, &registered);
    if (!s.ok()) {
      std::fprintf(stderr, "register: %s\n", testing::Describe(s).c_str());
      return 1;
    }
  }
  std::atomic<bool> stop{false};
  std::thread beats([&] {
    while (!stop.load()) {
      for (int w = 0; w < workers; ++w) {
        v1::HeartbeatRequest beat;
        beat.set_worker_id(absl::StrCat("sim-", w));
        v1::HeartbeatResponse answer;
        (void)cluster->Heartbeat(testing::Context(c.worker_token).get(), beat, &answer);
      }
      std::this_thread::sleep_for(milliseconds(500));
    }
  });

  auto users = testing::CoordinatorStub(c.address);
  std::string first_job;
  auto measure = [&](int done, double jobs_per_second) {
    std::vector<double> list_ms, get_ms;
    for (int i = 0; i < 21; ++i) {
      v1::ListJobsRequest list;
      list.set_page_size(100);
      v1::ListJobsResponse page;
      auto t0 = Clock::now();
      (void)users->ListJobs(testing::Context(c.admin_token).get(), list, &page);
      list_ms.push_back(Ms(Clock::now() - t0));
      if (done > 0) {
        v1::GetJobRequest get;
        get.set_job_id("job-1");
        v1::Job got;
        t0 = Clock::now();
        (void)users->GetJob(testing::Context(c.admin_token).get(), get, &got);
        get_ms.push_back(Ms(Clock::now() - t0));
      }
    }
    const auto [rss, anon] = ResidentMiB(pid);
    std::printf(
        "%-10s jobs %7d  rss %7.1f MiB  anon %7.1f MiB  in memory %7s  list %7.2f ms  "
        "get %6.2f ms  %6.0f jobs/s\n",
        label.c_str(), done, rss, anon, Series(c, "aidn_jobs_in_memory").c_str(), Median(list_ms),
        Median(get_ms), jobs_per_second);
    std::fflush(stdout);
  };
  measure(0, 0);

  std::atomic<int> next{0}, failed{0};
  const int tenth = std::max(1, jobs / 10);
  for (int part = 0; part < 10; ++part) {
    const int until = part == 9 ? jobs : (part + 1) * tenth;
    const auto t0 = Clock::now();
    const int from = next.load();
    std::vector<std::thread> clients;
    for (int t = 0; t < threads; ++t) {
      clients.emplace_back([&] {
        auto my_users = testing::CoordinatorStub(c.address);
        auto my_cluster = testing::ClusterStub(c.address);
        for (int n = next.fetch_add(1); n < until; n = next.fetch_add(1)) {
          const grpc::Status s = RunOneJob(my_users.get(), my_cluster.get(), c, n);
          if (!s.ok() && failed.fetch_add(1) < 3) {
            std::fprintf(stderr, "job %d: %s\n", n, testing::Describe(s).c_str());
          }
        }
      });
    }
    for (std::thread& t : clients) t.join();
    next.store(until);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    measure(until, (until - from) / seconds);
  }
  stop.store(true);
  beats.join();
  c.process->Signal(SIGTERM);
  (void)c.process->Wait(std::chrono::seconds(20));
  std::filesystem::remove_all(dir);
  if (failed.load() > 0) {
    std::fprintf(stderr, "%d jobs did not run through\n", failed.load());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace aidn::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return aidn::bench::Run();
}
