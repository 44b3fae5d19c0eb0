#include "aidnctl/watch.h"

#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <ostream>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "aidnctl/output.h"
#include "aidnctl/watch_view.h"
#include "common/rpc/client.h"
#include "common/rpc/retry.h"
#include "grpcpp/client_context.h"

namespace aidn::ctl {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kHideCursor[] = "\x1b[?25l";
constexpr char kShowCursor[] = "\x1b[?25h";

extern "C" void ShowCursorAndExit(int sig) {
  // Only async-signal-safe calls here.
  static const char kText[] = "\x1b[?25h\n";
  ssize_t ignored = write(STDOUT_FILENO, kText, sizeof(kText) - 1);
  (void)ignored;
  _exit(128 + sig);
}

// Hides the cursor for its lifetime; a signal that ends the process shows it
// again first.
class HiddenCursor {
 public:
  explicit HiddenCursor(std::ostream* out) : out_(out) {
    struct sigaction action {};
    action.sa_handler = ShowCursorAndExit;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &action, &saved_[i]);
    *out_ << kHideCursor << std::flush;
  }
  ~HiddenCursor() {
    *out_ << kShowCursor << std::flush;
    for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &saved_[i], nullptr);
  }
  HiddenCursor(const HiddenCursor&) = delete;
  HiddenCursor& operator=(const HiddenCursor&) = delete;

 private:
  static constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};
  std::ostream* out_;
  struct sigaction saved_[std::size(kSignals)];
};

// What a stream's reading thread hands over.
struct Inbox {
  absl::Mutex mu;
  std::deque<v1::WatchJobResponse> items ABSL_GUARDED_BY(mu);
  bool done ABSL_GUARDED_BY(mu) = false;
  grpc::Status status ABSL_GUARDED_BY(mu);
};

class Watcher {
 public:
  Watcher(const CommandEnv& env, const WatchOptions& options)
      : env_(env), options_(options), resume_step_(options.from_step) {}

  absl::Status Run() {
    std::optional<HiddenCursor> hidden;
    if (options_.live && options_.hide_cursor) hidden.emplace(env_.out);
    bool connected_once = false;
    std::optional<Clock::time_point> away_since;
    rpc::Backoff backoff({.initial = options_.initial_backoff, .max = options_.max_backoff});
    while (true) {
      bool received = false;
      const grpc::Status status = Follow(&received);
      if (received) {
        connected_once = true;
        away_since.reset();
        backoff.Reset();
      }
      if (status.ok() && have_job_ && IsTerminal(view_.job.state())) {
        Finish();
        return Result();
      }
      const std::string address = env_.options.connection.address;
      if (!connected_once) {
        if (status.ok()) {
          return absl::UnavailableError(
              absl::StrCat("the coordinator at ", address, " ended the watch at once"));
        }
        return RpcError(status, address, env_.options.timeout);
      }
      // A broken stream is called again for while the coordinator is away,
      // restarting or busy (rpc::Transient).
      if (!status.ok() && !rpc::Transient(status)) {
        Finish();
        return RpcError(status, address, env_.options.timeout);
      }
      const Clock::time_point now = Clock::now();
      if (!away_since) {
        away_since = now;
        const std::string reason =
            status.ok() ? "the watch ended before the job did" : OneLine(status.error_message());
        SetAway(
            absl::StrCat("lost the coordinator at ", address, " (", reason, "); reconnecting..."));
      }
      if (now - *away_since >= options_.reconnect_timeout) {
        Finish();
        return GaveUpReconnecting(address, options_.reconnect_timeout,
                                  status.ok() ? "the watch kept ending before the job did"
                                              : OneLine(status.error_message()));
      }
      backoff.Sleep();
    }
  }

 private:
  // One WatchJob call, handling what it sends until its stream ends; the
  // call's final status. `received`: whether it sent anything.
  grpc::Status Follow(bool* received) {
    grpc::ClientContext context;
    // No deadline: the stream lasts as long as the job.
    rpc::PrepareContext(&context, env_.options.connection.token, std::chrono::milliseconds(0));
    v1::WatchJobRequest request;
    request.set_job_id(options_.job_id);
    request.set_from_step(resume_step_);
    request.set_include_metrics(true);
    request.set_after_event_seq(last_event_seq_);
    std::unique_ptr<grpc::ClientReaderInterface<v1::WatchJobResponse>> reader =
        env_.stub->WatchJob(&context, request);

    // Reading blocks; a thread reads so that this one can redraw on time
    // while nothing arrives.
    Inbox inbox;
    std::thread reading([&inbox, &reader] {
      v1::WatchJobResponse item;
      while (reader->Read(&item)) {
        absl::MutexLock lock(&inbox.mu);
        inbox.items.push_back(std::move(item));
        item.Clear();
      }
      grpc::Status status = reader->Finish();
      absl::MutexLock lock(&inbox.mu);
      inbox.status = std::move(status);
      inbox.done = true;
    });

    const absl::Duration tick =
        absl::FromChrono(std::clamp(std::min(options_.redraw_interval, options_.progress_interval),
                                    std::chrono::milliseconds(10), std::chrono::milliseconds(100)));
    grpc::Status status;
    while (true) {
      std::deque<v1::WatchJobResponse> items;
      bool done = false;
      {
        absl::MutexLock lock(&inbox.mu);
        inbox.mu.AwaitWithTimeout(absl::Condition(
                                      +[](Inbox* in) ABSL_EXCLUSIVE_LOCKS_REQUIRED(in->mu) {
                                        return in->done || !in->items.empty();
                                      },
                                      &inbox),
                                  tick);
        items.swap(inbox.items);
        done = inbox.done;
        status = inbox.status;
      }
      for (const v1::WatchJobResponse& item : items) {
        if (!*received) {
          *received = true;
          SetBack();
        }
        Handle(item);
      }
      Tick(/*force=*/false);
      if (done) break;
    }
    reading.join();
    return status;
  }

  void Handle(const v1::WatchJobResponse& item) {
    switch (item.item_case()) {
      case v1::WatchJobResponse::kJob:
        HandleJob(item.job());
        break;
      case v1::WatchJobResponse::kEvent:
        if (item.event().seq() <= last_event_seq_) break;  // seen before a reconnection
        last_event_seq_ = item.event().seq();
        Print(EventLine(item.event()));
        break;
      case v1::WatchJobResponse::kStep:
        HandleStep(item.step());
        break;
      case v1::WatchJobResponse::ITEM_NOT_SET:
        break;
    }
  }

  void HandleJob(const v1::Job& job) {
    const bool changed = !have_job_ || job.state() != view_.job.state();
    view_.job = job;
    have_job_ = true;
    dirty_ = true;
    // The end is said last, by Finish: a job watched after it ended is
    // first sent as it ended, before its history.
    if (!changed || options_.live || IsTerminal(job.state())) return;
    Print(JobStateLine(job));
  }

  void HandleStep(const v1::StepMetrics& step) {
    // Steps of a later generation are new even at a step seen before; one
    // not above the last of its kind and generation was seen before a
    // reconnection.
    const std::pair<int64_t, int64_t> key = {step.generation(), step.step()};
    auto [last, inserted] = last_step_.try_emplace(step.kind(), key);
    if (!inserted) {
      if (key <= last->second) return;
      last->second = key;
    }
    resume_step_ = step.step();
    dirty_ = true;
    if (step.kind() == v1::MetricRecord::EVAL) {
      view_.eval = step;
      Print(EvalLine(step, view_.job.spec().model().name() == "gpt"));
      return;
    }
    view_.train = step;
    throughput_.Add(step);
    view_.steps_per_second = throughput_.StepsPerSecond();
    view_.samples_per_second = throughput_.SamplesPerSecond();
    progress_pending_ = true;
    MaybePrintProgress(/*force=*/false);
  }

  // Plain: the progress line, if one is due.
  void MaybePrintProgress(bool force) {
    if (options_.live || !progress_pending_) return;
    const Clock::time_point now = Clock::now();
    if (!force && last_progress_ && now - *last_progress_ < options_.progress_interval) return;
    last_progress_ = now;
    progress_pending_ = false;
    Print(ProgressLine(view_));
  }

  void Tick(bool force) {
    if (!options_.live) {
      MaybePrintProgress(force);
      return;
    }
    const Clock::time_point now = Clock::now();
    if (!have_job_ || !(dirty_ || !above_.empty())) return;
    if (!force && last_draw_ && now - *last_draw_ < options_.redraw_interval) return;
    const std::vector<std::string> block = StatusBlock(view_, options_.width());
    *env_.out << RedrawFrame(lines_drawn_, above_, block) << std::flush;
    above_.clear();
    lines_drawn_ = static_cast<int>(block.size());
    dirty_ = false;
    last_draw_ = now;
  }

  void Print(const std::string& line) {
    if (options_.live) {
      above_.push_back(line);
      return;
    }
    *env_.out << line << "\n" << std::flush;
  }

  void SetAway(const std::string& what) {
    if (options_.live) {
      view_.reconnecting = "reconnecting...";
      Print(what);
      dirty_ = true;
      Tick(/*force=*/true);
      return;
    }
    MaybePrintProgress(/*force=*/true);
    Print(what);
  }

  void SetBack() {
    if (!streamed_before_) {
      streamed_before_ = true;  // from now on, a stream that starts is a reconnection
      return;
    }
    view_.reconnecting.clear();
    dirty_ = true;
    Print(absl::StrCat("reconnected to the coordinator at ", env_.options.connection.address));
  }

  // Live: the last frame. Plain: the last progress line, then the line
  // saying how the job ended.
  void Finish() {
    if (options_.live) {
      Tick(/*force=*/true);
      return;
    }
    MaybePrintProgress(/*force=*/true);
    if (have_job_ && IsTerminal(view_.job.state())) Print(JobStateLine(view_.job));
  }

  absl::Status Result() const {
    const v1::Job& job = view_.job;
    switch (job.state()) {
      case v1::Job::SUCCEEDED:
        return absl::OkStatus();
      case v1::Job::CANCELLED:
        return absl::CancelledError(JobStateLine(job));
      default:
        return absl::FailedPreconditionError(JobStateLine(job));
    }
  }

  const CommandEnv& env_;
  const WatchOptions& options_;

  // Where the next call resumes.
  int64_t resume_step_;
  int64_t last_event_seq_ = 0;
  // The last (generation, step) received, by kind.
  std::map<int, std::pair<int64_t, int64_t>> last_step_;
  // Set once the first stream sent something.
  bool streamed_before_ = false;

  WatchView view_;
  bool have_job_ = false;
  Throughput throughput_;

  // Live.
  std::vector<std::string> above_;
  int lines_drawn_ = 0;
  bool dirty_ = false;
  std::optional<Clock::time_point> last_draw_;

  // Plain.
  bool progress_pending_ = false;
  std::optional<Clock::time_point> last_progress_;
};

}  // namespace

absl::Status RunWatch(const CommandEnv& env, const WatchOptions& options) {
  return Watcher(env, options).Run();
}

int TerminalWidth(int fd) {
  winsize size{};
  if (ioctl(fd, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  return 80;
}

}  // namespace aidn::ctl
