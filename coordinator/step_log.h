#ifndef AIDN_COORDINATOR_STEP_LOG_H_
#define AIDN_COORDINATOR_STEP_LOG_H_

// One job's metrics as the coordinator keeps them in memory: the ranks'
// records of steps still in flight, combined into StepMetrics in step order
// once every rank has reported (or once waiting longer would only hide the
// step: the generation ended, or the step has waited `max_wait`), and the
// most recent combined steps, numbered, for watchers.
//
// Not thread-safe: the coordinator calls it under its mutex.

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "aidn/v1/job.pb.h"
#include "common/clock.h"

namespace aidn::coordinator {

struct StepLogOptions {
  // Combined steps kept in memory for watchers; older ones are read back
  // from the store.
  size_t recent_steps = 4096;
  // A step still missing ranks after this long is combined from the ranks
  // that reported (ranks_reported < world_size tells).
  std::chrono::milliseconds max_wait{10'000};
  // Bound on steps in flight; beyond it the oldest are combined at once.
  size_t max_pending = 65'536;
};

class StepLog {
 public:
  explicit StepLog(const StepLogOptions& options);

  // A generation with `world_size` ranks starts: steps in flight from the
  // one before are combined as they are, and step numbers may go back (a
  // restart resumes from a checkpoint).
  void StartGeneration(int64_t generation, int world_size);

  // One rank's record (rank and generation set, generation current). Steps
  // that became complete are appended to the log. Returns false, dropping
  // it, for a record of a step already combined (it came too late) or of a
  // rank out of range.
  bool Add(const v1::MetricRecord& record, Clock::TimePoint now);

  // The generation's TRAIN steps from `first_train_step` on are still to
  // come, all of them: a step is combined only once every TRAIN step before
  // it was (or it waited max_wait). For a coordinator that restarted in the
  // middle of a generation, whose trainers send the steps it lost again
  // after (some of) their newer ones. Until StartGeneration.
  void ExpectFrom(int64_t first_train_step);

  // Combines the steps that waited longer than max_wait (all of them when
  // `everything`), whatever ranks they miss.
  void Expire(Clock::TimePoint now, bool everything);

  // Combined steps are numbered from 1 in the order they were combined.
  int64_t last_seq() const { return next_seq_ - 1; }
  // The oldest number still in memory (last_seq() + 1 when none is).
  int64_t first_seq() const { return next_seq_ - static_cast<int64_t>(recent_.size()); }
  // Steps numbered after `after_seq` with step >= from_step, at most
  // `limit`; sets *last to the number of the last one looked at (so a
  // caller skipping steps below from_step still moves on). False when
  // numbers after `after_seq` are no longer in memory.
  bool After(int64_t after_seq, int64_t from_step, size_t limit, std::vector<v1::StepMetrics>* out,
             int64_t* last) const;

  // Combined steps not yet taken by the store writer; TakeUnstored empties
  // the list and returns the highest number taken.
  int64_t TakeUnstored(std::vector<v1::StepMetrics>* out);
  bool has_unstored() const { return !unstored_.empty(); }

  // The newest combined TRAIN and EVAL steps (nullptr before the first).
  const v1::StepMetrics* last_train() const { return has_train_ ? &last_train_ : nullptr; }
  const v1::StepMetrics* last_eval() const { return has_eval_ ? &last_eval_ : nullptr; }

  // The smallest step of a record that Add accepted and TakeUnstored has
  // not yet taken (still waiting for ranks, or combined but not taken);
  // nullopt when there is none. Every record of a lower step that was
  // accepted went to the store writer.
  std::optional<int64_t> FirstStepNotTaken() const;

  // The slowest rank's step time of the newest combined TRAIN steps, at
  // most kRecentTrainSteps of them, oldest first: what "a normal step"
  // takes, for the automatic progress timeout.
  static constexpr size_t kRecentTrainSteps = 100;
  const std::deque<double>& recent_train_step_seconds() const { return recent_train_seconds_; }

  // TRAIN steps combined so far, and their samples (summed over ranks):
  // what the job's throughput counters count.
  int64_t train_steps() const { return train_steps_; }
  int64_t train_samples() const { return train_samples_; }

  // Records dropped by Add so far.
  int64_t dropped() const { return dropped_; }
  size_t pending() const { return pending_.size(); }

 private:
  // TRAIN before EVAL at one step: an epoch's evaluation follows its last
  // training step.
  using Key = std::pair<int64_t, int>;
  struct Pending {
    std::vector<v1::MetricRecord> records;
    uint64_t ranks_seen = 0;  // bit per rank below 64
    Clock::TimePoint first_seen;
  };

  void Combine(std::map<Key, Pending>::iterator it);
  // Combines complete steps at the front, in order.
  void Drain();

  const StepLogOptions options_;
  int64_t generation_ = 0;
  int world_size_ = 1;
  std::map<Key, Pending> pending_;
  // Steps at or below this were combined in the current generation.
  bool any_combined_ = false;
  // ExpectFrom: the next TRAIN step to combine.
  bool expecting_ = false;
  int64_t expect_train_ = 0;
  Key last_combined_{0, 0};
  std::deque<v1::StepMetrics> recent_;
  int64_t next_seq_ = 1;
  std::vector<v1::StepMetrics> unstored_;
  int64_t unstored_last_seq_ = 0;
  v1::StepMetrics last_train_, last_eval_;
  bool has_train_ = false, has_eval_ = false;
  std::deque<double> recent_train_seconds_;
  int64_t dropped_ = 0;
  int64_t train_steps_ = 0;
  int64_t train_samples_ = 0;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_STEP_LOG_H_
