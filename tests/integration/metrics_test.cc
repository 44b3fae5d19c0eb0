// /metrics of the real coordinator and worker during a real training job:
// promtool accepts both scrapes, a real Prometheus server started here with
// the shipped deploy/prometheus/prometheus.yml scrapes them and answers
// queries for the job's step and loss, finished jobs' series go after the
// retention period, and bad --metrics-addr values stop the daemons at start.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <httplib.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"

namespace aidn::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kPromtool[] = "/usr/bin/promtool";
constexpr char kPrometheus[] = "/usr/bin/prometheus";

// GET http://<address><path>; the body, or "" on any failure.
std::string HttpGet(const std::string& address, const std::string& path) {
  const size_t colon = address.rfind(':');
  httplib::Client client(address.substr(0, colon), std::stoi(address.substr(colon + 1)));
  client.set_connection_timeout(5);
  client.set_read_timeout(10);
  httplib::Result result = client.Get(path.c_str());
  if (!result || result->status != 200) return "";
  return result->body;
}

// promtool check metrics on `text`: its exit code and output.
CommandResult Promtool(const std::string& dir, const std::string& text) {
  const std::string file = dir + "/scrape.txt";
  WriteFileOrDie(file, text);
  return RunCommand({"/bin/sh", "-c", absl::StrCat(kPromtool, " check metrics < ", file)});
}

// A port free right now on 127.0.0.1.
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// The value of the first sample line starting with `series` ("name{...}"),
// or -1.
double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, series) && absl::ConsumePrefix(&line, " ")) {
      return std::stod(std::string(line));
    }
  }
  return -1;
}

class MetricsTest : public ClusterFixture {
 protected:
  MetricsTest() : ClusterFixture("aidn-metrics-test") {}

  void SetUp() override {
    if (!FashionMnistInstalled()) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
    }
    ClusterFixture::SetUp();
  }

  void TearDown() override {
    prometheus_.reset();
    ClusterFixture::TearDown();
  }

  void StartCluster(const std::vector<std::string>& coordinator_args = {}) {
    absl::Status started = cluster().StartCoordinator(coordinator_args);
    ASSERT_TRUE(started.ok()) << started;
    ASSERT_FALSE(cluster().coordinator().metrics_address.empty());
    const std::string addr_file = cluster().Path("worker.metrics.addr");
    started = cluster().StartWorker(
        "w1", {.args = {"--metrics-addr=127.0.0.1:0", "--metrics-addr-file=" + addr_file}});
    ASSERT_TRUE(started.ok()) << started;
    ASSERT_TRUE(WaitFor(
        [&] {
          worker_metrics_ = std::string(absl::StripAsciiWhitespace(ReadFileOrEmpty(addr_file)));
          return !worker_metrics_.empty();
        },
        TestCluster::kStartTimeout, "the worker's metrics address file"));
    ASSERT_TRUE(cluster().WaitForAliveWorkers(1));
  }

  const std::string& metrics_address() { return cluster().coordinator().metrics_address; }

  std::string Submit(int64_t max_steps) {
    v1::JobSpec spec;
    spec.set_name("metrics-test");
    spec.set_world_size(1);
    spec.mutable_model()->set_name("mlp");
    spec.set_batch_size(64);
    spec.set_max_steps(max_steps);
    spec.set_max_restarts(0);
    absl::StatusOr<std::string> id = cluster().Submit(spec);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }

  // A real Prometheus server with `config` (the shipped one, edited),
  // answering on *web once ready.
  void StartPrometheus(const std::string& config, std::string* web) {
    WriteFileOrDie(cluster().Path("prometheus.yml"), config);
    *web = absl::StrCat("127.0.0.1:", FreePort());
    absl::StatusOr<std::unique_ptr<Process>> p =
        Process::Start({kPrometheus, "--config.file=" + cluster().Path("prometheus.yml"),
                        "--storage.tsdb.path=" + cluster().Path("tsdb"),
                        "--web.listen-address=" + *web, "--log.level=warn"},
                       {}, cluster().Path("prometheus.log"), cluster().Path("prometheus.log"));
    ASSERT_TRUE(p.ok()) << p.status();
    prometheus_ = std::move(*p);
    ASSERT_TRUE(
        WaitFor([&] { return !HttpGet(*web, "/-/ready").empty(); }, std::chrono::seconds(30)))
        << ReadFileOrEmpty(cluster().Path("prometheus.log"));
  }

  std::string worker_metrics_;
  std::unique_ptr<Process> prometheus_;
};

TEST_F(MetricsTest, ScrapesPassPromtoolAndAPrometheusServerQueriesTheRunningJob) {
  if (!std::filesystem::exists(kPromtool) || !std::filesystem::exists(kPrometheus)) {
    GTEST_SKIP() << "Debian's prometheus package (server and promtool) is not installed";
  }
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  // Long enough to be scraped while running; cancelled at the end.
  const std::string id = Submit(1'000'000);
  ASSERT_TRUE(cluster().WaitForJob(
      id, [](const v1::Job& j) { return j.last_step() >= 20; }, "training 20 steps",
      std::chrono::seconds(60)));
  // Job series carry the job's name and owner; rank series its id.
  const std::string job = absl::StrCat("job_id=\"", id, "\",name=\"metrics-test\",owner=\"",
                                       cluster().GetJob(id).owner(), "\"");
  const std::string rank_job = absl::StrCat("job_id=\"", id, "\"");

  // The coordinator's scrape.
  std::string text;
  ASSERT_TRUE(WaitFor(
      [&] {
        text = HttpGet(metrics_address(), "/metrics");
        // An RPC is counted when it completes, and a StreamMetrics call
        // completes after the coordinator took its records in: the loss
        // can show before the call does.
        return Sample(text, absl::StrCat("aidn_job_loss{", job, "}")) > 0 &&
               absl::StrContains(text, "method=\"StreamMetrics\"");
      },
      std::chrono::seconds(30)))
      << text;
  CommandResult check = Promtool(cluster().dir(), text);
  EXPECT_EQ(check.exit_code, 0) << check.out << check.err;
  EXPECT_EQ(check.out + check.err, "") << "promtool found problems";
  EXPECT_GT(Sample(text, absl::StrCat("aidn_job_step{", job, "}")), 0);
  EXPECT_EQ(Sample(text, absl::StrCat("aidn_job_total_steps{", job, "}")), 1'000'000);
  EXPECT_EQ(Sample(text, "aidn_jobs{state=\"RUNNING\"}"), 1);
  EXPECT_EQ(Sample(text, "aidn_worker_up{worker_id=\"w1\"}"), 1);
  EXPECT_EQ(Sample(text, "aidn_worker_slots_used{kind=\"cpu\",worker_id=\"w1\"}"), 1);
  EXPECT_GT(Sample(text, absl::StrCat("aidn_rank_step_seconds_count{", rank_job, ",rank=\"0\"}")),
            0);
  EXPECT_GT(Sample(text, absl::StrCat("aidn_job_samples_total{", job, "}")), 0);
  EXPECT_THAT(text, HasSubstr("method=\"StreamMetrics\""));
  EXPECT_THAT(text, HasSubstr("aidn_rpc_duration_seconds_bucket{"));
  EXPECT_GT(Sample(text, "process_resident_memory_bytes"), 0);

  // The worker's scrape.
  const std::string worker_text = HttpGet(worker_metrics_, "/metrics");
  check = Promtool(cluster().dir(), worker_text);
  EXPECT_EQ(check.exit_code, 0) << check.out << check.err;
  EXPECT_EQ(check.out + check.err, "") << "promtool found problems";
  EXPECT_EQ(Sample(worker_text, "aidn_worker_trainers_running"), 1);
  EXPECT_EQ(Sample(worker_text, "aidn_worker_trainers_started_total"), 1);
  EXPECT_EQ(Sample(worker_text, "aidn_worker_coordinator_up"), 1);
  EXPECT_GT(Sample(worker_text, absl::StrCat("aidn_worker_trainer_resident_memory_bytes{", rank_job,
                                             ",rank=\"0\"}")),
            10e6);
  EXPECT_GT(Sample(worker_text, "process_resident_memory_bytes"), 0);

  // Every series the shipped Grafana dashboard draws exists in one scrape
  // or the other.
  const std::string dashboard =
      ReadFileOrEmpty(std::string(AIDN_SOURCE_DIR) + "/deploy/grafana/aidn-dashboard.json");
  ASSERT_FALSE(dashboard.empty());
  const std::regex name(R"(\b(aidn_[a-z_]+))");
  int names = 0;
  for (auto it = std::sregex_iterator(dashboard.begin(), dashboard.end(), name);
       it != std::sregex_iterator(); ++it) {
    const std::string metric = (*it)[1];
    EXPECT_TRUE(absl::StrContains(text, "# TYPE " + metric + " ") ||
                absl::StrContains(worker_text, "# TYPE " + metric + " ") ||
                absl::StrContains(text, "# TYPE " +
                                            std::string(absl::StripSuffix(
                                                absl::StripSuffix(metric, "_bucket"), "_sum")) +
                                            " "))
        << "the dashboard uses " << metric << ", which nothing exports";
    ++names;
  }
  EXPECT_GT(names, 15);

  // A real Prometheus server with the shipped configuration; only the
  // targets (and, to be quick, the intervals) differ.
  std::string config =
      ReadFileOrEmpty(std::string(AIDN_SOURCE_DIR) + "/deploy/prometheus/prometheus.yml");
  ASSERT_THAT(config, HasSubstr("\"127.0.0.1:9464\""));
  ASSERT_THAT(config, HasSubstr("\"127.0.0.1:9465\""));
  config = absl::StrReplaceAll(config,
                               {{"\"127.0.0.1:9464\"", absl::StrCat("\"", metrics_address(), "\"")},
                                {"\"127.0.0.1:9465\"", absl::StrCat("\"", worker_metrics_, "\"")},
                                {"scrape_interval: 15s", "scrape_interval: 1s"},
                                {"evaluation_interval: 15s", "evaluation_interval: 1s"},
                                {"scrape_timeout: 10s", "scrape_timeout: 1s"}});
  std::string web;
  ASSERT_NO_FATAL_FAILURE(StartPrometheus(config, &web));

  const std::regex value(R"re("value":\[[0-9.]+,"([0-9.e+-]+)"\])re");
  for (const std::string metric : {"aidn_job_step", "aidn_job_loss"}) {
    std::string body;
    std::smatch m;
    EXPECT_TRUE(WaitFor(
        [&] {
          body = HttpGet(
              web, absl::StrCat("/api/v1/query?query=", metric, "%7Bjob_id%3D%22", id, "%22%7D"));
          return std::regex_search(body, m, value) && std::stod(m[1]) > 0;
        },
        std::chrono::seconds(30)))
        << metric << ": " << body;
  }
  std::string targets;
  EXPECT_TRUE(WaitFor(
      [&] {
        targets = HttpGet(web, "/api/v1/targets?state=active");
        size_t up = 0;
        for (size_t at = 0; (at = targets.find("\"health\":\"up\"", at)) != std::string::npos;
             ++at) {
          ++up;
        }
        return up == 2;
      },
      std::chrono::seconds(30)))
      << targets;
  EXPECT_THAT(targets, HasSubstr("\"job\":\"aidn-coordinator\""));
  EXPECT_THAT(targets, HasSubstr("\"job\":\"aidn-workers\""));

  EXPECT_TRUE(cluster().Cancel(id).ok());
}

// --metrics-tls and --metrics-token-file: /metrics over HTTPS with the
// coordinator's certificate, and only with the bearer token; a real
// Prometheus server scrapes it with the shipped configuration's commented
// TLS and authorization lines switched on.
TEST_F(MetricsTest, ServedOverHttpsWithABearerTokenAndScrapedSoByPrometheus) {
  if (!std::filesystem::exists(kPrometheus)) GTEST_SKIP() << "no " << kPrometheus;
  const std::string token_file = cluster().Path("metrics.token");
  WriteFileOrDie(token_file, "scrape-token-0123456789\n");
  ASSERT_NO_FATAL_FAILURE(StartCluster({"--metrics-tls", "--metrics-token-file=" + token_file}));
  const std::string ca = cluster().coordinator().ca_file;
  const std::string url = absl::StrCat("https://", metrics_address(), "/metrics");
  auto curl = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"/usr/bin/curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}"});
    return RunCommand(args);
  };
  // Plain HTTP gets nothing; HTTPS without the token 401; with it 200.
  EXPECT_NE(curl({absl::StrCat("http://", metrics_address(), "/metrics")}).out, "200");
  EXPECT_EQ(curl({"--cacert", ca, url}).out, "401");
  EXPECT_EQ(curl({"--cacert", ca, "-H", "Authorization: Bearer wrong", url}).out, "401");
  EXPECT_EQ(curl({"--cacert", ca, "-H", "Authorization: Bearer scrape-token-0123456789", url}).out,
            "200");
  EXPECT_EQ(curl({"--cacert", ca, absl::StrCat("https://", metrics_address(), "/healthz")}).out,
            "200");
  // A worker's /metrics the same way, with a certificate of its own.
  const std::string tls = cluster().coordinator().state_dir + "/tls";
  const std::string w2_file = cluster().Path("w2.metrics.addr");
  ASSERT_TRUE(cluster()
                  .StartWorker("w2", {.args = {"--metrics-addr=127.0.0.1:0",
                                               "--metrics-addr-file=" + w2_file,
                                               "--metrics-tls-cert=" + tls + "/server.pem",
                                               "--metrics-tls-key=" + tls + "/server.key",
                                               "--metrics-token-file=" + token_file}})
                  .ok());
  std::string w2;
  ASSERT_TRUE(WaitFor(
      [&] {
        return !(w2 = std::string(absl::StripAsciiWhitespace(ReadFileOrEmpty(w2_file)))).empty();
      },
      TestCluster::kStartTimeout, "w2's metrics address file"));
  const std::string w2_url = absl::StrCat("https://", w2, "/metrics");
  EXPECT_EQ(curl({"--cacert", ca, w2_url}).out, "401");
  EXPECT_EQ(
      curl({"--cacert", ca, "-H", "Authorization: Bearer scrape-token-0123456789", w2_url}).out,
      "200");

  std::string config =
      ReadFileOrEmpty(std::string(AIDN_SOURCE_DIR) + "/deploy/prometheus/prometheus.yml");
  for (const char* line : {"    # scheme: https\n", "    # tls_config:\n",
                           "    #   ca_file: /var/lib/aidn/tls/ca.pem\n", "    # authorization:\n",
                           "    #   credentials_file: /etc/prometheus/aidn-metrics.token\n"}) {
    ASSERT_THAT(config, HasSubstr(line));
  }
  config = absl::StrReplaceAll(
      config, {{"    # scheme: https", "    scheme: https"},
               {"    # tls_config:", "    tls_config:"},
               {"    #   ca_file: /var/lib/aidn/tls/ca.pem", "      ca_file: " + ca},
               {"    # authorization:", "    authorization:"},
               {"    #   credentials_file: /etc/prometheus/aidn-metrics.token",
                "      credentials_file: " + token_file},
               {"\"127.0.0.1:9464\"", absl::StrCat("\"", metrics_address(), "\"")},
               {"\"127.0.0.1:9465\"", absl::StrCat("\"", worker_metrics_, "\"")},
               {"scrape_interval: 15s", "scrape_interval: 1s"},
               {"scrape_timeout: 10s", "scrape_timeout: 1s"}});
  std::string web;
  ASSERT_NO_FATAL_FAILURE(StartPrometheus(config, &web));
  std::string targets;
  EXPECT_TRUE(WaitFor(
      [&] {
        targets = HttpGet(web, "/api/v1/targets?state=active");
        return absl::StrContains(targets, "\"scrapeUrl\":\"https://") &&
               absl::StrContains(targets, "\"job\":\"aidn-coordinator\"") &&
               targets.find("\"health\":\"up\"") != std::string::npos &&
               std::string(HttpGet(web, "/api/v1/query?query=up%7Bjob%3D%22aidn-coordinator%22%7D"))
                       .find("\"1\"]") != std::string::npos;
      },
      std::chrono::seconds(30)))
      << targets << "\n"
      << ReadFileOrEmpty(cluster().Path("prometheus.log"));
}

TEST_F(MetricsTest, AFinishedJobsSeriesGoAfterTheRetentionPeriod) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"--metrics-retention=2s"}));
  const std::string id = Submit(50);
  ASSERT_TRUE(cluster().WaitForState(id, v1::Job::SUCCEEDED, std::chrono::seconds(60)));
  const std::string step =
      absl::StrCat("aidn_job_step{job_id=\"", id, "\",name=\"metrics-test\",owner=\"",
                   cluster().GetJob(id).owner(), "\"}");
  std::string text = HttpGet(metrics_address(), "/metrics");
  EXPECT_EQ(Sample(text, step), 50) << "still shown right after it ended";
  EXPECT_TRUE(WaitFor(
      [&] {
        text = HttpGet(metrics_address(), "/metrics");
        return !text.empty() && !absl::StrContains(text, id);
      },
      std::chrono::seconds(15)))
      << "series of " << id << " still there:\n"
      << text;
  EXPECT_EQ(Sample(text, "aidn_jobs{state=\"SUCCEEDED\"}"), 1);
  // The steps themselves stay in the store.
  EXPECT_EQ(cluster().Metrics(id).size(), 51u);  // 50 TRAIN, 1 EVAL
}

TEST_F(MetricsTest, AnUnusableMetricsAddressStopsTheDaemonsAtStart) {
  // Not a host:port.
  CommandResult bad =
      RunCommand({AIDN_COORDINATOR_BIN, "--listen=127.0.0.1:0",
                  "--state-dir=" + cluster().Path("bad"), "--metrics-addr=nonsense"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("nonsense"));

  // A port someone else holds.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::string taken = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  CommandResult coordinator =
      RunCommand({AIDN_COORDINATOR_BIN, "--listen=127.0.0.1:0",
                  "--state-dir=" + cluster().Path("busy"), "--metrics-addr=" + taken});
  EXPECT_NE(coordinator.exit_code, 0);
  EXPECT_THAT(coordinator.err, HasSubstr(taken));
  CommandResult worker =
      RunCommand({AIDN_WORKER_BIN, "--coordinator=127.0.0.1:1", "--token=x", "--worker-id=w9",
                  "--work-dir=" + cluster().Path("w9"), "--metrics-addr=" + taken});
  EXPECT_NE(worker.exit_code, 0);
  EXPECT_THAT(worker.err, HasSubstr(taken));
  close(fd);
  EXPECT_THAT(worker.err, Not(HasSubstr("registered")));
}

}  // namespace
}  // namespace aidn::testing
