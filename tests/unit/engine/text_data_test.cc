// Byte-level text corpora (worker/engine/text_data.h): loading files and
// directories, the split by position, and the windows a step trains on.

#include "worker/engine/text_data.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "worker/engine/data.h"

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;

class TextDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "aidn_text_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& bytes) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }
  std::string dir_;
};

TEST_F(TextDataTest, LoadsFilesInOrderAndDirectoriesByName) {
  const std::string a = Write("b.txt", "second ");
  const std::string b = Write("a.txt", "first ");
  absl::StatusOr<std::string> files = LoadText({a, b});
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ(*files, "second first ");
  // A directory: its text files in name order; the binary index, the
  // hidden file and the link are left out.
  Write("a.txt.dat", std::string("\0\0\1\2", 4));
  Write(".hidden", "hidden");
  ASSERT_EQ(symlink(a.c_str(), (dir_ + "/c.link").c_str()), 0);
  absl::StatusOr<std::string> dir = LoadText({dir_});
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(*dir, "first second ");
}

TEST_F(TextDataTest, BadPathsNameTheProblem) {
  EXPECT_EQ(LoadText({}).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status missing = LoadText({dir_ + "/nope.txt"}).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("nope.txt"));
  absl::Status binary = LoadText({Write("x.bin", std::string("ab\0c", 4))}).status();
  EXPECT_EQ(binary.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(binary.message(), HasSubstr("x.bin"));
  EXPECT_EQ(LoadText({Write("empty.txt", "")}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TextData, DebiansFortunesCorpusLoadsAsText) {
  // Installed by scripts/setup.sh (package fortunes): the example corpus.
  absl::StatusOr<std::string> text = LoadText({"/usr/share/games/fortunes"});
  ASSERT_TRUE(text.ok()) << text.status() << " (install the Debian package fortunes)";
  EXPECT_GT(text->size(), 2'000'000u);
  EXPECT_EQ(text->find('\0'), std::string::npos);
}

TEST(TextData, SplitKeepsTheLastFractionForValidation) {
  TextSplit split = SplitText("abcdefghij", 0.2);
  EXPECT_EQ(split.train, "abcdefgh");
  EXPECT_EQ(split.val, "ij");
  EXPECT_EQ(SplitText("abc", 0.0).val, "");
}

TEST(TextData, WindowsStayInsideTheTextForEveryShift) {
  std::string text;
  for (int i = 0; i < 103; ++i) text.push_back(static_cast<char>('a' + i % 26));
  constexpr int kBlock = 8;
  const int64_t windows = TextWindowCount(static_cast<int64_t>(text.size()), kBlock);
  EXPECT_EQ(windows, (103 - 8) / 8);
  std::vector<int64_t> all(static_cast<size_t>(windows));
  for (int64_t i = 0; i < windows; ++i) all[static_cast<size_t>(i)] = i;
  std::vector<int32_t> x(all.size() * kBlock), y(all.size() * kBlock);
  for (int64_t shift = 0; shift < kBlock; ++shift) {
    GatherTextWindows(text, shift, kBlock, all, 0, all.size(), x.data(), y.data());
    for (int64_t w = 0; w < windows; ++w) {
      for (int t = 0; t < kBlock; ++t) {
        const size_t at = static_cast<size_t>(shift + w * kBlock + t);
        ASSERT_EQ(x[static_cast<size_t>(w * kBlock + t)], text[at]);
        ASSERT_EQ(y[static_cast<size_t>(w * kBlock + t)], text[at + 1]);
      }
    }
  }
  EXPECT_EQ(TextWindowCount(15, 8), 0);
}

TEST(TextData, ShiftsComeFromSeedAndEpoch) {
  std::set<int64_t> shifts;
  for (int64_t epoch = 0; epoch < 20; ++epoch) {
    const int64_t s = TextWindowShift(1, epoch, 64);
    EXPECT_EQ(s, TextWindowShift(1, epoch, 64));
    EXPECT_GE(s, 0);
    EXPECT_LT(s, 64);
    shifts.insert(s);
  }
  EXPECT_GT(shifts.size(), 10u);
  EXPECT_NE(TextWindowShift(1, 0, 1 << 20), TextWindowShift(2, 0, 1 << 20));
}

TEST(TextData, RanksTakeDisjointWindowsEachEpoch) {
  const int64_t windows = TextWindowCount(10'000, 32);
  std::set<int64_t> seen;
  for (int rank = 0; rank < 3; ++rank) {
    DistributedSampler sampler(windows, 3, rank, /*shuffle=*/true, /*seed=*/5,
                               /*drop_last=*/true);
    for (int64_t w : sampler.EpochIndices(2)) EXPECT_TRUE(seen.insert(w).second) << w;
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), windows / 3 * 3);
}

TEST(TextDataDeathTest, WindowsBeyondTheTextAbort) {
  const std::string text(64, 'a');
  std::vector<int32_t> x(8), y(8);
  EXPECT_DEATH(GatherTextWindows(text, 0, 8, {TextWindowCount(64, 8)}, 0, 1, x.data(), y.data()),
               "window");
}

}  // namespace
}  // namespace aidn::engine
