#include "aidnctl/watch_view.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "aidnctl/output.h"

namespace aidn::ctl {
namespace {

constexpr char kSeparator[] = " | ";
constexpr int kMinWidth = 20;
constexpr int kMinBar = 10;
constexpr int kMaxBar = 40;

// `line` cut to `max_chars` bytes, ending in "..." if cut, without cutting
// a UTF-8 sequence in half.
std::string Fit(std::string line, int max_chars) {
  if (static_cast<int>(line.size()) <= max_chars) return line;
  line.resize(static_cast<size_t>(std::max(max_chars - 3, 0)));
  while (!line.empty() && (static_cast<unsigned char>(line.back()) & 0xC0) == 0x80) line.pop_back();
  if (!line.empty() && (static_cast<unsigned char>(line.back()) & 0xC0) == 0xC0) line.pop_back();
  return line + "...";
}

int Percent(int64_t step, int64_t total) {
  if (total <= 0) return 0;
  return static_cast<int>(std::clamp<int64_t>(step * 100 / total, 0, 100));
}

std::string Restarts(const v1::Job& job) {
  return job.spec().has_max_restarts()
             ? absl::StrCat("restarts ", job.restarts(), "/", job.spec().max_restarts())
             : absl::StrCat("restarts ", job.restarts());
}

std::string Accuracy(double accuracy) { return absl::StrFormat("%.2f%%", accuracy * 100); }

// "11%" of the step spent in the allreduce; empty without a step time.
std::string AllreduceShare(const v1::StepMetrics& step) {
  if (step.step_seconds() <= 0) return "";
  return absl::StrFormat("%.0f%%", 100 * step.allreduce_seconds() / step.step_seconds());
}

// Samples/s, or tokens/s for a language model (its steps count tokens).
std::string SamplesPerSecond(const WatchView& view) {
  const double rate =
      view.samples_per_second.value_or(view.train ? view.train->samples_per_second() : 0);
  if (view.train && view.train->tokens() > 0 && view.train->samples() > 0) {
    const double per_sample =
        static_cast<double>(view.train->tokens()) / static_cast<double>(view.train->samples());
    return absl::StrFormat("%.0f tokens/s", rate * per_sample);
  }
  return absl::StrFormat("%.0f samples/s", rate);
}

int32_t Epoch(const WatchView& view) { return view.train ? view.train->epoch() : view.job.epoch(); }

}  // namespace

std::string FormatEta(absl::Duration duration) {
  if (duration < absl::ZeroDuration() || duration == absl::InfiniteDuration()) return "0s";
  const int64_t s = absl::ToInt64Seconds(duration);
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  if (s < 86400) return absl::StrFormat("%dh%02dm", s / 3600, s % 3600 / 60);
  return absl::StrFormat("%dd%02dh", s / 86400, s % 86400 / 3600);
}

std::string FormatSeconds(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-";
  if (seconds < 1e-3) return absl::StrFormat("%.0fus", seconds * 1e6);
  if (seconds < 1) return absl::StrFormat("%.1fms", seconds * 1e3);
  if (seconds < 10) return absl::StrFormat("%.2fs", seconds);
  return absl::StrFormat("%.0fs", seconds);
}

std::string ProgressBar(double fraction, int width) {
  width = std::max(width, 3);
  const int inner = width - 2;
  if (!(fraction >= 0)) fraction = 0;  // NaN too
  fraction = std::min(fraction, 1.0);
  const int filled = static_cast<int>(std::floor(fraction * inner));
  std::string bar = "[";
  if (filled >= inner) {
    bar.append(inner, '=');
  } else {
    bar.append(filled, '=');
    bar += '>';
    bar.append(inner - filled - 1, ' ');
  }
  bar += ']';
  return bar;
}

void Throughput::Add(const v1::StepMetrics& step) {
  if (step.kind() != v1::MetricRecord::TRAIN) return;
  if (step.generation() != generation_ ||
      (!points_.empty() && step.step() <= points_.back().step)) {
    points_.clear();
    samples_after_first_ = 0;
    generation_ = step.generation();
  }
  if (!points_.empty()) samples_after_first_ += step.samples();
  points_.push_back({step.step(), ToTime(step.time()), step.samples()});
  // Keep two points at least, so that steps slower than the window still
  // give a rate.
  while (points_.size() > 2 && points_.back().time - points_[1].time >= window_) {
    points_.pop_front();
    samples_after_first_ -= points_.front().samples;
  }
}

std::optional<double> Throughput::StepsPerSecond() const {
  if (points_.size() < 2) return std::nullopt;
  const double seconds = absl::ToDoubleSeconds(points_.back().time - points_.front().time);
  if (seconds <= 0) return std::nullopt;
  return static_cast<double>(points_.back().step - points_.front().step) / seconds;
}

std::optional<double> Throughput::SamplesPerSecond() const {
  if (points_.size() < 2) return std::nullopt;
  const double seconds = absl::ToDoubleSeconds(points_.back().time - points_.front().time);
  if (seconds <= 0) return std::nullopt;
  return static_cast<double>(samples_after_first_) / seconds;
}

int64_t TotalSteps(const v1::Job& job) {
  if (job.total_steps() > 0) return job.total_steps();
  return std::max<int64_t>(job.spec().max_steps(), 0);
}

int64_t CurrentStep(const WatchView& view) {
  return view.train ? view.train->step() : view.job.last_step();
}

std::optional<absl::Duration> EstimatedTimeLeft(const WatchView& view) {
  const int64_t total = TotalSteps(view.job);
  if (total <= 0 || view.job.state() != v1::Job::RUNNING || !view.steps_per_second ||
      *view.steps_per_second <= 0) {
    return std::nullopt;
  }
  const int64_t left = std::max<int64_t>(total - CurrentStep(view), 0);
  return absl::Seconds(static_cast<double>(left) / *view.steps_per_second);
}

std::vector<std::string> StatusBlock(const WatchView& view, int width) {
  width = std::max(width, kMinWidth);
  const int max_chars = width - 1;
  const v1::Job& job = view.job;
  std::vector<std::string> lines;

  std::vector<std::string> head = {job.id(), StateName(job.state()),
                                   absl::StrCat("gen ", job.generation()), Restarts(job)};
  const std::string note = view.reconnecting.empty() ? OneLine(job.message()) : view.reconnecting;
  if (!note.empty()) head.push_back(note);
  lines.push_back(absl::StrJoin(head, "  "));

  const int64_t step = CurrentStep(view);
  const int64_t total = TotalSteps(job);
  std::string progress;
  if (total > 0) {
    std::string rest = absl::StrCat("  ", Percent(step, total), "%  step ", step, "/", total,
                                    "  epoch ", Epoch(view));
    if (const auto left = EstimatedTimeLeft(view))
      absl::StrAppend(&rest, "  ETA ", FormatEta(*left));
    const int bar = std::min(kMaxBar, max_chars - static_cast<int>(rest.size()));
    progress = bar >= kMinBar ? ProgressBar(static_cast<double>(step) / total, bar) + rest
                              : rest.substr(2);
  } else {
    progress = absl::StrCat("step ", step, "  epoch ", Epoch(view));
  }
  lines.push_back(progress);

  if (view.train) {
    const v1::StepMetrics& train = *view.train;
    std::vector<std::string> parts = {absl::StrFormat("loss %.4f", train.loss()),
                                      SamplesPerSecond(view),
                                      absl::StrCat("slowest rank ", train.slowest_rank(), " ",
                                                   FormatSeconds(train.step_seconds()))};
    if (const std::string share = AllreduceShare(train); !share.empty()) {
      parts.push_back(absl::StrCat("allreduce ", share, " of step"));
    }
    lines.push_back(absl::StrJoin(parts, kSeparator));
  } else {
    lines.push_back("no step metrics yet");
  }

  std::vector<std::string> tail = {
      job.last_checkpoint_step() > 0 ? absl::StrCat("checkpoint step ", job.last_checkpoint_step())
                                     : std::string("no checkpoint yet")};
  tail.push_back(view.eval ? absl::StrCat("test accuracy ", Accuracy(view.eval->test_accuracy()),
                                          " (step ", view.eval->step(), ")")
                           : std::string("no evaluation yet"));
  if (view.steps_per_second) {
    tail.push_back(absl::StrFormat("%.1f steps/s", *view.steps_per_second));
  }
  lines.push_back(absl::StrJoin(tail, kSeparator));

  for (std::string& line : lines) line = Fit(line, max_chars);
  return lines;
}

std::string ProgressLine(const WatchView& view) {
  const int64_t step = CurrentStep(view);
  const int64_t total = TotalSteps(view.job);
  std::vector<std::string> parts;
  parts.push_back(total > 0
                      ? absl::StrCat("step ", step, "/", total, " (", Percent(step, total), "%)")
                      : absl::StrCat("step ", step));
  parts.push_back(absl::StrCat("epoch ", Epoch(view)));
  if (view.train) {
    const v1::StepMetrics& train = *view.train;
    parts.push_back(absl::StrFormat("loss %.4f", train.loss()));
    parts.push_back(SamplesPerSecond(view));
    parts.push_back(absl::StrCat("step ", FormatSeconds(train.step_seconds()), " (slowest rank ",
                                 train.slowest_rank(), ")"));
    if (const std::string share = AllreduceShare(train); !share.empty()) {
      parts.push_back(absl::StrCat("allreduce ", share));
    }
  }
  if (const auto left = EstimatedTimeLeft(view)) {
    parts.push_back(absl::StrCat("ETA ", FormatEta(*left)));
  }
  return absl::StrJoin(parts, " | ");
}

std::string EvalLine(const v1::StepMetrics& eval, bool language_model) {
  if (language_model) {
    return absl::StrFormat(
        "eval at step %d (epoch %d) | val loss %.4f | perplexity %.3f | next-token accuracy %s",
        eval.step(), eval.epoch(), eval.test_loss(), std::exp(eval.test_loss()),
        Accuracy(eval.test_accuracy()));
  }
  return absl::StrFormat("eval at step %d (epoch %d) | test loss %.4f | test accuracy %s",
                         eval.step(), eval.epoch(), eval.test_loss(),
                         Accuracy(eval.test_accuracy()));
}

std::string EventLine(const v1::Event& event) {
  std::string line = absl::StrCat(FormatTimestamp(event.time()), "  ", event.type());
  const std::string message = OneLine(event.message());
  if (!message.empty()) absl::StrAppend(&line, "  ", message);
  return line;
}

std::string JobStateLine(const v1::Job& job) {
  std::string line = absl::StrCat("job ", job.id(), " ", StateName(job.state()));
  const std::string message = OneLine(job.message());
  if (!message.empty()) absl::StrAppend(&line, ": ", message);
  return line;
}

std::string RedrawFrame(int previous_lines, const std::vector<std::string>& above,
                        const std::vector<std::string>& block) {
  std::string out = "\r";
  if (previous_lines > 0) absl::StrAppend(&out, "\x1b[", previous_lines, "A");
  out += "\x1b[J";  // clear from here to the end of the screen
  for (const std::string& line : above) absl::StrAppend(&out, line, "\n");
  for (const std::string& line : block) absl::StrAppend(&out, line, "\n");
  return out;
}

}  // namespace aidn::ctl
