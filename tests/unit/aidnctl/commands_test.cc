// Tests of aidnctl's commands against an in-process fake coordinator: what
// they send, what they print, and how they report failures.

#include "aidnctl/commands.h"

#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "aidnctl/commands.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace aidn::ctl {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// ---------------------------------------------------------------------------
// Commands against a fake coordinator.

class FakeCoordinator final : public v1::CoordinatorService::Service {
 public:
  explicit FakeCoordinator(int job_count) {
    for (int i = 0; i < job_count; ++i) {
      v1::Job job;
      job.set_id(absl::StrCat("job-", i));
      job.set_state(v1::Job::PENDING);
      jobs_.push_back(job);
    }
  }

  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request,
                         v1::SubmitJobResponse* response) override {
    RecordToken(context);
    if (request->spec().world_size() > 8) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "world_size: 9 is above the limit 8");
    }
    response->mutable_job()->set_id("job-new");
    *response->mutable_job()->mutable_spec() = request->spec();
    return grpc::Status::OK;
  }

  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::Job* response) override {
    RecordToken(context);
    if (request->job_id() == "secret") {
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "not your job");
    }
    for (const v1::Job& job : jobs_) {
      if (job.id() == request->job_id()) {
        *response = job;
        return grpc::Status::OK;
      }
    }
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "job " + request->job_id() + " not found");
  }

  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* response) override {
    RecordToken(context);
    ++list_calls_;
    {
      absl::MutexLock lock(&mu_);
      last_list_request_ = *request;
    }
    size_t start = 0;
    if (!request->page_token().empty()) start = std::stoul(request->page_token());
    const size_t size = request->page_size() > 0 ? request->page_size() : 100;
    for (size_t i = start; i < jobs_.size() && i < start + size; ++i) {
      *response->add_jobs() = jobs_[i];
    }
    if (start + size < jobs_.size()) response->set_next_page_token(std::to_string(start + size));
    return grpc::Status::OK;
  }

  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                         v1::Job* response) override {
    RecordToken(context);
    response->set_id(request->job_id());
    response->set_state(v1::Job::CANCELLED);
    response->set_message(request->reason());
    return grpc::Status::OK;
  }

  grpc::Status ListWorkers(grpc::ServerContext* context, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse*) override {
    RecordToken(context);
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing bearer token");
  }

  int list_calls() const { return list_calls_; }
  std::string last_authorization() {
    absl::MutexLock lock(&mu_);
    return last_authorization_;
  }
  v1::ListJobsRequest last_list_request() {
    absl::MutexLock lock(&mu_);
    return last_list_request_;
  }

 private:
  void RecordToken(grpc::ServerContext* context) {
    absl::MutexLock lock(&mu_);
    auto it = context->client_metadata().find("authorization");
    last_authorization_ = it == context->client_metadata().end()
                              ? ""
                              : std::string(it->second.data(), it->second.size());
  }

  std::vector<v1::Job> jobs_;
  std::atomic<int> list_calls_{0};
  absl::Mutex mu_;
  std::string last_authorization_ ABSL_GUARDED_BY(mu_);
  v1::ListJobsRequest last_list_request_ ABSL_GUARDED_BY(mu_);
};

class CommandsTest : public testing::Test {
 protected:
  void SetUp() override { Start(250); }

  void Start(int job_count) {
    server_.reset();  // before the service it serves
    fake_ = std::make_unique<FakeCoordinator>(job_count);
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(fake_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    env_.options.connection.address = absl::StrCat("127.0.0.1:", port);
    env_.options.connection.token = "t0ken";
    env_.options.connection.insecure = true;  // the fake serves plaintext
    env_.options.timeout = std::chrono::seconds(10);
    stub_ = NewCoordinatorStub(env_.options.connection);
    env_.stub = stub_.get();
    env_.out = &out_;
    env_.in = &in_;
  }

  void TearDown() override { server_->Shutdown(); }

  std::unique_ptr<FakeCoordinator> fake_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::CoordinatorService::Stub> stub_;
  std::ostringstream out_;
  std::istringstream in_;
  CommandEnv env_;
};

TEST_F(CommandsTest, SubmitPrintsOneLineAndSendsTheBearerToken) {
  in_.str("name: x\nworld_size: 2\n");
  ASSERT_TRUE(RunSubmit(env_, "-").ok());
  EXPECT_EQ(out_.str(), "submitted job-new\n");
  EXPECT_EQ(fake_->last_authorization(), "Bearer t0ken");
}

TEST_F(CommandsTest, SubmitPrintsTheResponseAsJson) {
  env_.options.format = OutputFormat::kJson;
  in_.str("name: x\nworld_size: 2\n");
  ASSERT_TRUE(RunSubmit(env_, "-").ok());
  const auto json = nlohmann::json::parse(out_.str());
  EXPECT_EQ(json["job"]["id"], "job-new");
  EXPECT_EQ(json["job"]["spec"]["world_size"], 2);
}

TEST_F(CommandsTest, ARefusedSpecIsReportedAsAnInvalidJobSpec) {
  in_.str("world_size: 9\n");
  const absl::Status status = RunSubmit(env_, "-");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "invalid job spec: world_size: 9 is above the limit 8");
  EXPECT_EQ(out_.str(), "");
}

TEST_F(CommandsTest, ABadSpecFileFailsBeforeAnyCall) {
  in_.str("world_sise: 2\n");
  const absl::Status status = RunSubmit(env_, "-");
  EXPECT_THAT(std::string(status.message()), HasSubstr("<stdin>: world_sise: unknown field"));
  EXPECT_EQ(fake_->last_authorization(), "");  // never called
}

TEST_F(CommandsTest, ASpecTooLargeForACallFailsBeforeAnyCallNamingTheField) {
  in_.str(absl::StrCat(
      "name: x\nworld_size: 2\nlabels:\n  notes: ", std::string(5 * 1024 * 1024, 'x'), "\n"));
  const absl::Status status = RunSubmit(env_, "-");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              StartsWith("<stdin>: labels[\"notes\"]: 5242880 bytes"));
  EXPECT_EQ(fake_->last_authorization(), "");  // never called
}

TEST_F(CommandsTest, ListFollowsPageTokensUpToTheLimit) {
  ListOptions options;
  options.limit = 120;
  options.states = {v1::Job::PENDING, v1::Job::RUNNING};
  options.labels = {{"team", "ml"}};
  env_.options.format = OutputFormat::kJson;
  ASSERT_TRUE(RunList(env_, options).ok());
  const auto json = nlohmann::json::parse(out_.str());
  ASSERT_EQ(json["jobs"].size(), 120u);
  EXPECT_EQ(json["jobs"][119]["id"], "job-119");
  EXPECT_EQ(json["jobs"][0]["state"], "PENDING");
  EXPECT_EQ(fake_->list_calls(), 1);
  const v1::ListJobsRequest request = fake_->last_list_request();
  EXPECT_EQ(request.states_size(), 2);
  EXPECT_EQ(request.labels().at("team"), "ml");
}

TEST_F(CommandsTest, ListWithoutLimitReadsEveryPage) {
  ListOptions options;
  options.limit = 0;
  ASSERT_TRUE(RunList(env_, options).ok());
  const std::string table = out_.str();
  // Header and 250 rows.
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 251);
  EXPECT_THAT(table, HasSubstr("job-249"));
}

TEST_F(CommandsTest, ListOfManyPagesStopsAtTheLimit) {
  // Pages of the coordinator's 1000 at most: 1000 + 200.
  Start(2500);
  ListOptions options;
  options.limit = 1200;
  env_.options.format = OutputFormat::kYaml;
  ASSERT_TRUE(RunList(env_, options).ok());
  EXPECT_EQ(fake_->list_calls(), 2);
  EXPECT_THAT(out_.str(), HasSubstr("id: job-1199\n"));
  EXPECT_THAT(out_.str(), testing::Not(HasSubstr("id: job-1200\n")));
  EXPECT_THAT(out_.str(), HasSubstr("next_page_token: \"1200\"\n"));
}

TEST_F(CommandsTest, DescribeOfAMissingJobGivesTheServerMessage) {
  const absl::Status status = RunDescribe(env_, "job-x");
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(status.message(), "job job-x not found");
}

TEST_F(CommandsTest, DescribePrintsTheJob) {
  ASSERT_TRUE(RunDescribe(env_, "job-3").ok());
  EXPECT_THAT(out_.str(), HasSubstr("ID:"));
  EXPECT_THAT(out_.str(), HasSubstr("job-3"));
  EXPECT_THAT(out_.str(), HasSubstr("PENDING"));
}

TEST_F(CommandsTest, CancelPrintsOneLine) {
  ASSERT_TRUE(RunCancel(env_, "job-5", "no longer needed").ok());
  EXPECT_EQ(out_.str(), "cancelled job-5\n");
}

TEST_F(CommandsTest, RefusedCredentialsHintAtTheTokenSettings) {
  absl::Status status = RunWorkers(env_);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(std::string(status.message()), HasSubstr("missing bearer token"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("--token"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("AIDN_TOKEN"));

  status = RunDescribe(env_, "secret");
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(status.message()), HasSubstr("permission denied: not your job"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("AIDN_TOKEN"));
}

TEST_F(CommandsTest, AnUnimplementedCallSaysSo) {
  const absl::Status status = RunCheckpoints(env_, "job-1");
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(status.message()), HasSubstr("does not implement"));
}

// A loopback port nothing listens on.
int ClosedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

TEST(Commands, AnUnreachableCoordinatorFailsFastNamingTheAddress) {
  CommandEnv env;
  env.options.connection.address = absl::StrCat("127.0.0.1:", ClosedPort());
  env.options.timeout = std::chrono::seconds(20);
  auto stub = NewCoordinatorStub(env.options.connection);
  env.stub = stub.get();
  std::ostringstream out;
  env.out = &out;
  const absl::Time start = absl::Now();
  const absl::Status status = RunList(env, ListOptions());
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(status.message()),
              StartsWith("cannot reach coordinator at " + env.options.connection.address + ": "));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // refused at once, not at the deadline
}

TEST(RpcError, NamesTheDeadlineOnATimeout) {
  const absl::Status status =
      RpcError(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded"), "h:1",
               std::chrono::milliseconds(1500));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(status.message()), HasSubstr("h:1 did not answer within 1.5s"));
}

TEST(FlagParsers, ReadStatesLabelsAndTimeouts) {
  EXPECT_EQ(*ParseJobState("running"), v1::Job::RUNNING);
  EXPECT_EQ(*ParseJobState("Failed"), v1::Job::FAILED);
  EXPECT_FALSE(ParseJobState("state_unspecified").ok());
  EXPECT_THAT(std::string(ParseJobState("done").status().message()), HasSubstr("SUCCEEDED"));

  EXPECT_EQ(*ParseLabel("team=ml"), std::make_pair(std::string("team"), std::string("ml")));
  EXPECT_EQ(*ParseLabel("expr=a=b"), std::make_pair(std::string("expr"), std::string("a=b")));
  EXPECT_EQ(ParseLabel("empty=")->second, "");
  EXPECT_FALSE(ParseLabel("team").ok());
  EXPECT_FALSE(ParseLabel("=x").ok());

  EXPECT_EQ(*ParseTimeout("30s"), std::chrono::seconds(30));
  EXPECT_EQ(*ParseTimeout("500ms"), std::chrono::milliseconds(500));
  EXPECT_EQ(*ParseTimeout("2m"), std::chrono::minutes(2));
  EXPECT_EQ(*ParseTimeout("5"), std::chrono::seconds(5));
  EXPECT_EQ(*ParseTimeout("1.5"), std::chrono::milliseconds(1500));
  EXPECT_FALSE(ParseTimeout("0").ok());
  EXPECT_FALSE(ParseTimeout("-1s").ok());
  EXPECT_FALSE(ParseTimeout("soon").ok());
  EXPECT_FALSE(ParseTimeout("inf").ok());
}

TEST(BashCompletionScript, CompletesCommandsFlagsAndValues) {
  const std::string script = BashCompletionScript(
      {{{"-o", "--output"}, true}, {{"--addr"}, true}},
      {{"submit", {{{"-f", "--file"}, true}}}, {"list", {{{"--state"}, true}}}, {"version", {}}});
  EXPECT_THAT(script, HasSubstr("local commands=\"submit list version\""));
  EXPECT_THAT(script, HasSubstr("list) flags=\"--state\""));
  EXPECT_THAT(script, HasSubstr("\"table json yaml\""));
  EXPECT_THAT(script, HasSubstr("pending scheduled running"));
  EXPECT_THAT(script, HasSubstr("complete -F _aidnctl aidnctl"));
  // Global flags that take a value skip their value when finding the command.
  EXPECT_THAT(script, HasSubstr("-o|--output|--addr) ((i++))"));
}

}  // namespace
}  // namespace aidn::ctl
