#ifndef AIDN_COMMON_METRICS_HTTP_LISTENER_H_
#define AIDN_COMMON_METRICS_HTTP_LISTENER_H_

// An httplib server made with the house settings and listening on a thread
// of its own: what the Prometheus endpoint (http_server.h) and the
// coordinator's web UI share. Includes <httplib.h>: targets using it link
// aidn_metrics, whose CPPHTTPLIB_* defines they must all see.

#include <httplib.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace aidn::metrics {

struct HttpListenOptions {
  // "host:port" or "[v6]:port"; an empty host is every interface; port 0
  // picks a free one.
  std::string address;
  // Both set: HTTPS with this certificate (PEM, chain after it) and key.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Requests served at once (each keep-alive connection holds one while
  // it is open).
  int threads = 2;
  // Names the server in errors and logs ("metrics HTTP", "web UI").
  std::string what = "HTTP";
};

// A server (HTTPS when both files are set) with short keep-alive and I/O
// timeouts and SO_REUSEADDR without SO_REUSEPORT (a second server on the
// same port fails to bind rather than sharing it). INVALID_ARGUMENT for one
// TLS file without the other or files that do not load.
absl::StatusOr<std::unique_ptr<httplib::Server>> NewHttpServer(const HttpListenOptions& options);

class HttpListener {
 public:
  // Binds options.address and serves `server` (its routes set) until
  // destroyed. INVALID_ARGUMENT for an address that does not parse,
  // UNAVAILABLE naming it when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpListener>> Start(
      std::unique_ptr<httplib::Server> server, const HttpListenOptions& options);
  // Stops serving and joins the thread.
  ~HttpListener();
  HttpListener(const HttpListener&) = delete;
  HttpListener& operator=(const HttpListener&) = delete;

  int port() const { return port_; }
  // "host:port" as bound.
  std::string address() const;

 private:
  HttpListener() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  // Set by the thread when listen_after_bind returns.
  std::atomic<bool> listener_done_{false};
  std::string host_;
  int port_ = 0;
};

}  // namespace aidn::metrics

#endif  // AIDN_COMMON_METRICS_HTTP_LISTENER_H_
