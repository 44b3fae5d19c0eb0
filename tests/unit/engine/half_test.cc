#include "worker/engine/half.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace aidn::engine::half_test {
namespace {

TEST(Fp16, KnownValuesRoundToNearestEven) {
  EXPECT_EQ(FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFp16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  // Halfway between 65504 and the next (65536): ties to even, infinity.
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToFp16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(1e9f), 0x7c00);
  EXPECT_EQ(FloatToFp16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(FloatToFp16(std::numeric_limits<float>::quiet_NaN()) & 0x7c00, 0x7c00);
  EXPECT_NE(FloatToFp16(std::numeric_limits<float>::quiet_NaN()) & 0x03ff, 0);
  EXPECT_EQ(FloatToFp16(1.0f / 3.0f), 0x3555);
  // Subnormals: 2^-24 is the smallest; 2^-25 ties to even (0), 3 x 2^-26
  // rounds up.
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToFp16(3 * std::ldexp(1.0f, -26)), 0x0001);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -14)), 0x0400);
  // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: even (1).
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(FloatToFp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
}

TEST(Fp16, EveryHalfSurvivesTheRoundTrip) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t half = static_cast<uint16_t>(h);
    const float f = Fp16ToFloat(half);
    if ((half & 0x7c00) == 0x7c00 && (half & 0x03ff) != 0) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
      continue;
    }
    ASSERT_EQ(FloatToFp16(f), half) << std::hex << h << " " << f;
  }
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFloat(0x3555), 0.333251953125f);
}

TEST(Bf16, KnownValuesRoundToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  // Ties to even, either way.
  EXPECT_EQ(FloatToBf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);
  EXPECT_EQ(FloatToBf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);
  EXPECT_EQ(FloatToBf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(FloatToBf16(3e38f), 0x7f62);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to infinity
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Bf16, EveryHalfSurvivesTheRoundTrip) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t half = static_cast<uint16_t>(h);
    const float f = Bf16ToFloat(half);
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f), half) << std::hex << h;
  }
}

TEST(Half, ToHalfScalesBeforeRounding) {
  const float in[3] = {70000.0f, 1.0f, -3.0f};
  uint16_t out[3];
  ToHalf(in, 3, 0.5f, HalfFormat::kFp16, out);
  float back[3];
  FromHalf(out, 3, HalfFormat::kFp16, back);
  // 70000 overflows fp16; halved first it does not.
  EXPECT_EQ(back[0], 35008.0f);
  EXPECT_EQ(back[1], 0.5f);
  EXPECT_EQ(back[2], -1.5f);
}

}  // namespace
}  // namespace aidn::engine::half_test
