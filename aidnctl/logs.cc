#include "aidnctl/logs.h"

#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/rpc/client.h"
#include "common/rpc/retry.h"
#include "google/protobuf/util/time_util.h"
#include "grpcpp/client_context.h"
#include "nlohmann/json.hpp"

namespace aidn::ctl {
namespace {

using Clock = std::chrono::steady_clock;

// One JSON object on one line; the text as a string (bytes that are not
// UTF-8 become U+FFFD), not base64 as the proto's JSON mapping has it.
std::string LogLineJson(const v1::LogEntry& entry) {
  nlohmann::ordered_json json;
  json["generation"] = entry.generation();
  json["rank"] = entry.rank();
  json["seq"] = entry.seq();
  json["time"] = google::protobuf::util::TimeUtil::ToString(entry.time());
  json["text"] = entry.text();
  return json.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

class LogReader {
 public:
  LogReader(const CommandEnv& env, const LogsOptions& options)
      : env_(env), options_(options), with_generation_(options.all_generations) {}

  absl::Status Run() {
    if (env_.options.format != OutputFormat::kTable && env_.options.format != OutputFormat::kJson) {
      return absl::InvalidArgumentError("logs prints text (-o table) or JSON Lines (-o json)");
    }
    rpc::Backoff backoff({.initial = options_.initial_backoff, .max = options_.max_backoff});
    std::optional<Clock::time_point> away_since;
    const std::string& address = env_.options.connection.address;
    while (true) {
      bool received = false;
      grpc::Status status = ReadOnce(&received);
      if (status.ok()) return absl::OkStatus();
      if (received) {
        away_since.reset();
        backoff.Reset();
      }
      // Only a follower whose stream was open is called again, and only for
      // a coordinator away, restarting or busy.
      if (!options_.follow || !opened_ || !rpc::Transient(status)) {
        return RpcError(status, address, env_.options.timeout);
      }
      const Clock::time_point now = Clock::now();
      if (!away_since) away_since = now;
      if (now - *away_since >= options_.reconnect_timeout) {
        return GaveUpReconnecting(address, options_.reconnect_timeout, status.error_message());
      }
      backoff.Sleep();
    }
  }

 private:
  grpc::Status ReadOnce(bool* received) {
    grpc::ClientContext context;
    // A follower's stream lasts as long as the job; a plain read gets the
    // usual deadline.
    rpc::PrepareContext(&context, env_.options.connection.token,
                        options_.follow ? std::chrono::milliseconds(0) : env_.options.timeout);
    v1::ReadLogsRequest request;
    request.set_job_id(options_.job_id);
    if (options_.rank) request.set_rank(*options_.rank);
    if (options_.generation) request.set_generation(*options_.generation);
    if (generation_) request.set_generation(*generation_);
    request.set_all_generations(options_.all_generations);
    // Again after a break: from the start, skipping what was shown.
    if (!opened_) request.set_tail(options_.tail);
    request.set_follow(options_.follow);
    std::unique_ptr<grpc::ClientReaderInterface<v1::ReadLogsResponse>> reader =
        env_.stub->ReadLogs(&context, request);
    v1::ReadLogsResponse response;
    while (reader->Read(&response)) {
      opened_ = true;
      *received = true;
      Print(response);
      response.Clear();
    }
    env_.out->flush();
    return reader->Finish();
  }

  void Print(const v1::ReadLogsResponse& response) {
    std::ostream& out = *env_.out;
    if (response.dropped_lines() > dropped_shown_) {
      if (env_.options.format == OutputFormat::kTable) {
        out << "[aidn: " << response.dropped_lines() - dropped_shown_ << " older lines ("
            << FormatBytes(response.dropped_bytes() - dropped_bytes_shown_)
            << ") dropped: the job printed more than the coordinator keeps per job]\n";
      }
      dropped_shown_ = response.dropped_lines();
      dropped_bytes_shown_ = response.dropped_bytes();
    }
    for (const v1::LogEntry& entry : response.lines()) {
      // The generation read is pinned once known, so a reconnect reads the
      // same one even if the job has moved on.
      if (!options_.all_generations) generation_ = entry.generation();
      int64_t& shown = shown_[{entry.generation(), entry.rank()}];
      if (entry.seq() < shown) continue;
      shown = entry.seq() + 1;
      if (env_.options.format == OutputFormat::kJson) {
        out << LogLineJson(entry) << '\n';
      } else {
        out << FormatLogLine(entry, with_generation_) << '\n';
      }
    }
    out.flush();
  }

  const CommandEnv& env_;
  const LogsOptions& options_;
  const bool with_generation_;
  // A stream delivered something (so a break is worth reading again).
  bool opened_ = false;
  std::optional<int64_t> generation_;
  // Per (generation, rank): the next line number to show.
  std::map<std::pair<int64_t, int32_t>, int64_t> shown_;
  int64_t dropped_shown_ = 0;
  int64_t dropped_bytes_shown_ = 0;
};

}  // namespace

std::string FormatLogLine(const v1::LogEntry& entry, bool with_generation) {
  if (with_generation) {
    return absl::StrCat("[gen ", entry.generation(), " rank ", entry.rank(), "] ", entry.text());
  }
  return absl::StrCat("[rank ", entry.rank(), "] ", entry.text());
}

absl::Status RunLogs(const CommandEnv& env, const LogsOptions& options) {
  return LogReader(env, options).Run();
}

}  // namespace aidn::ctl
