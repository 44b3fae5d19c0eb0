#ifndef AIDN_COORDINATOR_WEB_WEB_SERVER_H_
#define AIDN_COORDINATOR_WEB_WEB_SERVER_H_

// The coordinator's web UI on an address of its own (--web_addr; off by
// default): the pages compiled into the binary (web_assets.h), Debian's
// Chart.js at /chart.js, and the JSON API (web_api.h) at /api/v1/. The
// browser sends the token its user pasted as a bearer token; the server
// holds none of its own. Every answer forbids framing and sniffing and
// allows scripts from the same origin only.

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"

namespace aidn::metrics {
class HttpListener;
}

namespace aidn::coordinator::web {

class WebApi;

struct WebServerOptions {
  // "host:port"; port 0 picks a free one.
  std::string address;
  // Both set: HTTPS with this certificate and key.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Debian's libjs-chart.js; served at /chart.js when it exists (the
  // pages show no charts without it).
  std::string chartjs_file = "/usr/share/javascript/chart.js/chart.min.js";
  // Each API call's deadline.
  std::chrono::milliseconds call_timeout{10'000};
  // Requests served at once (a browser tab keeps a few connections).
  int threads = 8;
};

class WebServer {
 public:
  // Serves until destroyed; `channel` reaches the coordinator's gRPC
  // service (Server::InProcessChannel). The listener's errors
  // (http_listener.h).
  static absl::StatusOr<std::unique_ptr<WebServer>> Start(const WebServerOptions& options,
                                                          std::shared_ptr<grpc::Channel> channel);
  ~WebServer();
  WebServer(const WebServer&) = delete;
  WebServer& operator=(const WebServer&) = delete;

  // "host:port" as bound.
  std::string address() const;

 private:
  WebServer() = default;
  std::unique_ptr<WebApi> api_;
  std::string chartjs_;
  // Last: stopped first, while what its handlers use still exists.
  std::unique_ptr<metrics::HttpListener> listener_;
};

}  // namespace aidn::coordinator::web

#endif  // AIDN_COORDINATOR_WEB_WEB_SERVER_H_
