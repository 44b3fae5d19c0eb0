// aidnctl: the command-line client of the aidn coordinator. Parses the
// command line and calls the command functions of aidnctl_lib (commands.h).
//
// Exit status: 0 on success, 1 when a command fails (coordinator unreachable
// or answering with an error, a bad job spec or config file; for `watch` and
// `submit --watch` also a job that FAILED or was CANCELLED), 2 for a usage
// error, 130 for Ctrl-C during a live watch. Every failure is one line on
// stderr: "aidnctl: error: <what>".

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "aidnctl/commands.h"
#include "aidnctl/config.h"
#include "aidnctl/export.h"
#include "aidnctl/generate.h"
#include "aidnctl/health.h"
#include "aidnctl/logs.h"
#include "aidnctl/metrics.h"
#include "aidnctl/output.h"
#include "aidnctl/plot.h"
#include "aidnctl/watch.h"
#include "common/rpc/client.h"
#include "common/tls.h"

namespace {

namespace ctl = aidn::ctl;

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// A CLI11 validator over one of ctl's parsers.
template <typename Parse>
CLI::Validator Check(Parse parse, const std::string& description) {
  return CLI::Validator(
      [parse](std::string& value) -> std::string {
        auto parsed = parse(value);
        return parsed.ok() ? "" : std::string(parsed.status().message());
      },
      description);
}

const auto kAll = [](const CLI::App*) { return true; };

// A CLI11 validator for counts and sequence numbers.
const CLI::Validator kNotNegative(
    [](std::string& value) -> std::string {
      return !value.empty() && value[0] == '-' ? "must not be negative" : "";
    },
    "NOT NEGATIVE");

int Fail(const std::string& what, int exit_code) {
  std::cerr << "aidnctl: error: " << ctl::OneLine(what) << std::endl;
  return exit_code;
}

// The flags of `app` (not its positionals or --help), for the completion script.
std::vector<ctl::CompletionFlag> FlagsOf(const CLI::App* app) {
  std::vector<ctl::CompletionFlag> flags;
  for (const CLI::Option* option : app->get_options()) {
    if (!option->nonpositional() || option == app->get_help_ptr()) continue;
    ctl::CompletionFlag flag;
    for (const std::string& name : option->get_snames()) flag.names.push_back("-" + name);
    for (const std::string& name : option->get_lnames()) flag.names.push_back("--" + name);
    // Flags (--watch, --force) expect no item; get_type_size() is 1 for them too.
    flag.takes_value = option->get_items_expected_min() > 0;
    flag.takes_file = option->get_type_name().rfind("FILE", 0) == 0;
    flags.push_back(std::move(flag));
  }
  return flags;
}

// What the command line says: the values CLI11 fills in, and the commands, to
// see which one was given. CLI11 keeps pointers into it: it does not move.
struct CommandLine {
  CommandLine() = default;
  CommandLine(const CommandLine&) = delete;
  CommandLine& operator=(const CommandLine&) = delete;

  // Global options.
  std::string address, token, output = "table", timeout = "30s";
  CLI::Option* address_flag = nullptr;
  CLI::Option* token_flag = nullptr;
  std::string tls_ca;
  CLI::Option* tls_ca_flag = nullptr;
  bool insecure = false;
  // submit and watch.
  std::string spec_path, reconnect_timeout = "5m";
  bool submit_watch = false;
  // list.
  std::vector<std::string> states, labels;
  int list_limit = 100;
  // describe, cancel and checkpoints.
  std::string job_id, reason;
  ctl::EventsOptions events_options;
  // workers cordon/uncordon/drain/remove.
  std::optional<ctl::WorkerOp> worker_op_kind;
  ctl::WorkerOpOptions worker_op;
  std::string drain_wait_timeout = "1h";
  std::string events_interval = "1s";
  ctl::ExportOptions export_options;
  int64_t export_step = 0;
  ctl::GenerateOptions generate_options;
  int64_t generate_step = 0;
  CLI::Option* generate_step_flag = nullptr;
  CLI::Option* export_step_flag = nullptr;
  ctl::WatchOptions watch_options;
  ctl::MetricsOptions metrics_options;
  ctl::PlotOptions plot_options;
  ctl::LogsOptions logs_options;
  int32_t logs_rank = 0;
  std::string logs_generation;
  CLI::Option* logs_rank_flag = nullptr;
  std::string shell;

  CLI::App* submit = nullptr;
  CLI::App* list = nullptr;
  CLI::App* describe = nullptr;
  CLI::App* cancel = nullptr;
  CLI::App* pause = nullptr;
  CLI::App* resume = nullptr;
  ctl::PauseOptions pause_options;
  std::string pause_wait_timeout = "10m";
  CLI::App* workers = nullptr;
  CLI::App* health = nullptr;
  std::string health_service;
  CLI::App* events = nullptr;
  CLI::App* checkpoints = nullptr;
  CLI::App* export_command = nullptr;
  CLI::App* generate = nullptr;
  CLI::App* watch = nullptr;
  CLI::App* metrics = nullptr;
  CLI::App* plot = nullptr;
  CLI::App* logs = nullptr;
  CLI::App* completion = nullptr;
  CLI::App* version = nullptr;
};

void AddGlobalOptions(CLI::App& app, CommandLine& cl) {
  cl.address_flag =
      app.add_option("--addr", cl.address,
                     "Coordinator HOST:PORT (else $AIDN_ADDR, the config file, 127.0.0.1:7070)");
  cl.token_flag =
      app.add_option("--token", cl.token, "Bearer token (else $AIDN_TOKEN, the config file)");
  cl.tls_ca_flag = app.add_option(
      "--tls-ca", cl.tls_ca,
      "CA file verifying the coordinator: its <state-dir>/tls/ca.pem (else $AIDN_TLS_CA, the "
      "config file's tls_ca, the system's roots)");
  app.add_flag("--insecure", cl.insecure,
               "Plaintext, to a coordinator run with --insecure (else $AIDN_INSECURE=1, the "
               "config file's insecure: true)");
  app.add_option("-o,--output", cl.output, "Output format: table, json or yaml (metrics: csv too)")
      ->check(Check(ctl::ParseOutputFormat, "FORMAT"))
      ->capture_default_str();
  app.add_option("--timeout", cl.timeout, "Deadline of each call: 30s, 500ms, 2m")
      ->check(Check(ctl::ParseTimeout, "DURATION"))
      ->capture_default_str();
}

void AddSubmit(CLI::App& app, CommandLine& cl) {
  cl.submit = app.add_subcommand("submit", "Submit a job spec (YAML or JSON)");
  // The file as an argument (aidnctl submit job.yaml) or as -f/--file.
  cl.submit->add_option("file,-f,--file", cl.spec_path, "The job spec file; - reads stdin")
      ->required()
      ->type_name("FILE");
  cl.submit->add_flag("--watch", cl.submit_watch, "Then watch the job as `aidnctl watch` does");
  cl.submit
      ->add_option("--reconnect-timeout", cl.reconnect_timeout,
                   "With --watch: give up when the coordinator is gone this long")
      ->check(Check(ctl::ParseTimeout, "DURATION"))
      ->capture_default_str();
}

void AddList(CLI::App& app, CommandLine& cl) {
  cl.list = app.add_subcommand("list", "List jobs, newest first");
  cl.list->add_option("--state", cl.states, "Only jobs in this state (repeatable, or a,b)")
      ->delimiter(',')
      ->check(Check(ctl::ParseJobState, "STATE"));
  cl.list->add_option("--label", cl.labels, "Only jobs with this label KEY=VALUE (repeatable)")
      ->check(Check(ctl::ParseLabel, "KEY=VALUE"));
  cl.list->add_option("--limit", cl.list_limit, "At most this many jobs; 0: all")
      ->check(kNotNegative)
      ->capture_default_str();
}

// describe, cancel, workers, events and checkpoints: one job's (or every job's)
// records.
void AddJobRecords(CLI::App& app, CommandLine& cl) {
  cl.describe = app.add_subcommand("describe", "Show a job: state, spec and placement");
  cl.describe->add_option("job", cl.job_id, "Job ID")->required();

  cl.cancel = app.add_subcommand("cancel", "Cancel a job");
  cl.cancel->add_option("job", cl.job_id, "Job ID")->required();
  cl.cancel->add_option("--reason", cl.reason, "Why; recorded in the job's events");

  cl.pause = app.add_subcommand(
      "pause",
      "Checkpoint a job at a step its ranks agree on and stop it, holding no slots, until "
      "resumed (no restart counted)");
  cl.pause->add_option("job", cl.pause_options.job_id, "Job ID")->required();
  cl.pause->add_option("--reason", cl.pause_options.reason, "Why; recorded in the job's events");
  cl.pause->add_flag("--wait", cl.pause_options.wait, "Return once the job is PAUSED (or ended)");
  cl.pause->add_option("--wait-timeout", cl.pause_wait_timeout, "With --wait: give up after this")
      ->check(Check(ctl::ParseTimeout, "DURATION"))
      ->capture_default_str();
  cl.resume =
      app.add_subcommand("resume", "Queue a PAUSED job again, to go on from its checkpoint");
  cl.resume->add_option("job", cl.job_id, "Job ID")->required();

  cl.workers = app.add_subcommand(
      "workers", "List workers; or (admins) cordon, uncordon, drain or remove one");
  cl.workers->require_subcommand(0, 1);
  const struct {
    const char* name;
    ctl::WorkerOp op;
    const char* help;
  } ops[] = {
      {"cordon", ctl::WorkerOp::kCordon, "Place no new ranks on a worker; running ones go on"},
      {"uncordon", ctl::WorkerOp::kUncordon, "Place ranks on a cordoned or drained worker again"},
      {"drain", ctl::WorkerOp::kDrain,
       "Cordon a worker and move each job running there to other workers at a checkpoint "
       "asked for now (a restart from it that does not count against max_restarts)"},
      {"remove", ctl::WorkerOp::kRemove,
       "Forget a LOST worker (its daemon, if it comes back, registers anew)"},
  };
  for (const auto& op : ops) {
    CLI::App* sub = cl.workers->add_subcommand(op.name, op.help);
    sub->add_option("worker", cl.worker_op.worker_id, "Worker ID")->required();
    if (op.op == ctl::WorkerOp::kCordon || op.op == ctl::WorkerOp::kDrain) {
      sub->add_option("--reason", cl.worker_op.reason, "Why; recorded in the worker's events");
    }
    if (op.op == ctl::WorkerOp::kDrain) {
      sub->add_flag("--wait", cl.worker_op.wait, "Return once no job runs there any more");
      sub->add_option("--wait-timeout", cl.drain_wait_timeout, "With --wait: give up after this")
          ->check(Check(ctl::ParseTimeout, "DURATION"))
          ->capture_default_str();
    }
    sub->callback([&cl, kind = op.op] { cl.worker_op_kind = kind; });
  }

  cl.health = app.add_subcommand(
      "health",
      "Ask the coordinator's gRPC health service (grpc.health.v1); exits 0 when SERVING. No "
      "token needed: for probes and scripts");
  cl.health->add_option("service", cl.health_service,
                        "A service's full name (default: the server as a whole)");

  cl.events = app.add_subcommand(
      "events",
      "List events of a job, or of every job and worker; --follow keeps printing new ones "
      "(-o json: one event per line)");
  cl.events->add_option("job", cl.events_options.job_id, "Job ID (default: all)");
  cl.events->add_option("--after", cl.events_options.after_seq, "Only events with seq above this")
      ->check(kNotNegative);
  cl.events->add_option("--limit", cl.events_options.limit, "At most this many (default 1000)")
      ->check(kNotNegative);
  cl.events->add_flag("-f,--follow", cl.events_options.follow,
                      "Keep printing new events; with a job, until it has ended");
  cl.events
      ->add_option("--interval", cl.events_interval, "With --follow: ask for new events this often")
      ->check(Check(ctl::ParseTimeout, "DURATION"))
      ->capture_default_str();
  cl.events
      ->add_option("--reconnect-timeout", cl.reconnect_timeout,
                   "With --follow: give up when the coordinator is gone this long")
      ->check(Check(ctl::ParseTimeout, "DURATION"))
      ->capture_default_str();

  cl.checkpoints = app.add_subcommand("checkpoints", "List a job's checkpoints");
  cl.checkpoints->add_option("job", cl.job_id, "Job ID")->required();
}

void AddExport(CLI::App& app, CommandLine& cl) {
  cl.export_command = app.add_subcommand(
      "export",
      "Copy a checkpoint's weights (model.safetensors, Hugging Face layout) to a file, after "
      "verifying the checkpoint against its manifest. The checkpoint directory must be reachable "
      "from this machine at the path the workers wrote it to. Here -o/--output names the file; "
      "the global output format does not apply");
  cl.export_command->add_option("job", cl.export_options.job_id, "Job ID")->required();
  cl.export_step_flag =
      cl.export_command
          ->add_option("--step", cl.export_step,
                       "The checkpoint of this step (default: the newest committed, valid one)")
          ->check(kNotNegative);
  cl.export_command
      ->add_option("-o,--output", cl.export_options.output_path,
                   "The file to write, ending in .safetensors; its directory must exist")
      ->required()
      ->type_name("FILE");
  cl.export_command->add_flag("--force", cl.export_options.force, "Replace the file if it exists");
}

void AddGenerate(CLI::App& app, CommandLine& cl) {
  cl.generate = app.add_subcommand(
      "generate",
      "Continue a prompt with a language model (model gpt): from a job's checkpoint, read and "
      "verified as export reads it, or from an exported safetensors file; runs on this "
      "machine's CPU and prints the prompt and its continuation");
  ctl::GenerateOptions& o = cl.generate_options;
  cl.generate->add_option("job", o.job_id, "Job ID (or --file)");
  cl.generate_step_flag =
      cl.generate
          ->add_option("--step", cl.generate_step,
                       "The checkpoint of this step (default: the newest committed, valid one)")
          ->check(kNotNegative);
  cl.generate->add_option("--file", o.file, "A safetensors export instead of a job's checkpoint")
      ->type_name("FILE");
  cl.generate->add_option("--prompt", o.prompt, "The text to continue (default: a newline)");
  cl.generate->add_option("--length", o.sample.length, "Bytes to add")
      ->default_val(200)
      ->check(CLI::Range(int64_t{0}, int64_t{1'000'000}));
  cl.generate->add_flag("--greedy", o.sample.greedy,
                        "Always the most likely next byte (else a seeded draw)");
  cl.generate->add_option("--top-k", o.sample.top_k, "Draw among the k most likely only (0: all)")
      ->default_val(0)
      ->check(CLI::Range(0, 1 << 24));
  cl.generate->add_option("--temperature", o.sample.temperature, "Divides the logits; > 0")
      ->default_val(1.0)
      ->check(CLI::PositiveNumber);
  cl.generate->add_option("--seed", o.sample.seed, "Seeds the draws (same seed, same text)")
      ->default_val(0);
}

void AddWatch(CLI::App& app, CommandLine& cl) {
  cl.watch = app.add_subcommand(
      "watch",
      "Follow a job until it ends: progress and ETA, loss, samples/s, slowest rank, allreduce "
      "share, checkpoints, evaluations, events. Redraws in place on a terminal, else appends "
      "lines. Exit status 0 if the job succeeded, 1 if it failed or was cancelled");
  cl.watch->add_option("job", cl.watch_options.job_id, "Job ID")->required();
  cl.watch
      ->add_option("--from-step", cl.watch_options.from_step,
                   "Show step metrics from this step on (default: all)")
      ->check(kNotNegative);
  cl.watch
      ->add_option("--reconnect-timeout", cl.reconnect_timeout,
                   "Give up when the coordinator is gone this long")
      ->check(Check(ctl::ParseTimeout, "DURATION"))
      ->capture_default_str();
}

void AddMetrics(CLI::App& app, CommandLine& cl) {
  cl.metrics = app.add_subcommand(
      "metrics", "Print a job's step metrics: -o table (default), csv, json or yaml");
  cl.metrics->add_option("job", cl.metrics_options.job_id, "Job ID")->required();
  cl.metrics
      ->add_option("--from", cl.metrics_options.from_step, "From this step (default: the first)")
      ->check(kNotNegative);
  cl.metrics
      ->add_option("--to", cl.metrics_options.to_step,
                   "To this step, inclusive (default: the last)")
      ->check(kNotNegative);
}

void AddPlot(CLI::App& app, CommandLine& cl) {
  ctl::PlotOptions& plot_options = cl.plot_options;
  cl.plot = app.add_subcommand(
      "plot",
      "Draw a job's training loss (and test accuracy) against step as a PNG with gnuplot "
      "(Debian package gnuplot-nox). Here -o/--output names the PNG file; the global output "
      "format does not apply");
  cl.plot->add_option("job", plot_options.job_id, "Job ID")->required();
  cl.plot->add_option("-o,--output", plot_options.output_path, "The PNG file to write")
      ->required()
      ->type_name("FILE");
  cl.plot->add_option("--from", plot_options.from_step, "From this step (default: the first)")
      ->check(kNotNegative);
  cl.plot->add_option("--to", plot_options.to_step, "To this step, inclusive (default: the last)")
      ->check(kNotNegative);
  cl.plot->add_option("--width", plot_options.width, "Image width in pixels")
      ->check(CLI::Range(100, 10000))
      ->capture_default_str();
  cl.plot->add_option("--height", plot_options.height, "Image height in pixels")
      ->check(CLI::Range(100, 10000))
      ->capture_default_str();
}

// "all" or a generation number.
absl::StatusOr<int64_t> ParseGeneration(absl::string_view text) {
  int64_t generation = 0;
  if (text == "all") return -1;
  if (!absl::SimpleAtoi(text, &generation) || generation < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a generation is a number >= 0 or \"all\", not \"", text, "\""));
  }
  return generation;
}

void AddLogs(CLI::App& app, CommandLine& cl) {
  ctl::LogsOptions& o = cl.logs_options;
  cl.logs = app.add_subcommand(
      "logs",
      "Print the ranks' output (stdout and stderr) as the workers shipped it to the coordinator, "
      "each line prefixed [rank N] ([gen G rank N] with --generation all); default: the current "
      "generation, every rank");
  cl.logs->add_option("job", o.job_id, "Job ID")->required();
  cl.logs_rank_flag =
      cl.logs->add_option("--rank", cl.logs_rank, "Only this rank's lines")->check(kNotNegative);
  cl.logs
      ->add_option("--generation", cl.logs_generation,
                   "This generation's lines, or \"all\" (default: the current one)")
      ->check(Check(ParseGeneration, "GENERATION"));
  cl.logs->add_option("--tail", o.tail, "Only the last N lines (then, with --follow, new ones)")
      ->check(kNotNegative);
  cl.logs->add_flag("-f,--follow", o.follow,
                    "Keep printing new lines until the job has ended and its output is all in");
  cl.logs
      ->add_option("--reconnect-timeout", cl.reconnect_timeout,
                   "With --follow: give up when the coordinator is gone this long")
      ->check(Check(ctl::ParseTimeout, "DURATION"))
      ->capture_default_str();
}

void AddCompletionAndVersion(CLI::App& app, CommandLine& cl) {
  cl.completion = app.add_subcommand("completion", "Print a shell completion script");
  cl.completion->add_option("shell", cl.shell, "Shell: bash")
      ->required()
      ->check(CLI::IsMember({"bash"}));

  cl.version = app.add_subcommand("version", "Print aidnctl's version");
}

// Parses argv into `app`; an exit status when aidnctl is done (--help, or a
// usage error said on stderr).
std::optional<int> Parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    std::string what = e.what();
    std::string help = "aidnctl";
    for (const CLI::App* command : app.get_subcommands()) help += " " + command->get_name();
    if (app.get_subcommands().empty()) {
      // CLI11 says "A subcommand is required" for a misspelt one too.
      std::string commands;
      for (const CLI::App* command : app.get_subcommands(kAll)) {
        commands += (commands.empty() ? "" : ", ") + command->get_name();
      }
      what = app.remaining().empty() ? "no command given"
                                     : "unknown command \"" + app.remaining().front() + "\"";
      what += " (one of " + commands + ")";
    }
    return Fail(what + " (see " + help + " --help)", kExitUsage);
  }
  return std::nullopt;
}

// The usage errors CLI11 cannot see: an output format the command does not
// print in. Empty when there is none.
std::string MisusedOutputFormat(const CommandLine& cl, ctl::OutputFormat format) {
  const bool watching = *cl.watch || (*cl.submit && cl.submit_watch);
  if (format == ctl::OutputFormat::kCsv && !*cl.metrics && !*cl.completion) {
    return "-o csv is only for `aidnctl metrics`; use table, json or yaml here";
  }
  if (watching && format != ctl::OutputFormat::kTable) {
    return "watching prints for people, -o " + cl.output +
           " does not apply (for data: aidnctl metrics JOB -o json)";
  }
  return "";
}

// How a watch draws: in place on a terminal that can, else line by line.
void SetWatchDisplay(CommandLine& cl) {
  const char* term = std::getenv("TERM");
  cl.watch_options.live =
      isatty(STDOUT_FILENO) == 1 && !(term != nullptr && std::strcmp(term, "dumb") == 0);
  cl.watch_options.hide_cursor = cl.watch_options.live;
  cl.watch_options.width = [] { return ctl::TerminalWidth(STDOUT_FILENO); };
  cl.watch_options.reconnect_timeout = *ctl::ParseTimeout(cl.reconnect_timeout);
}

std::string CompletionScript(const CLI::App& app) {
  std::vector<ctl::CompletionCommand> commands;
  for (const CLI::App* command : app.get_subcommands(kAll)) {
    commands.push_back({command->get_name(), FlagsOf(command)});
  }
  return ctl::BashCompletionScript(FlagsOf(&app), commands);
}

// Runs the command given (one that talks to the coordinator).
absl::Status RunCommand(const ctl::CommandEnv& env, CommandLine& cl) {
  if (*cl.submit) {
    absl::Status status = ctl::RunSubmit(env, cl.spec_path, &cl.watch_options.job_id);
    if (status.ok() && cl.submit_watch) status = ctl::RunWatch(env, cl.watch_options);
    return status;
  }
  if (*cl.list) {
    ctl::ListOptions list_options;
    for (const std::string& state : cl.states) {
      list_options.states.push_back(*ctl::ParseJobState(state));
    }
    for (const std::string& label : cl.labels) list_options.labels.insert(*ctl::ParseLabel(label));
    list_options.limit = cl.list_limit;
    return ctl::RunList(env, list_options);
  }
  if (*cl.describe) return ctl::RunDescribe(env, cl.job_id);
  if (*cl.cancel) return ctl::RunCancel(env, cl.job_id, cl.reason);
  if (*cl.pause) {
    ctl::PauseOptions options = cl.pause_options;
    options.wait_timeout = *ctl::ParseTimeout(cl.pause_wait_timeout);
    return ctl::RunPause(env, options);
  }
  if (*cl.resume) return ctl::RunResume(env, cl.job_id);
  if (*cl.workers) {
    if (!cl.worker_op_kind) return ctl::RunWorkers(env);
    ctl::WorkerOpOptions options = cl.worker_op;
    options.wait_timeout = *ctl::ParseTimeout(cl.drain_wait_timeout);
    return ctl::RunWorkerOp(env, *cl.worker_op_kind, options);
  }
  if (*cl.health) {
    return ctl::RunHealth(env.options.connection, cl.health_service, env.options.timeout, env.out);
  }
  if (*cl.events) {
    ctl::EventsOptions options = cl.events_options;
    options.interval = *ctl::ParseTimeout(cl.events_interval);
    options.reconnect_timeout = *ctl::ParseTimeout(cl.reconnect_timeout);
    return ctl::RunEvents(env, options);
  }
  if (*cl.checkpoints) return ctl::RunCheckpoints(env, cl.job_id);
  if (*cl.export_command) {
    if (cl.export_step_flag->count() > 0) cl.export_options.step = cl.export_step;
    return ctl::RunExport(env, cl.export_options);
  }
  if (*cl.generate) {
    if (cl.generate_step_flag->count() > 0) cl.generate_options.step = cl.generate_step;
    return ctl::RunGenerate(env, cl.generate_options);
  }
  if (*cl.watch) return ctl::RunWatch(env, cl.watch_options);
  if (*cl.metrics) return ctl::RunMetrics(env, cl.metrics_options);
  if (*cl.plot) return ctl::RunPlot(env, cl.plot_options);
  if (*cl.logs) {
    ctl::LogsOptions options = cl.logs_options;
    if (cl.logs_rank_flag->count() > 0) options.rank = cl.logs_rank;
    if (!cl.logs_generation.empty()) {
      const int64_t generation = *ParseGeneration(cl.logs_generation);
      options.all_generations = generation < 0;
      if (generation >= 0) options.generation = generation;
    }
    options.reconnect_timeout = *ctl::ParseTimeout(cl.reconnect_timeout);
    return ctl::RunLogs(env, options);
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  // One line on stderr per failure: gRPC's own logging stays quiet unless
  // asked for (GRPC_VERBOSITY=debug).
  setenv("GRPC_VERBOSITY", "NONE", /*overwrite=*/0);

  CLI::App app{"aidnctl: the command-line client of the aidn coordinator.", "aidnctl"};
  app.require_subcommand(1);
  app.fallthrough();  // global options may also follow the command
  CommandLine cl;
  AddGlobalOptions(app, cl);
  AddSubmit(app, cl);
  AddList(app, cl);
  AddJobRecords(app, cl);
  AddExport(app, cl);
  AddGenerate(app, cl);
  AddWatch(app, cl);
  AddMetrics(app, cl);
  AddPlot(app, cl);
  AddLogs(app, cl);
  AddCompletionAndVersion(app, cl);
  if (std::optional<int> exit_code = Parse(app, argc, argv)) return *exit_code;

  ctl::GlobalOptions options;
  options.format = *ctl::ParseOutputFormat(cl.output);  // checked by the validators
  options.timeout = *ctl::ParseTimeout(cl.timeout);
  if (std::string misuse = MisusedOutputFormat(cl, options.format); !misuse.empty()) {
    return Fail(misuse, kExitUsage);
  }
  SetWatchDisplay(cl);

  if (*cl.version) {
    std::cout << ctl::VersionText(options.format);
    return 0;
  }
  if (*cl.completion) {
    std::cout << CompletionScript(app);
    return 0;
  }

  if (*cl.generate && !cl.generate_options.file.empty() && cl.generate_options.job_id.empty()) {
    // A file alone needs no coordinator.
    ctl::CommandEnv env;
    env.options = options;
    env.out = &std::cout;
    if (absl::Status status = ctl::RunGenerate(env, cl.generate_options); !status.ok()) {
      return Fail(std::string(status.message()), kExitFailure);
    }
    return 0;
  }

  ctl::ConnectionFlags flags;
  if (cl.address_flag->count() > 0) flags.address = cl.address;
  if (cl.token_flag->count() > 0) flags.token = cl.token;
  if (cl.tls_ca_flag->count() > 0) flags.tls_ca = cl.tls_ca;
  flags.insecure = cl.insecure;
  absl::StatusOr<ctl::ConnectionSettings> connection = ctl::LoadConnection(flags);
  if (!connection.ok()) return Fail(std::string(connection.status().message()), kExitFailure);
  options.connection = *connection;
  if (absl::Status s = aidn::rpc::CheckChannelOptions(
          {.tls_ca_file = connection->tls_ca_file, .insecure = connection->insecure});
      !s.ok()) {
    return Fail(std::string(s.message()), kExitFailure);
  }

  auto stub = ctl::NewCoordinatorStub(options.connection);
  ctl::CommandEnv env;
  env.options = options;
  env.stub = stub.get();
  env.out = &std::cout;
  env.in = &std::cin;
  if (absl::Status status = RunCommand(env, cl); !status.ok()) {
    std::string message(status.message());
    // gRPC says only that the handshake failed: a handshake of our own says why.
    if (absl::IsUnavailable(status)) {
      const std::string why =
          aidn::DiagnoseTls(connection->address, connection->tls_ca_file, connection->insecure);
      if (!why.empty())
        absl::StrAppend(&message, "\nTLS: the coordinator at ", connection->address, ": ", why);
    }
    return Fail(message, kExitFailure);
  }
  return 0;
}
