#ifndef AIDN_AIDNCTL_WATCH_VIEW_H_
#define AIDN_AIDNCTL_WATCH_VIEW_H_

// What `aidnctl watch` shows, as pure functions of the job and its latest
// step metrics: the live block redrawn in place on a terminal, and the plain
// lines appended when stdout is not one. Nothing here does I/O or reads the
// clock; watch.h drives it.
//
// The live block (every line cut to the terminal's width):
//   job-1f3a  RUNNING  gen 1  restarts 0/3  all 2 ranks joined
//   [==============>               ]  48%  step 480/1000  epoch 1  ETA 1m05s
//   loss 0.4312 | 5290 samples/s | slowest rank 1 12.1ms | allreduce 11% of step
//   checkpoint step 400 | test accuracy 85.31% (step 469) | 8.0 steps/s
// Without a known total (Job.total_steps, else spec.max_steps) the bar, the
// percentage and the ETA are left out: "step 480  epoch 1".

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "aidn/v1/job.pb.h"

namespace aidn::ctl {

// A duration as "45s", "1m05s", "2h03m", "3d04h" (rounded down; "0s" for
// negative or infinite ones).
std::string FormatEta(absl::Duration duration);

// Seconds as "850us", "12.1ms", "1.25s", "95s".
std::string FormatSeconds(double seconds);

// A bar of exactly `width` characters (at least 3), "[=====>    ]", filled to
// `fraction` (clamped to [0, 1]; a full bar has no '>').
std::string ProgressBar(double fraction, int width);

// Steps and samples per second of a job over its most recent `window` of
// StepMetrics.time (the trainers' clocks, so a replay of past steps gives
// the rate they ran at). Not thread-safe.
class Throughput {
 public:
  explicit Throughput(absl::Duration window = absl::Seconds(20)) : window_(window) {}

  // TRAIN steps only (others are ignored), as they come. A step of another
  // generation, or not above the last one, starts the window over: a
  // restarted job resumes from its checkpoint.
  void Add(const v1::StepMetrics& step);

  // Unknown until the window holds two steps at different times.
  std::optional<double> StepsPerSecond() const;
  // Samples of the steps after the window's first, over the time they took.
  std::optional<double> SamplesPerSecond() const;

 private:
  struct Point {
    int64_t step;
    absl::Time time;
    int64_t samples;
  };
  absl::Duration window_;
  int64_t generation_ = -1;
  std::deque<Point> points_;
  int64_t samples_after_first_ = 0;
};

// Everything the live block and the progress line show.
struct WatchView {
  v1::Job job;
  // The latest TRAIN and EVAL step metrics seen.
  std::optional<v1::StepMetrics> train;
  std::optional<v1::StepMetrics> eval;
  std::optional<double> steps_per_second;
  std::optional<double> samples_per_second;
  // Set while the connection to the coordinator is down: what the first line
  // says instead of the job's message ("reconnecting to HOST:PORT...").
  std::string reconnecting;
};

// Job.total_steps, else spec.max_steps, else 0 (unknown).
int64_t TotalSteps(const v1::Job& job);
// The latest TRAIN step seen, else Job.last_step.
int64_t CurrentStep(const WatchView& view);
// Time left at the current rate; nullopt when the total or the rate is
// unknown, or the job is not running.
std::optional<absl::Duration> EstimatedTimeLeft(const WatchView& view);

// The live block, one string per line, none longer than `width` - 1
// characters (a line filling the last column wraps early on some
// terminals). `width` below 20 is taken as 20.
std::vector<std::string> StatusBlock(const WatchView& view, int width);

// Plain lines, without the final newline.
//   step 480/1000 (48%) | epoch 1 | loss 0.4312 | 5290 samples/s | step 12.1ms (slowest rank 1) |
//   allreduce 11% | ETA 1m05s
std::string ProgressLine(const WatchView& view);
//   eval at step 469 (epoch 1) | test loss 0.4123 | test accuracy 85.31%
// or, for a language model (model gpt: the validation text),
//   eval at step 500 (epoch 1) | val loss 2.0513 | perplexity 7.778 | next-token accuracy 41.20%
std::string EvalLine(const v1::StepMetrics& eval, bool language_model = false);
//   2026-11-22T04:10:00Z  job.running  all 2 ranks joined
std::string EventLine(const v1::Event& event);
//   job job-1f3a RUNNING: all 2 ranks joined
std::string JobStateLine(const v1::Job& job);

// The bytes that replace the live block of `previous_lines` lines just above
// the cursor: move up to its first line, clear to the end of the screen,
// print `above` (lines that stay and scroll away, such as events) and then
// `block`, each line ended by a newline, leaving the cursor below the block.
std::string RedrawFrame(int previous_lines, const std::vector<std::string>& above,
                        const std::vector<std::string>& block);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_WATCH_VIEW_H_
