// aidnctl against a real coordinator on loopback: the submit/list/describe/
// cancel cycle, checkpoints and export of a job without any, refusal of bad
// specs, authentication, an unreachable coordinator, oversized requests, and
// persistence across kill -9.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/tls.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster_fixture.h"

namespace aidn::testing {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
using Json = nlohmann::json;

const std::string kExampleSpec = std::string(AIDN_SOURCE_DIR) + "/examples/fashion-mnist-mlp.yaml";

// Lower case with '_' as ' ', so "PERMISSION_DENIED" and "permission denied"
// read alike.
std::string Normalized(const std::string& text) {
  return absl::StrReplaceAll(absl::AsciiStrToLower(text), {{"_", " "}});
}

Json ParseJson(const std::string& text) { return Json::parse(text, nullptr, false); }

// The field `name` of a JSON object as aidnctl prints it: protobuf's JSON
// mapping uses lowerCamelCase unless told to keep the proto names, so both
// are looked up.
const Json* Field(const Json& object, const std::string& name) {
  if (!object.is_object()) return nullptr;
  if (auto it = object.find(name); it != object.end()) return &*it;
  std::string camel;
  bool upper = false;
  for (char c : name) {
    if (c == '_') {
      upper = true;
    } else {
      camel.push_back(upper ? static_cast<char>(std::toupper(c)) : c);
      upper = false;
    }
  }
  if (auto it = object.find(camel); it != object.end()) return &*it;
  return nullptr;
}

std::string StringField(const Json& object, const std::string& name) {
  const Json* field = Field(object, name);
  return field != nullptr && field->is_string() ? field->get<std::string>() : "";
}

// int64 fields are strings in protobuf's JSON mapping; accept both.
int64_t IntField(const Json& object, const std::string& name) {
  const Json* field = Field(object, name);
  if (field == nullptr) return 0;
  if (field->is_number()) return field->get<int64_t>();
  if (field->is_string()) return std::stoll(field->get<std::string>());
  return -1;
}

// The items of a listing printed with -o json: either a bare array or an
// object holding the array under `key` (absent when empty, as protobuf's
// JSON mapping leaves out empty repeated fields).
std::vector<Json> Items(const Json& listing, const std::string& key) {
  if (listing.is_array()) return listing.get<std::vector<Json>>();
  if (const Json* items = Field(listing, key); items != nullptr && items->is_array()) {
    return items->get<std::vector<Json>>();
  }
  return {};
}

// Runs `aidnctl -o json args...`, expecting success and JSON on stdout.
Json AidnctlJson(const CoordinatorHandle& c, const std::string& token,
                 std::vector<std::string> args) {
  args.insert(args.begin(), {"-o", "json"});
  const CommandResult r = Aidnctl(c, token, args);
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  Json json = ParseJson(r.out);
  EXPECT_FALSE(json.is_discarded()) << "not JSON: " << Describe(r);
  return json;
}

// Job id → state name, from `aidnctl -o json list`.
std::map<std::string, std::string> JobStates(const CoordinatorHandle& c, const std::string& token,
                                             std::vector<std::string> filters = {}) {
  filters.insert(filters.begin(), "list");
  std::map<std::string, std::string> states;
  for (const Json& job : Items(AidnctlJson(c, token, filters), "jobs")) {
    states[StringField(job, "id")] = StringField(job, "state");
  }
  return states;
}

// The jobs as the API returns them.
std::vector<v1::Job> ApiJobs(const CoordinatorHandle& c) {
  v1::ListJobsRequest request;
  request.set_page_size(1000);
  v1::ListJobsResponse response;
  const grpc::Status status =
      CoordinatorStub(c.address)->ListJobs(Context(c.admin_token).get(), request, &response);
  EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
  return {response.jobs().begin(), response.jobs().end()};
}

std::vector<v1::Event> ApiEvents(const CoordinatorHandle& c) {
  v1::ListEventsRequest request;
  request.set_limit(10000);
  v1::ListEventsResponse response;
  const grpc::Status status =
      CoordinatorStub(c.address)->ListEvents(Context(c.admin_token).get(), request, &response);
  EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
  return {response.events().begin(), response.events().end()};
}

template <typename Message>
void ExpectSameMessages(const std::vector<Message>& expected, const std::vector<Message>& actual,
                        const std::string& what) {
  ASSERT_EQ(expected.size(), actual.size()) << what;
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(MessageDifferencer::Equals(expected[i], actual[i]))
        << what << " #" << i << " was\n"
        << expected[i].DebugString() << "now\n"
        << actual[i].DebugString();
  }
}

std::string SubmittedId(const CommandResult& r) {
  const std::string out(absl::StripAsciiWhitespace(r.out));
  return absl::StartsWith(out, "submitted ") ? out.substr(strlen("submitted ")) : "";
}

// A loopback port where nothing listens (bound once, then released).
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return 1;
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// Each test gets its own cluster directory (kept when the test fails, for
// the coordinator logs in it) and starts its own coordinator.
class Cli : public ClusterFixture {
 protected:
  Cli() : ClusterFixture("aidn-cli-test") {}

  void StartCoordinatorWith(const std::vector<std::string>& args = {}) {
    const absl::Status started = cluster().StartCoordinator(args);
    ASSERT_TRUE(started.ok()) << started;
  }
};

TEST_F(Cli, SubmitsListsDescribesAndCancelsAJob) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith());
  const CoordinatorHandle& c = cluster().coordinator();
  const std::string& token = c.admin_token;

  CommandResult r = Aidnctl(c, token, {"submit", "-f", kExampleSpec});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(absl::StripAsciiWhitespace(r.out), "submitted job-1") << Describe(r);

  // No workers: it waits.
  EXPECT_EQ(JobStates(c, token), (std::map<std::string, std::string>{{"job-1", "PENDING"}}));

  // describe shows the state and the spec with the defaults filled in.
  r = Aidnctl(c, token, {"describe", "job-1"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("job-1"));
  EXPECT_THAT(r.out, HasSubstr("PENDING"));
  EXPECT_THAT(Normalized(r.out), HasSubstr("bucket"));
  const Json job = AidnctlJson(c, token, {"describe", "job-1"});
  EXPECT_EQ(StringField(job, "id"), "job-1") << job.dump(2);
  EXPECT_EQ(StringField(job, "state"), "PENDING") << job.dump(2);
  const Json* spec = Field(job, "spec");
  ASSERT_NE(spec, nullptr) << job.dump(2);
  const Json* bucket_mb = Field(*spec, "bucket_mb");
  ASSERT_NE(bucket_mb, nullptr) << "bucket_mb default not filled in: " << job.dump(2);
  EXPECT_EQ(bucket_mb->get<double>(), 25.0);
  EXPECT_GT(IntField(*spec, "world_size"), 0) << job.dump(2);

  r = Aidnctl(c, token, {"cancel", "job-1", "--reason", "integration test"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(StringField(AidnctlJson(c, token, {"describe", "job-1"}), "state"), "CANCELLED");
  EXPECT_EQ(JobStates(c, token), (std::map<std::string, std::string>{{"job-1", "CANCELLED"}}));
  EXPECT_EQ(JobStates(c, token, {"--state", "PENDING"}).size(), 0u);
  EXPECT_EQ(JobStates(c, token, {"--state", "CANCELLED"}).size(), 1u);

  // A second cancel is refused: the job already ended.
  r = Aidnctl(c, token, {"cancel", "job-1"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, StartsWith("aidnctl: error:"));
  EXPECT_THAT(r.err, HasSubstr("job-1"));
  const std::string err = Normalized(r.err);
  EXPECT_TRUE(absl::StrContains(err, "ended") || absl::StrContains(err, "cancelled") ||
              absl::StrContains(err, "already") || absl::StrContains(err, "finished"))
      << Describe(r);
  EXPECT_EQ(StringField(AidnctlJson(c, token, {"describe", "job-1"}), "state"), "CANCELLED");

  r = Aidnctl(c, token, {"describe", "job-404"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, StartsWith("aidnctl: error:"));
  EXPECT_THAT(r.err, HasSubstr("job-404"));
  const std::string unknown = Normalized(r.err);
  EXPECT_TRUE(absl::StrContains(unknown, "not found") || absl::StrContains(unknown, "no such"))
      << Describe(r);
}

TEST_F(Cli, ListsCheckpointsAndExportSaysWhenThereIsNone) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith());
  const CoordinatorHandle& c = cluster().coordinator();
  const std::string& token = c.admin_token;
  CommandResult r = Aidnctl(c, token, {"submit", "-f", kExampleSpec});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);

  r = Aidnctl(c, token, {"checkpoints", "job-1"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.out, "STEP   GEN   COMMITTED   CREATED   BYTES   PATH   NOTE\n") << Describe(r);
  EXPECT_TRUE(Items(AidnctlJson(c, token, {"checkpoints", "job-1"}), "checkpoints").empty());

  // Nothing to export yet; the global -o still names the format before the
  // command and the file after it.
  const std::string output = cluster().Path("model.safetensors");
  r = Aidnctl(c, token, {"-o", "json", "export", "job-1", "-o", output});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, StartsWith("aidnctl: error: job job-1 has no checkpoints")) << Describe(r);
  r = Aidnctl(c, token, {"export", "job-404", "--step", "10", "-o", output});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("job-404")) << Describe(r);
  EXPECT_EQ(access(output.c_str(), F_OK), -1) << output << " was written";
}

// The parts of a spec the bad-spec cases vary; the defaults make a valid one.
struct SpecText {
  std::string world_size = "2";
  std::string model = "mlp";
  std::string optimizer = "sgd";
  std::string lr = "0.05";
  std::string dataset_dir = "/usr/share/datasets/fashion-mnist";
  std::string checkpoint_dir = "runs/bad-spec-test";
  std::string batch_size = "32";
  std::string strategy = "ddp";
  std::string extra;  // appended verbatim
};

std::string Yaml(const SpecText& s) {
  return absl::StrCat("name: bad-spec-test\n",                                  //
                      "world_size: ", s.world_size, "\n",                       //
                      "device: cpu\n",                                          //
                      "model:\n  name: ", s.model, "\n  hidden_sizes: [32]\n",  //
                      "dataset:\n  kind: fashion-mnist\n  dir: ", s.dataset_dir, "\n",
                      "optimizer:\n  name: ", s.optimizer, "\n  lr: ", s.lr, "\n",
                      "batch_size: ", s.batch_size, "\n",  //
                      "max_steps: 10\n",                   //
                      "strategy: ", s.strategy, "\n",      //
                      "checkpoint:\n  dir: ", s.checkpoint_dir, "\n", s.extra);
}

TEST_F(Cli, RefusesBadSpecsNamingTheFieldAndStoresNothing) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith());
  const CoordinatorHandle& c = cluster().coordinator();
  const std::string& token = c.admin_token;

  // The valid base spec is accepted, so each refusal below is the mutation's.
  const std::string good = cluster().Path("good.yaml");
  WriteFileOrDie(good, Yaml({}));
  CommandResult r = Aidnctl(c, token, {"submit", "-f", good});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  ASSERT_EQ(SubmittedId(r), "job-1") << Describe(r);

  const Json listed_before = AidnctlJson(c, token, {"list"});
  const std::vector<v1::Job> jobs_before = ApiJobs(c);
  const std::vector<v1::Event> events_before = ApiEvents(c);
  ASSERT_EQ(jobs_before.size(), 1u);

  struct Case {
    std::string name;
    SpecText spec;
    std::string field;  // must appear in aidnctl's error
  };
  auto with = [](auto mutate) {
    SpecText s;
    mutate(s);
    return s;
  };
  const std::vector<Case> cases = {
      {"world_size_zero", with([](SpecText& s) { s.world_size = "0"; }), "world_size"},
      {"world_size_huge", with([](SpecText& s) { s.world_size = "100000"; }), "world_size"},
      {"unknown_model", with([](SpecText& s) { s.model = "resnet"; }), "model.name"},
      {"unknown_optimizer", with([](SpecText& s) { s.optimizer = "adagrad"; }), "optimizer.name"},
      {"negative_lr", with([](SpecText& s) { s.lr = "-0.1"; }), "optimizer.lr"},
      {"dotdot_dataset", with([](SpecText& s) { s.dataset_dir = "data/../../etc"; }),
       "dataset.dir"},
      {"dotdot_checkpoint", with([](SpecText& s) { s.checkpoint_dir = "../outside"; }),
       "checkpoint.dir"},
      // 0 would mean "default 64" (job.proto), so a negative size is the bad one.
      {"negative_batch_size", with([](SpecText& s) { s.batch_size = "-1"; }), "batch_size"},
      {"fsdp_options_under_ddp",
       with([](SpecText& s) { s.extra = "fsdp: {sharding: shard_grad_op}\n"; }), "fsdp"},
      {"unknown_field", with([](SpecText& s) { s.extra = "bogus_field: 1\n"; }), "bogus_field"},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.name);
    const std::string path = cluster().Path(bad.name + ".yaml");
    WriteFileOrDie(path, Yaml(bad.spec));
    r = Aidnctl(c, token, {"submit", "-f", path});
    EXPECT_EQ(r.exit_code, 1) << Describe(r);
    EXPECT_THAT(r.err, StartsWith("aidnctl: error:")) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr(bad.field)) << Describe(r);
  }

  {
    SCOPED_TRACE("malformed YAML");
    const std::string path = cluster().Path("malformed.yaml");
    WriteFileOrDie(path, "name: broken\nworld_size: [1, 2\nmodel: {name: mlp\n");
    r = Aidnctl(c, token, {"submit", "-f", path});
    EXPECT_EQ(r.exit_code, 1) << Describe(r);
    EXPECT_THAT(r.err, StartsWith("aidnctl: error:")) << Describe(r);
    EXPECT_TRUE(absl::StrContains(r.err, "malformed.yaml") ||
                absl::StrContains(Normalized(r.err), "yaml"))
        << "the error should name the file: " << Describe(r);
  }

  // The same refusals straight through the API, which is what guards the
  // store: INVALID_ARGUMENT with the field path first.
  v1::JobSpec base;
  base.set_name("api-bad-spec");
  base.set_world_size(2);
  base.mutable_model()->set_name("mlp");
  base.mutable_optimizer()->set_name("sgd");
  const std::vector<std::pair<std::string, std::function<void(v1::JobSpec&)>>> api_cases = {
      {"world_size", [](v1::JobSpec& s) { s.set_world_size(0); }},
      {"world_size", [](v1::JobSpec& s) { s.set_world_size(100000); }},
      {"model.name", [](v1::JobSpec& s) { s.mutable_model()->set_name("resnet"); }},
      {"optimizer.name", [](v1::JobSpec& s) { s.mutable_optimizer()->set_name("adagrad"); }},
      {"optimizer.lr", [](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(-0.1); }},
      {"dataset.dir", [](v1::JobSpec& s) { s.mutable_dataset()->set_dir("a/../../etc"); }},
      {"checkpoint.dir", [](v1::JobSpec& s) { s.mutable_checkpoint()->set_dir("../x"); }},
      {"batch_size", [](v1::JobSpec& s) { s.set_batch_size(-1); }},
      {"strategy", [](v1::JobSpec& s) { s.set_strategy(static_cast<v1::JobSpec::Strategy>(99)); }},
  };
  auto stub = CoordinatorStub(c.address);
  for (const auto& [field, mutate] : api_cases) {
    SCOPED_TRACE("API " + field);
    v1::SubmitJobRequest request;
    *request.mutable_spec() = base;
    mutate(*request.mutable_spec());
    v1::SubmitJobResponse response;
    const grpc::Status status = stub->SubmitJob(Context(token).get(), request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), StartsWith(field + ":"));
  }

  EXPECT_EQ(AidnctlJson(c, token, {"list"}), listed_before);
  ExpectSameMessages(jobs_before, ApiJobs(c), "job");
  ExpectSameMessages(events_before, ApiEvents(c), "event");

  // Refused submits took no job id.
  r = Aidnctl(c, token, {"submit", "-f", good});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(SubmittedId(r), "job-2") << Describe(r);
}

TEST_F(Cli, RefusesMissingAndWrongTokensAndHonoursRoles) {
  const std::string user_token = "user-token-0123456789abcdef";
  const std::string token_file = cluster().Path("tokens");
  WriteFileOrDie(token_file, absl::StrCat("# test tokens\n\n", user_token, " user alice\n"));
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith({"--token-file=" + token_file}));
  const CoordinatorHandle& c = cluster().coordinator();
  ASSERT_FALSE(c.worker_token.empty());
  ASSERT_EQ(
      c.worker_token,
      std::string(absl::StripAsciiWhitespace(ReadFileOrEmpty(c.state_dir + "/worker.token"))));

  for (const std::string& token : {std::string("wrong-token-0123456789abcdef"), std::string()}) {
    SCOPED_TRACE(token.empty() ? "no token" : "wrong token");
    const CommandResult r = Aidnctl(c, token, {"list"});
    EXPECT_EQ(r.exit_code, 1) << Describe(r);
    EXPECT_THAT(r.err, StartsWith("aidnctl: error:")) << Describe(r);
    const std::string err = Normalized(r.err);
    EXPECT_TRUE(absl::StrContains(err, "unauthenticated") ||
                absl::StrContains(err, "not authenticated"))
        << Describe(r);
  }

  {
    SCOPED_TRACE("worker token");
    const CommandResult r = Aidnctl(c, c.worker_token, {"list"});
    EXPECT_EQ(r.exit_code, 1) << Describe(r);
    EXPECT_THAT(r.err, StartsWith("aidnctl: error:")) << Describe(r);
    EXPECT_THAT(Normalized(r.err), HasSubstr("permission denied")) << Describe(r);
  }

  // The user token from --token-file may submit and list; the job is
  // recorded as the token's owner's.
  CommandResult r = Aidnctl(c, user_token, {"submit", "-f", kExampleSpec});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(SubmittedId(r), "job-1") << Describe(r);
  EXPECT_EQ(JobStates(c, user_token), (std::map<std::string, std::string>{{"job-1", "PENDING"}}));
  EXPECT_EQ(StringField(AidnctlJson(c, user_token, {"describe", "job-1"}), "owner"), "alice");
}

// Jobs belong to the token that submitted them: a user sees and changes its
// own, and those labelled with one of its projects; admins all. Every
// refusal names the owner, and a cancel says who cancelled.
TEST_F(Cli, UsersSeeAndChangeTheirOwnJobsAndTheirProjectsOnly) {
  const std::string alice = "alice-token-0123456789abcdef", bob = "bob-token-0123456789abcdef",
                    carol = "carol-token-0123456789abcdef";
  const std::string token_file = cluster().Path("tokens");
  WriteFileOrDie(token_file,
                 absl::StrCat(alice, " user alice projects=vision\n", bob, " user bob\n", carol,
                              " user carol projects=vision,nlp\n"));
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith({"--token-file=" + token_file}));
  const CoordinatorHandle& c = cluster().coordinator();
  ASSERT_EQ(Aidnctl(c, alice, {"submit", "-f", kExampleSpec}).exit_code, 0);  // job-1: hers
  const std::string shared = cluster().Path("shared.yaml");
  const std::string example = ReadFileOrEmpty(kExampleSpec);
  ASSERT_THAT(example, HasSubstr("labels:\n  team: demo\n"));
  WriteFileOrDie(shared,
                 absl::StrReplaceAll(example, {{"labels:\n  team: demo\n",
                                                "labels:\n  team: demo\n  project: vision\n"}}));
  ASSERT_EQ(Aidnctl(c, alice, {"submit", "-f", shared}).exit_code, 0);  // job-2: the project's

  EXPECT_EQ(JobStates(c, alice).size(), 2u);
  EXPECT_TRUE(JobStates(c, bob).empty());
  EXPECT_EQ(JobStates(c, carol), (std::map<std::string, std::string>{{"job-2", "PENDING"}}));
  EXPECT_EQ(JobStates(c, c.admin_token).size(), 2u);

  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"describe", "job-1"},
                                             {"cancel", "job-1"},
                                             {"events", "job-1"},
                                             {"metrics", "job-1"},
                                             {"checkpoints", "job-1"},
                                             {"logs", "job-1"}}) {
    SCOPED_TRACE(args.front());
    const CommandResult r = Aidnctl(c, bob, args);
    EXPECT_EQ(r.exit_code, 1) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr("job-1 belongs to alice")) << Describe(r);
  }
  EXPECT_EQ(JobStates(c, alice).at("job-1"), "PENDING");  // the refused cancel did nothing
  // Bob's event list leaves out alice's jobs.
  const CommandResult events = Aidnctl(c, bob, {"events"});
  EXPECT_EQ(events.exit_code, 0) << Describe(events);
  EXPECT_THAT(events.out, Not(HasSubstr("job-1"))) << Describe(events);

  // Carol shares the project: she may cancel job-2, and the event says so.
  const CommandResult cancelled = Aidnctl(c, carol, {"cancel", "job-2"});
  EXPECT_EQ(cancelled.exit_code, 0) << Describe(cancelled);
  EXPECT_EQ(Aidnctl(c, carol, {"cancel", "job-1"}).exit_code, 1);
  EXPECT_THAT(Aidnctl(c, alice, {"events", "job-2"}).out, HasSubstr("cancelled by carol"));
}

// TLS is on by default: the coordinator makes a CA in its state directory
// and a server certificate at every start; aidnctl verifies with the CA
// file, and is told in words why it cannot when it cannot.
TEST_F(Cli, ServesTlsByDefaultAndSaysWhyAClientCannotVerifyIt) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith());
  const CoordinatorHandle& c = cluster().coordinator();
  ASSERT_FALSE(c.ca_file.empty());
  EXPECT_EQ(Aidnctl(c, c.admin_token, {"list"}).exit_code, 0);
  EXPECT_THAT(ReadFileOrEmpty(c.state_dir + "/coordinator.1.log"), HasSubstr("tls=on"));

  auto run = [&](std::vector<std::string> argv) {
    argv.insert(argv.begin(), {AIDNCTL_BIN, "--addr=" + c.address, "--token=" + c.admin_token});
    return RunCommand(argv,
                      {"HOME=" + cluster().Path("home"),
                       "AIDN_ADDR=", "AIDN_TOKEN=", "AIDN_TLS_CA=", "AIDN_INSECURE="},
                      std::chrono::seconds(30));
  };
  CommandResult plain = run({"--insecure", "list"});
  EXPECT_EQ(plain.exit_code, 1) << Describe(plain);
  EXPECT_THAT(plain.err, HasSubstr("it serves TLS: drop --insecure")) << Describe(plain);
  CommandResult roots = run({"list"});
  EXPECT_EQ(roots.exit_code, 1) << Describe(roots);
  EXPECT_THAT(roots.err, HasSubstr("not signed by a CA this system trusts")) << Describe(roots);
  CommandResult missing = run({"--tls-ca=" + cluster().Path("nope.pem"), "list"});
  EXPECT_EQ(missing.exit_code, 1) << Describe(missing);
  EXPECT_THAT(missing.err, HasSubstr("TLS CA file " + cluster().Path("nope.pem")))
      << Describe(missing);
  // The CA file from the environment, as the worker and the Python client
  // read it too.
  CommandResult from_env = RunCommand(
      {AIDNCTL_BIN, "--addr=" + c.address, "--token=" + c.admin_token, "list"},
      {"HOME=" + cluster().Path("home"), "AIDN_TLS_CA=" + c.ca_file}, std::chrono::seconds(30));
  EXPECT_EQ(from_env.exit_code, 0) << Describe(from_env);

  // A restart makes a new server certificate signed by the same CA: the
  // same CA file still verifies it.
  const std::string ca = ReadFileOrEmpty(c.ca_file);
  const std::string cert = ReadFileOrEmpty(c.state_dir + "/tls/server.pem");
  ASSERT_TRUE(cluster().RestartCoordinator(/*same_address=*/true).ok());
  EXPECT_EQ(ReadFileOrEmpty(cluster().coordinator().ca_file), ca);
  EXPECT_NE(ReadFileOrEmpty(c.state_dir + "/tls/server.pem"), cert);
  EXPECT_EQ(Aidnctl(cluster().coordinator(), c.admin_token, {"list"}).exit_code, 0);
}

// Plaintext only when asked for (--insecure); an expired or mismatched
// certificate keeps the coordinator from starting, saying so.
TEST_F(Cli, PlaintextIsExplicitAndABadCertificateIsRefusedAtStart) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith({"--insecure"}));
  const CoordinatorHandle& c = cluster().coordinator();
  EXPECT_TRUE(c.ca_file.empty());
  EXPECT_EQ(Aidnctl(c, c.admin_token, {"list"}).exit_code, 0);  // with --insecure
  EXPECT_THAT(ReadFileOrEmpty(c.state_dir + "/coordinator.1.log"),
              HasSubstr("serving plaintext on loopback (--insecure)"));
  absl::StatusOr<ServerTls> theirs = EnsureAutoTls({.dir = cluster().Path("theirs")});
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  CommandResult tls = RunCommand({AIDNCTL_BIN, "--addr=" + c.address, "--token=" + c.admin_token,
                                  "--tls-ca=" + theirs->ca_file, "list"},
                                 {"HOME=" + cluster().Path("home")}, std::chrono::seconds(30));
  EXPECT_EQ(tls.exit_code, 1) << Describe(tls);
  EXPECT_THAT(tls.err, HasSubstr("serves plaintext")) << Describe(tls);

  absl::StatusOr<ServerTls> expired =
      EnsureAutoTls({.dir = cluster().Path("expired"), .validity = absl::Minutes(-30)});
  ASSERT_TRUE(expired.ok()) << expired.status();
  const std::string dir = cluster().Path("expired");
  for (const auto& [cert, key, says] :
       {std::tuple{dir + "/server.pem", dir + "/server.key", "the certificate expired on"},
        std::tuple{dir + "/server.pem", cluster().Path("theirs") + "/server.key",
                   "is not the key of the certificate"}}) {
    CommandResult refused =
        RunCommand({AIDN_COORDINATOR_BIN, "--listen=127.0.0.1:0",
                    "--metrics-addr=", "--state-dir=" + cluster().Path("state-refused"),
                    "--tls-cert=" + cert, "--tls-key=" + key},
                   {}, std::chrono::seconds(30));
    EXPECT_EQ(refused.exit_code, 1) << Describe(refused);
    EXPECT_THAT(refused.err + refused.out, HasSubstr(says)) << Describe(refused);
  }
}

TEST_F(Cli, ReportsAnUnreachableCoordinatorQuickly) {
  CoordinatorHandle nowhere;
  nowhere.address = absl::StrCat("127.0.0.1:", UnusedPort());
  const auto start = std::chrono::steady_clock::now();
  const CommandResult r = Aidnctl(nowhere, "some-token-0123456789abcdef", {"list"});
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, StartsWith("aidnctl: error:")) << Describe(r);
  const std::string err = Normalized(r.err);
  EXPECT_THAT(err, HasSubstr("coordinator")) << Describe(r);
  EXPECT_TRUE(absl::StrContains(err, "reach") || absl::StrContains(err, "unavailable") ||
              absl::StrContains(err, "connect"))
      << Describe(r);
  EXPECT_THAT(r.err, HasSubstr(nowhere.address)) << Describe(r);
  EXPECT_LT(elapsed, std::chrono::seconds(20)) << "aidnctl took too long to give up";
}

TEST_F(Cli, RefusesAnOversizedRequestAndStaysUp) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith());
  const CoordinatorHandle& c = cluster().coordinator();
  CommandResult r = Aidnctl(c, c.admin_token, {"submit", "-f", kExampleSpec});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  const std::vector<v1::Job> jobs_before = ApiJobs(c);

  // A client that allows itself to send 80 MB; the coordinator accepts 4 MB.
  rpc::ChannelOptions big = ChannelTo(c.address);
  big.max_message_bytes = 80 << 20;
  auto big_stub = v1::CoordinatorService::NewStub(rpc::MakeChannel(big));
  v1::SubmitJobRequest request;
  request.mutable_spec()->set_name(std::string(64 << 20, 'x'));
  request.mutable_spec()->set_world_size(1);
  request.mutable_spec()->mutable_model()->set_name("mlp");
  request.mutable_spec()->mutable_optimizer()->set_name("sgd");
  v1::SubmitJobResponse response;
  const grpc::Status status = big_stub->SubmitJob(
      Context(c.admin_token, std::chrono::seconds(60)).get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  request.Clear();

  EXPECT_TRUE(c.process->Running());
  ExpectSameMessages(jobs_before, ApiJobs(c), "job");
  r = Aidnctl(c, c.admin_token, {"submit", "-f", kExampleSpec});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(SubmittedId(r), "job-2") << Describe(r);
}

TEST_F(Cli, KeepsJobsAndEventsAcrossKillNineAndRestart) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinatorWith());
  const CoordinatorHandle& c = cluster().coordinator();
  const std::string token = c.admin_token;

  CommandResult r = Aidnctl(c, token, {"submit", "-f", kExampleSpec});
  ASSERT_EQ(SubmittedId(r), "job-1") << Describe(r);
  r = Aidnctl(c, token, {"submit", "-f", kExampleSpec});
  ASSERT_EQ(SubmittedId(r), "job-2") << Describe(r);
  r = Aidnctl(c, token, {"cancel", "job-1"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);

  const std::map<std::string, std::string> states_before = JobStates(c, token);
  EXPECT_EQ(states_before,
            (std::map<std::string, std::string>{{"job-1", "CANCELLED"}, {"job-2", "PENDING"}}));
  const std::vector<Json> cli_events_before = Items(AidnctlJson(c, token, {"events"}), "events");
  const std::vector<v1::Job> jobs_before = ApiJobs(c);
  const std::vector<v1::Event> events_before = ApiEvents(c);
  ASSERT_GE(events_before.size(), 3u);  // two submits and a cancel at least
  ASSERT_EQ(cli_events_before.size(), events_before.size());

  const std::string worker_token = c.worker_token;
  absl::StatusOr<int> code = cluster().KillCoordinator();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGKILL);

  // The same state directory, on a new port.
  const absl::Status started = cluster().RestartCoordinator(/*same_address=*/false);
  ASSERT_TRUE(started.ok()) << started;
  const CoordinatorHandle* restarted = &cluster().coordinator();
  EXPECT_EQ(restarted->admin_token, token);
  EXPECT_EQ(restarted->worker_token, worker_token);

  EXPECT_EQ(JobStates(*restarted, token), states_before);
  const std::vector<v1::Job> jobs_after = ApiJobs(*restarted);
  ASSERT_EQ(jobs_after.size(), jobs_before.size());
  for (size_t i = 0; i < jobs_before.size(); ++i) {
    const v1::Job& before = jobs_before[i];
    const v1::Job& after = jobs_after[i];
    EXPECT_EQ(after.id(), before.id());
    EXPECT_EQ(after.state(), before.state()) << after.id();
    EXPECT_EQ(after.generation(), before.generation()) << after.id();
    EXPECT_EQ(after.restarts(), before.restarts()) << after.id();
    EXPECT_EQ(after.owner(), before.owner()) << after.id();
    EXPECT_TRUE(MessageDifferencer::Equals(after.spec(), before.spec())) << after.id();
    EXPECT_TRUE(MessageDifferencer::Equals(after.created_at(), before.created_at())) << after.id();
  }

  // Every event from before is back with the same seq; a restart may add
  // events of its own after them.
  const std::vector<v1::Event> events_after = ApiEvents(*restarted);
  ASSERT_GE(events_after.size(), events_before.size());
  ExpectSameMessages(
      events_before,
      std::vector<v1::Event>(events_after.begin(), events_after.begin() + events_before.size()),
      "event");
  const std::vector<Json> cli_events_after =
      Items(AidnctlJson(*restarted, token, {"events"}), "events");
  ASSERT_GE(cli_events_after.size(), cli_events_before.size());
  for (size_t i = 0; i < cli_events_before.size(); ++i) {
    EXPECT_EQ(IntField(cli_events_after[i], "seq"), IntField(cli_events_before[i], "seq"));
    EXPECT_EQ(IntField(cli_events_before[i], "seq"), events_before[i].seq());
    EXPECT_EQ(StringField(cli_events_after[i], "type"), StringField(cli_events_before[i], "type"));
    EXPECT_EQ(StringField(cli_events_after[i], "job_id"),
              StringField(cli_events_before[i], "job_id"));
  }

  // Numbering continues.
  r = Aidnctl(*restarted, token, {"submit", "-f", kExampleSpec});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(SubmittedId(r), "job-3") << Describe(r);
}

}  // namespace
}  // namespace aidn::testing
