// Watching training end to end: a real coordinator, one real aidn-worker and
// its trainer on Debian's Fashion-MNIST, followed by the real aidnctl: `submit
// --watch` in a pseudo-terminal (util-linux `script`), `watch` without one,
// `metrics -o csv` and `plot`.

#include <signal.h>

#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

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

constexpr const char* kDataset = kFashionMnist;
constexpr char kScript[] = "/usr/bin/script";
// About 2 s of the MLP on one core (and 2 epochs and a bit: evaluations at
// 937, 1874 and 2000): redrawn every 100 ms, the bar shows many values.
constexpr int kSteps = 2000;
constexpr std::chrono::milliseconds kJobTimeout{180'000};

// `text` as one word for sh.
std::string ShellQuoted(const std::string& text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

// Width and height in a PNG's IHDR; {0, 0} if `bytes` is no PNG.
std::pair<uint32_t, uint32_t> PngSize(const std::string& bytes) {
  if (bytes.size() < 24 || bytes.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0 ||
      bytes.compare(12, 4, "IHDR") != 0) {
    return {0, 0};
  }
  auto be32 = [&](size_t at) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
    return v;
  };
  return {be32(16), be32(20)};
}

class WatchTest : public ClusterFixture {
 protected:
  WatchTest() : ClusterFixture("aidn-watch-test") {}

  void SetUp() override {
    if (!FashionMnistInstalled()) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
    }
    ClusterFixture::SetUp();
    home_ = cluster().Path("home");
    std::filesystem::create_directories(home_);
    ASSERT_TRUE(
        cluster().StartCoordinator({"--worker-timeout=3s", "--heartbeat-interval=500ms"}).ok());
    ASSERT_TRUE(cluster().StartWorkers({"w1"}, {.args = {"--metrics-addr=127.0.0.1:0"}}));
  }

  // A one-rank MLP job of kSteps steps, as a YAML file; returns its path.
  std::string WriteSpec(const std::string& name, const std::string& dataset_dir = kDataset) {
    const std::string path = cluster().Path(name + ".yaml");
    WriteFileOrDie(path, absl::StrCat("name: ", name,
                                      "\n"
                                      "world_size: 1\n"
                                      "model: {name: mlp}\n"
                                      "dataset: {dir: ",
                                      dataset_dir,
                                      "}\n"
                                      "optimizer: {name: sgd, lr: 0.05, momentum: 0.9}\n"
                                      "batch_size: 64\n"
                                      "max_steps: ",
                                      kSteps,
                                      "\n"
                                      "seed: 1\n"
                                      "max_restarts: 0\n"));
    return path;
  }

  // aidnctl with the test's coordinator and admin token, stdout on a
  // pseudo-terminal of `script`.
  CommandResult AidnctlInTerminal(const std::vector<std::string>& args) {
    std::string command = absl::StrCat(ShellQuoted(AIDNCTL_BIN), " --addr=", cluster().address(),
                                       " --tls-ca=", ShellQuoted(cluster().coordinator().ca_file),
                                       " --token=", ShellQuoted(admin()));
    for (const std::string& arg : args) absl::StrAppend(&command, " ", ShellQuoted(arg));
    return RunCommand({kScript, "-qfec", command, "/dev/null"},
                      {"HOME=" + home_, "AIDN_ADDR=", "AIDN_TOKEN=", "TERM=xterm"}, kJobTimeout);
  }

  CommandResult Ctl(const std::vector<std::string>& args) { return cluster().Aidnctl(args); }

  std::string home_;
};

TEST_F(WatchTest, SubmitWatchDrawsAnAdvancingBarAndTheRestReadsTheSameJob) {
  if (!std::filesystem::exists(kScript)) GTEST_SKIP() << "util-linux script is not installed";
  // 1. Submit and watch in a terminal.
  const CommandResult live = AidnctlInTerminal({"submit", "-f", WriteSpec("watched"), "--watch"});
  ASSERT_EQ(live.exit_code, 0) << Describe(live);
  std::smatch id_match;
  ASSERT_TRUE(std::regex_search(live.out, id_match, std::regex("submitted (\\S+)")))
      << Describe(live);
  const std::string id = id_match[1];

  // The bar's percentages, frame by frame: they rise to 100, through at
  // least one value between 0 and 100.
  std::vector<int> percents;
  const std::regex bar_percent("\\] +([0-9]+)%  step ([0-9]+)/([0-9]+)");
  for (auto it = std::sregex_iterator(live.out.begin(), live.out.end(), bar_percent);
       it != std::sregex_iterator(); ++it) {
    percents.push_back(std::stoi((*it)[1]));
    EXPECT_EQ(std::stoi((*it)[3]), kSteps) << "total steps";
  }
  ASSERT_FALSE(percents.empty()) << Describe(live);
  EXPECT_TRUE(std::is_sorted(percents.begin(), percents.end())) << Describe(live);
  std::set<int> distinct(percents.begin(), percents.end());
  distinct.erase(0);  // before the first step
  EXPECT_GE(distinct.size(), 2u) << Describe(live);
  EXPECT_EQ(percents.back(), 100);
  EXPECT_THAT(live.out, HasSubstr("\x1b[4A"));  // redrawn in place
  EXPECT_THAT(live.out, HasSubstr(id + "  SUCCEEDED"));
  EXPECT_THAT(live.out, HasSubstr("\x1b[?25h"));  // the cursor shown again

  // 2. Watching the finished job without a terminal: plain lines.
  const CommandResult plain = Ctl({"watch", id});
  ASSERT_EQ(plain.exit_code, 0) << Describe(plain);
  EXPECT_THAT(plain.out, Not(HasSubstr("\x1b")));
  const std::vector<std::string> lines = absl::StrSplit(plain.out, '\n', absl::SkipEmpty());
  ASSERT_GE(lines.size(), 3u) << Describe(plain);
  EXPECT_EQ(lines.back().rfind("job " + id + " SUCCEEDED", 0), 0u) << Describe(plain);
  // The last progress line is the last step's.
  std::string last_progress;
  for (const std::string& line : lines) {
    if (absl::StartsWith(line, "step ")) last_progress = line;
  }
  EXPECT_TRUE(
      absl::StartsWith(last_progress, absl::StrCat("step ", kSteps, "/", kSteps, " (100%) | ")))
      << Describe(plain);
  EXPECT_THAT(plain.out, HasSubstr(absl::StrCat("eval at step ", kSteps, " ")));
  EXPECT_THAT(plain.out, HasSubstr("  job.succeeded"));

  // 3. Every step's metrics as CSV: one TRAIN line per step, 1..kSteps.
  const CommandResult csv = Ctl({"-o", "csv", "metrics", id});
  ASSERT_EQ(csv.exit_code, 0) << Describe(csv);
  const std::vector<std::string> rows = absl::StrSplit(csv.out, '\n', absl::SkipEmpty());
  ASSERT_FALSE(rows.empty());
  EXPECT_TRUE(absl::StartsWith(rows[0], "kind,step,epoch,generation,loss,samples,"));
  int64_t expected_step = 1;
  int evals = 0;
  for (size_t i = 1; i < rows.size(); ++i) {
    const std::vector<std::string> cells = absl::StrSplit(rows[i], ',');
    ASSERT_EQ(cells.size(), 19u) << rows[i];
    if (cells[0] == "EVAL") {
      ++evals;
      continue;
    }
    ASSERT_EQ(cells[0], "TRAIN") << rows[i];
    ASSERT_EQ(std::stoll(cells[1]), expected_step) << "a gap or a repeat at " << rows[i];
    ++expected_step;
    EXPECT_EQ(cells[13], "1") << "ranks_reported: " << rows[i];
    EXPECT_EQ(cells[14], "1") << "world_size: " << rows[i];
  }
  EXPECT_EQ(expected_step - 1, kSteps);
  EXPECT_GE(evals, 1);
  EXPECT_THAT(csv.out, HasSubstr(absl::StrCat("\nEVAL,", kSteps, ",")));

  // 4. A PNG of the size asked for.
  const std::string png = cluster().Path("loss.png");
  const CommandResult plot = Ctl({"plot", id, "-o", png, "--width", "800", "--height", "500"});
  ASSERT_EQ(plot.exit_code, 0) << Describe(plot);
  EXPECT_THAT(plot.out, HasSubstr(absl::StrCat(kSteps, " steps, ", evals, " evaluation")));
  EXPECT_EQ(PngSize(ReadFileOrEmpty(png)), std::make_pair(800u, 500u));
}

TEST_F(WatchTest, AWatchSurvivesACoordinatorRestartMissingNothing) {
  // About 9 s of training, which goes on while the coordinator is away.
  const std::string spec = WriteSpec("long");
  WriteFileOrDie(spec,
                 absl::StrReplaceAll(ReadFileOrEmpty(spec),
                                     {{absl::StrCat("max_steps: ", kSteps), "max_steps: 8000"}}));
  const CommandResult submit = Ctl({"submit", "-f", spec});
  ASSERT_EQ(submit.exit_code, 0) << Describe(submit);
  const std::string id = std::string(
      absl::StripAsciiWhitespace(absl::StripPrefix(absl::string_view(submit.out), "submitted ")));

  const std::string out = cluster().Path("watch.out"), err = cluster().Path("watch.err");
  absl::StatusOr<std::unique_ptr<Process>> watch = Process::Start(
      {AIDNCTL_BIN, "--addr=" + cluster().address(), "--tls-ca=" + cluster().coordinator().ca_file,
       "--token=" + admin(), "watch", id, "--reconnect-timeout=60s"},
      {"HOME=" + home_, "AIDN_ADDR=", "AIDN_TOKEN="}, out, err);
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(ReadFileOrEmpty(out), "\nstep "); },
                      std::chrono::seconds(60)))
      << ReadFileOrEmpty(out) << ReadFileOrEmpty(err);

  // kill -9, and the same coordinator again on the same port and state.
  const std::string address = cluster().address();
  const absl::Status restarted = cluster().RestartCoordinator(/*same_address=*/true);
  ASSERT_TRUE(restarted.ok()) << restarted;
  ASSERT_EQ(cluster().address(), address);

  absl::StatusOr<int> exit = (*watch)->Wait(kJobTimeout);
  ASSERT_TRUE(exit.ok()) << exit.status();
  const std::string text = ReadFileOrEmpty(out);
  EXPECT_EQ(*exit, 0) << text << ReadFileOrEmpty(err);
  EXPECT_THAT(text, HasSubstr("lost the coordinator at " + address));
  EXPECT_THAT(text, HasSubstr("reconnected to the coordinator at " + address));
  const std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  ASSERT_FALSE(lines.empty());
  EXPECT_TRUE(absl::StartsWith(lines.back(), "job " + id + " SUCCEEDED")) << text;
  // Progress and evaluations only ever move forward: nothing twice.
  int64_t last_step = 0, last_eval = 0;
  int evals = 0;
  std::set<std::string> events;
  for (const std::string& line : lines) {
    int64_t step = 0;
    if (std::sscanf(line.c_str(), "step %" SCNd64 "/", &step) == 1) {
      EXPECT_GT(step, last_step) << text;
      last_step = step;
    } else if (std::sscanf(line.c_str(), "eval at step %" SCNd64 " ", &step) == 1) {
      EXPECT_GT(step, last_eval) << text;
      last_eval = step;
      ++evals;
    } else if (absl::StrContains(line, "Z  ")) {
      EXPECT_TRUE(events.insert(line).second) << "twice: " << line;
    }
  }
  EXPECT_EQ(last_step, 8000);
  EXPECT_EQ(last_eval, 8000);
  EXPECT_GE(evals, 8);  // one per epoch of 937 steps, and one at the end
}

TEST_F(WatchTest, WatchingAJobThatFailsExitsNonZeroSayingWhy) {
  const std::string empty_dataset = cluster().Path("no-data");
  std::filesystem::create_directories(empty_dataset);
  const CommandResult submit = Ctl({"submit", "-f", WriteSpec("doomed", empty_dataset)});
  ASSERT_EQ(submit.exit_code, 0) << Describe(submit);
  const std::string id = std::string(
      absl::StripAsciiWhitespace(absl::StripPrefix(absl::string_view(submit.out), "submitted ")));

  const CommandResult watch = Ctl({"watch", id});
  EXPECT_EQ(watch.exit_code, 1) << Describe(watch);
  EXPECT_THAT(watch.err, HasSubstr("aidnctl: error: job " + id + " FAILED"));
  EXPECT_THAT(watch.out, HasSubstr("job " + id + " FAILED"));
}

TEST_F(WatchTest, WatchingAnUnknownJobFailsLikeOtherCommands) {
  const CommandResult watch = Ctl({"watch", "no-such-job"});
  EXPECT_EQ(watch.exit_code, 1) << Describe(watch);
  EXPECT_THAT(watch.err, HasSubstr("aidnctl: error: "));
  EXPECT_THAT(watch.err, HasSubstr("no-such-job"));
  EXPECT_EQ(watch.out, "");
}

}  // namespace
}  // namespace aidn::testing
