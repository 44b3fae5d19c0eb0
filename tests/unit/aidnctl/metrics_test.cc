// Tests of `aidnctl metrics` (paging, CSV, JSON, table) and `aidnctl plot`
// against a fake coordinator.

#include "aidnctl/metrics.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "aidnctl/plot.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/unit/aidnctl/fake_job_coordinator.h"

namespace aidn::ctl {
namespace {

using testing::Eval;
using testing::FakeServer;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using testing::Train;

std::vector<std::string> OutputLines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

// Steps 1..n with an evaluation after every 7th.
void Steps(testing::FakeJobCoordinator* fake, int n) {
  for (int step = 1; step <= n; ++step) {
    fake->steps_.push_back(Train(step));
    if (step % 7 == 0) fake->steps_.push_back(Eval(step, 0.8));
  }
}

// (kind, step) of every CSV row after the header.
std::vector<std::pair<std::string, int>> CsvKeys(const std::string& csv) {
  std::vector<std::pair<std::string, int>> keys;
  std::vector<std::string> lines = OutputLines(csv);
  for (size_t i = 1; i < lines.size(); ++i) {
    std::vector<std::string> cells = absl::StrSplit(lines[i], ',');
    keys.emplace_back(cells[0], std::stoi(cells[1]));
  }
  return keys;
}

TEST(StepMetricsCsv, HasOneColumnPerHeaderName) {
  EXPECT_EQ(StepMetricsCsvHeader(),
            "kind,step,epoch,generation,loss,samples,step_seconds,slowest_rank,allreduce_seconds,"
            "samples_per_second,lr,test_loss,test_accuracy,ranks_reported,world_size,time,tokens,"
            "tokens_per_second,peak_memory_bytes\n");
  v1::StepMetrics step = Train(12, 0.4312);
  step.mutable_time()->set_nanos(250'000'000);
  EXPECT_EQ(
      StepMetricsCsvRow(step),
      "TRAIN,12,0,1,0.4312,128,0.04,1,0.01,3200,0.05,0,0,2,2,2027-01-15T08:00:06.250Z,0,0,0\n");
  step.set_tokens(4096);
  step.set_tokens_per_second(102400);
  step.set_peak_memory_bytes(1 << 20);
  EXPECT_EQ(StepMetricsCsvRow(step),
            "TRAIN,12,0,1,0.4312,128,0.04,1,0.01,3200,0.05,0,0,2,2,2027-01-15T08:00:06.250Z,4096,"
            "102400,1048576\n");
  EXPECT_EQ(StepMetricsCsvRow(Eval(14, 0.8125)),
            "EVAL,14,1,1,0,0,0,0,0,0,0,0.45,0.8125,2,2,2027-01-15T08:00:07.200Z,0,0,0\n");
  v1::StepMetrics bare;
  EXPECT_EQ(StepMetricsCsvRow(bare), "TRAIN,0,0,0,0,0,0,0,0,0,0,0,0,0,0,,0,0,0\n");
}

TEST(Metrics, CsvPagesThroughEveryStepInOrderWithoutGapsOrRepeats) {
  FakeServer server;
  Steps(&server.fake, 100);
  server.Start();
  server.env.options.format = OutputFormat::kCsv;
  MetricsOptions options;
  options.job_id = "job-1";
  options.page_size = 8;  // pages that end between a step's TRAIN and EVAL
  ASSERT_TRUE(RunMetrics(server.env, options).ok());
  EXPECT_THAT(server.out.str(), StartsWith(StepMetricsCsvHeader()));
  std::vector<std::pair<std::string, int>> expected;
  for (int step = 1; step <= 100; ++step) {
    expected.emplace_back("TRAIN", step);
    if (step % 7 == 0) expected.emplace_back("EVAL", step);
  }
  EXPECT_EQ(CsvKeys(server.out.str()), expected);
  // Each call went on from the last step of the page before.
  const auto requests = server.fake.metrics_requests();
  ASSERT_GT(requests.size(), 10u);
  for (size_t i = 1; i < requests.size(); ++i) {
    EXPECT_GT(requests[i].from_step(), requests[i - 1].from_step());
    EXPECT_EQ(requests[i].limit(), 8);
  }
}

TEST(Metrics, KeepsToTheRangeAskedFor) {
  FakeServer server;
  Steps(&server.fake, 100);
  server.Start();
  server.env.options.format = OutputFormat::kCsv;
  MetricsOptions options;
  options.job_id = "job-1";
  options.from_step = 10;
  options.to_step = 21;
  options.page_size = 5;
  ASSERT_TRUE(RunMetrics(server.env, options).ok());
  const auto keys = CsvKeys(server.out.str());
  ASSERT_FALSE(keys.empty());
  EXPECT_EQ(keys.front(), std::make_pair(std::string("TRAIN"), 10));
  EXPECT_EQ(keys.back(), std::make_pair(std::string("EVAL"), 21));
  EXPECT_EQ(keys.size(), 12u + 2u);  // 10..21 and the evaluations at 14 and 21
}

TEST(Metrics, HalvesThePageWhileTheAnswerIsTooLarge) {
  FakeServer server;
  Steps(&server.fake, 50);
  server.fake.max_limit_ = 3000;
  server.Start();
  server.env.options.format = OutputFormat::kCsv;
  MetricsOptions options;
  options.job_id = "job-1";
  ASSERT_TRUE(RunMetrics(server.env, options).ok());
  EXPECT_EQ(CsvKeys(server.out.str()).size(), 50u + 7u);
  EXPECT_EQ(server.fake.metrics_requests().back().limit(), 2500);
}

TEST(Metrics, JsonIsOneArrayOfObjectsWithNumbers) {
  FakeServer server;
  Steps(&server.fake, 14);
  // A GPU job's step: the GPU's peak memory too.
  server.fake.steps_[0].set_device_peak_memory_bytes(int64_t{3} << 30);
  server.Start();
  server.env.options.format = OutputFormat::kJson;
  MetricsOptions options;
  options.job_id = "job-1";
  options.page_size = 4;
  ASSERT_TRUE(RunMetrics(server.env, options).ok());
  const nlohmann::json json = nlohmann::json::parse(server.out.str());
  ASSERT_TRUE(json.is_array());
  ASSERT_EQ(json.size(), 16u);
  EXPECT_EQ(json[0]["kind"], "TRAIN");
  EXPECT_EQ(json[0]["step"], 1);
  EXPECT_EQ(json[0]["samples"], 128);
  EXPECT_DOUBLE_EQ(json[0]["loss"].get<double>(), 2.499);
  EXPECT_EQ(json[0]["rank_step_seconds"].size(), 2u);
  EXPECT_EQ(json[0]["device_peak_memory_bytes"], int64_t{3} << 30);
  EXPECT_EQ(json[1]["device_peak_memory_bytes"], 0);
  EXPECT_EQ(json[7]["kind"], "EVAL");
  EXPECT_EQ(json[7]["step"], 7);
  EXPECT_DOUBLE_EQ(json[7]["test_accuracy"].get<double>(), 0.8);
  EXPECT_EQ(json[7]["time"], "2027-01-15T08:00:03.700Z");
}

TEST(Metrics, JsonOfNoStepsIsAnEmptyArray) {
  FakeServer server;
  server.Start();
  server.env.options.format = OutputFormat::kJson;
  MetricsOptions options;
  options.job_id = "job-1";
  ASSERT_TRUE(RunMetrics(server.env, options).ok());
  EXPECT_EQ(server.out.str(), "[]\n");
}

TEST(Metrics, TableAndYamlShowEachStep) {
  FakeServer server;
  Steps(&server.fake, 7);
  server.Start();
  MetricsOptions options;
  options.job_id = "job-1";
  ASSERT_TRUE(RunMetrics(server.env, options).ok());
  const std::vector<std::string> lines = OutputLines(server.out.str());
  ASSERT_EQ(lines.size(), 9u);
  EXPECT_THAT(lines[0], StartsWith("KIND    STEP   EPOCH   GEN   LOSS"));
  EXPECT_THAT(lines[1], StartsWith("TRAIN   1      0       1     2.4990   3200"));
  EXPECT_THAT(lines[1], HasSubstr("40.0ms"));
  EXPECT_THAT(lines[8], StartsWith("EVAL    7"));
  EXPECT_THAT(lines[8], HasSubstr("0.4500      80.00%     2/2"));

  server.out.str("");
  server.env.options.format = OutputFormat::kYaml;
  ASSERT_TRUE(RunMetrics(server.env, options).ok());
  EXPECT_THAT(server.out.str(), StartsWith("- kind: TRAIN\n  step: 1\n"));
}

TEST(Metrics, AnUnknownJobIsNotFoundAndPrintsNothing) {
  FakeServer server;
  server.Start();
  MetricsOptions options;
  options.job_id = "job-x";
  for (OutputFormat format :
       {OutputFormat::kTable, OutputFormat::kCsv, OutputFormat::kJson, OutputFormat::kYaml}) {
    server.env.options.format = format;
    const absl::Status status = RunMetrics(server.env, options);
    EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(status.message(), "job job-x not found");
    EXPECT_EQ(server.out.str(), "");
  }
}

TEST(OutputFormat, CsvIsParsedButOnlyMetricsWriteIt) {
  EXPECT_EQ(*ParseOutputFormat("CSV"), OutputFormat::kCsv);
  const absl::StatusOr<std::string> text = FormatMessage(v1::Job(), OutputFormat::kCsv);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(text.status().message()), HasSubstr("only for `aidnctl metrics`"));

  FakeServer server;
  server.Start();
  server.env.options.format = OutputFormat::kCsv;
  const absl::Status status = RunDescribe(server.env, "job-1");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// plot

struct PngSize {
  uint32_t width = 0, height = 0;
};

// The size in a PNG's IHDR, after checking the signature.
std::optional<PngSize> ReadPng(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(file)), {});
  if (bytes.size() < 24 || bytes.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0 ||
      bytes.compare(12, 4, "IHDR") != 0) {
    return std::nullopt;
  }
  auto be32 = [&](size_t at) {
    return (static_cast<uint32_t>(static_cast<unsigned char>(bytes[at])) << 24) |
           (static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + 1])) << 16) |
           (static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + 2])) << 8) |
           static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + 3]));
  };
  return PngSize{be32(16), be32(20)};
}

class PlotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/aidnctl-plot-test-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // No file but `name` left in the directory.
  void ExpectOnly(const std::set<std::string>& names) {
    std::set<std::string> found;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      found.insert(entry.path().filename().string());
    }
    EXPECT_EQ(found, names);
  }

  std::string dir_;
};

TEST(GnuplotScript, QuotesPathsAndDrawsAccuracyOnASecondAxis) {
  GnuplotInputs inputs;
  inputs.title = "job j-1: mlp (it's)";
  inputs.png_path = "/tmp/a b/out.png";
  inputs.train_data_path = "/tmp/t/train.dat";
  inputs.width = 800;
  inputs.height = 500;
  std::string script = GnuplotScript(inputs);
  EXPECT_THAT(script, HasSubstr("set terminal pngcairo size 800,500"));
  EXPECT_THAT(script, HasSubstr("set output '/tmp/a b/out.png'\n"));
  EXPECT_THAT(script, HasSubstr("set title 'job j-1: mlp (it''s)'\n"));
  EXPECT_THAT(script, ::testing::Not(HasSubstr("y2")));
  inputs.eval_data_path = "/tmp/t/eval.dat";
  script = GnuplotScript(inputs);
  EXPECT_THAT(script, HasSubstr("set y2tics"));
  EXPECT_THAT(script, HasSubstr("'/tmp/t/eval.dat' using 1:2"));
  EXPECT_THAT(script, HasSubstr("axes x1y2"));
}

TEST_F(PlotTest, WritesAPngOfTheSizeAskedFor) {
  if (access(kDefaultGnuplot, X_OK) != 0) GTEST_SKIP() << "gnuplot-nox is not installed";
  FakeServer server;
  Steps(&server.fake, 60);
  server.Start();
  PlotOptions options;
  options.job_id = "job-1";
  options.output_path = dir_ + "/loss.png";
  options.width = 640;
  options.height = 480;
  const absl::Status status = RunPlot(server.env, options);
  ASSERT_TRUE(status.ok()) << status;
  const std::optional<PngSize> size = ReadPng(options.output_path);
  ASSERT_TRUE(size.has_value());
  EXPECT_EQ(size->width, 640u);
  EXPECT_EQ(size->height, 480u);
  EXPECT_EQ(server.out.str(), "wrote " + options.output_path + ": 60 steps, 8 evaluations\n");
  ExpectOnly({"loss.png"});  // the temporary file was renamed
}

TEST_F(PlotTest, AMissingGnuplotNamesItsPackage) {
  FakeServer server;
  Steps(&server.fake, 5);
  server.Start();
  PlotOptions options;
  options.job_id = "job-1";
  options.output_path = dir_ + "/loss.png";
  options.gnuplot = dir_ + "/no-gnuplot";
  const absl::Status status = RunPlot(server.env, options);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("gnuplot is not installed"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("gnuplot-nox"));
  ExpectOnly({});
}

TEST_F(PlotTest, AJobWithoutMetricsHasNothingToPlot) {
  if (access(kDefaultGnuplot, X_OK) != 0) GTEST_SKIP() << "gnuplot-nox is not installed";
  FakeServer server;
  server.Start();
  PlotOptions options;
  options.job_id = "job-1";
  options.output_path = dir_ + "/loss.png";
  const absl::Status status = RunPlot(server.env, options);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(), "job job-1 has no training metrics yet; nothing to plot");
  ExpectOnly({});

  Steps(&server.fake, 5);
  options.from_step = 10;
  EXPECT_THAT(std::string(RunPlot(server.env, options).message()),
              HasSubstr("no training metrics in steps 10.."));
}

TEST_F(PlotTest, AnUnwritablePathFailsBeforeAnyCall) {
  if (access(kDefaultGnuplot, X_OK) != 0) GTEST_SKIP() << "gnuplot-nox is not installed";
  FakeServer server;
  Steps(&server.fake, 5);
  server.Start();
  PlotOptions options;
  options.job_id = "job-1";
  options.output_path = dir_ + "/missing-dir/loss.png";
  absl::Status status = RunPlot(server.env, options);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("cannot write " + options.output_path + ": No such file or directory"));
  options.output_path = dir_;
  status = RunPlot(server.env, options);
  EXPECT_THAT(std::string(status.message()), HasSubstr("it is a directory"));
  EXPECT_TRUE(server.fake.metrics_requests().empty());
}

TEST_F(PlotTest, AFailedPlotLeavesTheOldFileAlone) {
  FakeServer server;
  Steps(&server.fake, 5);
  server.Start();
  // A "gnuplot" that fails the way gnuplot does.
  const std::string fake_gnuplot = dir_ + "/gnuplot";
  {
    std::ofstream script(fake_gnuplot);
    script << "#!/bin/sh\necho 'line 3: unknown terminal type' >&2\nexit 1\n";
  }
  std::filesystem::permissions(fake_gnuplot, std::filesystem::perms::owner_all);
  {
    std::ofstream old(dir_ + "/loss.png");
    old << "old";
  }
  PlotOptions options;
  options.job_id = "job-1";
  options.output_path = dir_ + "/loss.png";
  options.gnuplot = fake_gnuplot;
  const absl::Status status = RunPlot(server.env, options);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(status.message(), "gnuplot failed (exit 1): line 3: unknown terminal type");
  std::ifstream old(dir_ + "/loss.png");
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(old)), {}), "old");
  ExpectOnly({"gnuplot", "loss.png"});
}

}  // namespace
}  // namespace aidn::ctl

namespace aidn::ctl {
namespace {

TEST(BashCompletionScript, CompletesFilesForFileFlagsAndCsvForMetrics) {
  const std::string script =
      BashCompletionScript({{{"-o", "--output"}, true}, {{"--addr"}, true}},
                           {{"submit", {{{"-f", "--file"}, true, true}, {{"--watch"}, false}}},
                            {"metrics", {{{"--from"}, true}}},
                            {"plot", {{{"-o", "--output"}, true, true}, {{"--width"}, true}}}});
  // A command's own file flag comes before the global -o.
  EXPECT_THAT(script, HasSubstr("    submit:-f|submit:--file|plot:-o|plot:--output) COMPREPLY=($("
                                "compgen -f -- \"$cur\")); return ;;\n"
                                "    metrics:-o|metrics:--output) COMPREPLY=($(compgen -W "
                                "\"table json yaml csv\""));
  EXPECT_THAT(script, HasSubstr("*:-o|*:--output) COMPREPLY=($(compgen -W \"table json yaml\""));
  EXPECT_THAT(script, HasSubstr("plot) flags=\"-o --output --width\""));
  EXPECT_THAT(script, HasSubstr("submit) flags=\"-f --file --watch\""));
}

}  // namespace
}  // namespace aidn::ctl
