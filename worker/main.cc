// aidn-worker: flags in, Options out.
//
//   aidn-worker [daemon flags]           the worker daemon, until SIGINT/SIGTERM
//   aidn-worker train [trainer flags]    one trainer rank (what the daemon runs)
//
// The two modes share one flag namespace; each reads the flags it needs.
// A trainer's token comes from $AIDN_TRAINER_TOKEN, never from argv.
#include <limits.h>
#include <pwd.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/time.h"
#include "aidn/config.h"
#include "common/file.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/metrics/http_server.h"
#include "common/metrics/process_stats.h"
#include "common/metrics/registry.h"
#include "common/status.h"
#include "common/stop_signals.h"
#include "worker/daemon.h"
#include "worker/engine/cpu.h"
#include "worker/engine/device.h"
#include "worker/engine/gpu_session.h"
#include "worker/engine/model.h"
#include "worker/launch.h"
#include "worker/trainer/trainer.h"

// Both modes.
ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "host:port of the coordinator");
ABSL_FLAG(std::string, tls_ca, "",
          "CA file (PEM) that verifies the coordinator's certificate (its <state-dir>/tls/ca.pem); "
          "default: $AIDN_TLS_CA, else the system's roots");
ABSL_FLAG(std::vector<std::string>, allowed_paths, {"/usr/share"},
          "absolute directories whose paths a job may name (checkpoint.dir, dataset files, a "
          "command's working directory), besides the work dir and checkpoint root; "
          "comma-separated");
ABSL_FLAG(std::string, tls_cert, "",
          "mutual TLS: the client certificate (PEM) this worker presents to a coordinator run "
          "with --tls-client-ca");
ABSL_FLAG(std::string, tls_key, "", "the key of --tls-cert (PEM)");
ABSL_FLAG(bool, insecure, false,
          "talk plaintext gRPC to a coordinator started with --insecure (no TLS)");
ABSL_FLAG(std::string, work_dir, "./aidn-work",
          "daemon: its directory (trainer logs, job directories); train: the job's directory");
ABSL_FLAG(std::string, checkpoint_root, "",
          "relative checkpoint.dir of jobs are taken under this (default <work-dir>/checkpoints); "
          "workers that may take over each other's ranks should share it");
ABSL_FLAG(std::string, cache_dir, "",
          "train: the worker's cache of inflated dataset files (the daemon passes "
          "<work-dir>/cache); empty: none");
ABSL_FLAG(std::string, worker_id, "", "this worker's id (default: the host name)");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error");

// Daemon.
ABSL_FLAG(std::string, token_file, "", "file holding the worker join token");
ABSL_FLAG(std::string, token, "", "the worker join token (prefer --token-file)");
ABSL_FLAG(std::string, address, "127.0.0.1", "address (no port) peers use to reach this node");
ABSL_FLAG(int32_t, cpu_slots, 1, "CPU slots this worker offers");
ABSL_FLAG(std::string, metrics_addr, "127.0.0.1:9465",
          "host:port for Prometheus /metrics (port 0 picks one); empty turns it off");
ABSL_FLAG(std::string, metrics_tls_cert, "",
          "serve /metrics over HTTPS with this certificate (PEM; --metrics-tls-key its key)");
ABSL_FLAG(std::string, metrics_tls_key, "", "the key of --metrics-tls-cert (PEM)");
ABSL_FLAG(std::string, metrics_token_file, "",
          "answer /metrics only to requests with this file's token as a bearer token");
ABSL_FLAG(std::string, metrics_addr_file, "",
          "write the host:port /metrics is served on to this file once serving");
ABSL_FLAG(std::string, trainer_binary, "/proc/self/exe",
          "the program each rank runs; it shows in ps as `aidn-trainer train ... --job=<job> "
          "--generation=<g> --rank=<r> ...`");
ABSL_FLAG(bool, no_command_jobs, false,
          "run no command jobs (users' own programs); the scheduler then places none here");
ABSL_FLAG(std::string, command_user, "",
          "the user command jobs run as; required for them when the worker runs as root (naming "
          "root itself runs them as root)");
ABSL_FLAG(std::string, python_path, "",
          "directory holding the aidn Python package, first on command ranks' PYTHONPATH "
          "(default: python/ beside the binary's directory, when it exists)");
ABSL_FLAG(absl::Duration, stop_grace, absl::Seconds(10),
          "SIGTERM to SIGKILL delay for trainers, unless a stop order says otherwise");

// Trainer.
ABSL_FLAG(std::string, job, "", "train: the job id");
ABSL_FLAG(int64_t, generation, 0, "train: the job's generation");
ABSL_FLAG(int32_t, rank, 0, "train: this rank");
ABSL_FLAG(int32_t, world_size, 1, "train: number of ranks");
ABSL_FLAG(std::string, host, "127.0.0.1", "train: address this rank binds for its peers");
ABSL_FLAG(int32_t, slot, 0, "train: first CPU slot (or GPU index)");
ABSL_FLAG(int32_t, threads, 1, "train: CPU threads");

namespace {

using aidn::Kv;
using aidn::worker::kTrainerTokenVariable;

int Fail(const char* mode, const absl::Status& status) {
  AIDN_LOG(ERROR) << mode << ": " << status;
  return 1;
}

std::string Hostname() {
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

absl::StatusOr<std::string> ReadToken(const std::string& path) {
  std::ifstream in(path);
  if (!in) return aidn::PosixError(absl::StrCat("--token-file ", path), errno);
  std::stringstream contents;
  contents << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(contents.str()));
  if (token.empty())
    return absl::InvalidArgumentError(absl::StrCat("--token-file ", path, ": empty"));
  return token;
}

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// --tls-ca, else $AIDN_TLS_CA.
std::string TlsCaFromFlags() {
  std::string path = absl::GetFlag(FLAGS_tls_ca);
  if (const char* env = std::getenv("AIDN_TLS_CA"); path.empty() && env != nullptr) path = env;
  return path;
}

int RunTrainMode() {
  aidn::trainer::TrainerOptions options;
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  options.tls_ca_file = TlsCaFromFlags();
  options.insecure = absl::GetFlag(FLAGS_insecure);
  options.job_id = absl::GetFlag(FLAGS_job);
  options.generation = absl::GetFlag(FLAGS_generation);
  options.rank = absl::GetFlag(FLAGS_rank);
  options.world_size = absl::GetFlag(FLAGS_world_size);
  options.worker_id = absl::GetFlag(FLAGS_worker_id);
  options.host = absl::GetFlag(FLAGS_host);
  options.slot = absl::GetFlag(FLAGS_slot);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.work_dir = absl::GetFlag(FLAGS_work_dir);
  options.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  options.cache_dir = absl::GetFlag(FLAGS_cache_dir);
  // `ps -e`, `top` and /proc/<pid>/comm show which rank of which job this is.
  prctl(PR_SET_NAME, aidn::worker::TrainerThreadName(options.job_id, options.rank).c_str());
  if (const char* token = getenv(kTrainerTokenVariable); token != nullptr) {
    options.token = token;
    // Nothing the trainer might start inherits the credential.
    unsetenv(kTrainerTokenVariable);
  }
  aidn::LogConfigTable(
      absl::StrCat("aidn-worker ", AIDN_VERSION, " train configuration:"),
      {{"coordinator", options.coordinator},
       {"job", options.job_id},
       {"generation", absl::StrCat(options.generation)},
       {"rank", absl::StrCat(options.rank)},
       {"world_size", absl::StrCat(options.world_size)},
       {"worker_id", options.worker_id},
       {"host", options.host},
       {"slot", absl::StrCat(options.slot)},
       {"threads", absl::StrCat(options.threads)},
       {"work_dir", options.work_dir},
       {"checkpoint_root", options.checkpoint_root},
       {"token", options.token.empty() ? absl::StrCat("(none: $", kTrainerTokenVariable, " unset)")
                                       : absl::StrCat("(from $", kTrainerTokenVariable, ")")}});
  if (options.job_id.empty() || options.generation < 1 || options.world_size < 1 ||
      options.rank < 0 || options.rank >= options.world_size || options.threads < 1) {
    AIDN_LOG(ERROR) << "train: need --job, --generation >= 1, --world-size >= 1, "
                       "0 <= --rank < --world-size and --threads >= 1";
    return aidn::trainer::kExitPermanent;
  }
  return aidn::trainer::RunTrainer(options);
}

// The daemon's flags, typed, with what the configuration table shows besides
// the options. options.registry is set by RunDaemonMode.
struct DaemonConfig {
  aidn::worker::DaemonOptions options;
  std::string token_file;     // where options.token came from; empty: --token
  std::string gpus_line;      // the GPUs found, and whether they are offered
  std::string blas_override;  // what trainers get for their GEMM kernels; empty: none
  std::string metrics_addr;   // empty: no /metrics
  aidn::metrics::HttpServerOptions metrics;  // address, HTTPS, bearer token
  std::string metrics_addr_file;             // empty: not written
  std::string log_level;
  std::string command_jobs_line;  // whether and as whom command jobs run
};

// The directory of this binary.
std::string SelfDir() {
  char self[PATH_MAX + 1] = {};
  const ssize_t n = readlink("/proc/self/exe", self, PATH_MAX);
  if (n <= 0) return "";
  return std::filesystem::path(std::string(self, static_cast<size_t>(n))).parent_path().string();
}

// --python-path, or python/ beside the binary's directory (the build tree's
// and the installed layout) when it holds the package.
std::string PythonPathFromFlags() {
  std::string path = absl::GetFlag(FLAGS_python_path);
  if (!path.empty()) return path;
  const std::string self = SelfDir();
  if (self.empty()) return "";
  for (const std::string& candidate : {self + "/../python", self + "/../lib/aidn/python"}) {
    std::error_code error;
    if (std::filesystem::exists(candidate + "/aidn/__init__.py", error)) {
      return std::filesystem::canonical(candidate, error).string();
    }
  }
  return "";
}

// Whether and as whom command jobs run; returns the table's line about it.
absl::StatusOr<std::string> CommandJobsFromFlags(aidn::worker::DaemonOptions* options) {
  options->command_jobs = !absl::GetFlag(FLAGS_no_command_jobs);
  options->python_path = PythonPathFromFlags();
  const std::string user = absl::GetFlag(FLAGS_command_user);
  if (!options->command_jobs) return std::string("off (--no-command-jobs)");
  if (user.empty()) {
    if (geteuid() != 0) return absl::StrCat("as this daemon's user (uid ", geteuid(), ")");
    // Never silently as root: a root daemon needs to be told whom to run
    // users' programs as.
    options->command_jobs = false;
    AIDN_LOG(WARNING) << "command jobs are off: this worker runs as root and no --command-user "
                         "names the user to run them as";
    return std::string("off (running as root without --command-user)");
  }
  struct passwd* pw = getpwnam(user.c_str());
  if (pw == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--command-user: no user \"", user, "\""));
  }
  if (geteuid() != 0 && pw->pw_uid != geteuid()) {
    return absl::InvalidArgumentError(absl::StrCat("--command-user: running command jobs as ", user,
                                                   " needs the worker to run as root"));
  }
  // Already that user: nothing to switch to.
  if (geteuid() != 0) return absl::StrCat("as this daemon's user ", user);
  options->command_user = aidn::worker::LaunchOptions::User{
      .name = user, .uid = pw->pw_uid, .gid = pw->pw_gid, .home = pw->pw_dir};
  if (pw->pw_uid == 0) {
    AIDN_LOG(WARNING) << "command jobs run as root (--command-user=" << user << ")";
  }
  return absl::StrCat("as ", user, " (uid ", pw->pw_uid, ", gid ", pw->pw_gid, ")");
}

// The join token from --token-file or --token (at most one of them).
absl::StatusOr<std::string> TokenFromFlags() {
  const std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (!token_file.empty() && !absl::GetFlag(FLAGS_token).empty()) {
    return absl::InvalidArgumentError("pass --token-file or --token, not both");
  }
  if (!token_file.empty()) return ReadToken(token_file);
  return absl::GetFlag(FLAGS_token);
}

// The GPUs this node has, offered in `options` only by a binary whose
// trainers can use them; returns the table's line about them.
std::string OfferGpus(aidn::worker::DaemonOptions* options) {
  const aidn::engine::DeviceInventory devices = aidn::engine::DiscoverDevices();
  std::vector<std::string> gpu_names;
  for (const aidn::engine::GpuDescription& gpu : devices.gpus) {
    gpu_names.push_back(
        absl::StrCat(gpu.index, ": ", gpu.name, " (", gpu.memory_bytes / (1024 * 1024), " MiB)"));
  }
  std::string gpus_line = gpu_names.empty() ? absl::StrCat("none (", devices.gpu_note, ")")
                                            : absl::StrJoin(gpu_names, ", ");
  if (aidn::engine::GpuSessionAvailable()) {
    options->gpus = devices.gpus;
  } else if (!devices.gpus.empty()) {
    gpus_line = absl::StrCat(gpus_line, "; not offered: this binary has no GPU trainer (run ",
                             "aidn-worker-gpu)");
    AIDN_LOG(WARNING) << "this node has GPUs but aidn-worker cannot train on them; run "
                         "aidn-worker-gpu to offer them";
  }
  return gpus_line;
}

absl::StatusOr<DaemonConfig> DaemonConfigFromFlags(const std::string& log_level) {
  DaemonConfig config;
  aidn::worker::DaemonOptions& options = config.options;
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  options.tls_ca_file = TlsCaFromFlags();
  options.insecure = absl::GetFlag(FLAGS_insecure);
  options.allowed_paths = absl::GetFlag(FLAGS_allowed_paths);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.hostname = Hostname();
  options.worker_id = absl::GetFlag(FLAGS_worker_id);
  if (options.worker_id.empty()) options.worker_id = options.hostname;
  options.address = absl::GetFlag(FLAGS_address);
  options.cpu_slots = absl::GetFlag(FLAGS_cpu_slots);
  options.work_dir = absl::GetFlag(FLAGS_work_dir);
  options.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  options.trainer_binary = absl::GetFlag(FLAGS_trainer_binary);
  options.trainer_log_level = log_level;
  options.stop_grace = Millis(absl::GetFlag(FLAGS_stop_grace));
  options.version = AIDN_VERSION;
  config.metrics_addr = absl::GetFlag(FLAGS_metrics_addr);
  config.metrics_addr_file = absl::GetFlag(FLAGS_metrics_addr_file);
  config.metrics.address = config.metrics_addr;
  config.metrics.tls_cert_file = absl::GetFlag(FLAGS_metrics_tls_cert);
  config.metrics.tls_key_file = absl::GetFlag(FLAGS_metrics_tls_key);
  AIDN_ASSIGN_OR_RETURN(config.metrics.bearer_token,
                        aidn::metrics::ReadMetricsToken(absl::GetFlag(FLAGS_metrics_token_file)));
  config.log_level = log_level;

  config.token_file = absl::GetFlag(FLAGS_token_file);
  AIDN_ASSIGN_OR_RETURN(options.token, TokenFromFlags());
  config.gpus_line = OfferGpus(&options);
  AIDN_ASSIGN_OR_RETURN(config.command_jobs_line, CommandJobsFromFlags(&options));
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible != nullptr) {
    options.cuda_visible_devices = visible;
  }
  // AVX-512 GEMM kernels for the trainers where OpenBLAS would not pick them.
  config.blas_override = aidn::engine::BlasCoreOverride();
  if (!config.blas_override.empty()) options.trainer_env.push_back(config.blas_override);
  return config;
}

// The configuration as a two-column table: `resolved` is what the daemon made
// of config.options (or config.options itself when it refused them).
void LogDaemonConfiguration(const DaemonConfig& config,
                            const aidn::worker::DaemonOptions& resolved) {
  std::string trainer = resolved.trainer_binary;
  if (trainer == "/proc/self/exe") {
    char self[PATH_MAX + 1] = {};
    const ssize_t n = readlink("/proc/self/exe", self, PATH_MAX);
    if (n > 0) trainer = absl::StrCat(std::string(self, static_cast<size_t>(n)), " (this binary)");
  }
  aidn::LogConfigTable(
      absl::StrCat("aidn-worker ", AIDN_VERSION, " configuration:"),
      {{"coordinator", resolved.coordinator},
       {"tls", resolved.insecure ? "off (--insecure)"
               : resolved.tls_ca_file.empty()
                   ? "verifying with the system's roots"
                   : absl::StrCat("verifying with ", resolved.tls_ca_file)},
       {"token", config.token_file.empty() ? (resolved.token.empty() ? "(none)" : "(from --token)")
                                           : absl::StrCat("(from ", config.token_file, ")")},
       {"worker_id", resolved.worker_id},
       {"allowed_paths",
        absl::StrJoin(resolved.path_roots.empty() ? resolved.allowed_paths : resolved.path_roots,
                      ", ")},
       {"hostname", resolved.hostname},
       {"address", resolved.address},
       {"cpu_slots", absl::StrCat(resolved.cpu_slots)},
       {"gpus", config.gpus_line},
       {"work_dir", resolved.work_dir},
       {"checkpoint_root", resolved.checkpoint_root},
       {"trainer_binary", trainer},
       {"trainer_blas", config.blas_override.empty() ? aidn::engine::BlasCoreName()
                                                     : absl::StrCat(aidn::engine::BlasCoreName(),
                                                                    " -> ", config.blas_override)},
       {"command_jobs", config.command_jobs_line},
       {"python_path", resolved.python_path.empty() ? "(none)" : resolved.python_path},
       {"stop_grace", absl::FormatDuration(absl::FromChrono(config.options.stop_grace))},
       {"metrics_addr", config.metrics_addr.empty() ? "(off)" : config.metrics_addr},
       {"log_level", config.log_level}});
}

// Starts /metrics and the daemon, and runs until one of `signals` arrives.
int ServeDaemon(aidn::worker::Daemon& daemon, const DaemonConfig& config,
                aidn::metrics::Registry* registry, const sigset_t& signals) {
  auto metrics_server =
      aidn::metrics::StartMetricsEndpoint(config.metrics, config.metrics_addr_file, registry);
  if (!metrics_server.ok()) return Fail("aidn-worker", metrics_server.status());
  if (absl::Status s = daemon.Start(); !s.ok()) return Fail("aidn-worker", s);

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  AIDN_LOG(INFO) << "signal received; stopping trainers and exiting" << Kv("signal", signal_number);
  daemon.Shutdown();
  // /metrics calls into the daemon: stop it before the daemon goes.
  metrics_server->reset();
  return 0;
}

int RunDaemonMode(const std::string& log_level) {
  absl::StatusOr<DaemonConfig> config = DaemonConfigFromFlags(log_level);
  if (!config.ok()) return Fail("aidn-worker", config.status());
  aidn::metrics::Registry registry;
  aidn::metrics::AddProcessMetrics(&registry);
  if (!config->metrics_addr.empty()) config->options.registry = &registry;

  const sigset_t signals = aidn::BlockStopSignals();
  absl::StatusOr<std::unique_ptr<aidn::worker::Daemon>> daemon =
      aidn::worker::Daemon::Create(config->options);
  LogDaemonConfiguration(*config, daemon.ok() ? (*daemon)->options() : config->options);
  if (!daemon.ok()) return Fail("aidn-worker", daemon.status());
  return ServeDaemon(**daemon, *config, &registry, signals);
}

}  // namespace

int main(int argc, char** argv) {
  constexpr char kUsage[] =
      "aidn-worker: the aidn worker daemon\n"
      "usage: aidn-worker [flags]          run the daemon\n"
      "       aidn-worker train [flags]    run one trainer rank (started by the daemon)";
  absl::SetProgramUsageMessage(kUsage);
  if (aidn::PrintFlagsHelpIfAsked(argc, argv, kUsage, "worker/main.cc")) return 0;
  // `train` is a mode, not a positional argument: take it out before parsing.
  const bool train = argc > 1 && std::string(argv[1]) == "train";
  std::vector<char*> raw(argv, argv + argc);
  if (train) raw.erase(raw.begin() + 1);
  std::vector<std::string> arg_storage;
  std::vector<char*> args =
      aidn::NormalizeFlagNames(static_cast<int>(raw.size()), raw.data(), &arg_storage);
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (positional.size() > 1) {
    std::fprintf(stderr, "aidn-worker: unexpected argument \"%s\" (see --help)\n", positional[1]);
    return 2;
  }

  const std::string log_level = absl::GetFlag(FLAGS_log_level);
  aidn::LogLevel level;
  if (!aidn::ParseLogLevel(log_level, &level)) {
    std::fprintf(stderr, "aidn-worker: --log-level: unknown level \"%s\"\n", log_level.c_str());
    return 2;
  }
  aidn::SetMinLogLevel(level);
  return train ? RunTrainMode() : RunDaemonMode(log_level);
}
