#ifndef AIDN_AIDNCTL_COMMANDS_H_
#define AIDN_AIDNCTL_COMMANDS_H_

// The aidnctl commands, one function each, over a CoordinatorService stub.
// main.cc parses the command line into these options and calls them.
//
// Every command makes its calls with the bearer token and a deadline of
// `timeout` per call, prints its answer on `out` (table, JSON or YAML) and
// returns an error whose message is one line ready to follow
// "aidnctl: error: ": the coordinator being unreachable, slow, refusing the
// token, or answering with an error (see RpcError).

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "aidnctl/config.h"
#include "aidnctl/output.h"
#include "grpcpp/support/status.h"

namespace aidn::ctl {

struct GlobalOptions {
  ConnectionSettings connection;
  OutputFormat format = OutputFormat::kTable;
  // Deadline of each call.
  std::chrono::milliseconds timeout{30000};
};

// What a command runs against. Not owned.
struct CommandEnv {
  GlobalOptions options;
  v1::CoordinatorService::StubInterface* stub = nullptr;
  std::ostream* out = nullptr;
  // Read by `submit -f -`.
  std::istream* in = nullptr;
  // Ages in tables are taken at this time.
  absl::Time now = absl::Now();
};

// A channel to `connection.address`, TLS as the connection says.
std::shared_ptr<grpc::Channel> NewChannel(const ConnectionSettings& connection);
// A stub over NewChannel(connection).
std::unique_ptr<v1::CoordinatorService::Stub> NewCoordinatorStub(
    const ConnectionSettings& connection);

struct ListOptions {
  // Empty: every state.
  std::vector<v1::Job::State> states;
  std::map<std::string, std::string> labels;
  // Stop after this many jobs (following next_page_token until then); 0: all.
  int limit = 100;
};

struct EventsOptions {
  // Empty: every job's and the cluster's events.
  std::string job_id;
  int64_t after_seq = 0;
  // 0: the coordinator's default (1000). Not with follow.
  int32_t limit = 0;
  // Keep printing new events (aidnctl/events.h).
  bool follow = false;
  std::chrono::milliseconds interval{1000};
  std::chrono::milliseconds initial_backoff{200};
  std::chrono::milliseconds max_backoff{2000};
  std::chrono::milliseconds reconnect_timeout{std::chrono::minutes(5)};
};

// Table output: "submitted <job-id>"; JSON/YAML: the SubmitJobResponse.
// `path` "-" reads the spec from env.in. `job_id`, if given, receives the new
// job's ID.
absl::Status RunSubmit(const CommandEnv& env, const std::string& path,
                       std::string* job_id = nullptr);
// Table output: JobsTable; JSON/YAML: one ListJobsResponse holding every job
// fetched, with the next_page_token of the last page read.
absl::Status RunList(const CommandEnv& env, const ListOptions& options);
// Table output: DescribeJob; JSON/YAML: the Job.
absl::Status RunDescribe(const CommandEnv& env, const std::string& job_id);
// Table output: "cancelled <job-id>"; JSON/YAML: the Job.
absl::Status RunCancel(const CommandEnv& env, const std::string& job_id, const std::string& reason);
struct PauseOptions {
  std::string job_id;
  std::string reason;
  // Return once the job is PAUSED (GetJob every `poll_interval`) or has
  // ended, or fail after `wait_timeout`.
  bool wait = false;
  std::chrono::milliseconds wait_timeout{std::chrono::minutes(10)};
  std::chrono::milliseconds poll_interval{500};
};
// Table output: "pausing <job-id>: ..." (with --wait, then "paused <job-id>
// at checkpoint step N", or how it ended instead); JSON/YAML: the Job (with
// --wait, as it is at the end).
absl::Status RunPause(const CommandEnv& env, const PauseOptions& options);
// Table output: "resumed <job-id>: continues from checkpoint step N";
// JSON/YAML: the Job.
absl::Status RunResume(const CommandEnv& env, const std::string& job_id);
// Table output: WorkersTable; JSON/YAML: the ListWorkersResponse.
absl::Status RunWorkers(const CommandEnv& env);
enum class WorkerOp { kCordon, kUncordon, kDrain, kRemove };

struct WorkerOpOptions {
  std::string worker_id;
  // Recorded in the worker's event (cordon, drain).
  std::string reason;
  // drain: return once no job has ranks on the worker (ListWorkers every
  // `poll_interval`), or fail after `wait_timeout`.
  bool wait = false;
  std::chrono::milliseconds wait_timeout{std::chrono::hours(1)};
  std::chrono::milliseconds poll_interval{1000};
};

// cordon, uncordon, drain (SetWorkerScheduling) or remove (RemoveWorker) one
// worker; admins only. Table output: "cordoned w1" and so on (drain adds
// what its jobs will do, --wait "drained w1" at the end); JSON/YAML: the
// Worker (remove: {}).
absl::Status RunWorkerOp(const CommandEnv& env, WorkerOp op, const WorkerOpOptions& options);
// Table output: EventsTable; JSON/YAML: the ListEventsResponse. With
// options.follow: FollowEvents (aidnctl/events.h).
absl::Status RunEvents(const CommandEnv& env, const EventsOptions& options);
// Table output: CheckpointsTable; JSON/YAML: the ListCheckpointsResponse.
absl::Status RunCheckpoints(const CommandEnv& env, const std::string& job_id);

// "aidnctl <version>" or, for JSON/YAML, {"client_version": ...}.
std::string VersionText(OutputFormat format);

// The failure of one call as a one-line error for a person:
//   UNAVAILABLE        cannot reach coordinator at <address>: <grpc message>
//   DEADLINE_EXCEEDED  coordinator at <address> did not answer within <timeout> ...
//   UNAUTHENTICATED    not authenticated by the coordinator: ... (hint: --token, AIDN_TOKEN)
//   PERMISSION_DENIED  permission denied: ... (same hint)
//   INVALID_ARGUMENT   <invalid_argument_prefix><server message>
//   others             the server's message
// keeping the call's status code.
absl::Status RpcError(const grpc::Status& status, const std::string& address,
                      std::chrono::milliseconds timeout,
                      absl::string_view invalid_argument_prefix = "");

// What a follower (watch, logs --follow, events --follow) returns when the
// coordinator at `address` has not answered for `reconnect_timeout`:
// UNAVAILABLE, "gave up reconnecting to the coordinator at <address> after
// <timeout>: <why>".
absl::Status GaveUpReconnecting(const std::string& address,
                                std::chrono::milliseconds reconnect_timeout, absl::string_view why);

// Flag values. Case-insensitive: "running" → RUNNING.
absl::StatusOr<v1::Job::State> ParseJobState(absl::string_view text);
// "key=value" (the value may be empty or hold '=').
absl::StatusOr<std::pair<std::string, std::string>> ParseLabel(absl::string_view text);
// "30s", "500ms", "2m", or a bare number of seconds; must be positive.
absl::StatusOr<std::chrono::milliseconds> ParseTimeout(absl::string_view text);

// The command line's shape, for the completion script.
struct CompletionFlag {
  std::vector<std::string> names;  // "-o", "--output"
  bool takes_value = false;
  // Its value is a path (completed as file names).
  bool takes_file = false;
};
struct CompletionCommand {
  std::string name;
  std::vector<CompletionFlag> flags;
};
// A bash completion script (`source <(aidnctl completion bash)`) completing
// commands, their flags, file names for flags that take_file, the values of
// --output (csv for metrics too) and --state, and the shell of `completion`.
// A command's own flag comes before a global flag of the same name (plot's
// -o is its output file).
std::string BashCompletionScript(const std::vector<CompletionFlag>& global_flags,
                                 const std::vector<CompletionCommand>& commands);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_COMMANDS_H_
