// metrics_load: streams metric records into a real coordinator at a fixed
// rate for a while, job after job, and watches the coordinator's resident
// memory and CPU, to show that finished jobs' metrics leave memory after the
// retention period.
//
//   metrics_load [--seconds=60] [--rate=1000] [--ranks=2] [--job-seconds=10]
//                [--retention-seconds=10]
//
// The coordinator is the real binary on loopback, with its own state
// directory under /tmp. This program plays one worker daemon (registering,
// heartbeating, reporting its trainers as running) and the trainers of each
// job (joining the rendezvous, then sending batches of TRAIN records every
// 100 ms the way aidn's trainers do, one StreamMetrics call per batch). Each
// job ends after --job-seconds with clean exit reports, and the next one is
// submitted. It prints the coordinator's RSS and CPU once a second, and a
// summary: RSS after the first job, at the end of the load, and once the
// retention period of the last job has passed.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "common/metrics/process_stats.h"
#include "tests/integration/cluster_fixture.h"

namespace aidn::bench {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testing::Context;

struct Options {
  int seconds = 60;
  int rate = 1000;
  int ranks = 2;
  int job_seconds = 10;
  int retention_seconds = 10;
};

constexpr char kUsage[] =
    "usage: metrics_load [--seconds=60] [--rate=1000] [--ranks=2] [--job-seconds=10]\n"
    "                    [--retention-seconds=10]\n";

// False on a bad flag, or with *help set on --help.
bool ParseFlags(int argc, char** argv, Options* o, bool* help) {
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    if (kv[0] == "--help" || kv[0] == "-h") {
      *help = true;
      return false;
    }
    int* target = nullptr;
    if (kv[0] == "--seconds") target = &o->seconds;
    if (kv[0] == "--rate") target = &o->rate;
    if (kv[0] == "--ranks") target = &o->ranks;
    if (kv[0] == "--job-seconds") target = &o->job_seconds;
    if (kv[0] == "--retention-seconds") target = &o->retention_seconds;
    if (target == nullptr || kv.size() != 2 || !absl::SimpleAtoi(kv[1], target) || *target <= 0) {
      std::fprintf(stderr, "metrics_load: bad flag \"%s\"\n", argv[i]);
      return false;
    }
  }
  return true;
}

double RssMiB(pid_t pid) {
  absl::StatusOr<metrics::ProcessStats> s = metrics::ReadProcessStats(pid);
  return s.ok() ? static_cast<double>(s->resident_bytes) / (1024.0 * 1024.0) : -1;
}

double CpuSeconds(pid_t pid) {
  absl::StatusOr<metrics::ProcessStats> s = metrics::ReadProcessStats(pid);
  return s.ok() ? s->cpu_seconds : -1;
}

// The worker daemon stand-in: heartbeats every 500 ms, reporting as running
// every trainer it was assigned, and remembers the assignments.
class FakeWorker {
 public:
  FakeWorker(v1::ClusterService::Stub* stub, std::string token)
      : stub_(stub), token_(std::move(token)) {}

  bool Register(int slots) {
    v1::RegisterWorkerRequest request;
    request.mutable_info()->set_id("load-worker");
    request.mutable_info()->set_hostname("load-worker");
    request.mutable_info()->set_address("127.0.0.1");
    request.mutable_info()->set_cpu_slots(slots);
    v1::RegisterWorkerResponse response;
    return stub_->RegisterWorker(Context(token_).get(), request, &response).ok();
  }

  void Start() {
    thread_ = std::thread([this] {
      while (!stop_) {
        v1::HeartbeatRequest request;
        request.set_worker_id("load-worker");
        {
          std::lock_guard<std::mutex> lock(mu_);
          for (const auto& [key, a] : assigned_) {
            v1::TrainerStatus* t = request.add_trainers();
            t->set_job_id(a.job_id());
            t->set_generation(a.generation());
            t->set_rank(a.rank());
            t->set_pid(getpid());
          }
        }
        v1::HeartbeatResponse response;
        if (stub_->Heartbeat(Context(token_).get(), request, &response).ok()) {
          std::lock_guard<std::mutex> lock(mu_);
          for (const v1::TrainerAssignment& a : response.assignments()) {
            assigned_[absl::StrCat(a.job_id(), "/", a.rank())] = a;
          }
        }
        std::this_thread::sleep_for(milliseconds(500));
      }
    });
  }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

  // The assignments of `job_id` once all `ranks` are there.
  std::vector<v1::TrainerAssignment> WaitFor(const std::string& job_id, int ranks) {
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < deadline) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<v1::TrainerAssignment> out;
        for (const auto& [key, a] : assigned_) {
          if (a.job_id() == job_id) out.push_back(a);
        }
        if (static_cast<int>(out.size()) == ranks) return out;
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    return {};
  }

  void Forget(const std::string& job_id) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = assigned_.begin(); it != assigned_.end();) {
      it = it->second.job_id() == job_id ? assigned_.erase(it) : std::next(it);
    }
  }

 private:
  v1::ClusterService::Stub* const stub_;
  const std::string token_;
  std::mutex mu_;
  std::map<std::string, v1::TrainerAssignment> assigned_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

int Run(const Options& o) {
  const std::string dir = absl::StrCat("/tmp/aidn-metrics-load-", getpid());
  std::filesystem::create_directories(dir);
  absl::StatusOr<testing::CoordinatorHandle> c = testing::StartCoordinator(
      dir + "/state", {absl::StrCat("--metrics-retention=", o.retention_seconds, "s"),
                       "--worker-timeout=30s", "--log-level=warning"});
  if (!c.ok()) {
    std::fprintf(stderr, "metrics_load: %s\n", c.status().ToString().c_str());
    return 1;
  }
  const pid_t pid = c->process->pid();
  auto coord = testing::CoordinatorStub(c->address);
  auto cluster = testing::ClusterStub(c->address);
  FakeWorker worker(cluster.get(), c->worker_token);
  if (!worker.Register(o.ranks)) {
    std::fprintf(stderr, "metrics_load: RegisterWorker failed\n");
    return 1;
  }
  worker.Start();

  std::printf(
      "metrics_load: %d records/s from %d ranks for %d s, a new job every %d s, "
      "retention %d s; coordinator pid %d\n",
      o.rate, o.ranks, o.seconds, o.job_seconds, o.retention_seconds, pid);
  std::printf("%6s %6s %10s %9s %8s\n", "t_s", "jobs", "records", "rss_mib", "cpu_%");

  std::atomic<int64_t> records_sent{0};
  std::atomic<int> jobs_done{0};
  std::atomic<bool> load_over{false};
  double rss_after_first_job = -1;
  const Clock::time_point start = Clock::now();

  std::thread load([&] {
    const int per_rank_batch = std::max(1, o.rate / o.ranks / 10);  // every 100 ms
    while (Clock::now() - start < std::chrono::seconds(o.seconds)) {
      v1::SubmitJobRequest submit;
      submit.mutable_spec()->set_name("metrics-load");
      submit.mutable_spec()->set_world_size(o.ranks);
      submit.mutable_spec()->mutable_model()->set_name("mlp");
      submit.mutable_spec()->set_epochs(1);
      v1::SubmitJobResponse submitted;
      if (!coord->SubmitJob(Context(c->admin_token).get(), submit, &submitted).ok()) break;
      const std::string job_id = submitted.job().id();
      std::vector<v1::TrainerAssignment> ranks = worker.WaitFor(job_id, o.ranks);
      if (ranks.empty()) break;
      std::vector<std::thread> joins;
      for (const v1::TrainerAssignment& a : ranks) {
        joins.emplace_back([&, a] {
          v1::JoinRendezvousRequest join;
          join.set_job_id(a.job_id());
          join.set_generation(a.generation());
          join.set_rank(a.rank());
          join.set_worker_id("load-worker");
          join.set_address(absl::StrCat("127.0.0.1:", 30000 + a.rank()));
          v1::JoinRendezvousResponse response;
          cluster->JoinRendezvous(Context(a.trainer_token()).get(), join, &response);
        });
      }
      for (std::thread& t : joins) t.join();

      const Clock::time_point job_end = Clock::now() + std::chrono::seconds(o.job_seconds);
      Clock::time_point next = Clock::now();
      int64_t step = 0;
      while (Clock::now() < job_end) {
        for (const v1::TrainerAssignment& a : ranks) {
          v1::StreamMetricsRequest batch;
          batch.set_job_id(job_id);
          batch.set_generation(a.generation());
          batch.set_rank(a.rank());
          for (int i = 1; i <= per_rank_batch; ++i) {
            v1::MetricRecord* r = batch.add_records();
            r->set_step(step + i);
            r->set_loss(2.0 / static_cast<double>(step + i));
            r->set_samples(64);
            r->set_step_seconds(0.001);
            r->set_allreduce_seconds(0.0004);
            r->set_lr(0.01);
          }
          auto context = Context(a.trainer_token());
          v1::StreamMetricsResponse response;
          auto writer = cluster->StreamMetrics(context.get(), &response);
          writer->Write(batch);
          writer->WritesDone();
          if (writer->Finish().ok()) records_sent += per_rank_batch;
        }
        step += per_rank_batch;
        next += milliseconds(100);
        std::this_thread::sleep_until(next);
      }
      for (const v1::TrainerAssignment& a : ranks) {
        v1::ReportTrainerExitRequest exit;
        exit.set_worker_id("load-worker");
        exit.set_job_id(a.job_id());
        exit.set_generation(a.generation());
        exit.set_rank(a.rank());
        v1::ReportTrainerExitResponse response;
        cluster->ReportTrainerExit(Context(c->worker_token).get(), exit, &response);
      }
      worker.Forget(job_id);
      ++jobs_done;
    }
    load_over = true;
  });

  double last_cpu = CpuSeconds(pid);
  Clock::time_point last = Clock::now();
  Clock::time_point load_end{};
  double rss_end_of_load = -1, rss_peak = 0;
  const auto settle = std::chrono::seconds(o.retention_seconds + 5);
  while (true) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    const Clock::time_point now = Clock::now();
    const double cpu = CpuSeconds(pid);
    const double rss = RssMiB(pid);
    rss_peak = std::max(rss_peak, rss);
    const double pct = 100.0 * (cpu - last_cpu) / std::chrono::duration<double>(now - last).count();
    last_cpu = cpu;
    last = now;
    std::printf("%6.0f %6d %10lld %9.1f %8.1f\n",
                std::chrono::duration<double>(now - start).count(), jobs_done.load(),
                static_cast<long long>(records_sent.load()), rss, pct);
    std::fflush(stdout);
    if (rss_after_first_job < 0 && jobs_done.load() >= 1) rss_after_first_job = rss;
    if (load_over && load_end == Clock::time_point{}) {
      load_end = now;
      rss_end_of_load = rss;
    }
    if (load_end != Clock::time_point{} && now - load_end >= settle) break;
  }
  load.join();
  worker.Stop();
  const double rss_final = RssMiB(pid);
  const double total_s = std::chrono::duration<double>(load_end - start).count();
  const double cpu_total = CpuSeconds(pid);
  std::printf("\nrecords sent: %lld in %.0f s (%.0f/s), %d jobs\n",
              static_cast<long long>(records_sent.load()), total_s,
              static_cast<double>(records_sent.load()) / total_s, jobs_done.load());
  std::printf("coordinator CPU over the whole run: %.1f s (%.1f%% of one core)\n", cpu_total,
              100.0 * cpu_total / std::chrono::duration<double>(Clock::now() - start).count());
  std::printf(
      "coordinator RSS: after the first job %.1f MiB, peak %.1f MiB, end of load %.1f "
      "MiB, %d s after the load (retention %d s) %.1f MiB\n",
      rss_after_first_job, rss_peak, rss_end_of_load, o.retention_seconds + 5, o.retention_seconds,
      rss_final);
  c->process->Signal(SIGTERM);
  c->process->Wait(std::chrono::seconds(10)).IgnoreError();
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace aidn::bench

int main(int argc, char** argv) {
  aidn::bench::Options options;
  bool help = false;
  if (!aidn::bench::ParseFlags(argc, argv, &options, &help)) {
    std::fputs(aidn::bench::kUsage, help ? stdout : stderr);
    return help ? 0 : 2;
  }
  return aidn::bench::Run(options);
}
