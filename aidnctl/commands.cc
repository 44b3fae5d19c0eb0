#include "aidnctl/commands.h"

#include <algorithm>
#include <functional>
#include <ostream>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "aidn/config.h"
#include "aidnctl/events.h"
#include "aidnctl/spec_io.h"
#include "common/rpc/client.h"
#include "common/rpc/status_convert.h"
#include "common/status.h"
#include "grpcpp/client_context.h"

namespace aidn::ctl {
namespace {

using Stub = v1::CoordinatorService::StubInterface;

// The largest page ListJobs serves.
constexpr int kMaxPageSize = 1000;

constexpr char kTokenHint[] =
    "pass a token with --token, AIDN_TOKEN or token/token_file in ~/.config/aidn/config";

template <typename Request, typename Response>
absl::Status Call(const CommandEnv& env,
                  grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                  const Request& request, Response* response,
                  absl::string_view invalid_argument_prefix = "") {
  grpc::ClientContext context;
  rpc::PrepareContext(&context, env.options.connection.token, env.options.timeout);
  const grpc::Status status = (env.stub->*method)(&context, request, response);
  if (status.ok()) return absl::OkStatus();
  return RpcError(status, env.options.connection.address, env.options.timeout,
                  invalid_argument_prefix);
}

// Prints `message` as JSON/YAML, or what `table` makes of it.
absl::Status Print(const CommandEnv& env, const google::protobuf::Message& message,
                   const std::function<absl::StatusOr<std::string>()>& table) {
  absl::StatusOr<std::string> text = env.options.format == OutputFormat::kTable
                                         ? table()
                                         : FormatMessage(message, env.options.format);
  if (!text.ok()) return text.status();
  *env.out << *text;
  env.out->flush();
  if (!*env.out) return absl::DataLossError("cannot write the output");
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<grpc::Channel> NewChannel(const ConnectionSettings& connection) {
  rpc::ChannelOptions options;
  options.address = connection.address;
  options.tls_ca_file = connection.tls_ca_file;
  options.insecure = connection.insecure;
  return rpc::MakeChannel(options);
}

std::unique_ptr<v1::CoordinatorService::Stub> NewCoordinatorStub(
    const ConnectionSettings& connection) {
  return v1::CoordinatorService::NewStub(NewChannel(connection));
}

absl::Status RpcError(const grpc::Status& status, const std::string& address,
                      std::chrono::milliseconds timeout,
                      absl::string_view invalid_argument_prefix) {
  const absl::StatusCode code = rpc::FromGrpcStatus(status).code();
  std::string message = OneLine(status.error_message());
  if (message.empty()) message = absl::StatusCodeToString(code);
  std::string what;
  switch (code) {
    case absl::StatusCode::kUnavailable:
      what = absl::StrCat("cannot reach coordinator at ", address, ": ", message);
      break;
    case absl::StatusCode::kDeadlineExceeded:
      what = absl::StrCat("coordinator at ", address, " did not answer within ",
                          absl::FormatDuration(absl::FromChrono(timeout)),
                          " (see --timeout): ", message);
      break;
    case absl::StatusCode::kUnauthenticated:
      what = absl::StrCat("not authenticated by the coordinator: ", message, "; ", kTokenHint);
      break;
    case absl::StatusCode::kPermissionDenied:
      what = absl::StrCat("permission denied: ", message, "; ", kTokenHint);
      break;
    case absl::StatusCode::kInvalidArgument:
      what = absl::StrCat(invalid_argument_prefix, message);
      break;
    case absl::StatusCode::kUnimplemented:
      what =
          absl::StrCat("the coordinator at ", address, " does not implement this call: ", message);
      break;
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:
      what = absl::StrCat("coordinator error (", absl::StatusCodeToString(code), "): ", message);
      break;
    default:
      what = message;
      break;
  }
  return absl::Status(code, what);
}

absl::Status RunSubmit(const CommandEnv& env, const std::string& path, std::string* job_id) {
  v1::SubmitJobRequest request;
  AIDN_ASSIGN_OR_RETURN(*request.mutable_spec(), ReadJobSpec(path, *env.in));
  AIDN_RETURN_IF_ERROR(CheckJobSpecSizes(request.spec(), path == "-" ? "<stdin>" : path,
                                         // Less the request's own framing.
                                         rpc::ChannelOptions().max_message_bytes - 64));
  v1::SubmitJobResponse response;
  AIDN_RETURN_IF_ERROR(Call(env, &Stub::SubmitJob, request, &response,
                            /*invalid_argument_prefix=*/"invalid job spec: "));
  if (job_id != nullptr) *job_id = response.job().id();
  return Print(env, response, [&]() -> absl::StatusOr<std::string> {
    return absl::StrCat("submitted ", response.job().id(), "\n");
  });
}

absl::Status RunList(const CommandEnv& env, const ListOptions& options) {
  v1::ListJobsResponse all;
  std::set<std::string> tokens_seen;
  std::string page_token;
  while (true) {
    v1::ListJobsRequest request;
    for (v1::Job::State state : options.states) request.add_states(state);
    for (const auto& [key, value] : options.labels) (*request.mutable_labels())[key] = value;
    const int wanted = options.limit > 0 ? options.limit - all.jobs_size() : kMaxPageSize;
    request.set_page_size(std::min(wanted, kMaxPageSize));
    request.set_page_token(page_token);
    v1::ListJobsResponse page;
    AIDN_RETURN_IF_ERROR(Call(env, &Stub::ListJobs, request, &page));
    for (v1::Job& job : *page.mutable_jobs()) {
      if (options.limit > 0 && all.jobs_size() >= options.limit) break;
      *all.add_jobs() = std::move(job);
    }
    all.set_next_page_token(page.next_page_token());
    page_token = page.next_page_token();
    if (page_token.empty() || (options.limit > 0 && all.jobs_size() >= options.limit)) break;
    // A coordinator that hands out the same token again would loop us forever.
    if (page.jobs().empty() || !tokens_seen.insert(page_token).second) break;
  }
  return Print(env, all,
               [&]() -> absl::StatusOr<std::string> { return JobsTable(all.jobs(), env.now); });
}

absl::Status RunDescribe(const CommandEnv& env, const std::string& job_id) {
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  AIDN_RETURN_IF_ERROR(Call(env, &Stub::GetJob, request, &job));
  return Print(env, job, [&]() { return DescribeJob(job, env.now); });
}

absl::Status RunCancel(const CommandEnv& env, const std::string& job_id,
                       const std::string& reason) {
  v1::CancelJobRequest request;
  request.set_job_id(job_id);
  request.set_reason(reason);
  v1::Job job;
  AIDN_RETURN_IF_ERROR(Call(env, &Stub::CancelJob, request, &job));
  return Print(env, job, [&]() -> absl::StatusOr<std::string> {
    return absl::StrCat("cancelled ", job.id().empty() ? job_id : job.id(), "\n");
  });
}

absl::Status RunPause(const CommandEnv& env, const PauseOptions& options) {
  v1::PauseJobRequest request;
  request.set_job_id(options.job_id);
  request.set_reason(options.reason);
  v1::Job job;
  AIDN_RETURN_IF_ERROR(Call(env, &Stub::PauseJob, request, &job));
  const bool table = env.options.format == OutputFormat::kTable;
  if (table) {
    *env.out << (job.state() == v1::Job::PAUSED
                     ? absl::StrCat("paused ", job.id())
                     : absl::StrCat("pausing ", job.id(),
                                    ": its ranks checkpoint, then stop (aidnctl resume ", job.id(),
                                    " continues it)"))
             << "\n";
    env.out->flush();
  }
  if (options.wait) {
    const auto deadline = std::chrono::steady_clock::now() + options.wait_timeout;
    v1::GetJobRequest get;
    get.set_job_id(options.job_id);
    while (job.state() != v1::Job::PAUSED && !IsTerminal(job.state())) {
      if (std::chrono::steady_clock::now() + options.poll_interval > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            options.job_id, " has not paused after ",
            absl::FormatDuration(absl::FromChrono(options.wait_timeout)), " (",
            v1::Job::State_Name(job.state()), ": ", job.message(),
            "); a program that never checkpoints on request pauses at its next periodic "
            "checkpoint"));
      }
      std::this_thread::sleep_for(options.poll_interval);
      AIDN_RETURN_IF_ERROR(Call(env, &Stub::GetJob, get, &job));
    }
    if (table) {
      *env.out << (job.state() == v1::Job::PAUSED
                       ? absl::StrCat("paused ", job.id(), " at checkpoint step ",
                                      job.last_checkpoint_step())
                       : absl::StrCat(job.id(), " ended before it paused: ",
                                      v1::Job::State_Name(job.state()), " (", job.message(), ")"))
               << "\n";
    }
  }
  if (table) return absl::OkStatus();
  return Print(env, job, []() -> absl::StatusOr<std::string> { return std::string(); });
}

absl::Status RunResume(const CommandEnv& env, const std::string& job_id) {
  v1::ResumeJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  AIDN_RETURN_IF_ERROR(Call(env, &Stub::ResumeJob, request, &job));
  return Print(env, job, [&]() -> absl::StatusOr<std::string> {
    return absl::StrCat(
        "resumed ", job.id(),
        job.last_checkpoint_step() > 0
            ? absl::StrCat(": continues from checkpoint step ", job.last_checkpoint_step())
            : std::string(": starts from the beginning (no checkpoint)"),
        "\n");
  });
}

absl::Status RunWorkers(const CommandEnv& env) {
  v1::ListWorkersResponse response;
  AIDN_RETURN_IF_ERROR(Call(env, &Stub::ListWorkers, v1::ListWorkersRequest(), &response));
  return Print(env, response, [&]() -> absl::StatusOr<std::string> {
    return WorkersTable(response.workers(), env.now);
  });
}

absl::Status RunWorkerOp(const CommandEnv& env, WorkerOp op, const WorkerOpOptions& options) {
  if (op == WorkerOp::kRemove) {
    v1::RemoveWorkerRequest request;
    request.set_worker_id(options.worker_id);
    v1::RemoveWorkerResponse response;
    AIDN_RETURN_IF_ERROR(Call(env, &Stub::RemoveWorker, request, &response));
    return Print(env, response, [&]() -> absl::StatusOr<std::string> {
      return absl::StrCat("removed ", options.worker_id, "\n");
    });
  }
  v1::SetWorkerSchedulingRequest request;
  request.set_worker_id(options.worker_id);
  request.set_reason(options.reason);
  request.set_scheduling(op == WorkerOp::kCordon  ? v1::Worker::CORDONED
                         : op == WorkerOp::kDrain ? v1::Worker::DRAINING
                                                  : v1::Worker::SCHEDULABLE);
  v1::Worker worker;
  AIDN_RETURN_IF_ERROR(Call(env, &Stub::SetWorkerScheduling, request, &worker));
  AIDN_RETURN_IF_ERROR(Print(env, worker, [&]() -> absl::StatusOr<std::string> {
    const char* done = op == WorkerOp::kCordon  ? "cordoned "
                       : op == WorkerOp::kDrain ? "draining "
                                                : "uncordoned ";
    std::string text = absl::StrCat(done, options.worker_id);
    if (op == WorkerOp::kDrain && worker.job_ids_size() > 0) {
      absl::StrAppend(&text, ": ", absl::StrJoin(worker.job_ids(), ", "),
                      " move(s) to other workers at a checkpoint asked for now (aidnctl events "
                      "--follow shows it)");
    }
    return text + "\n";
  }));
  if (op != WorkerOp::kDrain || !options.wait) return absl::OkStatus();
  const auto deadline = std::chrono::steady_clock::now() + options.wait_timeout;
  while (true) {
    v1::ListWorkersResponse listed;
    AIDN_RETURN_IF_ERROR(Call(env, &Stub::ListWorkers, v1::ListWorkersRequest(), &listed));
    const v1::Worker* now = nullptr;
    for (const v1::Worker& w : listed.workers()) {
      if (w.info().id() == options.worker_id) now = &w;
    }
    if (now == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("worker ", options.worker_id, " was removed while draining"));
    }
    if (now->scheduling() != v1::Worker::DRAINING) {
      return absl::AbortedError(absl::StrCat("worker ", options.worker_id,
                                             " is no longer draining (uncordoned or cordoned "
                                             "by someone else)"));
    }
    if (now->job_ids_size() == 0) {
      if (env.options.format == OutputFormat::kTable) {
        *env.out << "drained " << options.worker_id << "\n";
        env.out->flush();
      }
      return absl::OkStatus();
    }
    if (std::chrono::steady_clock::now() + options.poll_interval > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "worker ", options.worker_id, " still runs ", absl::StrJoin(now->job_ids(), ", "),
          " after ", absl::FormatDuration(absl::FromChrono(options.wait_timeout)),
          " (a job that takes no checkpoints runs to its end there)"));
    }
    std::this_thread::sleep_for(options.poll_interval);
  }
}

absl::Status RunEvents(const CommandEnv& env, const EventsOptions& options) {
  if (options.follow) return FollowEvents(env, options);
  v1::ListEventsRequest request;
  request.set_job_id(options.job_id);
  request.set_after_seq(options.after_seq);
  request.set_limit(options.limit);
  v1::ListEventsResponse response;
  AIDN_RETURN_IF_ERROR(Call(env, &Stub::ListEvents, request, &response));
  return Print(env, response,
               [&]() -> absl::StatusOr<std::string> { return EventsTable(response.events()); });
}

absl::Status RunCheckpoints(const CommandEnv& env, const std::string& job_id) {
  v1::ListCheckpointsRequest request;
  request.set_job_id(job_id);
  v1::ListCheckpointsResponse response;
  AIDN_RETURN_IF_ERROR(Call(env, &Stub::ListCheckpoints, request, &response));
  return Print(env, response, [&]() -> absl::StatusOr<std::string> {
    return CheckpointsTable(response.checkpoints());
  });
}

std::string VersionText(OutputFormat format) {
  const nlohmann::ordered_json json = {{"client_version", AIDN_VERSION}};
  switch (format) {
    case OutputFormat::kJson:
      return json.dump(2) + "\n";
    case OutputFormat::kYaml:
      return JsonToYaml(json);
    case OutputFormat::kTable:
    case OutputFormat::kCsv:  // refused by main
      break;
  }
  return absl::StrCat("aidnctl ", AIDN_VERSION, "\n");
}

absl::StatusOr<v1::Job::State> ParseJobState(absl::string_view text) {
  v1::Job::State state;
  if (!v1::Job::State_Parse(absl::AsciiStrToUpper(text), &state) ||
      state == v1::Job::STATE_UNSPECIFIED) {
    std::vector<std::string> names;
    for (int i = v1::Job::State_MIN; i <= v1::Job::State_MAX; ++i) {
      if (i != v1::Job::STATE_UNSPECIFIED && v1::Job::State_IsValid(i)) {
        names.push_back(v1::Job::State_Name(static_cast<v1::Job::State>(i)));
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("unknown job state \"", text, "\" (one of ", absl::StrJoin(names, ", "), ")"));
  }
  return state;
}

absl::StatusOr<std::pair<std::string, std::string>> ParseLabel(absl::string_view text) {
  const size_t equals = text.find('=');
  if (equals == absl::string_view::npos || equals == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("label \"", text, "\" is not of the form key=value"));
  }
  return std::make_pair(std::string(text.substr(0, equals)), std::string(text.substr(equals + 1)));
}

absl::StatusOr<std::chrono::milliseconds> ParseTimeout(absl::string_view text) {
  std::string written(text);
  double seconds = 0;
  if (absl::SimpleAtod(written, &seconds) && !written.empty() &&
      absl::ascii_isdigit(static_cast<unsigned char>(written.back()))) {
    written += "s";  // a bare number is seconds
  }
  absl::Duration duration;
  if (!absl::ParseDuration(written, &duration) || duration <= absl::ZeroDuration() ||
      duration == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout \"", text, "\" is not a positive duration such as 30s, 500ms or 2m"));
  }
  return std::max(std::chrono::milliseconds(1), absl::ToChronoMilliseconds(duration));
}

absl::Status GaveUpReconnecting(const std::string& address,
                                std::chrono::milliseconds reconnect_timeout,
                                absl::string_view why) {
  return absl::UnavailableError(
      absl::StrCat("gave up reconnecting to the coordinator at ", address, " after ",
                   absl::FormatDuration(absl::FromChrono(reconnect_timeout)), ": ", why));
}

std::string BashCompletionScript(const std::vector<CompletionFlag>& global_flags,
                                 const std::vector<CompletionCommand>& commands) {
  auto names = [](const std::vector<CompletionFlag>& flags, bool only_with_value) {
    std::vector<std::string> out;
    for (const CompletionFlag& flag : flags) {
      if (only_with_value && !flag.takes_value) continue;
      out.insert(out.end(), flag.names.begin(), flag.names.end());
    }
    return absl::StrJoin(out, " ");
  };
  std::vector<std::string> command_names;
  for (const CompletionCommand& command : commands) command_names.push_back(command.name);
  std::vector<std::string> states;
  for (int i = v1::Job::State_MIN; i <= v1::Job::State_MAX; ++i) {
    if (i != v1::Job::STATE_UNSPECIFIED && v1::Job::State_IsValid(i)) {
      states.push_back(absl::AsciiStrToLower(v1::Job::State_Name(static_cast<v1::Job::State>(i))));
    }
  }
  auto alternatives = [](const std::string& words) {
    std::string out = words;
    std::replace(out.begin(), out.end(), ' ', '|');
    return out;
  };
  // Case patterns "<command>:<flag>" for the word before the cursor; the
  // command is "" before one is given, and global flags go anywhere.
  auto patterns = [](const std::string& command, const std::vector<CompletionFlag>& flags,
                     bool (*wanted)(const CompletionFlag&)) {
    std::vector<std::string> out;
    for (const CompletionFlag& flag : flags) {
      if (!wanted(flag)) continue;
      for (const std::string& name : flag.names) out.push_back(absl::StrCat(command, ":", name));
    }
    return out;
  };
  const auto file_flag = [](const CompletionFlag& flag) { return flag.takes_file; };
  const auto value_flag = [](const CompletionFlag& flag) { return flag.takes_value; };
  std::vector<std::string> file_patterns = patterns("*", global_flags, file_flag);
  std::vector<std::string> value_patterns = patterns("*", global_flags, value_flag);
  for (const CompletionCommand& command : commands) {
    for (std::string& p : patterns(command.name, command.flags, file_flag)) {
      file_patterns.push_back(std::move(p));
    }
    for (std::string& p : patterns(command.name, command.flags, value_flag)) {
      value_patterns.push_back(std::move(p));
    }
  }
  const std::string global_value_flags = names(global_flags, true);

  std::string script = absl::StrCat(
      "# bash completion for aidnctl.\n"
      "# Load it with: source <(aidnctl completion bash)\n"
      "_aidnctl() {\n"
      "  local cur=\"${COMP_WORDS[COMP_CWORD]}\"\n"
      "  local prev=\"${COMP_WORDS[COMP_CWORD-1]}\"\n"
      "  local commands=\"",
      absl::StrJoin(command_names, " "),
      "\"\n"
      "  local global_flags=\"",
      names(global_flags, false),
      "\"\n"
      "  local cmd=\"\" i\n"
      "  for ((i = 1; i < COMP_CWORD; i++)); do\n"
      "    case \"${COMP_WORDS[i]}\" in\n");
  if (!global_value_flags.empty()) {
    absl::StrAppend(&script, "      ", alternatives(global_value_flags), ") ((i++)) ;;\n");
  }
  absl::StrAppend(&script,
                  "      -*) ;;\n"
                  "      *) cmd=\"${COMP_WORDS[i]}\"; break ;;\n"
                  "    esac\n"
                  "  done\n"
                  "  case \"$cmd:$prev\" in\n");
  if (!file_patterns.empty()) {
    absl::StrAppend(&script, "    ", absl::StrJoin(file_patterns, "|"),
                    ") COMPREPLY=($(compgen -f -- \"$cur\")); return ;;\n");
  }
  absl::StrAppend(
      &script,
      "    metrics:-o|metrics:--output) COMPREPLY=($(compgen -W \"table json yaml csv\" -- "
      "\"$cur\")); return ;;\n"
      "    *:-o|*:--output) COMPREPLY=($(compgen -W \"table json yaml\" -- \"$cur\")); return ;;\n"
      "    *:--state) COMPREPLY=($(compgen -W \"",
      absl::StrJoin(states, " "), "\" -- \"$cur\")); return ;;\n");
  if (!value_patterns.empty()) {
    absl::StrAppend(&script, "    ", absl::StrJoin(value_patterns, "|"), ") return ;;\n");
  }
  absl::StrAppend(&script,
                  "  esac\n"
                  "  if [[ -z \"$cmd\" ]]; then\n"
                  "    if [[ \"$cur\" == -* ]]; then\n"
                  "      COMPREPLY=($(compgen -W \"$global_flags\" -- \"$cur\"))\n"
                  "    else\n"
                  "      COMPREPLY=($(compgen -W \"$commands\" -- \"$cur\"))\n"
                  "    fi\n"
                  "    return\n"
                  "  fi\n"
                  "  local flags=\"\"\n"
                  "  case \"$cmd\" in\n");
  for (const CompletionCommand& command : commands) {
    absl::StrAppend(&script, "    ", command.name, ") flags=\"", names(command.flags, false),
                    "\" ;;\n");
  }
  absl::StrAppend(&script,
                  "  esac\n"
                  "  if [[ \"$cur\" == -* ]]; then\n"
                  "    COMPREPLY=($(compgen -W \"$flags $global_flags --help\" -- \"$cur\"))\n"
                  "  elif [[ \"$cmd\" == completion ]]; then\n"
                  "    COMPREPLY=($(compgen -W \"bash\" -- \"$cur\"))\n"
                  "  fi\n"
                  "}\n"
                  "complete -F _aidnctl aidnctl\n");
  return script;
}

}  // namespace aidn::ctl
