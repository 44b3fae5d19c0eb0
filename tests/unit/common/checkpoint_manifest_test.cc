#include "common/checkpoint_manifest.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn {
namespace {

using ::testing::HasSubstr;

TEST(Crc32c, MatchesTheStandardCheckValues) {
  // RFC 3720 B.4 and the usual "123456789" check value.
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  const std::string ones(32, '\xff');
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);
}

TEST(Crc32c, ExtendsAcrossPiecesOfAnyAlignment) {
  std::string text;
  for (int i = 0; i < 1000; ++i) text.push_back(static_cast<char>(i * 7 + 3));
  const uint32_t whole = Crc32c(text.data(), text.size());
  for (size_t cut : {1u, 3u, 8u, 13u, 999u}) {
    EXPECT_EQ(Crc32c(text.data() + cut, text.size() - cut, Crc32c(text.data(), cut)), whole) << cut;
  }
}

TEST(Manifest, FormatsAndParsesBack) {
  Manifest m;
  m.step = 40;
  m.files = {{"model.safetensors", 1086784, 0x3f1a09c2}, {"state.txt", 0, 0}};
  const std::string text = FormatManifest(m);
  EXPECT_EQ(text,
            "aidn-checkpoint 1\nstep 40\nfile model.safetensors 1086784 3f1a09c2\n"
            "file state.txt 0 00000000\n");
  absl::StatusOr<Manifest> back = ParseManifest(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->step, 40);
  ASSERT_EQ(back->files.size(), 2u);
  EXPECT_EQ(back->files[0].name, "model.safetensors");
  EXPECT_EQ(back->files[0].bytes, 1086784);
  EXPECT_EQ(back->files[0].crc32c, 0x3f1a09c2u);
}

TEST(Manifest, RefusesAnythingMalformed) {
  const std::string good = "aidn-checkpoint 1\nstep 4\nfile a 1 0000000a\n";
  ASSERT_TRUE(ParseManifest(good).ok());
  for (const std::string& bad : {
           std::string(""),
           good.substr(0, good.size() - 1),  // truncated: no final newline
           good.substr(0, good.size() - 5),
           std::string("aidn-checkpoint 2\nstep 4\nfile a 1 0000000a\n"),
           std::string("aidn-checkpoint 1\nfile a 1 0000000a\n"),
           std::string("aidn-checkpoint 1\nstep 4\n"),
           std::string("aidn-checkpoint 1\nstep -4\nfile a 1 0000000a\n"),
           std::string("aidn-checkpoint 1\nstep 4\nfile ../a 1 0000000a\n"),
           std::string("aidn-checkpoint 1\nstep 4\nfile .hidden 1 0000000a\n"),
           std::string("aidn-checkpoint 1\nstep 4\nfile a/b 1 0000000a\n"),
           std::string("aidn-checkpoint 1\nstep 4\nfile a 1 0000000a\nfile a 1 0000000a\n"),
           std::string("aidn-checkpoint 1\nstep 4\nfile a x 0000000a\n"),
           std::string("aidn-checkpoint 1\nstep 4\nfile a 1 zz\n"),
           std::string("aidn-checkpoint 1\nstep 4\nfile a 1 0000000a\nextra\n"),
       }) {
    absl::StatusOr<Manifest> m = ParseManifest(bad);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << bad;
  }
}

class VerifyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/verify-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    Write("a.bin", std::string(1000, 'a'));
    Write("b.bin", "bee");
    Manifest m;
    m.step = 7;
    for (const char* name : {"a.bin", "b.bin"}) {
      absl::StatusOr<FileChecksum> sum = ChecksumFile(absl::StrCat(dir_, "/", name));
      ASSERT_TRUE(sum.ok()) << sum.status();
      m.files.push_back({name, sum->bytes, sum->crc32c});
    }
    Write(kManifestName, FormatManifest(m));
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void Write(const std::string& name, const std::string& text) {
    std::ofstream(absl::StrCat(dir_, "/", name), std::ios::binary) << text;
  }

  std::string dir_;
};

TEST_F(VerifyTest, AcceptsAnIntactDirectory) {
  absl::StatusOr<Manifest> m = VerifyCheckpointDir(dir_);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->step, 7);
}

TEST_F(VerifyTest, NamesATruncatedFile) {
  std::filesystem::resize_file(absl::StrCat(dir_, "/a.bin"), 999);
  absl::Status s = VerifyCheckpointDir(dir_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("a.bin: 999 bytes, the manifest says 1000"));
}

TEST_F(VerifyTest, NamesAFileWithAFlippedBit) {
  Write("a.bin", std::string(500, 'a') + "c" + std::string(499, 'a'));
  absl::Status s = VerifyCheckpointDir(dir_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("a.bin: CRC-32C"));
}

TEST_F(VerifyTest, NamesAMissingFileAndAMissingManifest) {
  std::filesystem::remove(absl::StrCat(dir_, "/b.bin"));
  absl::Status s = VerifyCheckpointDir(dir_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("b.bin: missing"));
  std::filesystem::remove(absl::StrCat(dir_, "/", kManifestName));
  s = VerifyCheckpointDir(dir_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr(kManifestName));
  EXPECT_EQ(VerifyCheckpointDir(dir_ + "/nope").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace aidn
