#include "coordinator/failure_detector.h"

#include <algorithm>
#include <functional>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "coordinator/rendezvous.h"
#include "coordinator/time_util.h"

namespace aidn::coordinator {
namespace {

using std::chrono::milliseconds;

// A hung generation's rank is "silent" after this many beat intervals
// without a beat.
constexpr int kSilentBeats = 3;
// At most this many ranks are named in a message.
constexpr size_t kMaxNamed = 16;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  const double upper = v[mid];
  if (v.size() % 2 == 1) return upper;
  const double lower = *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid));
  return (lower + upper) / 2;
}

// The median of `sorted` without its element at index `skip`.
double MedianWithout(const std::vector<double>& sorted, size_t skip) {
  const size_t n = sorted.size() - 1;
  auto at = [&](size_t j) { return sorted[j < skip ? j : j + 1]; };
  if (n % 2 == 1) return at(n / 2);
  return (at(n / 2 - 1) + at(n / 2)) / 2;
}

// "rank 3" or "ranks 0, 1, 2".
std::string RankList(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < kMaxNamed; ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ", ", ranks[i]);
  }
  if (ranks.size() > kMaxNamed) absl::StrAppend(&out, " and ", ranks.size() - kMaxNamed, " more");
  return out;
}

// Where a rank is: (step, collective), furthest first.
using Position = std::pair<int64_t, int64_t>;
using RanksByPosition = std::map<Position, std::vector<int>, std::greater<>>;

std::string Where(const Position& p) {
  return absl::StrCat("step ", p.first, ", collective ", p.second);
}

// The parts of a hang report after its opening: the silent ranks and where
// the others wait, or, when none is silent, which ranks are behind.
std::vector<std::string> HangParts(const std::vector<std::string>& silent,
                                   const RanksByPosition& at) {
  std::vector<std::string> parts;
  if (!silent.empty()) {
    parts.push_back(absl::StrJoin(silent, ", "));
    for (const auto& [pos, ranks] : at) {
      parts.push_back(absl::StrCat(RankList(ranks), " waiting at ", Where(pos)));
    }
  } else if (at.size() <= 1) {
    // Everyone beats from the same place: no rank to blame.
    parts.push_back(at.empty() ? "no rank reported"
                               : absl::StrCat("all ranks at ", Where(at.begin()->first)));
  } else {
    // Those behind the furthest in step or collective are where it hangs.
    for (auto it = std::next(at.begin()); it != at.end(); ++it) {
      parts.push_back(absl::StrCat(RankList(it->second), " behind at ", Where(it->first)));
    }
    parts.push_back(
        absl::StrCat(RankList(at.begin()->second), " waiting at ", Where(at.begin()->first)));
  }
  return parts;
}

}  // namespace

void JobHealth::Restart(Clock::TimePoint now) {
  beats.clear();
  last_advance = now;
  running_since = now;
}

void JobHealth::Clear() {
  beats.clear();
  step_window.clear();
  step_window_changed = false;
  stragglers.clear();
  step_samples.clear();
  straggler_changed_at.clear();
}

std::optional<milliseconds> FailureDetector::WorkerSilence(const WorkerLiveness& worker,
                                                           Clock::TimePoint now) const {
  if (worker.state != v1::Worker::ALIVE) return std::nullopt;
  const auto silent = std::chrono::duration_cast<milliseconds>(now - worker.last_seen);
  if (silent <= options_.worker_timeout) return std::nullopt;
  return silent;
}

milliseconds FailureDetector::JobWorkerTimeout(const v1::Job& job) const {
  const milliseconds ms = ToMillis(job.spec().timeouts().worker());
  return ms.count() > 0 ? ms : options_.worker_timeout;
}

std::string FailureDetector::PlacementFailure(const v1::Job& job, const WorkerLookup& lookup,
                                              Clock::TimePoint now) const {
  const milliseconds job_timeout = JobWorkerTimeout(job);
  for (const v1::RankPlacement& p : job.placement()) {
    const std::optional<WorkerLiveness> worker = lookup(p.worker_id());
    if (!worker.has_value()) return absl::StrCat("worker ", p.worker_id(), " is unknown");
    const auto silent = std::chrono::duration_cast<milliseconds>(now - worker->last_seen);
    if (worker->state == v1::Worker::LOST) {
      return absl::StrCat("worker ", p.worker_id(), " lost (no heartbeat for ",
                          FormatMillis(silent), ") with rank ", p.rank());
    }
    if (silent > job_timeout) {
      return absl::StrCat("worker ", p.worker_id(), " silent for ", FormatMillis(silent),
                          " (job's worker timeout ", FormatMillis(job_timeout), ") with rank ",
                          p.rank());
    }
  }
  return "";
}

std::optional<std::string> FailureDetector::RendezvousTimeout(const v1::Job& job,
                                                              const Rendezvous& rendezvous,
                                                              Clock::TimePoint now) {
  if (job.state() != v1::Job::SCHEDULED || rendezvous.completed() || now < rendezvous.deadline()) {
    return std::nullopt;
  }
  return absl::StrCat("rendezvous of ", job.id(), " generation ", job.generation(),
                      " timed out after ",
                      FormatMillis(ToMillis(job.spec().timeouts().rendezvous())),
                      ": missing ranks ", absl::StrJoin(rendezvous.MissingRanks(), ", "));
}

void FailureDetector::Beat(JobHealth* health, int rank, int64_t step, int64_t collective_seq,
                           Clock::TimePoint now) {
  JobHealth::Beat& beat = health->beats[rank];
  if (step > beat.step) health->last_advance = now;
  beat.step = step;
  beat.collective_seq = collective_seq;
  beat.at = now;
}

milliseconds FailureDetector::ProgressTimeout(const v1::Job& job,
                                              const std::deque<double>* recent_step_seconds) {
  const milliseconds set = ToMillis(job.spec().timeouts().progress());
  if (set.count() > 0) return set;
  milliseconds timeout = kMinAutoProgressTimeout;
  if (recent_step_seconds != nullptr) {
    const double median = Median({recent_step_seconds->begin(), recent_step_seconds->end()});
    const auto steps = std::chrono::duration_cast<milliseconds>(
        std::chrono::duration<double>(kAutoProgressSteps * median));
    timeout = std::max(timeout, steps);
  }
  return timeout;
}

std::optional<std::string> FailureDetector::Hang(const v1::Job& job, const JobHealth& health,
                                                 const std::deque<double>* recent_step_seconds,
                                                 Clock::TimePoint now) const {
  if (job.state() != v1::Job::RUNNING) return std::nullopt;
  // A command job's program reports progress only if it uses the client
  // library; until it does, it is judged by liveness alone (its process
  // exits, its worker's heartbeats).
  if (job.spec().has_command() && health.beats.empty()) return std::nullopt;
  milliseconds timeout = ProgressTimeout(job, recent_step_seconds);
  // Until every rank has beaten once the ranks are still setting up
  // (loading data, a checkpoint, connecting to each other): that gets at
  // least the automatic minimum, however short the spec's timeout.
  if (static_cast<int>(health.beats.size()) < job.spec().world_size()) {
    timeout = std::max(timeout, kMinAutoProgressTimeout);
  }
  if (now - health.last_advance <= timeout) return std::nullopt;
  return HangReport(job, health, now, timeout);
}

std::string FailureDetector::HangReport(const v1::Job& job, const JobHealth& health,
                                        Clock::TimePoint now, milliseconds timeout) const {
  const auto silent_after = kSilentBeats * options_.trainer_beat_interval;
  int64_t top_step = -1;
  for (const auto& [rank, beat] : health.beats) top_step = std::max(top_step, beat.step);
  std::string reason = absl::StrCat("no progress for ", FormatMillis(timeout));
  if (top_step >= 0) {
    absl::StrAppend(&reason, " at step ", top_step, ": ");
  } else {
    absl::StrAppend(&reason, " since the generation started: ");
  }
  // Ranks whose beats stopped (a stopped or wedged process) are the culprits;
  // the others are waiting for them in a collective, placed by where they are.
  std::vector<std::string> silent;
  RanksByPosition at;
  for (int r = 0; r < job.spec().world_size(); ++r) {
    auto it = health.beats.find(r);
    if (it == health.beats.end()) {
      const auto quiet = std::chrono::duration_cast<milliseconds>(now - health.running_since);
      silent.push_back(
          absl::StrCat("rank ", r, " silent for ", FormatMillis(quiet), " (no beat yet)"));
      continue;
    }
    const JobHealth::Beat& b = it->second;
    const auto quiet = std::chrono::duration_cast<milliseconds>(now - b.at);
    if (quiet > silent_after) {
      silent.push_back(absl::StrCat("rank ", r, " silent for ", FormatMillis(quiet),
                                    " (last beat at step ", b.step, ", collective ",
                                    b.collective_seq, ")"));
    } else {
      at[{b.step, b.collective_seq}].push_back(r);
    }
  }
  if (silent.size() > kMaxNamed) {
    const size_t more = silent.size() - kMaxNamed;
    silent.resize(kMaxNamed);
    silent.push_back(absl::StrCat("and ", more, " more silent"));
  }
  absl::StrAppend(&reason, absl::StrJoin(HangParts(silent, at), "; "));
  return reason;
}

void FailureDetector::AddStepTime(JobHealth* health, int rank, double seconds) {
  std::deque<double>& window = health->step_window[rank];
  window.push_back(seconds);
  if (window.size() > kStragglerWindow) window.pop_front();
  ++health->step_samples[rank];
  health->step_window_changed = true;
}

std::vector<StragglerChange> FailureDetector::CheckStragglers(JobHealth* health) {
  health->step_window_changed = false;
  std::vector<std::pair<int, double>> medians;
  for (const auto& [rank, window] : health->step_window) {
    if (window.size() >= kStragglerMinSamples) {
      medians.emplace_back(rank, Median({window.begin(), window.end()}));
    }
  }
  if (medians.size() < 2) return {};
  std::vector<double> sorted;
  for (const auto& [rank, m] : medians) sorted.push_back(m);
  std::sort(sorted.begin(), sorted.end());
  std::vector<StragglerChange> changes;
  for (const auto& [rank, m] : medians) {
    const size_t index = std::lower_bound(sorted.begin(), sorted.end(), m) - sorted.begin();
    const double others = MedianWithout(sorted, index);
    const bool was_slow = health->stragglers.contains(rank);
    const bool slow = was_slow ? m >= kRecoveredRatio * others : m > kStragglerRatio * others;
    if (slow == was_slow) continue;
    const int64_t samples_now = health->step_samples[rank];
    auto changed = health->straggler_changed_at.find(rank);
    if (changed != health->straggler_changed_at.end() &&
        samples_now - changed->second < static_cast<int64_t>(kStragglerWindow)) {
      continue;
    }
    health->straggler_changed_at[rank] = samples_now;
    const size_t samples = health->step_window.at(rank).size();
    std::string message = absl::StrFormat(
        "rank %d: median compute time %.3gs over its last %d steps, the other ranks' %.3gs", rank,
        m, samples, others);
    if (others > 0) absl::StrAppend(&message, absl::StrFormat(" (%.2fx)", m / others));
    if (slow) {
      health->stragglers.insert(rank);
    } else {
      health->stragglers.erase(rank);
    }
    changes.push_back({rank, slow, std::move(message)});
  }
  return changes;
}

std::string WorkerOfRank(const v1::Job& job, int rank) {
  for (const v1::RankPlacement& p : job.placement()) {
    if (p.rank() == rank) return p.worker_id();
  }
  return "";
}

}  // namespace aidn::coordinator
