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
#include "aidnctl/commands.h"
#include "aidnctl/config.h"
#include "aidnctl/export.h"
#include "aidnctl/metrics.h"
#include "aidnctl/output.h"
#include "aidnctl/plot.h"
#include "aidnctl/watch.h"

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

}  // namespace

int main(int argc, char** argv) {
  // One line on stderr per failure: gRPC's own logging stays quiet unless
  // asked for (GRPC_VERBOSITY=debug).
  setenv("GRPC_VERBOSITY", "NONE", /*overwrite=*/0);

  CLI::App app{"aidnctl: the command-line client of the aidn coordinator.", "aidnctl"};
  app.require_subcommand(1);
  app.fallthrough();  // global options may also follow the command

  std::string address, token, output = "table", timeout = "30s";
  CLI::Option* address_flag =
      app.add_option("--addr", address,
                     "Coordinator HOST:PORT (else $AIDN_ADDR, the config file, 127.0.0.1:7070)");
  CLI::Option* token_flag =
      app.add_option("--token", token, "Bearer token (else $AIDN_TOKEN, the config file)");
  app.add_option("-o,--output", output, "Output format: table, json or yaml (metrics: csv too)")
      ->check(Check(ctl::ParseOutputFormat, "FORMAT"))
      ->capture_default_str();
  app.add_option("--timeout", timeout, "Deadline of each call: 30s, 500ms, 2m")
      ->check(Check(ctl::ParseTimeout, "DURATION"))
      ->capture_default_str();

  std::string spec_path, reconnect_timeout = "5m";
  bool submit_watch = false;
  CLI::App* submit = app.add_subcommand("submit", "Submit a job spec (YAML or JSON)");
  // The file as an argument (aidnctl submit job.yaml) or as -f/--file.
  submit->add_option("file,-f,--file", spec_path, "The job spec file; - reads stdin")
      ->required()
      ->type_name("FILE");
  submit->add_flag("--watch", submit_watch, "Then watch the job as `aidnctl watch` does");
  submit
      ->add_option("--reconnect-timeout", reconnect_timeout,
                   "With --watch: give up when the coordinator is gone this long")
      ->check(Check(ctl::ParseTimeout, "DURATION"))
      ->capture_default_str();

  std::vector<std::string> states, labels;
  int list_limit = 100;
  CLI::App* list = app.add_subcommand("list", "List jobs, newest first");
  list->add_option("--state", states, "Only jobs in this state (repeatable, or a,b)")
      ->delimiter(',')
      ->check(Check(ctl::ParseJobState, "STATE"));
  list->add_option("--label", labels, "Only jobs with this label KEY=VALUE (repeatable)")
      ->check(Check(ctl::ParseLabel, "KEY=VALUE"));
  list->add_option("--limit", list_limit, "At most this many jobs; 0: all")
      ->check(kNotNegative)
      ->capture_default_str();

  std::string job_id;
  CLI::App* describe = app.add_subcommand("describe", "Show a job: state, spec and placement");
  describe->add_option("job", job_id, "Job ID")->required();

  std::string reason;
  CLI::App* cancel = app.add_subcommand("cancel", "Cancel a job");
  cancel->add_option("job", job_id, "Job ID")->required();
  cancel->add_option("--reason", reason, "Why; recorded in the job's events");

  CLI::App* workers = app.add_subcommand("workers", "List workers");

  ctl::EventsOptions events_options;
  CLI::App* events = app.add_subcommand("events", "List events of a job, or of every job");
  events->add_option("job", events_options.job_id, "Job ID (default: all)");
  events->add_option("--after", events_options.after_seq, "Only events with seq above this")
      ->check(kNotNegative);
  events->add_option("--limit", events_options.limit, "At most this many (default 1000)")
      ->check(kNotNegative);

  CLI::App* checkpoints = app.add_subcommand("checkpoints", "List a job's checkpoints");
  checkpoints->add_option("job", job_id, "Job ID")->required();

  ctl::ExportOptions export_options;
  int64_t export_step = 0;
  CLI::App* export_command = app.add_subcommand(
      "export",
      "Copy a checkpoint's weights (model.safetensors, Hugging Face layout) to a file, after "
      "verifying the checkpoint against its manifest. The checkpoint directory must be reachable "
      "from this machine at the path the workers wrote it to. Here -o/--output names the file; "
      "the global output format does not apply");
  export_command->add_option("job", export_options.job_id, "Job ID")->required();
  CLI::Option* export_step_flag =
      export_command
          ->add_option("--step", export_step,
                       "The checkpoint of this step (default: the newest committed, valid one)")
          ->check(kNotNegative);
  export_command
      ->add_option("-o,--output", export_options.output_path,
                   "The file to write, ending in .safetensors; its directory must exist")
      ->required()
      ->type_name("FILE");
  export_command->add_flag("--force", export_options.force, "Replace the file if it exists");

  ctl::WatchOptions watch_options;
  CLI::App* watch = app.add_subcommand(
      "watch",
      "Follow a job until it ends: progress and ETA, loss, samples/s, slowest rank, allreduce "
      "share, checkpoints, evaluations, events. Redraws in place on a terminal, else appends "
      "lines. Exit status 0 if the job succeeded, 1 if it failed or was cancelled");
  watch->add_option("job", watch_options.job_id, "Job ID")->required();
  watch
      ->add_option("--from-step", watch_options.from_step,
                   "Show step metrics from this step on (default: all)")
      ->check(kNotNegative);
  watch
      ->add_option("--reconnect-timeout", reconnect_timeout,
                   "Give up when the coordinator is gone this long")
      ->check(Check(ctl::ParseTimeout, "DURATION"))
      ->capture_default_str();

  ctl::MetricsOptions metrics_options;
  CLI::App* metrics = app.add_subcommand(
      "metrics", "Print a job's step metrics: -o table (default), csv, json or yaml");
  metrics->add_option("job", metrics_options.job_id, "Job ID")->required();
  metrics->add_option("--from", metrics_options.from_step, "From this step (default: the first)")
      ->check(kNotNegative);
  metrics
      ->add_option("--to", metrics_options.to_step, "To this step, inclusive (default: the last)")
      ->check(kNotNegative);

  ctl::PlotOptions plot_options;
  CLI::App* plot = app.add_subcommand(
      "plot",
      "Draw a job's training loss (and test accuracy) against step as a PNG with gnuplot "
      "(Debian package gnuplot-nox). Here -o/--output names the PNG file; the global output "
      "format does not apply");
  plot->add_option("job", plot_options.job_id, "Job ID")->required();
  plot->add_option("-o,--output", plot_options.output_path, "The PNG file to write")
      ->required()
      ->type_name("FILE");
  plot->add_option("--from", plot_options.from_step, "From this step (default: the first)")
      ->check(kNotNegative);
  plot->add_option("--to", plot_options.to_step, "To this step, inclusive (default: the last)")
      ->check(kNotNegative);
  plot->add_option("--width", plot_options.width, "Image width in pixels")
      ->check(CLI::Range(100, 10000))
      ->capture_default_str();
  plot->add_option("--height", plot_options.height, "Image height in pixels")
      ->check(CLI::Range(100, 10000))
      ->capture_default_str();

  std::string shell;
  CLI::App* completion = app.add_subcommand("completion", "Print a shell completion script");
  completion->add_option("shell", shell, "Shell: bash")->required()->check(CLI::IsMember({"bash"}));

  CLI::App* version = app.add_subcommand("version", "Print aidnctl's version");

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

  ctl::GlobalOptions options;
  options.format = *ctl::ParseOutputFormat(output);  // checked by the validators
  options.timeout = *ctl::ParseTimeout(timeout);

  const bool watching = *watch || (*submit && submit_watch);
  if (options.format == ctl::OutputFormat::kCsv && !*metrics && !*completion) {
    return Fail("-o csv is only for `aidnctl metrics`; use table, json or yaml here", kExitUsage);
  }
  if (watching && options.format != ctl::OutputFormat::kTable) {
    return Fail("watching prints for people, -o " + output +
                    " does not apply (for data: aidnctl metrics JOB -o json)",
                kExitUsage);
  }
  const char* term = std::getenv("TERM");
  watch_options.live =
      isatty(STDOUT_FILENO) == 1 && !(term != nullptr && std::strcmp(term, "dumb") == 0);
  watch_options.hide_cursor = watch_options.live;
  watch_options.width = [] { return ctl::TerminalWidth(STDOUT_FILENO); };
  watch_options.reconnect_timeout = *ctl::ParseTimeout(reconnect_timeout);

  if (*version) {
    std::cout << ctl::VersionText(options.format);
    return 0;
  }
  if (*completion) {
    std::vector<ctl::CompletionCommand> commands;
    for (const CLI::App* command : app.get_subcommands(kAll)) {
      commands.push_back({command->get_name(), FlagsOf(command)});
    }
    std::cout << ctl::BashCompletionScript(FlagsOf(&app), commands);
    return 0;
  }

  ctl::ConnectionFlags flags;
  if (address_flag->count() > 0) flags.address = address;
  if (token_flag->count() > 0) flags.token = token;
  absl::StatusOr<ctl::ConnectionSettings> connection = ctl::LoadConnection(flags);
  if (!connection.ok()) return Fail(std::string(connection.status().message()), kExitFailure);
  options.connection = *connection;

  auto stub = ctl::NewCoordinatorStub(options.connection);
  ctl::CommandEnv env;
  env.options = options;
  env.stub = stub.get();
  env.out = &std::cout;
  env.in = &std::cin;

  absl::Status status;
  if (*submit) {
    status = ctl::RunSubmit(env, spec_path, &watch_options.job_id);
    if (status.ok() && submit_watch) status = ctl::RunWatch(env, watch_options);
  } else if (*list) {
    ctl::ListOptions list_options;
    for (const std::string& state : states)
      list_options.states.push_back(*ctl::ParseJobState(state));
    for (const std::string& label : labels) list_options.labels.insert(*ctl::ParseLabel(label));
    list_options.limit = list_limit;
    status = ctl::RunList(env, list_options);
  } else if (*describe) {
    status = ctl::RunDescribe(env, job_id);
  } else if (*cancel) {
    status = ctl::RunCancel(env, job_id, reason);
  } else if (*workers) {
    status = ctl::RunWorkers(env);
  } else if (*events) {
    status = ctl::RunEvents(env, events_options);
  } else if (*checkpoints) {
    status = ctl::RunCheckpoints(env, job_id);
  } else if (*export_command) {
    if (export_step_flag->count() > 0) export_options.step = export_step;
    status = ctl::RunExport(env, export_options);
  } else if (*watch) {
    status = ctl::RunWatch(env, watch_options);
  } else if (*metrics) {
    status = ctl::RunMetrics(env, metrics_options);
  } else if (*plot) {
    status = ctl::RunPlot(env, plot_options);
  }
  if (!status.ok()) return Fail(std::string(status.message()), kExitFailure);
  return 0;
}
