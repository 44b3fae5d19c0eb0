// The web UI's HTTP server (coordinator/web/web_server.h): its pages, the
// headers every answer carries, Chart.js from its file, and the API behind
// /api/v1/ with the browser's bearer token passed on.

#include "coordinator/web/web_server.h"

#include <httplib.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "coordinator/server.h"
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator::web {
namespace {

using test_util::CoordinatorTest;
using test_util::TempDir;
using ::testing::HasSubstr;

class WebServerTest : public CoordinatorTest {
 protected:
  void SetUp() override {
    CoordinatorTest::SetUp();
    auth_->AddToken("tok-alice", Principal{Role::kUser, "alice", ""});
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options, &c(), auth_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    chartjs_ = dir_.path() + "/chart.min.js";
  }
  void TearDown() override {
    web_.reset();
    c().Shutdown();
    server_->Shutdown(std::chrono::milliseconds(0));
  }
  void StartWeb() {
    WebServerOptions options;
    options.address = "127.0.0.1:0";
    options.chartjs_file = chartjs_;
    absl::StatusOr<std::unique_ptr<WebServer>> web =
        WebServer::Start(options, server_->InProcessChannel());
    ASSERT_TRUE(web.ok()) << web.status();
    web_ = *std::move(web);
    const std::string address = web_->address();
    int port = 0;
    ASSERT_TRUE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port)) << address;
    client_ = std::make_unique<httplib::Client>("127.0.0.1", port);
  }

  TempDir dir_;
  std::string chartjs_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<WebServer> web_;
  std::unique_ptr<httplib::Client> client_;
};

TEST_F(WebServerTest, ServesItsPagesWithHeadersThatKeepThemToThemselves) {
  { std::ofstream(chartjs_) << "var Chart = function() {};\n"; }
  StartWeb();
  struct Page {
    const char* path;
    const char* type;
    const char* contains;
  };
  for (const Page& p :
       {Page{"/", "text/html", "<title>"}, Page{"/index.html", "text/html", "/app.js"},
        Page{"/app.js", "text/javascript", "use strict"},
        Page{"/common.js", "text/javascript", "window.aidnUi"},
        Page{"/job.js", "text/javascript", "renderJobPage"}, Page{"/style.css", "text/css", "{"},
        Page{"/chart.js", "text/javascript", "var Chart"}}) {
    const httplib::Result r = client_->Get(p.path);
    ASSERT_TRUE(r) << p.path;
    EXPECT_EQ(r->status, 200) << p.path;
    EXPECT_THAT(r->get_header_value("Content-Type"), HasSubstr(p.type)) << p.path;
    EXPECT_THAT(r->body, HasSubstr(p.contains)) << p.path;
    EXPECT_THAT(r->get_header_value("Content-Security-Policy"), HasSubstr("default-src 'self'"))
        << p.path;
    EXPECT_EQ(r->get_header_value("X-Content-Type-Options"), "nosniff") << p.path;
    EXPECT_EQ(r->get_header_value("X-Frame-Options"), "DENY") << p.path;
  }
  const httplib::Result missing = client_->Get("/secrets.txt");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
}

TEST_F(WebServerTest, PassesTheBrowsersTokenOnAndAnswersJson) {
  StartWeb();
  const httplib::Result anonymous = client_->Get("/api/v1/jobs");
  ASSERT_TRUE(anonymous);
  EXPECT_EQ(anonymous->status, 401);
  EXPECT_THAT(anonymous->get_header_value("Content-Type"), HasSubstr("application/json"));
  EXPECT_EQ(anonymous->get_header_value("Cache-Control"), "no-store");

  const std::string id = Submit(test_util::Spec(1));
  const httplib::Result mine =
      client_->Get("/api/v1/jobs", {{"Authorization", "Bearer tok-alice"}});
  ASSERT_TRUE(mine);
  EXPECT_EQ(mine->status, 200);
  EXPECT_THAT(mine->body, HasSubstr(id));

  const httplib::Result cancelled = client_->Post(
      ("/api/v1/jobs/" + id + "/cancel").c_str(), {{"Authorization", "Bearer tok-alice"}},
      R"({"reason": "from a test"})", "application/json");
  ASSERT_TRUE(cancelled);
  EXPECT_EQ(cancelled->status, 200) << cancelled->body;
  EXPECT_EQ(Get(id).state(), v1::Job::CANCELLED);
}

TEST_F(WebServerTest, WhatHttplibRefusesItselfCarriesTheHeadersToo) {
  StartWeb();
  const httplib::Result big =
      client_->Post("/api/v1/jobs/job-1/cancel", {{"Authorization", "Bearer tok-alice"}},
                    std::string(100 * 1024, 'x'), "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  EXPECT_THAT(big->get_header_value("Content-Security-Policy"), HasSubstr("default-src 'self'"));
  EXPECT_THAT(big->body, HasSubstr("RESOURCE_EXHAUSTED"));
  const httplib::Result wrong = client_->Delete("/api/v1/jobs", {{"Authorization", "Bearer x"}});
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 405);
  EXPECT_EQ(wrong->get_header_value("Allow"), "GET, HEAD");
  EXPECT_EQ(wrong->get_header_value("Content-Security-Policy").empty(), false);
}

TEST_F(WebServerTest, WithoutChartJsItSaysWhatToInstall) {
  StartWeb();  // no file at chartjs_
  const httplib::Result r = client_->Get("/chart.js");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_THAT(r->body, HasSubstr("libjs-chart.js"));
  const httplib::Result page = client_->Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
}

TEST_F(WebServerTest, RefusesABadAddress) {
  WebServerOptions options;
  options.address = "localhost";
  absl::StatusOr<std::unique_ptr<WebServer>> web =
      WebServer::Start(options, server_->InProcessChannel());
  ASSERT_FALSE(web.ok());
  EXPECT_THAT(std::string(web.status().message()), HasSubstr("web UI address \"localhost\""));
}

}  // namespace
}  // namespace aidn::coordinator::web
