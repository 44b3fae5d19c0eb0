#ifndef AIDN_COORDINATOR_FAILURE_DETECTOR_H_
#define AIDN_COORDINATOR_FAILURE_DETECTOR_H_

// Failure detection: which workers are lost, which placed job lost a worker
// or timed out its rendezvous, which running generation hangs (and which
// ranks are to blame), and which ranks are stragglers. It decides and
// explains; the coordinator acts (fails the generation, records events).
//
// Not thread-safe: the coordinator's mutex guards it and the JobHealth of
// every job. Time is passed in, so tests drive it with a FakeClock.

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "aidn/v1/cluster.pb.h"
#include "aidn/v1/job.pb.h"
#include "common/clock.h"

namespace aidn::coordinator {

class Rendezvous;

// One job's health as seen by the failure detector, for its current
// generation.
struct JobHealth {
  // The last progress beat of each rank.
  struct Beat {
    int64_t step = -1;
    int64_t collective_seq = 0;
    Clock::TimePoint at{};
  };
  std::map<int, Beat> beats;
  // When a rank's step last went up, or the generation started running
  // (or the coordinator did): the progress deadline runs from here, not
  // from the last beat, since beats go on while training is stuck.
  Clock::TimePoint last_advance{};
  // When the generation started running (or the coordinator did).
  Clock::TimePoint running_since{};
  // Stragglers: each rank's newest TRAIN step times, whether they changed
  // since the last look, and the ranks reported as stragglers now.
  std::map<int, std::deque<double>> step_window;
  bool step_window_changed = false;
  std::set<int> stragglers;
  // Per rank: TRAIN samples taken into step_window so far, and that count
  // when its straggler state last changed.
  std::map<int, int64_t> step_samples;
  std::map<int, int64_t> straggler_changed_at;

  // A generation starts running (or is placed): beats are forgotten and the
  // progress deadline runs from `now`.
  void Restart(Clock::TimePoint now);
  // The generation ended: beats and straggler state are forgotten.
  void Clear();
};

// A worker as the detector sees it.
struct WorkerLiveness {
  v1::Worker::State state = v1::Worker::ALIVE;
  Clock::TimePoint last_seen{};
};

// A rank that became, or stopped being, a straggler.
struct StragglerChange {
  int rank = 0;
  bool slow = false;
  std::string message;
};

struct FailureDetectorOptions {
  // A worker silent this long is declared lost.
  std::chrono::milliseconds worker_timeout{10'000};
  // How often trainers send progress beats; a rank without one for three
  // of these is silent.
  std::chrono::milliseconds trainer_beat_interval{1000};
};

class FailureDetector {
 public:
  // The automatic progress timeout: at least this, and this many median steps.
  static constexpr std::chrono::milliseconds kMinAutoProgressTimeout{60'000};
  static constexpr double kAutoProgressSteps = 10;
  // Stragglers: the window of step times per rank, how many a rank needs
  // before it is judged, and how much slower than the others' median is
  // too slow. A straggler recovers below kRecoveredRatio, and a rank's
  // state changes at most once per window of its own new steps, so noise
  // around the ratio does not flap.
  static constexpr size_t kStragglerWindow = 50;
  static constexpr size_t kStragglerMinSamples = 20;
  static constexpr double kStragglerRatio = 1.5;
  static constexpr double kRecoveredRatio = 1.2;

  explicit FailureDetector(const FailureDetectorOptions& options) : options_(options) {}

  // An alive worker silent longer than worker_timeout: how long it was
  // silent; nullopt while it is not lost.
  std::optional<std::chrono::milliseconds> WorkerSilence(const WorkerLiveness& worker,
                                                         Clock::TimePoint now) const;

  // The job's worker timeout: the spec's, else worker_timeout.
  std::chrono::milliseconds JobWorkerTimeout(const v1::Job& job) const;

  // Why the placed job cannot go on for want of a worker (one unknown, lost,
  // or silent past the job's own timeout), "" if all are well. `lookup`
  // says what is known of a worker, nullopt for an unknown one.
  using WorkerLookup = std::function<std::optional<WorkerLiveness>(const std::string& id)>;
  std::string PlacementFailure(const v1::Job& job, const WorkerLookup& lookup,
                               Clock::TimePoint now) const;

  // The reason a SCHEDULED job's rendezvous failed its deadline, nullopt
  // while it has time (or completed).
  static std::optional<std::string> RendezvousTimeout(const v1::Job& job,
                                                      const Rendezvous& rendezvous,
                                                      Clock::TimePoint now);

  // A progress beat of `rank`.
  static void Beat(JobHealth* health, int rank, int64_t step, int64_t collective_seq,
                   Clock::TimePoint now);

  // The job's progress timeout: the spec's, or the larger of a minute and
  // ten times the median of `recent_step_seconds` (the newest steps).
  static std::chrono::milliseconds ProgressTimeout(const v1::Job& job,
                                                   const std::deque<double>* recent_step_seconds);

  // The reason a RUNNING generation hangs (no step taken within the
  // progress timeout; until every rank beat once, at least the automatic
  // minimum), naming the culprit ranks; nullopt while it makes progress.
  std::optional<std::string> Hang(const v1::Job& job, const JobHealth& health,
                                  const std::deque<double>* recent_step_seconds,
                                  Clock::TimePoint now) const;

  // Why a generation without progress for `timeout` hangs, naming the
  // culprit ranks: silent ones first, else the ranks behind the others.
  std::string HangReport(const v1::Job& job, const JobHealth& health, Clock::TimePoint now,
                         std::chrono::milliseconds timeout) const;

  // One TRAIN step of `rank` took `seconds` (what the rank itself spent).
  static void AddStepTime(JobHealth* health, int rank, double seconds);

  // The ranks whose straggler state changed since the last look (and
  // records it in `health`).
  static std::vector<StragglerChange> CheckStragglers(JobHealth* health);

 private:
  const FailureDetectorOptions options_;
};

// The worker running `rank` of the job's current placement, "" if none.
std::string WorkerOfRank(const v1::Job& job, int rank);

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_FAILURE_DETECTOR_H_
