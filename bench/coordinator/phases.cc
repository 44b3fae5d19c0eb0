#include "bench/coordinator/phases.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"

namespace aidn::bench {
namespace {

int LoadJobs(const Options& o) {
  return o.ranks == 0 ? 0 : (o.ranks + o.ranks_per_job - 1) / o.ranks_per_job;
}

}  // namespace

void WarnIfNotRepresentative() {
#ifndef NDEBUG
  std::printf("WARNING: built with assertions (NDEBUG unset): figures are not representative\n");
#endif
#if !defined(__OPTIMIZE__)
  std::printf("WARNING: built without optimisation: figures are not representative\n");
#endif
}

void PrintSetup(const Options& o, const CoordinatorProcess& c) {
  std::printf("coordinator_load: one real aidn-coordinator (pid %d, %s, state %s/state)\n", c.pid,
              c.handle.address.c_str(), c.dir.c_str());
  std::printf("  %-34s %d (%d of them latency probes: max_wait 0, no slots), %d cpu slots each\n",
              "simulated workers", o.workers, o.probe_workers, o.slots_per_worker);
  std::printf("  %-34s %d in %d jobs of %d, %d records/s each, batched every %lld ms\n",
              "simulated ranks", o.ranks, LoadJobs(o), o.ranks_per_job, o.records_per_second,
              static_cast<long long>(kReporterPeriod.count()));
  std::printf("  %-34s %d ranks, under the load, before the window\n", "rendezvous job",
              o.rendezvous_world);
  std::printf("  %-34s %d gRPC channels (one TCP connection each), callback API, 1 timer thread\n",
              "client", o.channels);
  std::printf("  %-34s %lld s (after %lld s warm-up), samples every %lld s\n", "measurement window",
              static_cast<long long>(o.duration.count()), static_cast<long long>(o.warmup.count()),
              static_cast<long long>(o.sample_every.count()));
  std::string extra;
  for (const std::string& a : o.coordinator_args) absl::StrAppend(&extra, " ", a);
  std::printf("  %-34s defaults (heartbeat 2 s, worker timeout 10 s, tick 100 ms)%s\n",
              "coordinator flags", extra.empty() ? "" : (", plus" + extra).c_str());
  std::printf("  %-34s %u cores, load average %s\n", "machine", std::thread::hardware_concurrency(),
              LoadAverage().c_str());
  std::fflush(stdout);
}

std::vector<std::unique_ptr<SimWorker>> RegisterWorkers(const Options& o, Load* load) {
  std::vector<std::unique_ptr<SimWorker>> workers;
  workers.reserve(static_cast<size_t>(o.workers));
  for (int i = 0; i < o.workers; ++i) {
    // Probes spread over the id range.
    const bool probe = o.probe_workers > 0 && i % std::max(1, o.workers / o.probe_workers) == 0 &&
                       i / std::max(1, o.workers / o.probe_workers) < o.probe_workers;
    workers.push_back(std::make_unique<SimWorker>(load, i, probe));
  }
  const Clock::time_point reg_start = Clock::now();
  std::mutex mu;
  std::condition_variable cv;
  int outstanding = 0;
  for (auto& w : workers) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return outstanding < o.register_concurrency; });
    ++outstanding;
    lock.unlock();
    w->Start([&](bool ok) {
      if (ok) {
        load->registered++;
      } else {
        load->registrations_failed++;
      }
      std::lock_guard<std::mutex> l(mu);
      --outstanding;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return outstanding == 0; });
  }
  const double reg_s = std::chrono::duration<double>(Clock::now() - reg_start).count();
  std::printf("\nregistered %lld workers in %.1f s (%.0f/s), %lld first tries failed (retried)\n",
              static_cast<long long>(load->registered.load()), reg_s,
              static_cast<double>(load->registered.load()) / reg_s,
              static_cast<long long>(load->registrations_failed.load()));
  return workers;
}

absl::StatusOr<Clock::time_point> StartLoadJobs(const Options& o, CoordinatorProcess& c,
                                                Load* load) {
  const Clock::time_point submit_start = Clock::now();
  for (int j = 0, left = o.ranks; left > 0; ++j) {
    const int n = std::min(left, o.ranks_per_job);
    left -= n;
    absl::StatusOr<std::string> id = testing::SubmitJob(c.stub.get(), c.handle.admin_token,
                                                        Spec(absl::StrCat("load-", j), n, "load"));
    if (!id.ok()) return id.status();
  }
  while (load->load_ranks_streaming.load() < o.ranks &&
         Clock::now() - submit_start < std::chrono::minutes(3)) {
    std::this_thread::sleep_for(milliseconds(100));
  }
  std::printf("submitted %d jobs; %lld of %d ranks joined and streaming after %.1f s\n",
              LoadJobs(o), static_cast<long long>(load->load_ranks_streaming.load()), o.ranks,
              std::chrono::duration<double>(Clock::now() - submit_start).count());
  std::fflush(stdout);
  return Clock::now();
}

std::string RunRendezvous(const Options& o, CoordinatorProcess& c, Load* load) {
  if (o.rendezvous_world <= 0) return "";
  {
    std::lock_guard<std::mutex> lock(load->rendezvous.mu);
    load->rendezvous.submitted = Clock::now();
  }
  absl::StatusOr<std::string> id = testing::SubmitJob(
      c.stub.get(), c.handle.admin_token, Spec("rendezvous", o.rendezvous_world, "rendezvous"));
  const std::string job = id.ok() ? *id : "(submit failed: " + id.status().ToString() + ")";
  const Clock::time_point give_up = Clock::now() + std::chrono::minutes(2);
  while (id.ok() && Clock::now() < give_up) {
    {
      std::lock_guard<std::mutex> lock(load->rendezvous.mu);
      if (load->rendezvous.answered + load->rendezvous.failed >= o.rendezvous_world) break;
    }
    std::this_thread::sleep_for(milliseconds(100));
  }
  const v1::Job ended =
      testing::WaitForJobEnd(c.stub.get(), c.handle.admin_token, job, std::chrono::seconds(60));
  std::printf("rendezvous job %s of %d ranks: %s\n", job.c_str(), o.rendezvous_world,
              v1::Job::State_Name(ended.state()).c_str());
  return job;
}

bool WarmUp(const Options& o, pid_t pid, Clock::time_point streaming_since) {
  const Clock::time_point end = streaming_since + o.warmup;
  std::printf("warm-up until %.0f s after the ranks started streaming:\n",
              static_cast<double>(o.warmup.count()));
  double cpu = CpuSeconds(pid);
  Clock::time_point t = Clock::now();
  while (Clock::now() < end) {
    std::this_thread::sleep_until(std::min(end, Clock::now() + o.sample_every));
    const double dt = std::chrono::duration<double>(Clock::now() - t).count();
    const double now_cpu = CpuSeconds(pid);
    std::printf("  %5.0f s: coordinator %.1f%% of a core, RSS %.1f MiB\n",
                std::chrono::duration<double>(Clock::now() - streaming_since).count(),
                dt > 0 ? 100.0 * (now_cpu - cpu) / dt : 0.0, ResidentMiB(pid).first);
    std::fflush(stdout);
    cpu = now_cpu;
    t = Clock::now();
  }
  const double ring_fill_s = static_cast<double>(kRecentSteps) / o.records_per_second;
  return std::chrono::duration<double>(Clock::now() - streaming_since).count() >= ring_fill_s;
}

}  // namespace aidn::bench
