#ifndef AIDN_WORKER_LOG_SHIPPER_H_
#define AIDN_WORKER_LOG_SHIPPER_H_

// Ships the ranks' output to the coordinator. Each rank process writes its
// stdout and stderr to a file (<work_dir>/logs/<job>/gen-<g>/rank-<r>.log);
// the shipper follows each file by offset, splits it into lines and sends
// them in batches (ClusterService.ShipLogs), numbered per rank so the
// coordinator stores each once however often it is sent.
//
//   LogShipper shipper(options, MakeGrpcLogSink(...));
//   shipper.Start();
//   shipper.Follow(rank, path);     // a rank process started
//   shipper.Ended(rank);            // it exited: ship the rest, then forget it
//   shipper.Stop(3s);               // last chance to ship, then joined
//
// Bounds: a line is at most max_line_bytes (a longer one is cut and
// marked); of a line rewritten with carriage returns (a progress bar) only
// the last rewrite is kept; a rank whose unshipped output passes
// max_backlog_bytes has its oldest unread output skipped, and a marker line
// says how many bytes. Unacknowledged lines are kept (at most
// max_pending_bytes per rank; past that the file itself is the buffer) and
// sent again after a failed call, so a coordinator restart loses nothing.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "aidn/v1/cluster.pb.h"
#include "common/rpc/client.h"
#include "common/rpc/retry.h"

namespace aidn::worker {

// Splits output bytes into lines. Not thread-safe.
class LineSplitter {
 public:
  explicit LineSplitter(size_t max_line_bytes) : max_line_bytes_(max_line_bytes) {}

  // Appends the lines `data` completes to *lines, without their endings.
  // "\r\n" ends a line like "\n"; text after a lone "\r" replaces the line
  // so far. A line longer than max_line_bytes is cut there, marked, and the
  // rest of it dropped.
  void Feed(std::string_view data, std::vector<std::string>* lines);
  // The output ended: the partial last line, if any, becomes a line.
  void Finish(std::vector<std::string>* lines);
  // Output was skipped: the partial line is dropped and, unless the output
  // resumes at the start of a line, everything up to the next newline too
  // (a line's tail alone would mislead). Returns the bytes dropped now.
  size_t Resync(bool at_line_start);

  // What a cut line ends with.
  static std::string CutMarker(size_t max_line_bytes);

 private:
  void Append(std::string_view text, std::vector<std::string>* lines);
  void EndLine(std::vector<std::string>* lines);

  const size_t max_line_bytes_;
  std::string line_;
  // A '\r' was the last byte: what follows decides whether it ended the
  // line ("\r\n") or starts a rewrite of it.
  bool carriage_return_ = false;
  // Dropping bytes up to the next newline (a line cut, or a resync).
  bool dropping_ = false;
};

// Where batches go: ClusterService.ShipLogs, or a test's fake.
class LogSink {
 public:
  virtual ~LogSink() = default;
  // OK: every chunk is stored. INVALID_ARGUMENT, UNIMPLEMENTED: refused for
  // good (the batch is dropped). Anything else: send again later.
  virtual absl::Status Ship(const v1::ShipLogsRequest& request) = 0;
};

// ShipLogs over gRPC with the worker token; each call has `rpc_timeout`.
std::unique_ptr<LogSink> MakeGrpcLogSink(const rpc::ChannelOptions& coordinator,
                                         const std::string& token,
                                         std::chrono::milliseconds rpc_timeout);

struct LogShipperOptions {
  // Sent as ShipLogsRequest.worker_id.
  std::string worker_id;
  // How often the files are read for new output.
  std::chrono::milliseconds poll_interval{250};
  // Longest line shipped; longer ones are cut and marked.
  size_t max_line_bytes = 16 * 1024;
  // A batch (one call) holds at most this many lines and text bytes.
  size_t max_batch_lines = 4096;
  size_t max_batch_bytes = 1024 * 1024;
  // Read but unacknowledged lines kept per rank; past it reading pauses.
  size_t max_pending_bytes = 4 * 1024 * 1024;
  // Output of a rank not yet shipped (unread plus pending) beyond which the
  // oldest unread part is skipped, leaving half of this to read.
  int64_t max_backlog_bytes = 64 * 1024 * 1024;
  // Waits between failed calls.
  rpc::BackoffOptions backoff{.initial = std::chrono::milliseconds(200),
                              .max = std::chrono::milliseconds(5000)};
  // Ranks shipped to the end remembered (where their file ended), so one
  // followed again (a process restarted in place, appending to the same
  // file) carries on rather than reading its file again.
  size_t max_remembered = 4096;
};

// One rank of one generation of a job.
struct RankOutput {
  std::string job_id;
  int64_t generation = 0;
  int32_t rank = 0;
  friend bool operator<(const RankOutput& a, const RankOutput& b) {
    return std::tie(a.job_id, a.generation, a.rank) < std::tie(b.job_id, b.generation, b.rank);
  }
};

// Thread-safe: Follow, Ended and Stop may be called from any thread; the
// files are read and batches sent on the shipper's own thread (Start), or
// on the caller's in RunOnce (tests, without Start).
class LogShipper {
 public:
  LogShipper(LogShipperOptions options, std::unique_ptr<LogSink> sink);
  // Stop(0).
  ~LogShipper();
  LogShipper(const LogShipper&) = delete;
  LogShipper& operator=(const LogShipper&) = delete;

  // Starts the thread (once; a no-op after Stop).
  void Start();
  // Follows the rank's output file from its start, or from where it was
  // left if the rank was followed before. The file may not exist yet.
  void Follow(const RankOutput& rank, const std::string& path);
  // The rank's process ended: its file is shipped to the end (the partial
  // last line too), the coordinator told it is complete, then it is
  // forgotten.
  void Ended(const RankOutput& rank);
  // Ships what it can for at most `timeout` (ranks ended or not), then
  // joins the thread. Idempotent.
  void Stop(std::chrono::milliseconds timeout);

  // One round on the caller's thread: reads every file, sends batches
  // until all is acknowledged or a call fails (its status is returned).
  // Only without Start.
  absl::Status RunOnce();
  // Ranks followed and not yet forgotten.
  size_t following();

 private:
  struct Stream {
    Stream(std::string path, size_t max_line_bytes)
        : path(std::move(path)), splitter(max_line_bytes) {}
    ~Stream();  // closes fd
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    std::string path;
    int fd = -1;
    int64_t offset = 0;
    int64_t next_seq = 0;
    LineSplitter splitter;
    // Read, not yet acknowledged; their text bytes.
    std::deque<v1::LogLine> pending;
    size_t pending_bytes = 0;
    // The process ended; then its file was read to the end.
    bool ended = false;
    bool drained = false;
  };
  void Loop();
  void ApplyCommands();
  void Read(Stream* s);
  // Skips the oldest unread output of a rank that is too far behind.
  void SkipAhead(Stream* s, int64_t size);
  void AddLine(Stream* s, std::string text);
  // Sends batches until nothing is pending or a call fails.
  absl::Status ShipPending();
  void Forget(std::map<RankOutput, Stream>::iterator it);

  const LogShipperOptions options_;
  const std::unique_ptr<LogSink> sink_;

  absl::Mutex mu_;
  // Handed to the shipping thread: Follow (path set) and Ended (empty).
  std::vector<std::pair<RankOutput, std::string>> commands_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point stop_deadline_ ABSL_GUARDED_BY(mu_);
  size_t following_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
  absl::Mutex stop_mu_;

  // The shipping thread's (or RunOnce's caller's) only.
  std::map<RankOutput, Stream> streams_;
  struct Remembered {
    int64_t offset = 0;
    int64_t next_seq = 0;
  };
  std::map<RankOutput, Remembered> remembered_;
  std::deque<RankOutput> remembered_order_;
};

}  // namespace aidn::worker

#endif  // AIDN_WORKER_LOG_SHIPPER_H_
