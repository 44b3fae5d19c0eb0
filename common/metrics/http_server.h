#ifndef AIDN_COMMON_METRICS_HTTP_SERVER_H_
#define AIDN_COMMON_METRICS_HTTP_SERVER_H_

// The HTTP endpoint Prometheus scrapes: GET /metrics answers the registry's
// text exposition (Content-Type text/plain; version=0.0.4), GET /healthz
// answers "ok", anything else 404 (and non-GET methods 405). Built on
// cpp-httplib, serving on a thread pool of its own. Optionally HTTPS (a
// certificate and key), and /metrics only to requests that carry a bearer
// token (401 otherwise; /healthz stays open), as Prometheus's tls_config
// and authorization send them.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics/registry.h"

namespace aidn::metrics {

struct HttpServerOptions {
  // "host:port"; port 0 picks a free one (see port()).
  std::string address = "127.0.0.1:9464";
  // Both set: HTTPS with this certificate (PEM, chain after it) and key.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Not empty: /metrics answers only "Authorization: Bearer <token>".
  std::string bearer_token;
};

class HttpServer {
 public:
  // Binds and starts serving `registry` (not owned; must outlive the
  // server). INVALID_ARGUMENT for an address that does not parse,
  // UNAVAILABLE naming the address when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                           Registry* registry);
  // Stops serving and joins the thread.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The port bound, and "host:port" with it.
  int port() const;
  std::string address() const;

 private:
  struct Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Serves `registry` on `address` and, when `address_file` is not empty,
// writes the address it got there ("host:port\n", atomically: tests and
// scripts read it to find an ephemeral port). Null when `address` is empty
// (/metrics off).
absl::StatusOr<std::unique_ptr<HttpServer>> StartMetricsEndpoint(const HttpServerOptions& options,
                                                                 const std::string& address_file,
                                                                 Registry* registry);

// The bearer token in `path` (its contents, trimmed): INVALID_ARGUMENT
// naming the file when it cannot be read or is empty. "" for no path.
absl::StatusOr<std::string> ReadMetricsToken(const std::string& path);

}  // namespace aidn::metrics

#endif  // AIDN_COMMON_METRICS_HTTP_SERVER_H_
