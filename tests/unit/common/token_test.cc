#include "common/token.h"

#include <set>
#include <string>

#include <gtest/gtest.h>

namespace aidn {
namespace {

TEST(RandomHex, HasTwoLowercaseHexDigitsPerByte) {
  for (size_t bytes : {0u, 1u, 16u, 32u, 1000u}) {
    absl::StatusOr<std::string> hex = RandomHex(bytes);
    ASSERT_TRUE(hex.ok()) << hex.status();
    EXPECT_EQ(hex->size(), 2 * bytes);
    EXPECT_EQ(hex->find_first_not_of("0123456789abcdef"), std::string::npos) << *hex;
  }
}

TEST(RandomHex, UsesEveryHexDigit) {
  // 4096 bytes give 8192 digits; missing one of 16 digits by chance has
  // probability about 16 * (15/16)^8192, i.e. never.
  absl::StatusOr<std::string> hex = RandomHex(4096);
  ASSERT_TRUE(hex.ok()) << hex.status();
  std::set<char> seen(hex->begin(), hex->end());
  EXPECT_EQ(seen.size(), 16u);
}

TEST(RandomHex, GivesDistinctValues) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    absl::StatusOr<std::string> hex = RandomHex(16);
    ASSERT_TRUE(hex.ok()) << hex.status();
    EXPECT_TRUE(seen.insert(*hex).second) << "repeated " << *hex;
  }
}

TEST(ConstantTimeEquals, IsTrueForEqualStrings) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("secret-token", "secret-token"));
  std::string with_nul("a\0b", 3);
  EXPECT_TRUE(ConstantTimeEquals(with_nul, std::string("a\0b", 3)));
}

TEST(ConstantTimeEquals, IsFalseForAnyDifference) {
  EXPECT_FALSE(ConstantTimeEquals("secret-token", "Secret-token"));  // first byte
  EXPECT_FALSE(ConstantTimeEquals("secret-token", "secret-tokeN"));  // last byte
  EXPECT_FALSE(ConstantTimeEquals("secret-token", "secret-toke"));   // prefix
  EXPECT_FALSE(ConstantTimeEquals("secret-token", "secret-tokenx"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0b", 3), std::string("a\0c", 3)));
  // Bytes that differ only in the high bit.
  EXPECT_FALSE(ConstantTimeEquals("\x80", "\x00"));
}

}  // namespace
}  // namespace aidn
