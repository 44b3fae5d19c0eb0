// `aidnctl events --follow` against a real coordinator: a job's events as
// JSON Lines until the job ends, the cluster's as a table through a
// coordinator restart, and what it refuses.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster_fixture.h"

namespace aidn::testing {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

const std::string kSpec = std::string(AIDN_SOURCE_DIR) + "/examples/fashion-mnist-mlp.yaml";
constexpr std::chrono::seconds kDeadline{30};

class EventsFollow : public ClusterFixture {
 protected:
  EventsFollow() : ClusterFixture("aidn-events-follow-test") {}

  void SetUp() override {
    ClusterFixture::SetUp();
    const absl::Status started = cluster().StartCoordinator();
    ASSERT_TRUE(started.ok()) << started;
  }

  std::string Submit() {
    CommandResult r = Aidnctl(cluster().coordinator(), cluster().admin_token(), {"submit", kSpec});
    const std::string out(absl::StripAsciiWhitespace(r.out));
    EXPECT_TRUE(absl::StartsWith(out, "submitted ")) << r.out << r.err;
    return std::string(absl::StripPrefix(out, "submitted "));
  }

  // `aidnctl args...` in the background, its output in <dir>/<name>.out.
  std::unique_ptr<Process> Follow(const std::string& name, const std::vector<std::string>& args) {
    const std::string home = cluster().Path(name + ".home");
    std::filesystem::create_directories(home);
    auto p = StartAidnctl(cluster().coordinator(), cluster().admin_token(), args, home,
                          cluster().Path(name + ".out"), cluster().Path(name + ".err"));
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }
};

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

// The seq column of table lines (the header left out).
std::vector<int64_t> TableSeqs(const std::string& text) {
  std::vector<int64_t> seqs;
  for (const std::string& line : Lines(text)) {
    if (absl::StartsWith(line, "SEQ")) continue;
    seqs.push_back(std::stoll(line.substr(0, line.find(' '))));
  }
  return seqs;
}

TEST_F(EventsFollow, AJobsEventsAsJsonLinesUntilItEnds) {
  const std::string first = Submit();
  std::unique_ptr<Process> follower =
      Follow("job", {"-o", "json", "events", first, "--follow", "--interval", "100ms"});
  ASSERT_NE(follower, nullptr);
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(follower->Stdout(), "job.submitted"); },
                      kDeadline, "the job's submitted event", [&] { return follower->Stderr(); }));

  // Another job's events are not this one's; cancelling ends the job and
  // with it the follow.
  const std::string second = Submit();
  CommandResult cancel =
      Aidnctl(cluster().coordinator(), cluster().admin_token(), {"cancel", first});
  ASSERT_EQ(cancel.exit_code, 0) << cancel.err;
  absl::StatusOr<int> code = follower->Wait(kDeadline);
  ASSERT_TRUE(code.ok()) << "still following after the job ended: " << follower->Stdout();
  EXPECT_EQ(*code, 0) << follower->Stderr();

  std::vector<std::string> types;
  int64_t last_seq = 0;
  for (const std::string& line : Lines(follower->Stdout())) {
    const Json event = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(event.is_object()) << "not one JSON object: " << line;
    EXPECT_EQ(event.value("job_id", ""), first) << line;
    const int64_t seq = std::stoll(event.value("seq", "0"));
    EXPECT_GT(seq, last_seq) << "out of order or twice: " << line;
    last_seq = seq;
    types.push_back(event.value("type", ""));
  }
  ASSERT_FALSE(types.empty());
  EXPECT_EQ(types.front(), "job.submitted");
  EXPECT_EQ(types.back(), "job.cancelled");

  // A job that has already ended: its events, then at once the end.
  CommandResult ended = Aidnctl(cluster().coordinator(), cluster().admin_token(),
                                {"events", first, "--follow"}, kDeadline);
  EXPECT_EQ(ended.exit_code, 0) << ended.err;
  EXPECT_THAT(ended.out, HasSubstr("job.cancelled"));
  EXPECT_THAT(ended.out, testing::Not(HasSubstr(second)));
}

TEST_F(EventsFollow, TheClustersEventsGoOnThroughACoordinatorRestart) {
  Submit();
  std::unique_ptr<Process> follower = Follow("all", {"events", "--follow", "--interval", "100ms"});
  ASSERT_NE(follower, nullptr);
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(follower->Stdout(), "job.submitted"); },
                      kDeadline, "the first job's event", [&] { return follower->Stderr(); }));
  EXPECT_TRUE(absl::StartsWith(follower->Stdout(), "SEQ ")) << follower->Stdout();

  absl::Status restarted = cluster().RestartCoordinator(/*same_address=*/true);
  ASSERT_TRUE(restarted.ok()) << restarted;
  const std::string next = Submit();
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(follower->Stdout(), next); }, kDeadline,
                      "the event of a job submitted after the restart",
                      [&] { return follower->Stdout() + follower->Stderr(); }));
  EXPECT_TRUE(follower->Running()) << "a follow without a job runs until interrupted";
  follower->Signal(SIGTERM);
  ASSERT_TRUE(follower->Wait(kDeadline).ok());

  // Every event once, in order, as `events` lists them.
  const std::vector<int64_t> seqs = TableSeqs(follower->Stdout());
  const std::vector<int64_t> listed =
      TableSeqs(Aidnctl(cluster().coordinator(), cluster().admin_token(), {"events"}).out);
  ASSERT_FALSE(seqs.empty());
  ASSERT_GE(listed.size(), seqs.size());
  EXPECT_EQ(std::set<int64_t>(seqs.begin(), seqs.end()).size(), seqs.size()) << follower->Stdout();
  EXPECT_TRUE(std::is_sorted(seqs.begin(), seqs.end())) << follower->Stdout();
  EXPECT_EQ(std::vector<int64_t>(listed.begin(), listed.begin() + seqs.size()), seqs);
}

TEST_F(EventsFollow, RefusesWhatItCannotFollow) {
  const CoordinatorHandle& c = cluster().coordinator();
  CommandResult limit = Aidnctl(c, c.admin_token, {"events", "--follow", "--limit", "5"});
  EXPECT_EQ(limit.exit_code, 1);
  EXPECT_THAT(limit.err, HasSubstr("--limit does not go with --follow"));

  CommandResult unknown = Aidnctl(c, c.admin_token, {"events", "job-404", "--follow"}, kDeadline);
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_THAT(unknown.err, HasSubstr("job-404"));

  CommandResult interval = Aidnctl(c, c.admin_token, {"events", "--follow", "--interval", "0"});
  EXPECT_EQ(interval.exit_code, 2);
  EXPECT_THAT(interval.err, HasSubstr("--interval"));

  CommandResult csv = Aidnctl(c, c.admin_token, {"-o", "csv", "events", "--follow"}, kDeadline);
  EXPECT_NE(csv.exit_code, 0);
  EXPECT_THAT(csv.err, HasSubstr("csv"));
}

}  // namespace
}  // namespace aidn::testing
