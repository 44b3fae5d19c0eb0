// The web UI's JSON API (coordinator/web/web_api.h) over the coordinator's
// own gRPC server: what each path answers, under whose token, and what bad
// input gets. The pages themselves are driven in a real browser by
// tests/integration/web_ui_test.py.

#include "coordinator/web/web_api.h"

#include <chrono>
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "coordinator/server.h"
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator::web {
namespace {

using test_util::CoordinatorTest;
using test_util::Spec;
using ::testing::HasSubstr;

class WebApiTest : public CoordinatorTest {
 protected:
  void SetUp() override {
    CoordinatorTest::SetUp();
    auth_->AddToken("tok-alice", Principal{Role::kUser, "alice", ""});
    auth_->AddToken("tok-bob", Principal{Role::kUser, "bob", ""});
    auth_->AddToken("tok-admin", Principal{Role::kAdmin, "admin", ""});
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options, &c(), auth_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    api_ = std::make_unique<WebApi>(server_->InProcessChannel(), std::chrono::seconds(10));
  }
  void TearDown() override {
    api_.reset();
    c().Shutdown();
    server_->Shutdown(std::chrono::milliseconds(0));
  }

  WebResponse Call(const std::string& method, const std::string& path, const std::string& token,
                   std::map<std::string, std::string> query = {}, std::string body = "") {
    WebRequest request;
    request.method = method;
    request.path = path;
    request.query = std::move(query);
    request.body = std::move(body);
    if (!token.empty()) request.authorization = "Bearer " + token;
    return api_->Handle(request);
  }
  // The answer's JSON; a failure when it is not JSON.
  static nlohmann::json Body(const WebResponse& r) {
    nlohmann::json j = nlohmann::json::parse(r.body, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << r.body;
    return j;
  }
  std::string SubmitAs(const std::string& owner) {
    absl::StatusOr<v1::Job> job = c().SubmitJob(Spec(1), owner);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? job->id() : "";
  }

  std::unique_ptr<Server> server_;
  std::unique_ptr<WebApi> api_;
};

TEST_F(WebApiTest, WithoutAKnownTokenEveryCallIsUnauthenticated) {
  for (const std::string& token : {std::string(), std::string("not-a-token")}) {
    for (const char* path : {"/api/v1/jobs", "/api/v1/workers", "/api/v1/jobs/j-1"}) {
      const WebResponse r = Call("GET", path, token);
      EXPECT_EQ(r.status, 401) << path;
      EXPECT_EQ(Body(r)["code"], "UNAUTHENTICATED") << path;
    }
  }
}

// A user sees and cancels only its own jobs; an admin sees every job.
TEST_F(WebApiTest, AUserSeesAndChangesOnlyItsOwnJobs) {
  const std::string mine = SubmitAs("alice");
  const std::string theirs = SubmitAs("bob");
  auto ids = [&](const std::string& token) {
    std::vector<std::string> out;
    const nlohmann::json list = Body(Call("GET", "/api/v1/jobs", token));
    for (const auto& job : list["jobs"]) {
      out.push_back(job["id"]);
    }
    return out;
  };
  EXPECT_THAT(ids("tok-alice"), ::testing::ElementsAre(mine));
  EXPECT_THAT(ids("tok-admin"), ::testing::UnorderedElementsAre(mine, theirs));

  const WebResponse get = Call("GET", "/api/v1/jobs/" + theirs, "tok-alice");
  EXPECT_EQ(get.status, 403);
  EXPECT_THAT(get.body, ::testing::Not(HasSubstr("\"spec\"")));
  for (const char* what : {"/metrics", "/events", "/checkpoints", "/logs"}) {
    EXPECT_EQ(Call("GET", "/api/v1/jobs/" + theirs + what, "tok-alice").status, 403) << what;
  }
  for (const char* action : {"/cancel", "/pause", "/resume"}) {
    EXPECT_EQ(Call("POST", "/api/v1/jobs/" + theirs + action, "tok-alice").status, 403) << action;
  }
  EXPECT_EQ(Get(theirs).state(), v1::Job::PENDING) << "another user's job was changed";

  // A queued job pauses at once, and resumes to the queue.
  const WebResponse pause = Call("POST", "/api/v1/jobs/" + theirs + "/pause", "tok-bob");
  ASSERT_EQ(pause.status, 200) << pause.body;
  EXPECT_EQ(Body(pause)["state"], "PAUSED");
  EXPECT_EQ(Call("POST", "/api/v1/jobs/" + theirs + "/pause", "tok-bob").status, 409);
  const WebResponse resume = Call("POST", "/api/v1/jobs/" + theirs + "/resume", "tok-bob");
  ASSERT_EQ(resume.status, 200) << resume.body;
  EXPECT_EQ(Body(resume)["state"], "PENDING");

  const WebResponse cancel =
      Call("POST", "/api/v1/jobs/" + mine + "/cancel", "tok-alice", {}, R"({"reason": "typo"})");
  ASSERT_EQ(cancel.status, 200) << cancel.body;
  EXPECT_EQ(Body(cancel)["state"], "CANCELLED");
  EXPECT_THAT(Get(mine).message(), HasSubstr("typo"));
  const WebResponse again = Call("POST", "/api/v1/jobs/" + mine + "/cancel", "tok-alice");
  EXPECT_EQ(again.status, 409);
  EXPECT_EQ(Body(again)["code"], "FAILED_PRECONDITION");
}

// Steps, events and workers in protobuf's JSON mapping: snake_case names,
// int64 as strings, enums by name; metrics from a step on.
TEST_F(WebApiTest, AJobsRecordsComeAsProtobufJson) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(SendSteps(id, 0, 1, 5).ok());
  ASSERT_TRUE(SendSteps(id, 1, 1, 5).ok());
  const nlohmann::json job = Body(Call("GET", "/api/v1/jobs/" + id, "tok-alice"));
  EXPECT_EQ(job["state"], "RUNNING");
  EXPECT_EQ(job["owner"], "alice");
  EXPECT_EQ(job["spec"]["world_size"], 2);

  const WebResponse metrics =
      Call("GET", "/api/v1/jobs/" + id + "/metrics", "tok-alice", {{"from_step", "3"}});
  ASSERT_EQ(metrics.status, 200) << metrics.body;
  std::vector<std::string> steps;
  const nlohmann::json records = Body(metrics);
  for (const auto& s : records["steps"]) {
    steps.push_back(s["step"]);
    EXPECT_EQ(s["kind"], "TRAIN");
    EXPECT_EQ(s["rank_step_seconds"].size(), 2u);
  }
  EXPECT_THAT(steps, ::testing::ElementsAre("3", "4", "5"));

  const nlohmann::json events = Body(Call("GET", "/api/v1/jobs/" + id + "/events", "tok-alice"));
  ASSERT_FALSE(events["events"].empty());
  const std::string first_seq = events["events"][0]["seq"];
  const nlohmann::json later =
      Body(Call("GET", "/api/v1/jobs/" + id + "/events", "tok-alice", {{"after_seq", first_seq}}));
  EXPECT_EQ(later["events"].size() + 1, events["events"].size());

  const nlohmann::json workers = Body(Call("GET", "/api/v1/workers", "tok-alice"));
  ASSERT_EQ(workers["workers"].size(), 2u);
  EXPECT_EQ(workers["workers"][0]["state"], "ALIVE");
  EXPECT_EQ(workers["workers"][0]["cpu_slots_used"], 1);

  const WebResponse logs =
      Call("GET", "/api/v1/jobs/" + id + "/logs", "tok-alice", {{"tail", "10"}});
  ASSERT_EQ(logs.status, 200) << logs.body;
  EXPECT_TRUE(Body(logs)["lines"].is_array());
  EXPECT_EQ(Body(Call("GET", "/api/v1/jobs/" + id + "/checkpoints", "tok-alice"))["checkpoints"],
            nlohmann::json::array());
}

TEST_F(WebApiTest, BadInputIsRefusedNamingIt) {
  const std::string id = SubmitAs("alice");
  struct Case {
    std::string method, path;
    std::map<std::string, std::string> query;
    std::string body;
    int status;
    std::string message;
  };
  const Case cases[] = {
      {"GET",
       "/api/v1/jobs/" + id + "/metrics",
       {{"from_step", "x"}},
       "",
       400,
       "query parameter from_step: want an integer"},
      {"GET", "/api/v1/jobs/" + id + "/events", {{"limit", "0"}}, "", 400, "query parameter limit"},
      {"GET", "/api/v1/jobs/" + id + "/logs", {{"tail", "-3"}}, "", 400, "query parameter tail"},
      {"GET", "/api/v1/jobs", {{"state", "RUNNING,BOGUS"}}, "", 400, "unknown state \"BOGUS\""},
      {"GET", "/api/v1/jobs", {{"label", "=x"}}, "", 400, "want key=value"},
      {"POST", "/api/v1/jobs/" + id + "/cancel", {}, "not json", 400, "a JSON object"},
      {"POST", "/api/v1/jobs/" + id + "/cancel", {}, R"({"reason": 3})", 400, "reason: want"},
      {"GET", "/api/v1/jobs/" + id + "/cancel", {}, "", 405, "answers POST only"},
      {"GET", "/api/v1/jobs/" + id + "/pause", {}, "", 405, "answers POST only"},
      {"POST", "/api/v1/jobs/" + id + "/pause", {}, "[1]", 400, "a JSON object"},
      {"DELETE", "/api/v1/jobs/" + id, {}, "", 405, "answers GET only"},
      {"GET", "/api/v1/nothing", {}, "", 404, "no API path /api/v1/nothing"},
      {"GET",
       "/api/v1/jobs/" + id + "/checkpoints/x/model.safetensors",
       {},
       "",
       404,
       "no API path"},
      {"GET",
       "/api/v1/jobs/" + id + "/checkpoints/7/model.safetensors",
       {},
       "",
       404,
       "has no checkpoint at step 7 (no checkpoint is committed and valid)"},
      {"GET", "/api/v1/jobs/no-such-job", {}, "", 404, "no-such-job"},
  };
  for (const Case& c : cases) {
    const WebResponse r = Call(c.method, c.path, "tok-alice", c.query, c.body);
    EXPECT_EQ(r.status, c.status) << c.method << " " << c.path << ": " << r.body;
    EXPECT_THAT(std::string(Body(r)["error"]), HasSubstr(c.message)) << c.path;
  }
  WebRequest control;
  control.method = "GET";
  control.path = "/api/v1/jobs";
  control.authorization = "Bearer tok-alice\r\nX-Injected: 1";
  EXPECT_EQ(api_->Handle(control).status, 400);
  EXPECT_EQ(Get(id).state(), v1::Job::PENDING) << "bad input changed the job";
}

}  // namespace
}  // namespace aidn::coordinator::web
