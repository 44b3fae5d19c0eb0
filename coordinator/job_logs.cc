#include "coordinator/job_logs.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "coordinator/job_state.h"
#include "google/protobuf/util/time_util.h"

namespace aidn::coordinator {
namespace {

Store::LogQuery QueryOf(const v1::ReadLogsRequest& request, const LogCursor& cursor) {
  return {.job_id = request.job_id(),
          .rank = request.has_rank() ? request.rank() : -1,
          .generation = cursor.generation,
          .after_id = cursor.after_id};
}

}  // namespace

absl::Status JobLogs::Validate(const v1::ShipLogsRequest& request) {
  for (int i = 0; i < request.chunks_size(); ++i) {
    const v1::LogChunk& c = request.chunks(i);
    const std::string where = absl::StrCat("chunks[", i, "]");
    if (c.job_id().empty()) return absl::InvalidArgumentError(where + ".job_id: empty");
    if (c.generation() < 0 || c.rank() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": generation and rank must be >= 0, got ", c.generation(), " and ", c.rank()));
    }
    for (int j = 1; j < c.lines_size(); ++j) {
      if (c.lines(j).seq() <= c.lines(j - 1).seq()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".lines[", j,
                                                       "].seq: ", c.lines(j).seq(),
                                                       " does not follow ", c.lines(j - 1).seq()));
      }
    }
    if (c.lines_size() > 0 && c.lines(0).seq() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".lines[0].seq: negative"));
    }
  }
  return absl::OkStatus();
}

absl::Status JobLogs::Validate(const v1::ReadLogsRequest& request) {
  if (request.job_id().empty()) return absl::InvalidArgumentError("job_id: empty");
  if (request.has_rank() && request.rank() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("rank: negative (", request.rank(), ")"));
  }
  if (request.has_generation() && request.generation() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("generation: negative (", request.generation(), ")"));
  }
  if (request.tail() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("tail: negative (", request.tail(), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> JobLogs::Append(const std::vector<v1::LogChunk>& chunks) {
  return store_->AppendLogs(chunks, options_.max_bytes_per_job);
}

absl::StatusOr<bool> JobLogs::GenerationDone(const v1::Job& job, absl::Time now,
                                             LogCursor* cursor) {
  const int64_t generation = cursor->generation < 0 ? job.generation() : cursor->generation;
  const bool over = IsTerminal(job.state()) || generation < job.generation();
  if (!over) {
    cursor->over_since.reset();
    return false;
  }
  // A job cancelled before it was placed never ran a rank.
  if (job.generation() == 0) return true;
  AIDN_ASSIGN_OR_RETURN(Store::JobLogState state, store_->LogState(job.id(), generation));
  const std::set<int32_t> complete(state.complete_ranks.begin(), state.complete_ranks.end());
  bool all = true;
  for (int32_t r = 0; r < job.spec().world_size() && all; ++r) all = complete.contains(r);
  if (all) return true;
  if (!cursor->over_since) cursor->over_since = now;
  return now - *cursor->over_since >= absl::FromChrono(options_.settle);
}

absl::StatusOr<LogBatch> JobLogs::Poll(const v1::ReadLogsRequest& request, const v1::Job& job,
                                       absl::Time now, LogCursor* cursor, int max_responses) {
  const bool first = !cursor->started;
  if (first) {
    cursor->generation = request.all_generations()  ? -1
                         : request.has_generation() ? request.generation()
                                                    : job.generation();
    AIDN_ASSIGN_OR_RETURN(cursor->after_id,
                          store_->LogTailStart(QueryOf(request, *cursor), request.tail()));
    cursor->started = true;
  }
  LogBatch batch;
  // Asked before the lines are read: a rank's last lines are stored with
  // (or before) the word that its output ended, so once that word is seen
  // here the read below has them.
  bool done = false;
  if (request.follow()) {
    AIDN_ASSIGN_OR_RETURN(done, GenerationDone(job, now, cursor));
  }
  AIDN_ASSIGN_OR_RETURN(Store::JobLogState state, store_->LogState(job.id(), 0));
  if (state.dropped_lines > 0 && state.dropped_lines > cursor->dropped_sent) {
    v1::ReadLogsResponse& r = batch.responses.emplace_back();
    r.set_dropped_lines(state.dropped_lines);
    r.set_dropped_bytes(state.dropped_bytes);
    cursor->dropped_sent = state.dropped_lines;
  }
  bool more = true;
  while (more && static_cast<int>(batch.responses.size()) < max_responses) {
    AIDN_ASSIGN_OR_RETURN(std::vector<Store::StoredLogLine> lines,
                          store_->ReadLogs(QueryOf(request, *cursor), kMaxLinesPerResponse));
    more = static_cast<int>(lines.size()) == kMaxLinesPerResponse;
    if (lines.empty()) break;
    v1::ReadLogsResponse& r = batch.responses.emplace_back();
    int64_t bytes = 0;
    for (Store::StoredLogLine& line : lines) {
      if (bytes > 0 &&
          bytes + static_cast<int64_t>(line.entry.text().size()) > kMaxBytesPerResponse) {
        more = true;  // the rest next time round
        break;
      }
      bytes += static_cast<int64_t>(line.entry.text().size());
      cursor->after_id = line.id;
      *r.add_lines() = std::move(line.entry);
    }
  }
  // The first answer says the stream is open, even with nothing in it.
  if (first && batch.responses.empty()) batch.responses.emplace_back();
  batch.finished = !more && (!request.follow() || done);
  return batch;
}

}  // namespace aidn::coordinator
