#ifndef AIDN_COORDINATOR_JOB_LOGS_H_
#define AIDN_COORDINATOR_JOB_LOGS_H_

// The ranks' output lines as data: what workers ship (ShipLogs) goes into
// the store, bounded per job; readers (ReadLogs) get the lines they ask for
// from the store, and followers whatever arrives after, until the job's
// generation is over and its ranks' output is all in.
//
// Thread-safe: it keeps no state of its own beyond its options (the store
// is thread-safe). The coordinator takes a snapshot of the job under its
// mutex and calls Poll without it; a reader's LogCursor is the reader's.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "aidn/v1/cluster.pb.h"
#include "aidn/v1/coordinator.pb.h"
#include "aidn/v1/job.pb.h"
#include "coordinator/store.h"

namespace aidn::coordinator {

struct JobLogsOptions {
  // A job's lines (text plus one byte each) kept at most; past it the
  // oldest go, counted as dropped. 0: no bound.
  int64_t max_bytes_per_job = 64 << 20;
  // A finished job's lines are deleted this long after it ended; 0 keeps
  // them for as long as the job's record.
  std::chrono::milliseconds retention{std::chrono::hours(24 * 7)};
  // A follower of a generation that is over waits at most this long for
  // ranks whose output has not all arrived (a worker that was lost never
  // sends the rest).
  std::chrono::milliseconds settle{10'000};
};

// Where a reader is.
struct LogCursor {
  bool started = false;
  // Lines stored after this id come next.
  int64_t after_id = 0;
  // The generation read, -1 for all (resolved at the first poll).
  int64_t generation = -1;
  // The dropped count last sent (-1: none sent).
  int64_t dropped_sent = -1;
  // When the poll first saw the generation over with ranks still missing.
  std::optional<absl::Time> over_since;
};

struct LogBatch {
  // Empty when there is nothing new (no lines and no new dropped count).
  std::vector<v1::ReadLogsResponse> responses;
  // Nothing more will come: a reader that does not follow has read all, a
  // follower's generation is over and its ranks' lines are all in.
  bool finished = false;
};

class JobLogs {
 public:
  // Lines per response at most, and their text bytes at most (a line is at
  // most 16 KiB as workers cut them, so one response stays far below
  // gRPC's 4 MiB default).
  static constexpr int kMaxLinesPerResponse = 1000;
  static constexpr int64_t kMaxBytesPerResponse = 1 << 20;

  JobLogs(const JobLogsOptions& options, Store* store)  // store not owned
      : options_(options), store_(store) {}

  const JobLogsOptions& options() const { return options_; }

  // INVALID_ARGUMENT naming the chunk and field: an empty job id, a
  // negative generation or rank, lines not in increasing seq order.
  static absl::Status Validate(const v1::ShipLogsRequest& request);
  // INVALID_ARGUMENT for a negative rank, generation or tail.
  static absl::Status Validate(const v1::ReadLogsRequest& request);

  // Stores the chunks (of jobs the coordinator knows); returns the lines
  // that were new.
  absl::StatusOr<int64_t> Append(const std::vector<v1::LogChunk>& chunks);

  // The next responses for a reader of `job` (a snapshot), at most
  // `max_responses` of them.
  absl::StatusOr<LogBatch> Poll(const v1::ReadLogsRequest& request, const v1::Job& job,
                                absl::Time now, LogCursor* cursor, int max_responses = 4);

 private:
  // Whether a follower of `cursor->generation` has all it will get.
  absl::StatusOr<bool> GenerationDone(const v1::Job& job, absl::Time now, LogCursor* cursor);

  const JobLogsOptions options_;
  Store* const store_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_JOB_LOGS_H_
