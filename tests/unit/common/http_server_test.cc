#include "common/metrics/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/metrics/registry.h"

namespace aidn::metrics {
namespace {

using ::testing::HasSubstr;

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

std::unique_ptr<HttpServer> StartOnFreePort(Registry* registry) {
  HttpServerOptions options;
  options.address = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(options, registry);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<httplib::Client> ClientFor(const HttpServer& server) {
  auto client = std::make_unique<httplib::Client>("127.0.0.1", server.port());
  client->set_connection_timeout(std::chrono::seconds(5));
  client->set_read_timeout(std::chrono::seconds(5));
  return client;
}

TEST(HttpServer, ServesTheRegistryOnMetricsWithTheExpositionContentType) {
  Registry registry;
  registry.AddCounter("aidn_rpcs_total", "RPCs.").Add({{"method", "Get\"Job\""}}).Increment(3);
  registry.AddHistogram("aidn_step_seconds", "Steps.", {0.5, 1}).Add({}).Observe(0.7);
  std::atomic<int> hook_runs{0};
  registry.AddCollectHook([&hook_runs] { ++hook_runs; });
  std::unique_ptr<HttpServer> server = StartOnFreePort(&registry);
  ASSERT_NE(server, nullptr);
  EXPECT_GT(server->port(), 0);
  EXPECT_EQ(server->address(), absl::StrCat("127.0.0.1:", server->port()));

  httplib::Result res = ClientFor(*server)->Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), kContentType);
  EXPECT_EQ(hook_runs, 1);
  // The hook counts calls but changes no sample, so a second Serialize
  // gives the same text.
  EXPECT_EQ(res->body, registry.Serialize());
  EXPECT_THAT(res->body, HasSubstr("aidn_rpcs_total{method=\"Get\\\"Job\\\"\"} 3\n"));
}

TEST(HttpServer, AnswersHealthzWithOk) {
  Registry registry;
  std::unique_ptr<HttpServer> server = StartOnFreePort(&registry);
  ASSERT_NE(server, nullptr);
  httplib::Result res = ClientFor(*server)->Get("/healthz");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "ok\n");
}

TEST(HttpServer, AnswersOtherPathsWith404) {
  Registry registry;
  std::unique_ptr<HttpServer> server = StartOnFreePort(&registry);
  ASSERT_NE(server, nullptr);
  auto client = ClientFor(*server);
  for (const char* path : {"/", "/metric", "/metrics/x", "/healthz2"}) {
    httplib::Result res = client->Get(path);
    ASSERT_TRUE(res) << path << ": " << httplib::to_string(res.error());
    EXPECT_EQ(res->status, 404) << path;
  }
}

TEST(HttpServer, AnswersOtherMethodsOnItsPathsWith405) {
  Registry registry;
  std::unique_ptr<HttpServer> server = StartOnFreePort(&registry);
  ASSERT_NE(server, nullptr);
  auto client = ClientFor(*server);
  httplib::Result post = client->Post("/metrics", "x", "text/plain");
  ASSERT_TRUE(post) << httplib::to_string(post.error());
  EXPECT_EQ(post->status, 405);
  EXPECT_EQ(post->get_header_value("Allow"), "GET, HEAD");
  httplib::Result put = client->Put("/healthz", "x", "text/plain");
  ASSERT_TRUE(put) << httplib::to_string(put.error());
  EXPECT_EQ(put->status, 405);
  httplib::Result del = client->Delete("/metrics");
  ASSERT_TRUE(del) << httplib::to_string(del.error());
  EXPECT_EQ(del->status, 405);
}

TEST(HttpServer, ServesConcurrentScrapers) {
  Registry registry;
  registry.AddGauge("g", "G.").Add({}).Set(1);
  std::unique_ptr<HttpServer> server = StartOnFreePort(&registry);
  ASSERT_NE(server, nullptr);
  constexpr int kClients = 4, kRequests = 5;
  std::vector<int> ok(kClients, 0);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      auto client = ClientFor(*server);
      for (int i = 0; i < kRequests; ++i) {
        httplib::Result res = client->Get("/metrics");
        if (res && res->status == 200 && res->body == "# HELP g G.\n# TYPE g gauge\ng 1\n") {
          ++ok[c];
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int c = 0; c < kClients; ++c) EXPECT_EQ(ok[c], kRequests) << "client " << c;
}

TEST(HttpServer, RejectsAddressesThatDoNotParse) {
  Registry registry;
  for (const char* address :
       {"", "localhost", "127.0.0.1", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:-1",
        "127.0.0.1:+80", "127.0.0.1: 80", "127.0.0.1:65536", "127.0.0.1:999999", "::1:80", "[::1]",
        "[::1]80", "[::1:80", "[]:80"}) {
    HttpServerOptions options;
    options.address = address;
    absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(options, &registry);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_THAT(server.status().message(), HasSubstr(absl::StrCat("\"", address, "\"")));
  }
}

TEST(HttpServer, ServesOnIpv6Loopback) {
  Registry registry;
  HttpServerOptions options;
  options.address = "[::1]:0";
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(options, &registry);
  if (server.status().code() == absl::StatusCode::kUnavailable) {
    GTEST_SKIP() << "no IPv6 loopback here: " << server.status();
  }
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->address(), absl::StrCat("[::1]:", (*server)->port()));
  httplib::Client client("::1", (*server)->port());
  httplib::Result res = client.Get("/healthz");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->body, "ok\n");
}

TEST(HttpServer, TakesAnEmptyHostAsEveryInterface) {
  Registry registry;
  HttpServerOptions options;
  options.address = ":0";
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(options, &registry);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->address(), absl::StrCat("0.0.0.0:", (*server)->port()));
  httplib::Result res = ClientFor(**server)->Get("/healthz");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
}

TEST(HttpServer, IsUnavailableWhenThePortIsTakenByAnotherServer) {
  Registry registry;
  std::unique_ptr<HttpServer> first = StartOnFreePort(&registry);
  ASSERT_NE(first, nullptr);
  // httplib's default socket options set SO_REUSEPORT, with which this second
  // bind would succeed and share the port; the server must not allow that.
  HttpServerOptions options;
  options.address = first->address();
  absl::StatusOr<std::unique_ptr<HttpServer>> second = HttpServer::Start(options, &registry);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr(first->address()));
}

TEST(HttpServer, IsUnavailableWhenThePortIsTakenByAPlainSocket) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));

  Registry registry;
  HttpServerOptions options;
  options.address = address;
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(options, &registry);
  close(fd);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable) << server.status();
  EXPECT_THAT(server.status().message(), HasSubstr(address));
}

TEST(HttpServer, IsUnavailableForAnAddressThatIsNotLocal) {
  Registry registry;
  HttpServerOptions options;
  options.address = "192.0.2.1:0";  // TEST-NET-1: never assigned to this host
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(options, &registry);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable) << server.status();
  EXPECT_THAT(server.status().message(), HasSubstr("192.0.2.1:0"));
}

TEST(HttpServer, StopsPromptlyWithIdleClientConnectionsOpen) {
  Registry registry;
  std::unique_ptr<HttpServer> server = StartOnFreePort(&registry);
  ASSERT_NE(server, nullptr);

  // A keep-alive client that has made a request and keeps its connection...
  httplib::Client keep_alive("127.0.0.1", server->port());
  keep_alive.set_keep_alive(true);
  httplib::Result res = keep_alive.Get("/healthz");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  // ...and a connection that never sends anything.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(server->port()));
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);

  const auto start = std::chrono::steady_clock::now();
  server.reset();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  close(fd);
  // httplib's default keep-alive timeout (5 s) would hold the destructor for
  // that long.
  EXPECT_LT(elapsed, std::chrono::milliseconds(2500));
}

TEST(HttpServer, CanBeDestroyedRightAfterStart) {
  // The listener thread may not have started when the destructor runs.
  Registry registry;
  for (int i = 0; i < 20; ++i) {
    const auto start = std::chrono::steady_clock::now();
    StartOnFreePort(&registry).reset();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2)) << i;
  }
}

TEST(HttpServer, FreesThePortWhenDestroyed) {
  Registry registry;
  std::unique_ptr<HttpServer> server = StartOnFreePort(&registry);
  ASSERT_NE(server, nullptr);
  HttpServerOptions options;
  options.address = server->address();
  server.reset();
  absl::StatusOr<std::unique_ptr<HttpServer>> again = HttpServer::Start(options, &registry);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->address(), options.address);
}

}  // namespace
}  // namespace aidn::metrics
