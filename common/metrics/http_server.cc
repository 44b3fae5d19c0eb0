#include "common/metrics/http_server.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/log.h"
#include "common/metrics/http_listener.h"
#include "common/status.h"

namespace aidn::metrics {
namespace {

constexpr char kMetricsContentType[] = "text/plain; version=0.0.4; charset=utf-8";

void MethodNotAllowed(const httplib::Request&, httplib::Response& res) {
  res.status = 405;
  res.set_header("Allow", "GET, HEAD");
  res.set_content("method not allowed\n", "text/plain; charset=utf-8");
}

}  // namespace

struct HttpServer::Impl {
  std::unique_ptr<HttpListener> listener;
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                              Registry* registry) {
  const HttpListenOptions listen{.address = options.address,
                                 .tls_cert_file = options.tls_cert_file,
                                 .tls_key_file = options.tls_key_file,
                                 // A scrape every few seconds needs no more.
                                 .threads = 2,
                                 .what = "metrics HTTP"};
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<httplib::Server> server, NewHttpServer(listen));
  server->Get("/metrics", [registry, token = options.bearer_token](const httplib::Request& req,
                                                                   httplib::Response& res) {
    if (!token.empty() && req.get_header_value("Authorization") != "Bearer " + token) {
      res.status = 401;
      res.set_header("WWW-Authenticate", "Bearer realm=\"aidn metrics\"");
      res.set_content("a bearer token is required\n", "text/plain; charset=utf-8");
      return;
    }
    res.set_content(registry->Serialize(), kMetricsContentType);
  });
  server->Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain; charset=utf-8");
  });
  for (const char* path : {"/metrics", "/healthz"}) {
    server->Post(path, MethodNotAllowed);
    server->Put(path, MethodNotAllowed);
    server->Patch(path, MethodNotAllowed);
    server->Delete(path, MethodNotAllowed);
    server->Options(path, MethodNotAllowed);
  }
  auto impl = std::make_unique<Impl>();
  AIDN_ASSIGN_OR_RETURN(impl->listener, HttpListener::Start(std::move(server), listen));
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() = default;

int HttpServer::port() const { return impl_->listener->port(); }

std::string HttpServer::address() const { return impl_->listener->address(); }

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
