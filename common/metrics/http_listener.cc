#include "common/metrics/http_listener.h"

#include <sys/socket.h>

#include <chrono>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"

namespace aidn::metrics {
namespace {

struct HostPort {
  std::string host;
  int port = 0;
};

// "host:port" or "[v6 address]:port"; the port is required and decimal.
// An empty host (":9464") means every interface, as in most exporters.
absl::StatusOr<HostPort> ParseAddress(const std::string& address, const std::string& what) {
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " address \"", address, "\": ", why, " (want host:port)"));
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

}  // namespace

absl::StatusOr<std::unique_ptr<httplib::Server>> NewHttpServer(const HttpListenOptions& options) {
  std::unique_ptr<httplib::Server> server;
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.what, "S needs both a certificate and a key"));
  }
  if (!options.tls_cert_file.empty()) {
    auto https = std::make_unique<httplib::SSLServer>(options.tls_cert_file.c_str(),
                                                      options.tls_key_file.c_str());
    if (!https->is_valid()) {
      return absl::InvalidArgumentError(absl::StrCat(options.what, "S: cannot use the certificate ",
                                                     options.tls_cert_file, " and key ",
                                                     options.tls_key_file));
    }
    server = std::move(https);
  } else {
    server = std::make_unique<httplib::Server>();
  }
  const int threads = options.threads > 0 ? options.threads : 1;
  server->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // httplib parks a worker on each idle keep-alive connection until the
  // keep-alive timeout, and stop() waits for the workers: keep that timeout
  // short so the destructor returns promptly with a client connected (and
  // so idle connections cannot hold the pool for long).
  server->set_keep_alive_max_count(10);
  server->set_keep_alive_timeout(1);
  server->set_read_timeout(std::chrono::seconds(2));
  server->set_write_timeout(std::chrono::seconds(5));
  // httplib's default sets SO_REUSEPORT, with which a second server (say a
  // second coordinator on the host) binds the same port without error and
  // the kernel splits requests between the two. SO_REUSEADDR alone still
  // allows a quick restart over TIME_WAIT connections.
  server->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  return server;
}

absl::StatusOr<std::unique_ptr<HttpListener>> HttpListener::Start(
    std::unique_ptr<httplib::Server> server, const HttpListenOptions& options) {
  AIDN_ASSIGN_OR_RETURN(const HostPort host_port, ParseAddress(options.address, options.what));
  const std::string requested = JoinHostPort(host_port.host, host_port.port);
  int port = -1;
  if (host_port.port == 0) {
    port = server->bind_to_any_port(host_port.host);
  } else if (server->bind_to_port(host_port.host, host_port.port)) {
    port = host_port.port;
  }
  if (port < 0) {
    return absl::UnavailableError(absl::StrCat(options.what, " server cannot bind ", requested,
                                               " (address in use or not local?)"));
  }
  std::unique_ptr<HttpListener> listener(new HttpListener());
  listener->server_ = std::move(server);
  listener->host_ = host_port.host;
  listener->port_ = port;
  HttpListener* raw = listener.get();
  raw->thread_ = std::thread([raw, what = options.what] {
    if (!raw->server_->listen_after_bind()) {
      AIDN_LOG(WARNING) << what << " server stopped accepting" << Kv("address", raw->address());
    }
    raw->listener_done_.store(true);
  });
  AIDN_LOG(INFO) << options.what << " server listening" << Kv("address", listener->address());
  return listener;
}

HttpListener::~HttpListener() {
  // httplib 0.11's stop() does nothing until listen_after_bind has marked the
  // server running (there is no wait_until_ready yet), so a destructor right
  // after Start could miss the listener and join forever. Wait for it to be
  // running (or to have failed) first; this takes microseconds.
  while (!listener_done_.load()) {
    if (server_->is_running()) {
      server_->stop();
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  thread_.join();
}

std::string HttpListener::address() const { return JoinHostPort(host_, port_); }

}  // namespace aidn::metrics
