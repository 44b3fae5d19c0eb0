#ifndef AIDN_AIDNCTL_WATCH_H_
#define AIDN_AIDNCTL_WATCH_H_

// `aidnctl watch JOB`: follows a job through WatchJob until it ends.
//
// Live (a terminal): the status block of watch_view.h redrawn in place at
// most every `redraw_interval`, with events and evaluations printed above it
// as they come, so that they scroll. Plain (anything else): appended lines,
// each a state change, an event, an evaluation, or a progress line; progress
// lines at most every `progress_interval`, the latest one always printed
// before the watch ends.
//
// Reconnection: when the stream breaks (an rpc::Transient failure, or an
// end before the job ended) after it delivered anything, the watch calls
// again after a backoff (initial_backoff doubling to max_backoff), passing
// after_event_seq = the last event's seq and from_step = the step of the last
// step metrics received. That step is asked for again, not the next one: its
// EVAL may not have been sent yet when the stream broke (TRAIN comes before
// EVAL at a step). What was already received is recognised by (generation,
// step) and not shown twice; a later generation (a restarted job re-running
// steps from its checkpoint) is new. The watch gives up when no call has
// succeeded for `reconnect_timeout`. A first call that fails fails the watch
// at once, as any command does.
//
// Result: OK when the job SUCCEEDED; FAILED_PRECONDITION "job <id> FAILED:
// <message>" (or CANCELLED) when it ended otherwise; the call's error
// (RpcError) otherwise, e.g. NOT_FOUND for an unknown job.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "aidnctl/commands.h"

namespace aidn::ctl {

struct WatchOptions {
  std::string job_id;
  // Step metrics from this step on; 0: all of them.
  int64_t from_step = 0;
  // Redraw in place (stdout is a terminal) instead of appending lines.
  bool live = false;
  // Live: hide the cursor while drawing, and show it again on SIGINT,
  // SIGTERM and SIGHUP (then exit 130) or when done. For a real terminal on
  // stdout only.
  bool hide_cursor = false;
  // Live: the terminal's width, asked before every redraw.
  std::function<int()> width = [] { return 80; };
  std::chrono::milliseconds redraw_interval{100};
  std::chrono::milliseconds progress_interval{1000};
  std::chrono::milliseconds initial_backoff{200};
  std::chrono::milliseconds max_backoff{2000};
  std::chrono::milliseconds reconnect_timeout{std::chrono::minutes(5)};
};

absl::Status RunWatch(const CommandEnv& env, const WatchOptions& options);

// The width of the terminal on `fd` (TIOCGWINSZ), or 80 if it is none or
// does not say.
int TerminalWidth(int fd);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_WATCH_H_
