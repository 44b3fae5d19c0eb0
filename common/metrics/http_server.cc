#include "common/metrics/http_server.h"

#include <sys/socket.h>

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/log.h"
#include "common/status.h"

namespace aidn::metrics {
namespace {

constexpr char kMetricsContentType[] = "text/plain; version=0.0.4; charset=utf-8";

struct HostPort {
  std::string host;
  int port = 0;
};

// "host:port" or "[v6 address]:port"; the port is required and decimal.
// An empty host (":9464") means every interface, as in most exporters.
absl::StatusOr<HostPort> ParseAddress(const std::string& address) {
  auto invalid = [&address](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics HTTP address \"", address, "\": ", why, " (want host:port)"));
  };
  HostPort result;
  std::string port_text;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == std::string::npos) return invalid("no closing ']'");
    result.host = address.substr(1, close - 1);
    if (result.host.empty()) return invalid("empty host");
    if (close + 1 >= address.size() || address[close + 1] != ':') return invalid("no port");
    port_text = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return invalid("no port");
    result.host = address.substr(0, colon);
    if (result.host.find(':') != std::string::npos) {
      return invalid("an IPv6 host must be in brackets");
    }
    if (result.host.empty()) result.host = "0.0.0.0";
    port_text = address.substr(colon + 1);
  }
  // SimpleAtoi would also take signs and surrounding spaces; a port is digits.
  if (port_text.empty() || port_text.size() > 5 ||
      port_text.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(port_text, &result.port) || result.port > 65535) {
    return invalid("bad port");
  }
  return result;
}

std::string JoinHostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

void MethodNotAllowed(const httplib::Request&, httplib::Response& res) {
  res.status = 405;
  res.set_header("Allow", "GET, HEAD");
  res.set_content("method not allowed\n", "text/plain; charset=utf-8");
}

}  // namespace

struct HttpServer::Impl {
  std::unique_ptr<httplib::Server> owned;
  httplib::Server& server() { return *owned; }
  std::thread thread;
  // Set by the thread when listen_after_bind returns.
  std::atomic<bool> listener_done{false};
  std::string host;
  int port = 0;
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                              Registry* registry) {
  AIDN_ASSIGN_OR_RETURN(const HostPort host_port, ParseAddress(options.address));
  auto impl = std::make_unique<Impl>();
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("metrics HTTPS needs both a certificate and a key");
  }
  if (!options.tls_cert_file.empty()) {
    auto https = std::make_unique<httplib::SSLServer>(options.tls_cert_file.c_str(),
                                                      options.tls_key_file.c_str());
    if (!https->is_valid()) {
      return absl::InvalidArgumentError(absl::StrCat("metrics HTTPS: cannot use the certificate ",
                                                     options.tls_cert_file, " and key ",
                                                     options.tls_key_file));
    }
    impl->owned = std::move(https);
  } else {
    impl->owned = std::make_unique<httplib::Server>();
  }
  httplib::Server& server = impl->server();

  // A scrape every few seconds needs no more than this.
  server.new_task_queue = [] { return new httplib::ThreadPool(2); };
  // httplib parks a worker on each idle keep-alive connection until the
  // keep-alive timeout, and stop() waits for the workers: keep that timeout
  // short so the destructor returns promptly with a scraper connected (and
  // so two idle connections cannot hold the pool for long).
  server.set_keep_alive_max_count(10);
  server.set_keep_alive_timeout(1);
  server.set_read_timeout(std::chrono::seconds(2));
  server.set_write_timeout(std::chrono::seconds(5));
  // httplib's default sets SO_REUSEPORT, with which a second server (say a
  // second coordinator on the host) binds the same port without error and
  // the kernel splits scrapes between the two. SO_REUSEADDR alone still
  // allows a quick restart over TIME_WAIT connections.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });

  server.Get("/metrics", [registry, token = options.bearer_token](const httplib::Request& req,
                                                                  httplib::Response& res) {
    if (!token.empty() && req.get_header_value("Authorization") != "Bearer " + token) {
      res.status = 401;
      res.set_header("WWW-Authenticate", "Bearer realm=\"aidn metrics\"");
      res.set_content("a bearer token is required\n", "text/plain; charset=utf-8");
      return;
    }
    res.set_content(registry->Serialize(), kMetricsContentType);
  });
  server.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain; charset=utf-8");
  });
  for (const char* path : {"/metrics", "/healthz"}) {
    server.Post(path, MethodNotAllowed);
    server.Put(path, MethodNotAllowed);
    server.Patch(path, MethodNotAllowed);
    server.Delete(path, MethodNotAllowed);
    server.Options(path, MethodNotAllowed);
  }

  const std::string requested = JoinHostPort(host_port.host, host_port.port);
  if (host_port.port == 0) {
    impl->port = server.bind_to_any_port(host_port.host);
  } else if (server.bind_to_port(host_port.host, host_port.port)) {
    impl->port = host_port.port;
  } else {
    impl->port = -1;
  }
  if (impl->port < 0) {
    return absl::UnavailableError(absl::StrCat("metrics HTTP server cannot bind ", requested,
                                               " (address in use or not local?)"));
  }
  impl->host = host_port.host;

  Impl* raw = impl.get();
  raw->thread = std::thread([raw] {
    if (!raw->server().listen_after_bind()) {
      AIDN_LOG(WARNING) << "metrics HTTP server stopped accepting"
                        << Kv("address", JoinHostPort(raw->host, raw->port));
    }
    raw->listener_done.store(true);
  });
  AIDN_LOG(INFO) << "metrics HTTP server listening"
                 << Kv("address", JoinHostPort(impl->host, impl->port));
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() {
  // httplib 0.11's stop() does nothing until listen_after_bind has marked the
  // server running (there is no wait_until_ready yet), so a destructor right
  // after Start could miss the listener and join forever. Wait for it to be
  // running (or to have failed) first; this takes microseconds.
  while (!impl_->listener_done.load()) {
    if (impl_->server().is_running()) {
      impl_->server().stop();
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  impl_->thread.join();
}

int HttpServer::port() const { return impl_->port; }

std::string HttpServer::address() const { return JoinHostPort(impl_->host, impl_->port); }

absl::StatusOr<std::unique_ptr<HttpServer>> StartMetricsEndpoint(const HttpServerOptions& options,
                                                                 const std::string& address_file,
                                                                 Registry* registry) {
  if (options.address.empty()) return nullptr;
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<HttpServer> server, HttpServer::Start(options, registry));
  AIDN_LOG(INFO) << "serving /metrics" << Kv("address", server->address())
                 << Kv("https", options.tls_cert_file.empty() ? "off" : "on")
                 << Kv("bearer_token", options.bearer_token.empty() ? "off" : "required");
  if (!address_file.empty()) {
    AIDN_RETURN_IF_ERROR(WriteFileAtomically(address_file, server->address() + "\n"));
  }
  return server;
}

absl::StatusOr<std::string> ReadMetricsToken(const std::string& path) {
  if (path.empty()) return std::string();
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics token file: ", text.status().message()));
  }
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("metrics token file ", path, ": empty"));
  }
  return token;
}

}  // namespace aidn::metrics
