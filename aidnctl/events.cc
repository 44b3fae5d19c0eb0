#include "aidnctl/events.h"

#include <algorithm>
#include <ostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "aidnctl/spec_io.h"
#include "common/rpc/client.h"
#include "common/rpc/retry.h"
#include "common/status.h"
#include "grpcpp/client_context.h"

namespace aidn::ctl {
namespace {

using Clock = std::chrono::steady_clock;

// ListEvents' largest page.
constexpr int32_t kPage = 10000;

// Column widths of the followed table: a seq, an ISO time, "job-123", the
// longest common event type.
constexpr char kLineFormat[] = "%-6s  %-20s  %-8s  %-22s  %s\n";

class Follower {
 public:
  Follower(const CommandEnv& env, const EventsOptions& options)
      : env_(env), options_(options), after_(options.after_seq) {}

  absl::Status Run() {
    if (env_.options.format == OutputFormat::kCsv) {
      return absl::InvalidArgumentError(
          "-o csv is only for `aidnctl metrics`; use table, json or yaml here");
    }
    if (env_.options.format == OutputFormat::kTable) Write(FollowedEventHeader());
    rpc::Backoff backoff({.initial = options_.initial_backoff, .max = options_.max_backoff});
    // When the calls began failing; max() while they succeed.
    Clock::time_point away_since = Clock::time_point::max();
    while (true) {
      bool ended = false;
      grpc::Status status = PollOnce(&ended);
      if (status.ok()) {
        if (!*env_.out) return absl::DataLossError("cannot write the output");
        if (ended) return absl::OkStatus();
        away_since = Clock::time_point::max();
        backoff.Reset();
        std::this_thread::sleep_for(options_.interval);
        continue;
      }
      if (!rpc::Transient(status)) {
        return RpcError(status, env_.options.connection.address, env_.options.timeout);
      }
      const Clock::time_point now = Clock::now();
      away_since = std::min(away_since, now);
      if (now - away_since >= options_.reconnect_timeout) {
        return GaveUpReconnecting(env_.options.connection.address, options_.reconnect_timeout,
                                  status.error_message());
      }
      backoff.Sleep();
    }
  }

 private:
  // Prints every event past the last one shown. `ended`: the job had ended
  // before the events were read, so they include its last.
  grpc::Status PollOnce(bool* ended) {
    if (!options_.job_id.empty()) {
      v1::GetJobRequest request;
      request.set_job_id(options_.job_id);
      v1::Job job;
      grpc::ClientContext context;
      rpc::PrepareContext(&context, env_.options.connection.token, env_.options.timeout);
      grpc::Status status = env_.stub->GetJob(&context, request, &job);
      if (!status.ok()) return status;
      *ended = IsTerminal(job.state());
    }
    while (true) {
      v1::ListEventsRequest request;
      request.set_job_id(options_.job_id);
      request.set_after_seq(after_);
      request.set_limit(kPage);
      v1::ListEventsResponse response;
      grpc::ClientContext context;
      rpc::PrepareContext(&context, env_.options.connection.token, env_.options.timeout);
      grpc::Status status = env_.stub->ListEvents(&context, request, &response);
      if (!status.ok()) return status;
      for (const v1::Event& event : response.events()) {
        if (event.seq() <= after_) continue;
        Print(event);
        after_ = event.seq();
      }
      env_.out->flush();
      if (response.events_size() < kPage) return grpc::Status::OK;
    }
  }

  void Print(const v1::Event& event) {
    switch (env_.options.format) {
      case OutputFormat::kTable:
      case OutputFormat::kCsv:  // refused in Run
        Write(FollowedEventLine(event));
        return;
      case OutputFormat::kJson:
        Write(MessageToJsonLine(event));
        return;
      case OutputFormat::kYaml:
        if (absl::StatusOr<std::string> yaml = MessageToYaml(event); yaml.ok()) {
          Write("---\n" + *yaml);
        }
        return;
    }
  }

  void Write(const absl::StatusOr<std::string>& text) {
    if (text.ok()) *env_.out << *text;
  }

  const CommandEnv& env_;
  const EventsOptions& options_;
  int64_t after_;
};

}  // namespace

std::string FollowedEventHeader() {
  return absl::StrFormat(kLineFormat, "SEQ", "TIME", "JOB", "TYPE", "MESSAGE");
}

std::string FollowedEventLine(const v1::Event& event) {
  return absl::StrFormat(kLineFormat, absl::StrCat(event.seq()), FormatTimestamp(event.time()),
                         event.job_id().empty() ? "-" : event.job_id(), event.type(),
                         OneLine(event.message()));
}

absl::Status FollowEvents(const CommandEnv& env, const EventsOptions& options) {
  if (options.limit != 0) {
    return absl::InvalidArgumentError(
        "--limit does not go with --follow, which prints every event; use --after to start later");
  }
  return Follower(env, options).Run();
}

}  // namespace aidn::ctl
