#ifndef AIDN_AIDNCTL_LOGS_H_
#define AIDN_AIDNCTL_LOGS_H_

// `aidnctl logs JOB`: the ranks' output (stdout and stderr) as the workers
// shipped it to the coordinator, through ReadLogs.
//
// Table output (the default): one line per output line, prefixed
// "[rank N] ", or "[gen G rank N] " when every generation is shown, in the
// order the lines reached the coordinator. Lines the coordinator dropped to
// keep within its per-job bound show as one marker line
// "[aidn: N older lines (B) dropped: ...]". -o json: one LogEntry per line
// (JSON Lines); other formats are refused.
//
// --follow keeps reading until the job's generation is over and its ranks'
// output is all in. When the stream breaks (an rpc::Transient failure)
// after it delivered anything, it reads again after a backoff, from the
// start of what it asked for (without the tail), and prints only lines past
// the last one shown per (generation, rank); it gives up when no call has
// succeeded for `reconnect_timeout`.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "aidnctl/commands.h"

namespace aidn::ctl {

struct LogsOptions {
  std::string job_id;
  // One rank's lines; unset: every rank's.
  std::optional<int32_t> rank;
  // One generation's; unset: the current one.
  std::optional<int64_t> generation;
  bool all_generations = false;
  // > 0: only the last `tail` lines (then, with follow, new ones).
  int32_t tail = 0;
  bool follow = false;
  std::chrono::milliseconds initial_backoff{200};
  std::chrono::milliseconds max_backoff{2000};
  std::chrono::milliseconds reconnect_timeout{std::chrono::minutes(5)};
};

absl::Status RunLogs(const CommandEnv& env, const LogsOptions& options);

// "[rank 3] text" or, with the generation, "[gen 2 rank 3] text".
std::string FormatLogLine(const v1::LogEntry& entry, bool with_generation);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_LOGS_H_
