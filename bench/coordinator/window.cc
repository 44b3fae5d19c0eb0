#include "bench/coordinator/window.h"

#include <algorithm>
#include <cstdio>
#include <thread>
#include <tuple>

#include "bench/coordinator/coordinator_process.h"

namespace aidn::bench {
namespace {

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The window's samples of the coordinator, and a printed row per interval.
class Sampler {
 public:
  Sampler(pid_t pid, Load* load)
      : pid_(pid),
        load_(load),
        last_cpu_(CpuSeconds(pid)),
        last_bench_cpu_(CpuSeconds(0)),
        last_t_(Clock::now()),
        start_(Clock::now()),
        last_calls_(load->calls_done.load()) {}

  Clock::time_point start() const { return start_; }
  const std::vector<Sample>& samples() const { return samples_; }

  // A sample since the previous one (or since construction).
  Sample Take();
  // The figures printed per interval count from here.
  void StartIntervals() {
    hb_count_ = load_->heartbeats.load();
    records_ = load_->records_sent.load();
  }
  // The row of an interval `dt` seconds long that ends with `s`.
  void PrintInterval(const Sample& s, double dt);

 private:
  const pid_t pid_;
  Load* const load_;
  double last_cpu_;
  double last_bench_cpu_;
  Clock::time_point last_t_;
  const Clock::time_point start_;
  int64_t last_calls_;
  std::vector<Sample> samples_;
  size_t hb_from_ = 0, late_from_ = 0, metrics_from_ = 0;
  int64_t hb_count_ = 0, records_ = 0;
};

Sample Sampler::Take() {
  const Clock::time_point now = Clock::now();
  const double cpu = CpuSeconds(pid_);
  const int64_t calls_now = load_->calls_done.load();
  const double bench_cpu = CpuSeconds(0);
  const double dt = std::chrono::duration<double>(now - last_t_).count();
  Sample s;
  s.t_s = std::chrono::duration<double>(now - start_).count();
  s.cpu_pct = dt > 0 ? 100.0 * (cpu - last_cpu_) / dt : 0;
  s.bench_cpu_pct = dt > 0 ? 100.0 * (bench_cpu - last_bench_cpu_) / dt : 0;
  s.us_per_call = calls_now > last_calls_
                      ? 1e6 * (cpu - last_cpu_) / static_cast<double>(calls_now - last_calls_)
                      : 0;
  std::tie(s.rss_mib, s.anon_mib) = ResidentMiB(pid_);
  s.loadavg = LoadAverage();
  last_calls_ = calls_now;
  last_cpu_ = cpu;
  last_bench_cpu_ = bench_cpu;
  last_t_ = now;
  samples_.push_back(s);
  return s;
}

void Sampler::PrintInterval(const Sample& s, double dt) {
  const Summary hb = load_->heartbeat_now.Since(hb_from_);
  const Summary late = load_->heartbeat_late.Since(late_from_);
  const Summary m = load_->metrics.Since(metrics_from_);
  hb_from_ = load_->heartbeat_now.size();
  late_from_ = load_->heartbeat_late.size();
  metrics_from_ = load_->metrics.size();
  const int64_t hb_now = load_->heartbeats.load();
  const int64_t rec_now = load_->records_sent.load();
  std::printf("%7.0f %9.0f %9.1f %9.1f %9.0f %11.1f %8.1f %8.0f %9.1f %8.1f %s\n", s.t_s,
              static_cast<double>(hb_now - hb_count_) / dt, hb.p99, late.p99,
              static_cast<double>(rec_now - records_) / dt, m.p99, s.cpu_pct, s.us_per_call,
              s.rss_mib, s.bench_cpu_pct, s.loadavg.c_str());
  std::fflush(stdout);
  hb_count_ = hb_now;
  records_ = rec_now;
}

}  // namespace

WindowResult MeasureWindow(const Options& o, pid_t pid, Load* load) {
  Sampler sampler(pid, load);
  const Clock::time_point window_start = sampler.start();
  load->window.Open();
  const int64_t records_at_open = load->records_sent.load();
  const double cpu_at_open = CpuSeconds(pid);
  sampler.Take();
  std::printf("\nmeasurement window opened (coordinator RSS %.1f MiB)\n",
              sampler.samples()[0].rss_mib);
  std::printf("%7s %9s %9s %9s %9s %11s %8s %8s %9s %8s %s\n", "t_s", "hb/s", "hb_p99ms",
              "late_p99", "metr/s", "metr_p99ms", "coord%", "us/call", "rss_MiB", "bench%",
              "loadavg");
  std::fflush(stdout);

  const Clock::time_point window_end = window_start + o.duration;
  Clock::time_point next_sample = window_start + o.sample_every;
  sampler.StartIntervals();
  Clock::time_point interval_start = window_start;
  while (Clock::now() < window_end) {
    const Clock::time_point wake = std::min({next_sample, window_end, Clock::now() + seconds(1)});
    std::this_thread::sleep_until(wake);
    if (Clock::now() >= next_sample && Clock::now() < window_end) {
      const Sample s = sampler.Take();
      sampler.PrintInterval(s, SecondsSince(interval_start));
      interval_start = Clock::now();
      next_sample += o.sample_every;
    }
  }
  load->window.Close();
  WindowResult result;
  result.records_in_window = load->records_sent.load() - records_at_open;
  result.cpu_in_window = CpuSeconds(pid) - cpu_at_open;
  {
    const Sample s = sampler.Take();
    sampler.PrintInterval(s, SecondsSince(interval_start));
  }
  result.window_s = SecondsSince(window_start);
  result.samples = sampler.samples();
  return result;
}

}  // namespace aidn::bench
