#include <dirent.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/metrics/process_stats.h"
#include "common/metrics/registry.h"

namespace aidn::metrics {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// The value of the first sample line that starts with `series` followed by a
// space (e.g. "process_threads" or "x_total{a=\"b\"}"); NaN when absent.
double SampleValue(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, series + " ")) continue;
    double value = 0;
    if (absl::SimpleAtod(line, &value)) return value;
  }
  return std::numeric_limits<double>::quiet_NaN();
}

// ---------------------------------------------------------------------------
// Exposition.

TEST(Registry, SerializesCountersWithSortedLabels) {
  Registry registry;
  auto& rpcs = registry.AddCounter("aidn_rpcs_total", "RPCs handled.");
  // Inserted out of label order: the output is sorted by label values.
  rpcs.Add({{"method", "SubmitJob"}, {"code", "OK"}}).Increment(3);
  rpcs.Add({{"method", "GetJob"}, {"code", "OK"}}).Increment();
  rpcs.Add({{"method", "GetJob"}, {"code", "NOT_FOUND"}}).Increment(0.5);
  EXPECT_EQ(registry.Serialize(),
            "# HELP aidn_rpcs_total RPCs handled.\n"
            "# TYPE aidn_rpcs_total counter\n"
            "aidn_rpcs_total{code=\"NOT_FOUND\",method=\"GetJob\"} 0.5\n"
            "aidn_rpcs_total{code=\"OK\",method=\"GetJob\"} 1\n"
            "aidn_rpcs_total{code=\"OK\",method=\"SubmitJob\"} 3\n");
}

TEST(Registry, SerializesGaugesAndSeriesWithoutLabels) {
  Registry registry;
  auto& up = registry.AddGauge("aidn_workers", "Workers known.");
  up.Add({}).Set(4);
  auto& temp = registry.AddGauge("aidn_temperature_celsius", "Temperature.");
  temp.Add({{"gpu", "0"}}).Set(-12.25);
  Gauge& g = temp.Add({{"gpu", "1"}});
  g.Set(10);
  g.Increment(2.5);
  g.Decrement(0.25);
  EXPECT_EQ(registry.Serialize(),
            "# HELP aidn_workers Workers known.\n"
            "# TYPE aidn_workers gauge\n"
            "aidn_workers 4\n"
            "# HELP aidn_temperature_celsius Temperature.\n"
            "# TYPE aidn_temperature_celsius gauge\n"
            "aidn_temperature_celsius{gpu=\"0\"} -12.25\n"
            "aidn_temperature_celsius{gpu=\"1\"} 12.25\n");
}

TEST(Registry, SerializesHistogramsWithCumulativeBucketsLeLastSumAndCount) {
  Registry registry;
  auto& steps =
      registry.AddHistogram("aidn_step_seconds", "Step time.", {0.25, 1, 2.5}, {{"zone", "a"}});
  Histogram& h = steps.Add({{"rank", "0"}});
  // 0.25 and 1 lie exactly on bounds and count in those buckets (le is <=).
  for (double v : {0.25, 0.5, 1.0, 3.0, 10.0}) h.Observe(v);
  steps.Add({{"rank", "1"}});  // no observations
  EXPECT_EQ(registry.Serialize(),
            "# HELP aidn_step_seconds Step time.\n"
            "# TYPE aidn_step_seconds histogram\n"
            "aidn_step_seconds_bucket{rank=\"0\",zone=\"a\",le=\"0.25\"} 1\n"
            "aidn_step_seconds_bucket{rank=\"0\",zone=\"a\",le=\"1\"} 3\n"
            "aidn_step_seconds_bucket{rank=\"0\",zone=\"a\",le=\"2.5\"} 3\n"
            "aidn_step_seconds_bucket{rank=\"0\",zone=\"a\",le=\"+Inf\"} 5\n"
            "aidn_step_seconds_sum{rank=\"0\",zone=\"a\"} 14.75\n"
            "aidn_step_seconds_count{rank=\"0\",zone=\"a\"} 5\n"
            "aidn_step_seconds_bucket{rank=\"1\",zone=\"a\",le=\"0.25\"} 0\n"
            "aidn_step_seconds_bucket{rank=\"1\",zone=\"a\",le=\"1\"} 0\n"
            "aidn_step_seconds_bucket{rank=\"1\",zone=\"a\",le=\"2.5\"} 0\n"
            "aidn_step_seconds_bucket{rank=\"1\",zone=\"a\",le=\"+Inf\"} 0\n"
            "aidn_step_seconds_sum{rank=\"1\",zone=\"a\"} 0\n"
            "aidn_step_seconds_count{rank=\"1\",zone=\"a\"} 0\n");
}

TEST(Registry, SerializesHistogramWithoutLabelsOrBounds) {
  Registry registry;
  auto& family = registry.AddHistogram("aidn_latency_seconds", "Latency.", {});
  family.Add({}).Observe(-1.5);
  EXPECT_EQ(registry.Serialize(),
            "# HELP aidn_latency_seconds Latency.\n"
            "# TYPE aidn_latency_seconds histogram\n"
            "aidn_latency_seconds_bucket{le=\"+Inf\"} 1\n"
            "aidn_latency_seconds_sum -1.5\n"
            "aidn_latency_seconds_count 1\n");
}

TEST(Registry, WritesFamiliesWithoutSeriesAsHelpAndTypeOnlyInRegistrationOrder) {
  Registry registry;
  registry.AddHistogram("c_seconds", "C.", {1});
  registry.AddCounter("b_total", "B.");
  registry.AddGauge("a", "A.");
  EXPECT_EQ(registry.Serialize(),
            "# HELP c_seconds C.\n"
            "# TYPE c_seconds histogram\n"
            "# HELP b_total B.\n"
            "# TYPE b_total counter\n"
            "# HELP a A.\n"
            "# TYPE a gauge\n");
  EXPECT_EQ(Registry().Serialize(), "");
}

TEST(Registry, EscapesLabelValuesAndPassesUnicodeThrough) {
  Registry registry;
  registry.AddGauge("g", "G.")
      .Add({{"path", "C:\\dir \"x\"\nnext"}, {"name", "h\xC3\xA9llo \xE2\x9C\x93"}})
      .Set(1);
  EXPECT_EQ(registry.Serialize(),
            "# HELP g G.\n"
            "# TYPE g gauge\n"
            "g{name=\"h\xC3\xA9llo \xE2\x9C\x93\",path=\"C:\\\\dir \\\"x\\\"\\nnext\"} 1\n");
}

TEST(Registry, EscapesBackslashAndNewlineInHelpButNotQuotes) {
  Registry registry;
  registry.AddGauge("g", "Two\nlines, a \\ and \"quotes\".");
  EXPECT_EQ(registry.Serialize(),
            "# HELP g Two\\nlines, a \\\\ and \"quotes\".\n"
            "# TYPE g gauge\n");
}

TEST(Escape, LabelValueEscapesBackslashQuoteAndNewlineOnly) {
  EXPECT_EQ(EscapeLabelValue(""), "");
  EXPECT_EQ(EscapeLabelValue("plain \t text"), "plain \t text");
  EXPECT_EQ(EscapeLabelValue("a\\b"), "a\\\\b");
  EXPECT_EQ(EscapeLabelValue("say \"hi\""), "say \\\"hi\\\"");
  EXPECT_EQ(EscapeLabelValue("1\n2"), "1\\n2");
  EXPECT_EQ(EscapeLabelValue("\xE6\x97\xA5\xE6\x9C\xAC"), "\xE6\x97\xA5\xE6\x9C\xAC");
}

TEST(Escape, HelpEscapesBackslashAndNewlineOnly) {
  EXPECT_EQ(EscapeHelp("a\\b\nc \"d\""), "a\\\\b\\nc \"d\"");
}

TEST(Registry, SanitisesInvalidLabelNamesOnOutput) {
  Registry registry;
  auto& family = registry.AddCounter("x_total", "X.");
  family.Add({{"bad-name", "v"}, {"9lives", "w"}, {"__reserved", "z"}}).Increment();
  EXPECT_EQ(registry.Serialize(),
            "# HELP x_total X.\n"
            "# TYPE x_total counter\n"
            "x_total{_9lives=\"w\",_reserved=\"z\",bad_name=\"v\"} 1\n");
}

TEST(Registry, RenamesASeriesLabelCalledLeInHistogramsSoItCannotClashWithBuckets) {
  Registry registry;
  registry.AddHistogram("h_seconds", "H.", {1}).Add({{"le", "x"}}).Observe(2);
  EXPECT_EQ(registry.Serialize(),
            "# HELP h_seconds H.\n"
            "# TYPE h_seconds histogram\n"
            "h_seconds_bucket{le_=\"x\",le=\"1\"} 0\n"
            "h_seconds_bucket{le_=\"x\",le=\"+Inf\"} 1\n"
            "h_seconds_sum{le_=\"x\"} 2\n"
            "h_seconds_count{le_=\"x\"} 1\n");
}

// ---------------------------------------------------------------------------
// Values.

TEST(FormatValue, WritesIntegersWithoutAFraction) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(-0.0), "0");
  EXPECT_EQ(FormatValue(3), "3");
  EXPECT_EQ(FormatValue(-42), "-42");
  EXPECT_EQ(FormatValue(1000000), "1000000");
  EXPECT_EQ(FormatValue(9007199254740992.0), "9007199254740992");  // 2^53
}

TEST(FormatValue, WritesSpecialValuesAsPrometheusSpellsThem) {
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::quiet_NaN()), "NaN");
}

TEST(FormatValue, WritesFractionsAndLargeValuesShortestThatReadBackExactly) {
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(0.005), "0.005");
  EXPECT_EQ(FormatValue(-2.5), "-2.5");
  EXPECT_EQ(FormatValue(1e20), "1e+20");
  EXPECT_EQ(FormatValue(1e-7), "1e-07");
  const double values[] = {0.1,
                           1.0 / 3,
                           -2.0 / 3,
                           1e20,
                           -1e20,
                           1.5e-7,
                           123456.789,
                           9007199254740993.0 * 4,
                           std::numeric_limits<double>::max(),
                           std::numeric_limits<double>::lowest(),
                           std::numeric_limits<double>::min(),
                           std::numeric_limits<double>::denorm_min()};
  for (double v : values) {
    const std::string text = FormatValue(v);
    EXPECT_EQ(std::strtod(text.c_str(), nullptr), v) << text;
    EXPECT_THAT(text, Not(HasSubstr("00000"))) << "not the shortest form";
  }
}

TEST(Histogram, PlacesObservationsInTheFirstBucketWhoseBoundIsAtLeastTheValue) {
  Histogram h({1, 2, 4});
  for (double v : {-100.0, 0.0, 1.0, 1.0000001, 2.0, 3.9, 4.0, 4.1, 1e300}) h.Observe(v);
  const Histogram::Snapshot s = h.Collect();
  EXPECT_THAT(s.bounds, ElementsAre(1, 2, 4));
  // <=1: -100, 0, 1; <=2: +1.0000001, 2; <=4: +3.9, 4; +Inf: +4.1, 1e300.
  EXPECT_THAT(s.cumulative_counts, ElementsAre(3u, 5u, 7u, 9u));
  EXPECT_EQ(s.count, 9u);
  EXPECT_DOUBLE_EQ(s.sum, -100 + 0 + 1 + 1.0000001 + 2 + 3.9 + 4 + 4.1 + 1e300);
}

TEST(Histogram, CountsNaNAndInfinityOnlyInTheInfBucket) {
  Histogram h({1});
  h.Observe(std::numeric_limits<double>::quiet_NaN());
  h.Observe(std::numeric_limits<double>::infinity());
  h.Observe(-std::numeric_limits<double>::infinity());
  const Histogram::Snapshot s = h.Collect();
  EXPECT_THAT(s.cumulative_counts, ElementsAre(1u, 3u));
  EXPECT_EQ(s.count, 3u);
  EXPECT_TRUE(std::isnan(s.sum));
}

TEST(Histogram, DropsATrailingInfBoundSinceEveryHistogramHasOne) {
  Histogram h({1, std::numeric_limits<double>::infinity()});
  EXPECT_THAT(h.Collect().bounds, ElementsAre(1));
}

TEST(Histogram, RejectsBoundsThatDoNotIncrease) {
  EXPECT_DEATH(Histogram({1, 1}), "increase");
  EXPECT_DEATH(Histogram({2, 1}), "increase");
}

TEST(Buckets, ExponentialMultipliesByTheFactor) {
  EXPECT_THAT(ExponentialBuckets(1, 2, 4), ElementsAre(1, 2, 4, 8));
  EXPECT_THAT(ExponentialBuckets(0.001, 10, 3), ElementsAre(0.001, 0.001 * 10, 0.001 * 10 * 10));
  EXPECT_TRUE(ExponentialBuckets(1, 2, 0).empty());
}

TEST(Buckets, LinearAddsTheWidth) {
  EXPECT_THAT(LinearBuckets(0.5, 0.25, 3), ElementsAre(0.5, 0.75, 1.0));
  EXPECT_THAT(LinearBuckets(-1, 1, 3), ElementsAre(-1, 0, 1));
  EXPECT_TRUE(LinearBuckets(0, 1, -1).empty());
  // No drift from repeated addition: the tenth of 0.1-wide buckets is 0.9.
  EXPECT_EQ(LinearBuckets(0, 0.1, 10).back(), 9 * 0.1);
}

TEST(Counter, IgnoresNegativeAndNaNIncrements) {
  Counter c;
  c.Increment(2);
  c.Increment(-1);
  c.Increment(std::numeric_limits<double>::quiet_NaN());
  c.Increment();
  EXPECT_EQ(c.Value(), 3);
}

// ---------------------------------------------------------------------------
// Series.

TEST(Family, ReturnsTheSameSeriesForTheSameLabels) {
  Registry registry;
  auto& family = registry.AddCounter("x_total", "X.");
  Counter& a = family.Add({{"a", "1"}, {"b", "2"}});
  Counter& b = family.Add({{"b", "2"}, {"a", "1"}});
  Counter& c = family.Add({{"a", "1"}, {"b", "3"}});
  EXPECT_EQ(&a, &b);
  EXPECT_NE(&a, &c);
  EXPECT_EQ(family.size(), 2);
  a.Increment();
  b.Increment();
  EXPECT_EQ(SampleValue(registry.Serialize(), "x_total{a=\"1\",b=\"2\"}"), 2);
}

TEST(Family, RemoveDropsTheSeriesFromTheOutput) {
  Registry registry;
  auto& family = registry.AddGauge("g", "G.");
  Gauge& keep = family.Add({{"job", "keep"}});
  Gauge& drop = family.Add({{"job", "drop"}});
  keep.Set(1);
  drop.Set(2);
  family.Remove(&drop);
  Gauge unknown;
  family.Remove(&unknown);  // ignored
  EXPECT_EQ(family.size(), 1);
  EXPECT_EQ(registry.Serialize(),
            "# HELP g G.\n"
            "# TYPE g gauge\n"
            "g{job=\"keep\"} 1\n");
  // Adding the labels again starts a fresh series.
  EXPECT_EQ(family.Add({{"job", "drop"}}).Value(), 0);
}

TEST(Family, RemoveMatchingDropsEverySeriesWithTheGivenLabels) {
  Registry registry;
  auto& steps = registry.AddHistogram("step_seconds", "Steps.", {1});
  steps.Add({{"job_id", "job-1"}, {"rank", "0"}}).Observe(0.5);
  steps.Add({{"job_id", "job-1"}, {"rank", "1"}}).Observe(0.5);
  steps.Add({{"job_id", "job-2"}, {"rank", "0"}}).Observe(0.5);
  EXPECT_EQ(steps.RemoveMatching({{"job_id", "job-1"}}), 2);
  EXPECT_EQ(steps.RemoveMatching({{"job_id", "job-1"}}), 0);
  EXPECT_EQ(steps.RemoveMatching({{"job_id", "job-2"}, {"rank", "1"}}), 0);
  EXPECT_EQ(steps.size(), 1);
  const std::string text = registry.Serialize();
  EXPECT_THAT(text, Not(HasSubstr("job-1")));
  EXPECT_THAT(text, HasSubstr("step_seconds_count{job_id=\"job-2\",rank=\"0\"} 1\n"));
}

TEST(Family, RemoveWhereDropsTheSeriesOfManyValuesInOnePass) {
  Registry registry;
  auto& step = registry.AddGauge("step", "Step.");
  for (const char* job : {"job-1", "job-2", "job-3"}) step.Add({{"job_id", job}}).Set(1);
  step.Add({{"worker_id", "w1"}}).Set(1);
  const std::set<std::string> doomed{"job-1", "job-3", "job-9"};
  EXPECT_EQ(step.RemoveWhere("job_id", [&](const std::string& v) { return doomed.contains(v); }),
            2);
  EXPECT_EQ(step.size(), 2);
  EXPECT_THAT(registry.Serialize(), HasSubstr("step{job_id=\"job-2\"} 1\n"));
}

TEST(Family, MergesConstantLabelsIntoEverySeries) {
  Registry registry;
  auto& family = registry.AddCounter("x_total", "X.", {{"role", "coordinator"}});
  family.Add({{"method", "A"}}).Increment();
  // A series label cannot override a constant label.
  family.Add({{"role", "worker"}}).Increment(2);
  family.Add({}).Increment(4);
  EXPECT_EQ(registry.Serialize(),
            "# HELP x_total X.\n"
            "# TYPE x_total counter\n"
            "x_total{method=\"A\",role=\"coordinator\"} 1\n"
            "x_total{role=\"coordinator\"} 6\n");
  // Constant labels can be matched like any other.
  EXPECT_EQ(family.RemoveMatching({{"role", "coordinator"}}), 2);
}

TEST(Registry, ReturnsTheFirstFamilyWhenANameIsRegisteredTwice) {
  Registry registry;
  auto& first = registry.AddCounter("x_total", "First.");
  auto& second = registry.AddCounter("x_total", "Second.");
  EXPECT_EQ(&first, &second);
  EXPECT_EQ(second.help(), "First.");
  auto& h1 = registry.AddHistogram("h_seconds", "H.", {1});
  auto& h2 = registry.AddHistogram("h_seconds", "H.", {1, 2});
  EXPECT_EQ(&h1, &h2);
}

TEST(Registry, AbortsWhenANameIsRegisteredWithAnotherType) {
  Registry registry;
  registry.AddCounter("x_total", "X.");
  EXPECT_DEATH(registry.AddGauge("x_total", "X."), "another type");
}

TEST(Registry, AbortsOnAnInvalidMetricName) {
  Registry registry;
  EXPECT_DEATH(registry.AddGauge("1bad", "X."), "invalid metric name");
  EXPECT_DEATH(registry.AddGauge("bad-name", "X."), "invalid metric name");
}

TEST(Registry, RunsCollectHooksBeforeEachSerializeInOrder) {
  Registry registry;
  auto& family = registry.AddGauge("g", "G.");
  Gauge& calls = family.Add({{"k", "calls"}});
  std::vector<int> order;
  registry.AddCollectHook([&] {
    order.push_back(1);
    calls.Increment();
  });
  // A hook may add series: nothing in the registry is locked while it runs.
  registry.AddCollectHook([&] {
    order.push_back(2);
    family.Add({{"k", "added"}}).Set(7);
  });
  EXPECT_EQ(SampleValue(registry.Serialize(), "g{k=\"calls\"}"), 1);
  const std::string text = registry.Serialize();
  EXPECT_EQ(SampleValue(text, "g{k=\"calls\"}"), 2);
  EXPECT_EQ(SampleValue(text, "g{k=\"added\"}"), 7);
  EXPECT_THAT(order, ElementsAre(1, 2, 1, 2));
}

TEST(Registry, CollectHookMayRegisterFamiliesAndRemoveSeries) {
  Registry registry;
  auto& family = registry.AddGauge("g", "G.");
  family.Add({{"job", "gone"}}).Set(1);
  registry.AddCollectHook([&] {
    family.RemoveMatching({{"job", "gone"}});
    registry.AddCounter("late_total", "Late.").Add({}).Increment();
  });
  const std::string text = registry.Serialize();
  EXPECT_THAT(text, Not(HasSubstr("gone")));
  EXPECT_THAT(text, HasSubstr("late_total 1\n"));
}

TEST(Counter, ConcurrentIncrementsFromSeveralThreadsSumExactly) {
  Registry registry;
  auto& counters = registry.AddCounter("x_total", "X.");
  auto& gauges = registry.AddGauge("g", "G.");
  auto& histograms = registry.AddHistogram("h_seconds", "H.", {0.5});
  constexpr int kThreads = 8;
  constexpr int kIncrements = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIncrements; ++i) {
        // Look the series up every time too, to race Add against Add.
        counters.Add({{"k", "shared"}}).Increment();
        counters.Add({{"k", "weighted"}}).Increment(t + 1);
        gauges.Add({}).Increment(2);
        gauges.Add({}).Decrement();
        histograms.Add({}).Observe(i % 2);
      }
    });
  }
  // Serialize concurrently with the writers; it must not deadlock or tear.
  for (int i = 0; i < 20; ++i) registry.Serialize();
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(counters.Add({{"k", "shared"}}).Value(), kThreads * kIncrements);
  EXPECT_EQ(counters.Add({{"k", "weighted"}}).Value(), kIncrements * kThreads * (kThreads + 1) / 2);
  EXPECT_EQ(gauges.Add({}).Value(), kThreads * kIncrements);
  const Histogram::Snapshot s = histograms.Add({}).Collect();
  EXPECT_EQ(s.count, static_cast<uint64_t>(kThreads * kIncrements));
  EXPECT_THAT(s.cumulative_counts,
              ElementsAre(uint64_t{kThreads * kIncrements / 2}, uint64_t{kThreads * kIncrements}));
  EXPECT_EQ(s.sum, kThreads * kIncrements / 2);
}

// ---------------------------------------------------------------------------
// promtool.

constexpr char kPromtool[] = "/usr/bin/promtool";

struct CommandResult {
  int exit_status = -1;
  std::string output;  // stdout and stderr together
};

// Runs `argv` with `input` on its stdin; returns its exit status and output.
CommandResult RunWithInput(const std::vector<std::string>& argv, const std::string& input) {
  CommandResult result;
  int in_pipe[2], out_pipe[2];
  if (pipe(in_pipe) != 0 || pipe(out_pipe) != 0) return result;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(in_pipe[0], STDIN_FILENO);
    dup2(out_pipe[1], STDOUT_FILENO);
    dup2(out_pipe[1], STDERR_FILENO);
    close(in_pipe[0]);
    close(in_pipe[1]);
    close(out_pipe[0]);
    close(out_pipe[1]);
    std::vector<char*> args;
    for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(in_pipe[0]);
  close(out_pipe[1]);
  // The child may exit before reading everything; a write to a closed pipe
  // must not kill the test.
  signal(SIGPIPE, SIG_IGN);
  // Metrics text is far smaller than a pipe buffer plus what promtool reads
  // eagerly, but write and read from separate threads anyway so that a large
  // input cannot deadlock.
  std::thread writer([&] {
    size_t written = 0;
    while (written < input.size()) {
      const ssize_t n = write(in_pipe[1], input.data() + written, input.size() - written);
      if (n <= 0) break;
      written += static_cast<size_t>(n);
    }
    close(in_pipe[1]);
  });
  char buf[4096];
  ssize_t n;
  while ((n = read(out_pipe[0], buf, sizeof(buf))) > 0) result.output.append(buf, n);
  close(out_pipe[0]);
  writer.join();
  int status = 0;
  if (pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status)) {
    result.exit_status = WEXITSTATUS(status);
  }
  return result;
}

TEST(Registry, OutputPassesPromtoolCheckMetrics) {
  if (access(kPromtool, X_OK) != 0) {
    GTEST_SKIP() << kPromtool << " is absent (Debian package prometheus); cannot lint the output";
  }
  Registry registry;
  auto& rpcs = registry.AddCounter("aidn_rpcs_total", "RPCs handled, by \"method\".\nSecond line.",
                                   {{"role", "coordinator"}});
  rpcs.Add({{"method", "SubmitJob"}, {"code", "OK"}}).Increment(3);
  rpcs.Add({{"method", "a\\b \"quoted\"\nnewline \xE2\x9C\x93"}, {"code", "INTERNAL"}}).Increment();
  auto& jobs = registry.AddGauge("aidn_jobs", "Jobs by state.");
  jobs.Add({{"state", "RUNNING"}}).Set(2);
  jobs.Add({{"state", "FAILED"}}).Set(-1);
  jobs.Add({{"state", "weird"}}).Set(std::numeric_limits<double>::quiet_NaN());
  registry.AddGauge("aidn_ratio", "Big and small.").Add({}).Set(1e20);
  auto& steps = registry.AddHistogram("aidn_rank_step_seconds", "Step time.",
                                      ExponentialBuckets(1e-4, 2, 16));
  for (int i = 0; i < 100; ++i) steps.Add({{"job_id", "job-1"}, {"rank", "0"}}).Observe(i * 1e-3);
  steps.Add({{"job_id", "job-1"}, {"rank", "1"}});
  registry.AddHistogram("aidn_empty_seconds", "No series yet.", LinearBuckets(1, 1, 3));
  registry.AddCounter("aidn_empty_total", "No series yet.");
  AddProcessMetrics(&registry);

  const std::string text = registry.Serialize();
  const CommandResult result = RunWithInput({kPromtool, "check", "metrics"}, text);
  EXPECT_EQ(result.exit_status, 0) << result.output << "\nfor input:\n" << text;
  EXPECT_EQ(result.output, "") << "for input:\n" << text;
}

TEST(Registry, PromtoolRejectsBrokenOutputSoTheCheckAboveMeansSomething) {
  if (access(kPromtool, X_OK) != 0) GTEST_SKIP() << kPromtool << " is absent";
  const CommandResult result =
      RunWithInput({kPromtool, "check", "metrics"}, "# TYPE x counter\nx{a=\"unterminated} 1\n");
  EXPECT_NE(result.exit_status, 0) << result.output;
}

// ---------------------------------------------------------------------------
// Process stats.

// CPU time used by this process, as the C library counts it.
void BurnCpu(double seconds) {
  const std::clock_t start = std::clock();
  volatile double sink = 0;
  while (static_cast<double>(std::clock() - start) / CLOCKS_PER_SEC < seconds) {
    for (int i = 0; i < 10000; ++i) sink = sink + std::sqrt(static_cast<double>(i));
  }
}

int64_t CountDirEntries(const std::string& path) {
  int64_t count = 0;
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return -1;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") ++count;
  }
  closedir(dir);
  return count;
}

TEST(ProcessStats, ReportsSensibleFiguresForThisProcess) {
  // A second thread, parked, so that the thread count must be read right.
  absl::Notification stop;
  std::thread parked([&] { stop.WaitForNotification(); });
  BurnCpu(0.05);
  const absl::StatusOr<ProcessStats> stats = ReadProcessStats();
  const int64_t tasks = CountDirEntries("/proc/self/task");
  stop.Notify();
  parked.join();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GE(stats->cpu_seconds, 0.04);
  EXPECT_GT(stats->resident_bytes, 0);
  EXPECT_GE(stats->virtual_bytes, stats->resident_bytes);
  EXPECT_GE(stats->open_fds, 3);  // at least stdin, stdout, stderr
  EXPECT_EQ(stats->threads, tasks);
  EXPECT_GE(stats->threads, 2);
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  // Started within the last hour, and not in the future (boot time has a
  // one-second resolution).
  EXPECT_LE(stats->start_time_seconds, now + 1.5);
  EXPECT_GT(stats->start_time_seconds, now - 3600);
}

TEST(ProcessStats, CountsCpuTimeAsItIsUsed) {
  const absl::StatusOr<ProcessStats> before = ReadProcessStats(getpid());
  ASSERT_TRUE(before.ok()) << before.status();
  BurnCpu(0.2);
  const absl::StatusOr<ProcessStats> after = ReadProcessStats(getpid());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_GE(after->cpu_seconds - before->cpu_seconds, 0.15);
  EXPECT_LT(after->cpu_seconds - before->cpu_seconds, 5);
}

TEST(ProcessStats, ParsesACommandNameHoldingSpacesAndParentheses) {
  char old_name[17] = {};
  ASSERT_EQ(prctl(PR_GET_NAME, old_name), 0);
  // gtest runs tests on the main thread, whose name is the process's comm.
  ASSERT_EQ(prctl(PR_SET_NAME, "x) 1 2 (y) 3 4"), 0);
  const absl::StatusOr<ProcessStats> stats = ReadProcessStats();
  prctl(PR_SET_NAME, old_name);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GT(stats->resident_bytes, 0);
  EXPECT_GE(stats->threads, 1);
  EXPECT_GT(stats->virtual_bytes, 4096);
  EXPECT_GT(stats->start_time_seconds, 1e9);
}

TEST(ProcessStats, IsNotFoundForAProcessThatDoesNotExist) {
  // No pid exceeds pid_max, so this one cannot exist.
  std::ifstream pid_max_file("/proc/sys/kernel/pid_max");
  int64_t pid_max = 0;
  ASSERT_TRUE(pid_max_file >> pid_max);
  const absl::StatusOr<ProcessStats> stats = ReadProcessStats(static_cast<pid_t>(pid_max + 1));
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kNotFound) << stats.status();
}

TEST(ProcessStats, IsNotFoundForAChildThatHasBeenReaped) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) _exit(0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_EQ(ReadProcessStats(pid).status().code(), absl::StatusCode::kNotFound);
}

TEST(ProcessStats, AddProcessMetricsExportsTheStandardProcessMetrics) {
  Registry registry;
  AddProcessMetrics(&registry);
  const std::string text = registry.Serialize();
  EXPECT_THAT(text, HasSubstr("# TYPE process_cpu_seconds_total counter\n"));
  for (const char* gauge : {"process_resident_memory_bytes", "process_virtual_memory_bytes",
                            "process_open_fds", "process_start_time_seconds", "process_threads"}) {
    EXPECT_THAT(text, HasSubstr(absl::StrCat("# TYPE ", gauge, " gauge\n")));
    EXPECT_GT(SampleValue(text, gauge), 0) << gauge << " in\n" << text;
  }
  EXPECT_GE(SampleValue(text, "process_cpu_seconds_total"), 0);
}

TEST(ProcessStats, AddProcessMetricsTwiceDoesNotCountCpuTwice) {
  BurnCpu(0.2);
  Registry registry;
  AddProcessMetrics(&registry);
  AddProcessMetrics(&registry);
  const double first = SampleValue(registry.Serialize(), "process_cpu_seconds_total");
  BurnCpu(0.1);
  const double second = SampleValue(registry.Serialize(), "process_cpu_seconds_total");
  const absl::StatusOr<ProcessStats> after = ReadProcessStats();
  ASSERT_TRUE(after.ok());
  EXPECT_GE(first, 0.15);
  EXPECT_GE(second, first + 0.05);
  EXPECT_LE(second, after->cpu_seconds);
}

}  // namespace
}  // namespace aidn::metrics
