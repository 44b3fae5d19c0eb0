// Full disks, made with small tmpfs mounts the test creates: under the
// coordinator's state directory, and under the workers' checkpoint root.
//
// Needs root (mount); skips, saying so, where mounting is not allowed.

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_manifest.h"
#include "common/digest.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/support/files.h"
#include "tests/support/process.h"
#include "tests/support/wait.h"

namespace aidn::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;
using ::testing::HasSubstr;

constexpr milliseconds kLong{180'000};

// A tmpfs of `megabytes` at `path` (made if missing), unmounted on
// destruction; a filler file takes what is left of it.
class SmallDisk {
 public:
  static std::unique_ptr<SmallDisk> Mount(const std::string& path, int megabytes,
                                          std::string* why) {
    fs::create_directories(path);
    const CommandResult r = RunCommand(
        {"mount", "-t", "tmpfs", "-o", absl::StrCat("size=", megabytes, "m"), "tmpfs", path});
    if (r.exit_code != 0) {
      *why = absl::StrCat("mount -t tmpfs: ", r.err, r.out);
      return nullptr;
    }
    return std::unique_ptr<SmallDisk>(new SmallDisk(path));
  }
  ~SmallDisk() { RunCommand({"umount", "-l", path_}); }

  // Writes a file until the disk is full; its size.
  int64_t Fill() {
    const std::string filler = path_ + "/filler";
    const int fd = ::open(filler.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd < 0) return -1;
    const std::string chunk(64 * 1024, 'x');
    int64_t written = 0;
    while (true) {
      const ssize_t n = ::write(fd, chunk.data(), chunk.size());
      if (n <= 0) break;
      written += n;
    }
    ::close(fd);
    return written;
  }
  void Free() { fs::remove(path_ + "/filler"); }

 private:
  explicit SmallDisk(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

class DiskFullTest : public ClusterFixture {
 protected:
  DiskFullTest() : ClusterFixture("aidn-disk-full-test") {}

  void SetUp() override {
    if (!FashionMnistInstalled()) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
    }
    ClusterFixture::SetUp();
  }

  // Mounts a small disk at `dir()/name`; null (and why) when it cannot.
  SmallDisk* DiskAt(const std::string& name, int megabytes, std::string* why) {
    disk_ = SmallDisk::Mount(cluster().Path(name), megabytes, why);
    return disk_.get();
  }

  void TearDown() override {
    StopAllAndExpectNoProcesses();
    disk_.reset();
    ClusterFixture::TearDown();
  }

  // Retention keeps every checkpoint: none is deleted to make room, so a
  // full disk stays full.
  static v1::JobSpec Spec() {
    v1::JobSpec spec;
    spec.set_name("disk-full");
    spec.set_world_size(1);
    spec.mutable_model()->set_name("mlp");
    spec.mutable_model()->add_hidden_sizes(64);
    spec.mutable_optimizer()->set_name("adamw");
    spec.set_batch_size(64);
    spec.set_max_steps(1'000'000);
    spec.set_max_restarts(1);
    spec.mutable_checkpoint()->set_dir("runs");
    spec.mutable_checkpoint()->set_every_steps(100);
    spec.mutable_checkpoint()->set_keep_last(100);
    spec.mutable_timeouts()->mutable_restart_backoff()->set_nanos(200'000'000);
    return spec;
  }

  std::unique_ptr<SmallDisk> disk_;
};

// The state database's integrity_check, through Python's sqlite3.
std::string IntegrityCheck(const std::string& db) {
  const CommandResult r =
      RunCommand({"python3", "-c",
                  "import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute('PRAGMA "
                  "integrity_check').fetchone()[0])",
                  db});
  return r.out + r.err;
}

TEST_F(DiskFullTest, TheCoordinatorRefusesWritesWhileItsDiskIsFullAndGoesOnAfter) {
  std::string why;
  SmallDisk* disk = DiskAt("state", 8, &why);
  if (disk == nullptr) GTEST_SKIP() << "cannot mount a tmpfs here: " << why;
  ASSERT_TRUE(cluster().StartCoordinator().ok());
  // No workers: the jobs wait.
  absl::StatusOr<std::string> first = cluster().Submit(Spec());
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::string> second = cluster().Submit(Spec());
  ASSERT_TRUE(second.ok()) << second.status();

  ASSERT_GT(disk->Fill(), 0);
  // A submission is refused, saying why, and leaves nothing behind.
  bool refused = false;
  for (int i = 0; i < 50 && !refused; ++i) {
    absl::StatusOr<std::string> job = cluster().Submit(Spec());
    if (!job.ok()) {
      refused = true;
      EXPECT_THAT(job.status().message(), HasSubstr("code 8"));  // RESOURCE_EXHAUSTED
      EXPECT_THAT(job.status().message(), HasSubstr("full"));
    }
  }
  ASSERT_TRUE(refused) << "50 submissions on a full disk all went through";
  const std::string spec_file = cluster().Path("job.yaml");
  WriteFileOrDie(spec_file, "world_size: 1\nmodel: {name: mlp}\n");
  const CommandResult cli = cluster().Aidnctl({"submit", spec_file});
  EXPECT_NE(cli.exit_code, 0);
  EXPECT_THAT(cli.err, HasSubstr("full")) << Describe(cli);
  // Reads go on; a cancel goes through in memory and reaches the disk later.
  EXPECT_EQ(cluster().GetJob(*first).state(), v1::Job::PENDING);
  EXPECT_TRUE(cluster().Cancel(*second, "while the disk was full").ok() ||
              cluster().GetJob(*second).state() == v1::Job::CANCELLED);

  // Space returns: submissions go through again, and the cancel is stored.
  disk->Free();
  EXPECT_TRUE(WaitFor([&] { return cluster().Submit(Spec()).ok(); }, seconds(30),
                      "a submission after space returned"));
  // The tick writes what waited for space.
  const std::string metrics =
      absl::StrCat("http://", cluster().coordinator().metrics_address, "/metrics");
  EXPECT_TRUE(WaitFor(
      [&] {
        return absl::StrContains(RunCommand({"curl", "-s", metrics}).out,
                                 "\naidn_jobs_unstored 0\n");
      },
      seconds(30), "every job stored"));
  ASSERT_TRUE(cluster().RestartCoordinator().ok());
  EXPECT_EQ(cluster().GetJob(*first).state(), v1::Job::PENDING);
  EXPECT_EQ(cluster().GetJob(*second).state(), v1::Job::CANCELLED);
  EXPECT_EQ(IntegrityCheck(cluster().Path("state") + "/coordinator.db"), "ok\n");
}

TEST_F(DiskFullTest, ACheckpointOnAFullDiskFailsTheJobSayingWhyAndTheLastOneStaysValid) {
  std::string why;
  SmallDisk* disk = DiskAt("ckpt", 16, &why);
  if (disk == nullptr) GTEST_SKIP() << "cannot mount a tmpfs here: " << why;
  ASSERT_TRUE(cluster()
                  .StartCoordinator(
                      {"--worker-timeout=3s", "--heartbeat-interval=500ms", "--stop-grace=1s"})
                  .ok());
  ASSERT_TRUE(cluster().StartWorkers(
      {"w"}, {.args = {"--checkpoint-root=" + cluster().Path("ckpt"), "--stop-grace=1s"}}));
  absl::StatusOr<std::string> submitted = cluster().Submit(Spec());
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const std::string job = *submitted;
  ASSERT_TRUE(cluster().WaitForJob(
      job, [](const v1::Job& j) { return j.last_checkpoint_step() >= 200; },
      "two checkpoints committed", kLong));
  ASSERT_GT(disk->Fill(), 0);

  // Every later checkpoint fails; the restart resumes from the last good
  // one and fails again; the job fails naming the cause.
  v1::Job last = cluster().WaitForEnd(job, kLong);
  EXPECT_EQ(last.state(), v1::Job::FAILED) << cluster().EventText(job);
  EXPECT_THAT(last.message(), HasSubstr("checkpoint"));
  EXPECT_THAT(last.message(), HasSubstr("No space left on device"));
  EXPECT_THAT(cluster().EventText(job), HasSubstr("job.resumed"));

  // What the registry holds verifies, and nothing half-written is left.
  const std::vector<v1::Checkpoint> checkpoints = cluster().Checkpoints(job);
  ASSERT_FALSE(checkpoints.empty());
  for (const v1::Checkpoint& c : checkpoints) {
    if (!c.committed()) continue;
    EXPECT_EQ(Sha256Hex(ReadFileOrEmpty(c.path() + "/" + kManifestName)), c.manifest_sha256())
        << c.path();
  }
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(cluster().Path("ckpt"))) {
    EXPECT_FALSE(absl::StartsWith(e.path().filename().string(), ".tmp-")) << e.path();
  }
}

}  // namespace
}  // namespace aidn::testing
