#include "coordinator/web/web_server.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/file.h"
#include "common/log.h"
#include "common/metrics/http_listener.h"
#include "common/status.h"
#include "coordinator/web/web_api.h"
#include "coordinator/web/web_assets.h"

namespace aidn::coordinator::web {
namespace {

constexpr size_t kMaxBodyBytes = 64 * 1024;
constexpr size_t kFileChunk = 1 << 20;

void SecurityHeaders(httplib::Response& res) {
  res.set_header("Content-Security-Policy",
                 "default-src 'self'; img-src 'self' data: blob:; frame-ancestors 'none'; "
                 "base-uri 'none'; form-action 'none'");
  res.set_header("X-Content-Type-Options", "nosniff");
  res.set_header("X-Frame-Options", "DENY");
  res.set_header("Referrer-Policy", "no-referrer");
}

// Streams `r`'s open file (read with pread, so ranges work too); a whole
// download's bytes are checked against the CRC-32C the checkpoint manifest
// recorded once more as they pass, and the connection is cut (no complete
// answer) when they differ or the file ends early.
void StreamFile(const WebResponse& r, httplib::Response& res) {
  res.set_header("Content-Disposition",
                 absl::StrCat("attachment; filename=\"", r.download_name, "\""));
  struct Progress {
    int64_t offset = 0;  // of the bytes read in order from the start
    uint32_t crc = 0;
  };
  auto progress = std::make_shared<Progress>();
  const int64_t total = r.file_bytes;
  const uint32_t want_crc = r.file_crc32c;
  std::shared_ptr<ScopedFd> file = r.file;
  res.set_content_provider(
      static_cast<size_t>(total), r.content_type,
      [file, progress, total, want_crc](size_t offset, size_t length, httplib::DataSink& sink) {
        std::vector<char> buffer(std::min(length, kFileChunk));
        ssize_t n = 0;
        do {
          n = ::pread(file->get(), buffer.data(), buffer.size(), static_cast<off_t>(offset));
        } while (n < 0 && errno == EINTR);
        if (n <= 0) {
          AIDN_LOG(WARNING) << "web: a checkpoint's weights ended early";
          return false;
        }
        if (static_cast<int64_t>(offset) == progress->offset) {
          progress->crc = Crc32c(buffer.data(), static_cast<size_t>(n), progress->crc);
          progress->offset += n;
          if (progress->offset == total && progress->crc != want_crc) {
            AIDN_LOG(WARNING) << "web: a checkpoint's weights changed while sent";
            return false;
          }
        }
        return sink.write(buffer.data(), static_cast<size_t>(n));
      });
}

}  // namespace

absl::StatusOr<std::unique_ptr<WebServer>> WebServer::Start(
    const WebServerOptions& options, std::shared_ptr<grpc::Channel> channel) {
  const metrics::HttpListenOptions listen{.address = options.address,
                                          .tls_cert_file = options.tls_cert_file,
                                          .tls_key_file = options.tls_key_file,
                                          .threads = options.threads,
                                          .what = "web UI"};
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<httplib::Server> server, metrics::NewHttpServer(listen));
  std::unique_ptr<WebServer> web(new WebServer());
  web->api_ = std::make_unique<WebApi>(std::move(channel), options.call_timeout);
  if (absl::StatusOr<std::string> chart = ReadFileToString(options.chartjs_file); chart.ok()) {
    web->chartjs_ = std::move(*chart);
  } else {
    AIDN_LOG(WARNING) << "web UI: no Chart.js, the pages show no charts (apt-get install "
                         "libjs-chart.js)"
                      << Kv("file", options.chartjs_file);
  }
  server->set_payload_max_length(kMaxBodyBytes);
  // What httplib answers itself (a body over the limit, a request it cannot
  // parse) carries the same headers, and a JSON error under /api/.
  server->set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.has_header("Content-Security-Policy")) SecurityHeaders(res);
    if (res.body.empty() && absl::StartsWith(req.path, "/api/")) {
      res.set_content(
          absl::StrCat("{\"error\": \"HTTP ", res.status, "\", \"code\": \"",
                       res.status == 413 ? "RESOURCE_EXHAUSTED" : "INVALID_ARGUMENT", "\"}"),
          "application/json");
    }
  });
  WebServer* raw = web.get();

  auto api = [raw](const httplib::Request& req, httplib::Response& res) {
    WebRequest request;
    request.method = req.method;
    request.path = req.path;
    for (const auto& [key, value] : req.params) request.query[key] = value;
    request.body = req.body;
    request.authorization = req.get_header_value("Authorization");
    const WebResponse r = raw->api_->Handle(request);
    SecurityHeaders(res);
    res.set_header("Cache-Control", "no-store");
    res.status = r.status;
    if (!r.allow.empty()) res.set_header("Allow", r.allow);
    if (r.file != nullptr) return StreamFile(r, res);
    res.set_content(r.body, r.content_type);
  };
  server->Get(R"(/api/.*)", api);
  server->Post(R"(/api/.*)", api);
  server->Put(R"(/api/.*)", api);
  server->Delete(R"(/api/.*)", api);
  server->Patch(R"(/api/.*)", api);

  server->Get("/chart.js", [raw](const httplib::Request&, httplib::Response& res) {
    SecurityHeaders(res);
    if (raw->chartjs_.empty()) {
      res.status = 404;
      res.set_content("Chart.js is not installed (Debian's libjs-chart.js)\n",
                      "text/plain; charset=utf-8");
      return;
    }
    res.set_header("Cache-Control", "max-age=3600");
    res.set_content(raw->chartjs_, "text/javascript; charset=utf-8");
  });
  server->Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain; charset=utf-8");
  });
  server->Get(R"(/.*)", [](const httplib::Request& req, httplib::Response& res) {
    SecurityHeaders(res);
    const WebAsset* asset = FindWebAsset(req.path == "/index.html" ? "/" : req.path);
    if (asset == nullptr) {
      res.status = 404;
      res.set_content("not found\n", "text/plain; charset=utf-8");
      return;
    }
    res.set_header("Cache-Control", "no-cache");
    res.set_content(std::string(asset->body), std::string(asset->content_type));
  });

  AIDN_ASSIGN_OR_RETURN(web->listener_, metrics::HttpListener::Start(std::move(server), listen));
  return web;
}

WebServer::~WebServer() {
  // The listener's threads call into api_: stop them first.
  listener_.reset();
}

std::string WebServer::address() const { return listener_->address(); }

}  // namespace aidn::coordinator::web
