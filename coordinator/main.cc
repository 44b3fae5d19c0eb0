// aidn-coordinator: flags in, Options out, then the coordinator runs until
// SIGINT or SIGTERM.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "aidn/config.h"
#include "common/file.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/metrics/http_server.h"
#include "common/metrics/process_stats.h"
#include "common/metrics/registry.h"
#include "common/status.h"
#include "coordinator/auth.h"
#include "coordinator/coordinator.h"
#include "coordinator/server.h"
#include "coordinator/store.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070", "host:port to serve on; port 0 picks one");
ABSL_FLAG(std::string, state_dir, "./aidn-state", "directory for the SQLite state and tokens");
ABSL_FLAG(std::string, addr_file, "", "write the bound host:port to this file once serving");
ABSL_FLAG(std::string, token_file, "",
          "extra tokens, one per line: <token> <admin|user|worker> [<name>]");
ABSL_FLAG(int32_t, max_world_size, 1024, "largest world_size a job may ask for");
ABSL_FLAG(absl::Duration, heartbeat_interval, absl::Seconds(2), "how often workers heartbeat");
ABSL_FLAG(absl::Duration, stop_grace, absl::Seconds(10),
          "how long a worker lets a trainer it was told to stop exit after SIGTERM before SIGKILL");
ABSL_FLAG(absl::Duration, worker_timeout, absl::Seconds(10),
          "a worker silent this long is declared lost");
ABSL_FLAG(absl::Duration, rendezvous_timeout, absl::Minutes(5),
          "default timeouts.rendezvous for jobs");
ABSL_FLAG(int32_t, max_restarts, 3, "default max_restarts for jobs");
ABSL_FLAG(int32_t, max_message_bytes, 4 * 1024 * 1024, "largest gRPC message accepted");
ABSL_FLAG(absl::Duration, tick_interval, absl::Milliseconds(100), "how often timeouts are checked");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error");
ABSL_FLAG(std::string, metrics_addr, "127.0.0.1:9464",
          "host:port for Prometheus /metrics (port 0 picks one); empty turns it off");
ABSL_FLAG(std::string, metrics_addr_file, "",
          "write the host:port /metrics is served on to this file once serving");
ABSL_FLAG(absl::Duration, metrics_retention, absl::Minutes(10),
          "how long a finished job's series stay on /metrics (and its steps in memory)");

namespace {

using aidn::Kv;

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

absl::Status MakeDirs(const std::string& path) {
  std::string partial;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || (path[i] == '/' && i > 0)) {
      partial = path.substr(0, i);
      if (::mkdir(partial.c_str(), 0700) != 0 && errno != EEXIST) {
        return aidn::PosixError(absl::StrCat("mkdir ", partial), errno);
      }
    }
  }
  return absl::OkStatus();
}

int Fail(const absl::Status& status) {
  AIDN_LOG(ERROR) << "aidn-coordinator: " << status;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
#ifdef NDEBUG
  // Debian's Abseil is built without NDEBUG, so its Mutex runs the deadlock
  // detector on every lock (ours and gRPC's, which uses absl::Mutex) through
  // one global graph lock: 5 % of the coordinator's CPU under 10,000
  // workers, and a point where every RPC thread serialises. A debugging aid;
  // optimised builds go without it, as they would with a release Abseil.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  absl::SetProgramUsageMessage("the aidn training coordinator");
  if (aidn::PrintFlagsHelpIfAsked(argc, argv,
                                  "aidn-coordinator: the aidn training coordinator\n"
                                  "usage: aidn-coordinator [flags]",
                                  "coordinator/main.cc")) {
    return 0;
  }
  std::vector<std::string> arg_storage;
  std::vector<char*> args = aidn::NormalizeFlagNames(argc, argv, &arg_storage);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());

  aidn::LogLevel level;
  if (!aidn::ParseLogLevel(absl::GetFlag(FLAGS_log_level), &level)) {
    std::fprintf(stderr, "aidn-coordinator: --log_level: unknown level \"%s\"\n",
                 absl::GetFlag(FLAGS_log_level).c_str());
    return 2;
  }
  aidn::SetMinLogLevel(level);

  // Signals are taken by sigwait below, so block them in every thread first.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  const std::string state_dir = absl::GetFlag(FLAGS_state_dir);
  aidn::coordinator::CoordinatorOptions options;
  options.spec_limits.max_world_size = absl::GetFlag(FLAGS_max_world_size);
  options.spec_limits.default_worker_timeout = Millis(absl::GetFlag(FLAGS_worker_timeout));
  options.spec_limits.default_rendezvous_timeout = Millis(absl::GetFlag(FLAGS_rendezvous_timeout));
  options.spec_limits.default_max_restarts = absl::GetFlag(FLAGS_max_restarts);
  options.heartbeat_interval = Millis(absl::GetFlag(FLAGS_heartbeat_interval));
  options.worker_timeout = Millis(absl::GetFlag(FLAGS_worker_timeout));
  options.stop_grace = Millis(absl::GetFlag(FLAGS_stop_grace));
  options.metrics_retention = Millis(absl::GetFlag(FLAGS_metrics_retention));
  aidn::metrics::Registry registry;
  aidn::metrics::AddProcessMetrics(&registry);
  options.registry = &registry;
  aidn::coordinator::ServerOptions server_options;
  server_options.listen = absl::GetFlag(FLAGS_listen);
  server_options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  const std::chrono::milliseconds tick = Millis(absl::GetFlag(FLAGS_tick_interval));

  if (options.spec_limits.max_world_size < 1 || options.heartbeat_interval.count() <= 0 ||
      options.worker_timeout <= options.heartbeat_interval || tick.count() <= 0 ||
      options.stop_grace.count() < 0 || server_options.max_message_bytes < 1024 ||
      options.metrics_retention.count() < 0) {
    return Fail(absl::InvalidArgumentError(
        "flags: need --max_world_size >= 1, --heartbeat_interval > 0, --worker_timeout > "
        "--heartbeat_interval, --tick_interval > 0, --max_message_bytes >= 1024, "
        "--metrics_retention >= 0, --stop_grace >= 0"));
  }

  aidn::LogConfigTable(
      absl::StrCat("aidn-coordinator ", AIDN_VERSION, " configuration:"),
      {{"listen", server_options.listen},
       {"state_dir", state_dir},
       {"addr_file", absl::GetFlag(FLAGS_addr_file)},
       {"token_file", absl::GetFlag(FLAGS_token_file)},
       {"max_world_size", absl::StrCat(options.spec_limits.max_world_size)},
       {"heartbeat_interval", absl::FormatDuration(absl::GetFlag(FLAGS_heartbeat_interval))},
       {"stop_grace", absl::FormatDuration(absl::GetFlag(FLAGS_stop_grace))},
       {"worker_timeout", absl::FormatDuration(absl::GetFlag(FLAGS_worker_timeout))},
       {"rendezvous_timeout", absl::FormatDuration(absl::GetFlag(FLAGS_rendezvous_timeout))},
       {"max_restarts", absl::StrCat(options.spec_limits.default_max_restarts)},
       {"max_message_bytes", absl::StrCat(server_options.max_message_bytes)},
       {"tick_interval", absl::FormatDuration(absl::GetFlag(FLAGS_tick_interval))},
       {"metrics_addr", absl::GetFlag(FLAGS_metrics_addr)},
       {"metrics_retention", absl::FormatDuration(absl::GetFlag(FLAGS_metrics_retention))},
       {"log_level", absl::GetFlag(FLAGS_log_level)}});

  if (absl::Status s = MakeDirs(state_dir); !s.ok()) return Fail(s);
  auto auth = aidn::coordinator::Authenticator::Create(
      {.state_dir = state_dir, .token_file = absl::GetFlag(FLAGS_token_file)});
  if (!auth.ok()) return Fail(auth.status());
  auto store = aidn::coordinator::Store::Open({.path = state_dir + "/coordinator.db"});
  if (!store.ok()) return Fail(store.status());
  auto coordinator =
      aidn::coordinator::Coordinator::Create(options, *std::move(store), auth->get());
  if (!coordinator.ok()) return Fail(coordinator.status());
  auto server = aidn::coordinator::Server::Start(server_options, coordinator->get(), auth->get());
  if (!server.ok()) return Fail(server.status());
  (*coordinator)->StartTicker(tick);
  std::unique_ptr<aidn::metrics::HttpServer> metrics_server;
  if (!absl::GetFlag(FLAGS_metrics_addr).empty()) {
    auto started =
        aidn::metrics::HttpServer::Start({.address = absl::GetFlag(FLAGS_metrics_addr)}, &registry);
    if (!started.ok()) return Fail(started.status());
    metrics_server = *std::move(started);
    AIDN_LOG(INFO) << "serving /metrics" << Kv("address", metrics_server->address());
    if (const std::string file = absl::GetFlag(FLAGS_metrics_addr_file); !file.empty()) {
      if (absl::Status s = aidn::WriteFileAtomically(file, metrics_server->address() + "\n");
          !s.ok()) {
        return Fail(s);
      }
    }
  }

  const std::string& address = (*server)->address();
  if (!absl::GetFlag(FLAGS_addr_file).empty()) {
    if (absl::Status s = aidn::WriteFileAtomically(absl::GetFlag(FLAGS_addr_file), address + "\n");
        !s.ok()) {
      return Fail(s);
    }
  }
  AIDN_LOG(INFO) << "serving" << Kv("address", address)
                 << Kv("admin_token_file", (*auth)->admin_token_path())
                 << Kv("worker_token_file", (*auth)->worker_token_path());

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  AIDN_LOG(INFO) << "shutting down" << Kv("signal", signal_number);
  (*coordinator)->Shutdown();
  (*server)->Shutdown(std::chrono::seconds(2));
  (*coordinator)->StopTicker();
  // /metrics calls into the coordinator: stop it before the coordinator goes.
  metrics_server.reset();
  return 0;
}
