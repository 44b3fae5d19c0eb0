#include "bench/coordinator/report.h"

#include <algorithm>
#include <cstdio>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace aidn::bench {
namespace {

void Row(const char* name, const Summary& s, int64_t failed) {
  std::printf("  %-46s %8zu %8.1f %8.1f %8.1f %8lld\n", name, s.count, s.p50, s.p99, s.max,
              static_cast<long long>(failed));
}

void Target(const std::string& name, const std::string& figure, const std::string& bar, bool pass) {
  std::printf("%-48s %-30s %-30s %s\n", name.c_str(), figure.c_str(), bar.c_str(),
              pass ? "PASS" : "MISS");
}

// CPU flat: the coordinator's CPU per call answered in the last interval
// within 25 % of the first (its CPU % follows what the other processes on
// the host leave it once it is short of CPU; the offered load is fixed),
// or its CPU % within 5 points of the first (at a light load the ticker's
// fixed cost makes the per-call figure noisy).
// RSS flat: within 10 % (or 8 MiB) of the window's start.
struct Flatness {
  double cpu_first = 0, cpu_last = 0, us_first = 0, us_last = 0;
  double rss_first = 0, rss_last = 0, rss_max = 0;
  bool cpu_flat = false, rss_flat = false;
};

Flatness JudgeFlatness(const std::vector<Sample>& samples) {
  Flatness f;
  f.cpu_first = samples.size() > 1 ? samples[1].cpu_pct : 0;
  f.cpu_last = samples.back().cpu_pct;
  f.us_first = samples.size() > 1 ? samples[1].us_per_call : 0;
  f.us_last = samples.back().us_per_call;
  f.rss_first = samples.front().rss_mib;
  f.rss_last = samples.back().rss_mib;
  for (const Sample& s : samples) f.rss_max = std::max(f.rss_max, s.rss_mib);
  f.cpu_flat = f.us_last <= f.us_first * 1.25 || f.cpu_last <= f.cpu_first + 5;
  f.rss_flat = f.rss_last <= std::max(f.rss_first * 1.10, f.rss_first + 8);
  return f;
}

// The coordinator's targets: CPU and RSS flat over the window.
void PrintFlatnessTargets(const Options& o, const WindowResult& w, bool rings_full) {
  const Flatness f = JudgeFlatness(w.samples);
  const std::string rss_figure =
      absl::StrFormat("%.1f -> %.1f MiB (max %.1f)", f.rss_first, f.rss_last, f.rss_max);
  Target("coordinator CPU flat (per call, first vs last)",
         absl::StrFormat("%.0f -> %.0f us (%.0f%% -> %.0f%%)", f.us_first, f.us_last, f.cpu_first,
                         f.cpu_last),
         "<= 1.25x, or % within +5", f.cpu_flat);
  if (rings_full || o.ranks == 0) {
    Target("coordinator RSS flat (window start vs end)", rss_figure, "end <= max(1.10x, +8 MiB)",
           f.rss_flat);
  } else {
    const double ring_fill_s = static_cast<double>(kRecentSteps) / o.records_per_second;
    std::printf("%-48s %-30s %-30s %s\n", "coordinator RSS flat (window start vs end)",
                rss_figure.c_str(), "end <= max(1.10x, +8 MiB)", "n/a");
    std::printf(
        "  (not judged: the jobs' step rings fill for %.0f s of streaming, the warm-up "
        "was shorter; --warmup=auto waits)\n",
        ring_fill_s);
  }
}

}  // namespace

WindowLatencies SummarizeWindow(const Load& load) {
  WindowLatencies l;
  l.heartbeat = load.heartbeat_now.Since(0);
  l.heartbeat_late = load.heartbeat_late.Since(0);
  l.metrics = load.metrics.Since(0);
  l.progress = load.progress.Since(0);
  l.exits = load.exit_reports.Since(0);
  l.joins = load.join.Since(0);
  return l;
}

void PrintLatencies(const Load& load, const WindowLatencies& l, const WindowResult& w) {
  std::printf("\nlatencies over the window (client side; ms)      %8s %8s %8s %8s %8s\n", "calls",
              "p50", "p99", "max", "failed");
  Row("Heartbeat answered at once (probes, firsts)", l.heartbeat,
      load.heartbeat_now.window_failures());
  Row("Heartbeat held: lateness past max_wait", l.heartbeat_late, 0);
  Row("StreamMetrics (one batch per call)", l.metrics, load.metrics.window_failures());
  Row("ReportProgress", l.progress, load.progress.window_failures());
  std::printf(
      "  (the coordinator looks for held heartbeats past their deadline every 5 ms, so a few\n"
      "   ms late is the design; the rest is waiting for CPU)\n");
  std::printf(
      "  heartbeats answered %lld (whole run); held ones answered early, their assignments "
      "changed: %lld\n",
      static_cast<long long>(load.heartbeats.load()), static_cast<long long>(load.woken.load()));
  const int64_t calls =
      static_cast<int64_t>(l.heartbeat.count + l.heartbeat_late.count + l.metrics.count +
                           l.progress.count + l.exits.count + l.joins.count) +
      load.woken.load() + load.heartbeat_now.window_failures() + load.metrics.window_failures() +
      load.progress.window_failures() + load.join.window_failures() +
      load.exit_reports.window_failures();
  std::printf("  coordinator CPU per call answered: %.0f us (%.1f s of CPU, %lld calls, %.0f/s)\n",
              calls > 0 ? 1e6 * w.cpu_in_window / static_cast<double>(calls) : 0.0, w.cpu_in_window,
              static_cast<long long>(calls), static_cast<double>(calls) / w.window_s);
  std::printf(
      "  call failures over the whole run: heartbeat %s; metrics %s; progress %s; join %s; "
      "exit reports %s\n",
      load.heartbeat_now.FailureText().c_str(), load.metrics.FailureText().c_str(),
      load.progress.FailureText().c_str(), load.join.FailureText().c_str(),
      load.exit_reports.FailureText().c_str());
}

void PrintCoordinatorSamples(const WindowResult& w) {
  std::printf("\ncoordinator over the window (since the previous sample)\n");
  std::printf("  %8s %12s %12s %10s %10s\n", "t_s", "cpu_%core", "cpu_us/call", "rss_MiB",
              "anon_MiB");
  for (const Sample& s : w.samples) {
    std::printf("  %8.0f %12.1f %12.0f %10.1f %10.1f\n", s.t_s, s.cpu_pct, s.us_per_call, s.rss_mib,
                s.anon_mib);
  }
}

RendezvousFigures PrintRendezvous(const Options& o, Load* load, const std::string& job,
                                  const Verdict& v) {
  RendezvousTrace& r = load->rendezvous;
  double rdv_spread_ms = -1, rdv_tail_ms = -1, rdv_submit_ms = -1;
  RendezvousFigures figures;
  std::lock_guard<std::mutex> lock(r.mu);
  figures.answered = r.answered;
  if (r.answered > 0) {
    auto ms = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    figures.ms = ms(r.first_join_sent, r.last_answer);
    rdv_spread_ms = ms(r.first_join_sent, r.last_join_sent);
    rdv_tail_ms = ms(r.last_join_sent, r.last_answer);
    rdv_submit_ms = ms(r.submitted, r.first_join_sent);
  }
  const Summary waits = Summarize(r.waits_ms);
  if (o.rendezvous_world > 0) {
    std::printf(
        "\nrendezvous of %s (%d ranks): %d joins sent, %d answered, %d failed%s%s\n"
        "  submit -> first join sent %.0f ms (assignment reaches a worker); first join sent -> "
        "last join sent %.0f ms; last join sent -> last answer %.0f ms; job now %s\n"
        "  each rank's join -> answer: p50 %.0f ms, max %.0f ms; an answer is %.1f KB "
        "(taken unparsed)\n",
        job.c_str(), o.rendezvous_world, r.joins_sent, r.answered, r.failed,
        r.first_error.empty() ? "" : ": ", r.first_error.c_str(), rdv_submit_ms, rdv_spread_ms,
        rdv_tail_ms, v.rendezvous_job_state.c_str(), waits.p50, waits.max,
        static_cast<double>(r.answer_bytes) / 1024.0);
  }
  return figures;
}

void PrintFalseFailures(const Verdict& v, const Load& load) {
  std::printf(
      "\nfalse failures (coordinator's own record%s):\n"
      "  workers listed %d, LOST now %d; events: worker.lost %d, worker.back %d, "
      "worker.reregistered %d\n"
      "  events: job.restarting %d, job.failed %d, job.hang %d, rendezvous.timeout %d; jobs' "
      "restarts %lld, jobs FAILED %d\n"
      "  client side: heartbeats answered NOT_FOUND (registered again) %lld, trainers told "
      "superseded %lld, trainers failed %lld\n",
      (v.read_ok ? std::string() : ", INCOMPLETE: " + v.error).c_str(), v.workers_listed,
      v.workers_lost_now, v.events.at("worker.lost"), v.events.at("worker.back"),
      v.events.at("worker.reregistered"), v.events.at("job.restarting"), v.events.at("job.failed"),
      v.events.at("job.hang"), v.events.at("rendezvous.timeout"),
      static_cast<long long>(v.restarts), v.jobs_failed,
      static_cast<long long>(load.reregistrations.load()),
      static_cast<long long>(load.trainers_superseded.load()),
      static_cast<long long>(load.trainer_failures.load()));
}

void PrintTargets(const Options& o, const Load& load, const WindowLatencies& l,
                  const WindowResult& w, bool rings_full, const Verdict& v,
                  const RendezvousFigures& rendezvous) {
  const double records_per_s = static_cast<double>(w.records_in_window) / w.window_s;
  const double want_records = static_cast<double>(o.ranks) * o.records_per_second;
  const int64_t lost_events = v.events.at("worker.lost");
  const int64_t failed_generations = v.events.at("job.restarting") + v.events.at("job.failed");
  const int64_t streaming = load.load_ranks_streaming.load();
  std::printf("\n%-48s %-30s %-30s %s\n", "target", "figure", "bar", "");
  Target("workers registered and heartbeating",
         absl::StrCat(v.workers_listed - v.workers_lost_now, " of ", o.workers),
         absl::StrCat(o.workers), v.workers_listed - v.workers_lost_now == o.workers);
  Target("ranks streaming metrics",
         absl::StrFormat("%d of %d, %.0f records/s", static_cast<int>(streaming), o.ranks,
                         records_per_s),
         absl::StrFormat(">= 95%% of %.0f records/s", want_records),
         streaming >= o.ranks && records_per_s >= 0.95 * want_records);
  Target("heartbeat latency p99 (answered at once)", absl::StrFormat("%.1f ms", l.heartbeat.p99),
         "< 50 ms", l.heartbeat.count > 0 && l.heartbeat.p99 < 50);
  Target("heartbeat latency max (answered at once)", absl::StrFormat("%.1f ms", l.heartbeat.max),
         "< 2000 ms (the interval)", l.heartbeat.count > 0 && l.heartbeat.max < 2000);
  Target("held heartbeat lateness p99", absl::StrFormat("%.1f ms", l.heartbeat_late.p99),
         "< 250 ms (bench's bar)", l.heartbeat_late.count == 0 || l.heartbeat_late.p99 < 250);
  Target("StreamMetrics latency p99", absl::StrFormat("%.1f ms", l.metrics.p99),
         "< 250 ms (bench's bar)", o.ranks == 0 || (l.metrics.count > 0 && l.metrics.p99 < 250));
  Target("ReportProgress latency p99", absl::StrFormat("%.1f ms", l.progress.p99),
         "< 250 ms (bench's bar)", o.ranks == 0 || (l.progress.count > 0 && l.progress.p99 < 250));
  PrintFlatnessTargets(o, w, rings_full);
  Target("workers declared lost", absl::StrCat(lost_events, " (", v.workers_lost_now, " now)"), "0",
         v.read_ok && lost_events == 0 && v.workers_lost_now == 0);
  Target("generations failed", absl::StrCat(failed_generations, " (restarts ", v.restarts, ")"),
         "0", v.read_ok && failed_generations == 0 && v.restarts == 0 && v.jobs_failed == 0);
  if (o.rendezvous_world > 0) {
    Target(absl::StrCat("rendezvous of ", o.rendezvous_world, " ranks"),
           rendezvous.answered == o.rendezvous_world
               ? absl::StrFormat("%.0f ms", rendezvous.ms)
               : absl::StrCat(rendezvous.answered, " answered"),
           "< 2000 ms", rendezvous.answered == o.rendezvous_world && rendezvous.ms < 2000);
  }
  std::fflush(stdout);
}

}  // namespace aidn::bench
