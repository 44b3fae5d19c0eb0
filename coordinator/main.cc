// aidn-coordinator: flags in, Options out, then the coordinator runs until
// SIGINT or SIGTERM.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <memory>
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
#include "common/stop_signals.h"
#include "common/tls.h"
#include "coordinator/auth.h"
#include "coordinator/coordinator.h"
#include "coordinator/server.h"
#include "coordinator/store.h"
#include "coordinator/web/web_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070", "host:port to serve on; port 0 picks one");
ABSL_FLAG(std::string, state_dir, "./aidn-state", "directory for the SQLite state and tokens");
ABSL_FLAG(std::string, addr_file, "", "write the bound host:port to this file once serving");
ABSL_FLAG(std::string, tls_cert, "",
          "the server certificate (PEM, chain after it); default: one made at every start, signed "
          "by a CA made in <state-dir>/tls at first start (clients verify with its ca.pem)");
ABSL_FLAG(std::string, tls_key, "", "the key of --tls-cert (PEM)");
ABSL_FLAG(std::vector<std::string>, tls_san, {},
          "more host names or IPs the made server certificate covers (comma-separated); it "
          "always covers localhost, 127.0.0.1, ::1, this host's name and the listen host");
ABSL_FLAG(std::string, tls_client_ca, "",
          "mutual TLS for workers: a worker token counts only with a client certificate signed "
          "by a CA in this file (PEM)");
ABSL_FLAG(bool, insecure, false,
          "serve plaintext gRPC: tokens travel in the clear (logged loudly unless the listen "
          "address is loopback)");
ABSL_FLAG(std::string, token_file, "",
          "extra tokens, one per line: <token> <admin|user|worker> [<name>]");
ABSL_FLAG(int32_t, max_world_size, 1024, "largest world_size a job may ask for");
ABSL_FLAG(absl::Duration, heartbeat_interval, absl::Seconds(2), "how often workers heartbeat");
ABSL_FLAG(absl::Duration, stop_grace, absl::Seconds(10),
          "how long a worker lets a trainer it was told to stop exit after SIGTERM before SIGKILL");
ABSL_FLAG(absl::Duration, worker_timeout, absl::Seconds(10),
          "a worker silent this long is declared lost");
ABSL_FLAG(absl::Duration, checkpoint_ask_lead, absl::Seconds(2),
          "a checkpoint asked for (aidnctl pause, a drain) lies this much training time ahead of "
          "the furthest rank");
ABSL_FLAG(absl::Duration, rendezvous_timeout, absl::Minutes(5),
          "default timeouts.rendezvous for jobs");
ABSL_FLAG(int32_t, max_restarts, 3, "default max_restarts for jobs");
ABSL_FLAG(int32_t, max_message_bytes, 4 * 1024 * 1024, "largest gRPC message accepted");
ABSL_FLAG(absl::Duration, tick_interval, absl::Milliseconds(100), "how often timeouts are checked");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error");
ABSL_FLAG(std::string, metrics_addr, "127.0.0.1:9464",
          "host:port for Prometheus /metrics (port 0 picks one); empty turns it off");
ABSL_FLAG(
    bool, metrics_tls, false,
    "serve /metrics over HTTPS with the gRPC port's certificate (the made one or --tls-cert)");
ABSL_FLAG(std::string, metrics_token_file, "",
          "answer /metrics only to requests with this file's token as a bearer token");
ABSL_FLAG(std::string, metrics_addr_file, "",
          "write the host:port /metrics is served on to this file once serving");
ABSL_FLAG(std::string, web_addr, "",
          "host:port for the web UI (port 0 picks one); empty (the default) turns it off");
ABSL_FLAG(bool, web_tls, false,
          "serve the web UI over HTTPS with the gRPC port's certificate (needed off loopback, "
          "unless --insecure)");
ABSL_FLAG(std::string, web_addr_file, "",
          "write the host:port the web UI is served on to this file once serving");
ABSL_FLAG(std::string, web_chartjs, "/usr/share/javascript/chart.js/chart.min.js",
          "Chart.js for the web UI's charts (Debian's libjs-chart.js)");
ABSL_FLAG(absl::Duration, metrics_retention, absl::Minutes(10),
          "how long a finished job's series stay on /metrics (and its steps in memory)");
ABSL_FLAG(absl::Duration, job_retention, absl::Hours(1),
          "how long a finished job stays in memory (at least --metrics_retention); after it the "
          "job is read from the state database, still listed, described and watched");
ABSL_FLAG(int64_t, max_log_bytes_per_job, int64_t{64} << 20,
          "a job's output lines kept at most (bytes); past it the oldest are dropped and counted; "
          "0: no bound");
ABSL_FLAG(absl::Duration, log_retention, absl::Hours(24 * 7),
          "how long a finished job's output lines are kept; 0 keeps them");

namespace {

using aidn::Kv;

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

std::string Format(std::chrono::milliseconds ms) {
  return absl::FormatDuration(absl::FromChrono(ms));
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

// Debian's Abseil is built without NDEBUG, so its Mutex runs the deadlock
// detector on every lock (ours and gRPC's, which uses absl::Mutex) through
// one global graph lock: 5 % of the coordinator's CPU under 10,000 workers,
// and a point where every RPC thread serialises. A debugging aid; optimised
// builds go without it, as they would with a release Abseil.
void TurnOffDeadlockDetectionWhenOptimised() {
#ifdef NDEBUG
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
}

// False (after saying why on stderr) when --log_level names no level.
bool SetLogLevelFromFlag() {
  aidn::LogLevel level;
  if (!aidn::ParseLogLevel(absl::GetFlag(FLAGS_log_level), &level)) {
    std::fprintf(stderr, "aidn-coordinator: --log_level: unknown level \"%s\"\n",
                 absl::GetFlag(FLAGS_log_level).c_str());
    return false;
  }
  aidn::SetMinLogLevel(level);
  return true;
}

// Everything the flags say, typed. coordinator.registry is set by Serve.
struct Config {
  std::string state_dir;
  std::string addr_file;
  std::string token_file;
  std::string metrics_addr;       // empty: no /metrics
  std::string metrics_addr_file;  // empty: not written
  bool metrics_tls = false;
  std::string metrics_token_file;
  aidn::metrics::HttpServerOptions metrics;  // filled in by Serve
  bool web_tls = false;
  std::string web_addr_file;
  aidn::coordinator::web::WebServerOptions web;  // address empty: no web UI
  std::string log_level;
  // TLS: --tls-cert/--tls-key, or made in <state-dir>/tls; or plaintext.
  std::string tls_cert;
  std::string tls_key;
  std::vector<std::string> tls_san;
  bool insecure = false;
  std::string tls_client_ca;
  std::chrono::milliseconds tick{0};
  aidn::coordinator::CoordinatorOptions coordinator;
  aidn::coordinator::ServerOptions server;
};

absl::StatusOr<Config> ConfigFromFlags() {
  Config config;
  config.state_dir = absl::GetFlag(FLAGS_state_dir);
  config.addr_file = absl::GetFlag(FLAGS_addr_file);
  config.token_file = absl::GetFlag(FLAGS_token_file);
  config.metrics_addr = absl::GetFlag(FLAGS_metrics_addr);
  config.metrics_addr_file = absl::GetFlag(FLAGS_metrics_addr_file);
  config.metrics_tls = absl::GetFlag(FLAGS_metrics_tls);
  config.metrics_token_file = absl::GetFlag(FLAGS_metrics_token_file);
  config.metrics.address = config.metrics_addr;
  AIDN_ASSIGN_OR_RETURN(config.metrics.bearer_token,
                        aidn::metrics::ReadMetricsToken(config.metrics_token_file));
  config.web.address = absl::GetFlag(FLAGS_web_addr);
  config.web_tls = absl::GetFlag(FLAGS_web_tls);
  config.web_addr_file = absl::GetFlag(FLAGS_web_addr_file);
  config.web.chartjs_file = absl::GetFlag(FLAGS_web_chartjs);
  config.log_level = absl::GetFlag(FLAGS_log_level);
  config.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  config.tls_key = absl::GetFlag(FLAGS_tls_key);
  config.tls_san = absl::GetFlag(FLAGS_tls_san);
  config.insecure = absl::GetFlag(FLAGS_insecure);
  config.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  if (config.insecure && !config.tls_client_ca.empty()) {
    return absl::InvalidArgumentError("flags: --tls-client-ca needs TLS; drop --insecure");
  }
  if (config.tls_cert.empty() != config.tls_key.empty()) {
    return absl::InvalidArgumentError("flags: --tls-cert and --tls-key go together");
  }
  if (config.insecure && !config.tls_cert.empty()) {
    return absl::InvalidArgumentError("flags: --insecure serves plaintext; drop --tls-cert");
  }
  if (config.insecure && config.metrics_tls) {
    return absl::InvalidArgumentError(
        "flags: --metrics-tls serves /metrics with the gRPC certificate, which --insecure has not");
  }
  if (config.insecure && config.web_tls) {
    return absl::InvalidArgumentError(
        "flags: --web-tls serves the web UI with the gRPC certificate, which --insecure has not");
  }
  if (const std::string& web = config.web.address; !web.empty() && !config.web_tls) {
    if (!aidn::IsLoopbackHost(web.substr(0, web.rfind(':'))) && !config.insecure) {
      return absl::InvalidArgumentError(absl::StrCat(
          "flags: --web-addr ", web,
          " is not a loopback address: the browser's tokens would cross the network in the "
          "clear; add --web-tls (or --insecure to accept that)"));
    }
  }
  config.tick = Millis(absl::GetFlag(FLAGS_tick_interval));
  aidn::coordinator::CoordinatorOptions& options = config.coordinator;
  options.spec_limits.max_world_size = absl::GetFlag(FLAGS_max_world_size);
  options.spec_limits.default_worker_timeout = Millis(absl::GetFlag(FLAGS_worker_timeout));
  options.spec_limits.default_rendezvous_timeout = Millis(absl::GetFlag(FLAGS_rendezvous_timeout));
  options.spec_limits.default_max_restarts = absl::GetFlag(FLAGS_max_restarts);
  options.heartbeat_interval = Millis(absl::GetFlag(FLAGS_heartbeat_interval));
  options.worker_timeout = Millis(absl::GetFlag(FLAGS_worker_timeout));
  options.stop_grace = Millis(absl::GetFlag(FLAGS_stop_grace));
  options.checkpoint_ask_lead = Millis(absl::GetFlag(FLAGS_checkpoint_ask_lead));
  options.metrics_retention = Millis(absl::GetFlag(FLAGS_metrics_retention));
  options.job_retention = Millis(absl::GetFlag(FLAGS_job_retention));
  options.logs.max_bytes_per_job = absl::GetFlag(FLAGS_max_log_bytes_per_job);
  options.logs.retention = Millis(absl::GetFlag(FLAGS_log_retention));
  config.server.listen = absl::GetFlag(FLAGS_listen);
  config.server.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);

  if (options.spec_limits.max_world_size < 1 || options.heartbeat_interval.count() <= 0 ||
      options.worker_timeout <= options.heartbeat_interval || config.tick.count() <= 0 ||
      options.stop_grace.count() < 0 || options.checkpoint_ask_lead.count() <= 0 ||
      config.server.max_message_bytes < 1024 || options.metrics_retention.count() < 0 ||
      options.logs.max_bytes_per_job < 0 || options.logs.retention.count() < 0 ||
      options.job_retention.count() < 0) {
    return absl::InvalidArgumentError(
        "flags: need --max_world_size >= 1, --heartbeat_interval > 0, --worker_timeout > "
        "--heartbeat_interval, --tick_interval > 0, --max_message_bytes >= 1024, "
        "--metrics_retention >= 0, --stop_grace >= 0, --checkpoint_ask_lead > 0, "
        "--max_log_bytes_per_job >= 0, "
        "--log_retention >= 0, --job_retention >= 0");
  }
  return config;
}

// The resolved configuration as a two-column table.
void LogConfiguration(const Config& config) {
  const aidn::coordinator::CoordinatorOptions& options = config.coordinator;
  aidn::LogConfigTable(
      absl::StrCat("aidn-coordinator ", AIDN_VERSION, " configuration:"),
      {{"listen", config.server.listen},
       {"state_dir", config.state_dir},
       {"addr_file", config.addr_file},
       {"token_file", config.token_file},
       {"tls", config.insecure           ? "off (--insecure)"
               : config.tls_cert.empty() ? absl::StrCat("made in ", config.state_dir, "/tls")
                                         : absl::StrCat(config.tls_cert, ", ", config.tls_key)},
       {"max_world_size", absl::StrCat(options.spec_limits.max_world_size)},
       {"heartbeat_interval", Format(options.heartbeat_interval)},
       {"stop_grace", Format(options.stop_grace)},
       {"checkpoint_ask_lead", Format(options.checkpoint_ask_lead)},
       {"worker_timeout", Format(options.worker_timeout)},
       {"rendezvous_timeout", Format(options.spec_limits.default_rendezvous_timeout)},
       {"max_restarts", absl::StrCat(options.spec_limits.default_max_restarts)},
       {"max_message_bytes", absl::StrCat(config.server.max_message_bytes)},
       {"tick_interval", Format(config.tick)},
       {"metrics_addr", config.metrics_addr},
       {"metrics_retention", Format(options.metrics_retention)},
       {"web_addr", config.web.address.empty() ? "off" : config.web.address},
       {"job_retention", Format(options.job_retention)},
       {"max_log_bytes_per_job", absl::StrCat(options.logs.max_bytes_per_job)},
       {"log_retention", Format(options.logs.retention)},
       {"log_level", config.log_level}});
}

// The server's TLS material into config->server: --tls-cert's, or a
// certificate made for this start by the state directory's CA. Returns the
// CA file clients verify with ("" when not known: --tls-cert's issuer, or
// --insecure).
absl::StatusOr<std::string> SetUpTls(Config* config) {
  const std::string& listen = config->server.listen;
  const std::string host = listen.substr(0, listen.rfind(':'));
  if (config->insecure) {
    if (aidn::IsLoopbackHost(host)) {
      AIDN_LOG(INFO) << "serving plaintext on loopback (--insecure)";
    } else {
      for (int i = 0; i < 3; ++i) {
        AIDN_LOG(WARNING) << "--insecure: serving PLAINTEXT gRPC on " << listen
                          << ": bearer tokens cross the network in the clear, and a stolen "
                             "token runs commands on every worker";
      }
    }
    return std::string();
  }
  absl::StatusOr<aidn::ServerTls> tls;
  if (!config->tls_cert.empty()) {
    tls = aidn::LoadServerTls(config->tls_cert, config->tls_key);
  } else {
    std::vector<std::string> names = config->tls_san;
    names.push_back(host.size() >= 2 && host.front() == '[' ? host.substr(1, host.size() - 2)
                                                            : host);
    tls = aidn::EnsureAutoTls({.dir = config->state_dir + "/tls", .names = names});
  }
  if (!tls.ok()) return tls.status();
  config->server.tls_cert_pem = tls->cert_pem;
  config->server.tls_key_pem = tls->key_pem;
  if (!config->tls_client_ca.empty()) {
    AIDN_ASSIGN_OR_RETURN(config->server.tls_client_ca_pem,
                          aidn::ReadCaFile(config->tls_client_ca));
  }
  const std::string cert_file =
      config->tls_cert.empty() ? config->state_dir + "/tls/server.pem" : config->tls_cert;
  const std::string key_file =
      config->tls_key.empty() ? config->state_dir + "/tls/server.key" : config->tls_key;
  if (config->metrics_tls) {
    config->metrics.tls_cert_file = cert_file;
    config->metrics.tls_key_file = key_file;
  }
  if (config->web_tls) {
    config->web.tls_cert_file = cert_file;
    config->web.tls_key_file = key_file;
  }
  AIDN_LOG(INFO) << "TLS on"
                 << Kv("certificate_expires",
                       absl::FormatTime("%Y-%m-%d", tls->not_after, absl::UTCTimeZone()));
  return tls->ca_file;
}

// Opens the state, starts serving, and runs until one of `signals` arrives.
int Serve(Config config, const sigset_t& signals) {
  aidn::metrics::Registry registry;
  aidn::metrics::AddProcessMetrics(&registry);
  config.coordinator.registry = &registry;

  if (absl::Status s = MakeDirs(config.state_dir); !s.ok()) return Fail(s);
  absl::StatusOr<std::string> ca_file = SetUpTls(&config);
  if (!ca_file.ok()) return Fail(ca_file.status());
  auto auth = aidn::coordinator::Authenticator::Create(
      {.state_dir = config.state_dir, .token_file = config.token_file});
  if (!auth.ok()) return Fail(auth.status());
  (*auth)->set_worker_certificates_required(!config.server.tls_client_ca_pem.empty());
  auto store = aidn::coordinator::Store::Open({.path = config.state_dir + "/coordinator.db"});
  if (!store.ok()) return Fail(store.status());
  auto coordinator =
      aidn::coordinator::Coordinator::Create(config.coordinator, *std::move(store), auth->get());
  if (!coordinator.ok()) return Fail(coordinator.status());
  auto server = aidn::coordinator::Server::Start(config.server, coordinator->get(), auth->get());
  if (!server.ok()) return Fail(server.status());
  (*coordinator)->StartTicker(config.tick);
  auto metrics_server =
      aidn::metrics::StartMetricsEndpoint(config.metrics, config.metrics_addr_file, &registry);
  if (!metrics_server.ok()) return Fail(metrics_server.status());
  std::unique_ptr<aidn::coordinator::web::WebServer> web_server;
  if (!config.web.address.empty()) {
    auto web = aidn::coordinator::web::WebServer::Start(config.web, (*server)->InProcessChannel());
    if (!web.ok()) return Fail(web.status());
    web_server = *std::move(web);
    AIDN_LOG(INFO) << "serving the web UI" << Kv("address", web_server->address())
                   << Kv("https", config.web_tls ? "on" : "off");
    if (!config.web_addr_file.empty()) {
      if (absl::Status s =
              aidn::WriteFileAtomically(config.web_addr_file, web_server->address() + "\n");
          !s.ok()) {
        return Fail(s);
      }
    }
  }

  const std::string& address = (*server)->address();
  if (!config.addr_file.empty()) {
    if (absl::Status s = aidn::WriteFileAtomically(config.addr_file, address + "\n"); !s.ok()) {
      return Fail(s);
    }
  }
  AIDN_LOG(INFO) << "serving" << Kv("address", address) << Kv("tls", config.insecure ? "off" : "on")
                 << Kv("tls_ca_file", *ca_file)
                 << Kv("admin_token_file", (*auth)->admin_token_path())
                 << Kv("worker_token_file", (*auth)->worker_token_path());

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  AIDN_LOG(INFO) << "shutting down" << Kv("signal", signal_number);
  // The web UI's calls go to the gRPC server: it goes first.
  web_server.reset();
  (*coordinator)->Shutdown();
  (*server)->Shutdown(std::chrono::seconds(2));
  (*coordinator)->StopTicker();
  // /metrics calls into the coordinator: stop it before the coordinator goes.
  metrics_server->reset();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  TurnOffDeadlockDetectionWhenOptimised();
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
  if (!SetLogLevelFromFlag()) return 2;

  const sigset_t signals = aidn::BlockStopSignals();
  absl::StatusOr<Config> config = ConfigFromFlags();
  if (!config.ok()) return Fail(config.status());
  LogConfiguration(*config);
  return Serve(*std::move(config), signals);
}
