#include "worker/log_shipper.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "common/log.h"
#include "common/rpc/client.h"
#include "common/rpc/status_convert.h"
#include "common/status.h"
#include "google/protobuf/util/time_util.h"

namespace aidn::worker {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

constexpr size_t kReadBytes = 64 * 1024;

class GrpcLogSink final : public LogSink {
 public:
  GrpcLogSink(const rpc::ChannelOptions& coordinator, std::string token, milliseconds rpc_timeout)
      : channel_(rpc::MakeChannel(coordinator)),
        stub_(v1::ClusterService::NewStub(channel_)),
        token_(std::move(token)),
        rpc_timeout_(rpc_timeout) {}

  absl::Status Ship(const v1::ShipLogsRequest& request) override {
    grpc::ClientContext context;
    rpc::PrepareContext(&context, token_, rpc_timeout_);
    v1::ShipLogsResponse response;
    grpc::Status status = stub_->ShipLogs(&context, request, &response);
    rpc::ResetBackoffAfter(status, channel_.get());
    return rpc::FromGrpcStatus(status);
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ClusterService::Stub> stub_;
  const std::string token_;
  const milliseconds rpc_timeout_;
};

std::string KeyText(const RankOutput& r) {
  return absl::StrCat(r.job_id, "/gen-", r.generation, "/rank-", r.rank);
}

}  // namespace

// ---------------------------------------------------------------------------
// LineSplitter

std::string LineSplitter::CutMarker(size_t max_line_bytes) {
  return absl::StrCat(" [aidn: line cut at ", max_line_bytes, " bytes]");
}

void LineSplitter::Feed(std::string_view data, std::vector<std::string>* lines) {
  size_t i = 0;
  while (i < data.size()) {
    const size_t special = data.find_first_of("\r\n", i);
    const size_t end = special == std::string_view::npos ? data.size() : special;
    if (end > i) {
      // Text after a lone '\r' rewrites the line (a progress bar).
      if (carriage_return_) line_.clear();
      carriage_return_ = false;
      Append(data.substr(i, end - i), lines);
    }
    if (special == std::string_view::npos) break;
    if (data[special] == '\n') {
      EndLine(lines);
    } else {
      carriage_return_ = true;
    }
    i = special + 1;
  }
}

void LineSplitter::Append(std::string_view text, std::vector<std::string>* lines) {
  if (dropping_) return;
  if (line_.size() + text.size() <= max_line_bytes_) {
    line_.append(text);
    return;
  }
  line_.append(text.substr(0, max_line_bytes_ - line_.size()));
  lines->push_back(line_ + CutMarker(max_line_bytes_));
  line_.clear();
  dropping_ = true;
}

void LineSplitter::EndLine(std::vector<std::string>* lines) {
  if (!dropping_) lines->push_back(std::move(line_));
  line_.clear();
  carriage_return_ = false;
  dropping_ = false;
}

void LineSplitter::Finish(std::vector<std::string>* lines) {
  if (!line_.empty() && !dropping_) lines->push_back(std::move(line_));
  line_.clear();
  carriage_return_ = false;
  dropping_ = false;
}

size_t LineSplitter::Resync(bool at_line_start) {
  const size_t dropped = line_.size();
  line_.clear();
  carriage_return_ = false;
  dropping_ = !at_line_start;
  return dropped;
}

// ---------------------------------------------------------------------------
// LogShipper

std::unique_ptr<LogSink> MakeGrpcLogSink(const rpc::ChannelOptions& coordinator,
                                         const std::string& token, milliseconds rpc_timeout) {
  return std::make_unique<GrpcLogSink>(coordinator, token, rpc_timeout);
}

LogShipper::Stream::~Stream() {
  if (fd >= 0) close(fd);
}

LogShipper::LogShipper(LogShipperOptions options, std::unique_ptr<LogSink> sink)
    : options_(std::move(options)), sink_(std::move(sink)) {}

LogShipper::~LogShipper() { Stop(milliseconds(0)); }

void LogShipper::Start() {
  absl::MutexLock stop_lock(&stop_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
  }
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { Loop(); });
}

void LogShipper::Follow(const RankOutput& rank, const std::string& path) {
  absl::MutexLock lock(&mu_);
  commands_.emplace_back(rank, path);
}

void LogShipper::Ended(const RankOutput& rank) {
  absl::MutexLock lock(&mu_);
  commands_.emplace_back(rank, std::string());
}

void LogShipper::Stop(milliseconds timeout) {
  absl::MutexLock stop_lock(&stop_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      stopping_ = true;
      stop_deadline_ = steady_clock::now() + timeout;
    }
  }
  if (thread_.joinable()) thread_.join();
}

size_t LogShipper::following() {
  absl::MutexLock lock(&mu_);
  return following_;
}

void LogShipper::Loop() {
  rpc::Backoff backoff(options_.backoff);
  steady_clock::time_point next_send = steady_clock::now();
  bool stopping = false;
  while (true) {
    steady_clock::time_point deadline;
    {
      absl::MutexLock lock(&mu_);
      // Woken early once, by Stop; after that rounds keep their pace.
      auto wake = [this, &stopping]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ && !stopping; };
      mu_.AwaitWithTimeout(absl::Condition(&wake), absl::FromChrono(options_.poll_interval));
      stopping = stopping_;
      deadline = stop_deadline_;
    }
    ApplyCommands();
    for (auto& [rank, stream] : streams_) Read(&stream);
    const steady_clock::time_point now = steady_clock::now();
    if (stopping && (streams_.empty() || now >= deadline)) break;
    if (now < next_send) continue;
    absl::Status shipped = ShipPending();
    if (shipped.ok()) {
      backoff.Reset();
      next_send = now;
    } else {
      next_send = steady_clock::now() + backoff.Next();
    }
  }
  size_t unshipped = 0;
  for (const auto& [rank, stream] : streams_) unshipped += stream.pending.size();
  if (unshipped > 0) {
    AIDN_LOG(WARNING) << "output lines left unshipped at shutdown" << Kv("lines", unshipped)
                      << Kv("ranks", streams_.size());
  }
}

absl::Status LogShipper::RunOnce() {
  ApplyCommands();
  for (auto& [rank, stream] : streams_) Read(&stream);
  return ShipPending();
}

void LogShipper::ApplyCommands() {
  std::vector<std::pair<RankOutput, std::string>> commands;
  {
    absl::MutexLock lock(&mu_);
    commands.swap(commands_);
  }
  for (auto& [rank, path] : commands) {
    auto it = streams_.find(rank);
    if (path.empty()) {  // Ended
      if (it != streams_.end()) it->second.ended = true;
      continue;
    }
    if (it != streams_.end()) {  // followed again before it was forgotten
      it->second.ended = false;
      it->second.drained = false;
      continue;
    }
    Stream& s = streams_.try_emplace(rank, path, options_.max_line_bytes).first->second;
    if (auto r = remembered_.find(rank); r != remembered_.end()) {
      s.offset = r->second.offset;
      s.next_seq = r->second.next_seq;
      remembered_.erase(r);
    }
  }
  absl::MutexLock lock(&mu_);
  following_ = streams_.size();
}

void LogShipper::AddLine(Stream* s, std::string text) {
  v1::LogLine& line = s->pending.emplace_back();
  line.set_seq(s->next_seq++);
  *line.mutable_time() =
      google::protobuf::util::TimeUtil::MicrosecondsToTimestamp(absl::ToUnixMicros(absl::Now()));
  s->pending_bytes += text.size();
  line.set_text(std::move(text));
}

void LogShipper::SkipAhead(Stream* s, int64_t size) {
  const int64_t to = size - options_.max_backlog_bytes / 2;
  // Behind mostly in lines read and not yet acknowledged: nothing to skip.
  if (to <= s->offset) return;
  char before = '\0';
  const bool at_line_start = pread(s->fd, &before, 1, to - 1) == 1 && before == '\n';
  const int64_t skipped =
      (to - s->offset) + static_cast<int64_t>(s->splitter.Resync(at_line_start));
  s->offset = to;
  AddLine(s, absl::StrCat("[aidn: ", skipped,
                          " bytes of output skipped: the rank wrote faster than the worker could "
                          "ship]"));
}

void LogShipper::Read(Stream* s) {
  if (s->drained) return;
  if (s->fd < 0) {
    s->fd = open(s->path.c_str(), O_RDONLY | O_CLOEXEC);
    if (s->fd < 0) {
      // Not there yet; once the process ended there is nothing to wait for.
      if (s->ended) s->drained = true;
      return;
    }
  }
  // Whether the process had ended before the size was read: then the size
  // is final and reading up to it reads everything.
  const bool ended = s->ended;
  struct stat st {};
  if (fstat(s->fd, &st) != 0) return;
  const int64_t size = st.st_size;
  if (size < s->offset) s->offset = size;  // truncated: carry on from its end
  const int64_t backlog = size - s->offset + static_cast<int64_t>(s->pending_bytes);
  if (backlog > options_.max_backlog_bytes) SkipAhead(s, size);
  std::string buffer(kReadBytes, '\0');
  std::vector<std::string> lines;
  while (s->offset < size && s->pending_bytes < options_.max_pending_bytes) {
    const size_t want = static_cast<size_t>(std::min<int64_t>(kReadBytes, size - s->offset));
    const ssize_t n = pread(s->fd, buffer.data(), want, s->offset);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      break;
    }
    s->offset += n;
    lines.clear();
    s->splitter.Feed(std::string_view(buffer.data(), static_cast<size_t>(n)), &lines);
    for (std::string& line : lines) AddLine(s, std::move(line));
  }
  if (ended && s->offset >= size) {
    lines.clear();
    s->splitter.Finish(&lines);
    for (std::string& line : lines) AddLine(s, std::move(line));
    s->drained = true;
  }
}

absl::Status LogShipper::ShipPending() {
  while (true) {
    v1::ShipLogsRequest request;
    request.set_worker_id(options_.worker_id);
    // What the batch takes of each stream: lines, and whether it says
    // "complete".
    std::vector<std::pair<std::map<RankOutput, Stream>::iterator, size_t>> taken;
    size_t lines = 0;
    size_t bytes = 0;
    bool full = false;
    for (auto it = streams_.begin(); it != streams_.end() && !full; ++it) {
      Stream& s = it->second;
      if (s.pending.empty() && !s.drained) continue;
      v1::LogChunk* chunk = request.add_chunks();
      chunk->set_job_id(it->first.job_id);
      chunk->set_generation(it->first.generation);
      chunk->set_rank(it->first.rank);
      size_t n = 0;
      for (const v1::LogLine& line : s.pending) {
        if (lines > 0 && (lines + 1 > options_.max_batch_lines ||
                          bytes + line.text().size() > options_.max_batch_bytes)) {
          full = true;
          break;
        }
        *chunk->add_lines() = line;
        ++lines;
        bytes += line.text().size();
        ++n;
      }
      chunk->set_complete(s.drained && n == s.pending.size());
      taken.emplace_back(it, n);
    }
    if (taken.empty()) return absl::OkStatus();
    absl::Status status = sink_->Ship(request);
    if (!status.ok() && status.code() != absl::StatusCode::kInvalidArgument &&
        status.code() != absl::StatusCode::kUnimplemented) {
      return status;
    }
    if (!status.ok()) {
      AIDN_LOG(WARNING) << "output lines refused by the coordinator; dropped" << Kv("lines", lines)
                        << Kv("error", status);
    }
    for (int i = 0; i < request.chunks_size(); ++i) {
      auto [it, n] = taken[static_cast<size_t>(i)];
      Stream& s = it->second;
      for (size_t k = 0; k < n; ++k) {
        s.pending_bytes -= s.pending.front().text().size();
        s.pending.pop_front();
      }
      if (request.chunks(i).complete()) Forget(it);
    }
  }
}

void LogShipper::Forget(std::map<RankOutput, Stream>::iterator it) {
  AIDN_LOG(DEBUG) << "rank output shipped to the end" << Kv("rank", KeyText(it->first))
                  << Kv("lines", it->second.next_seq);
  remembered_[it->first] = {.offset = it->second.offset, .next_seq = it->second.next_seq};
  remembered_order_.push_back(it->first);
  while (remembered_order_.size() > options_.max_remembered) {
    remembered_.erase(remembered_order_.front());
    remembered_order_.pop_front();
  }
  streams_.erase(it);
  absl::MutexLock lock(&mu_);
  following_ = streams_.size();
}

}  // namespace aidn::worker
