#include "worker/engine/half.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

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

// The bulk conversions (vectorised, without branches) give the scalar
// ones' bits: every half, and floats across every binade, NaN, infinities
// and fp32 subnormals.
TEST(Half, BulkConversionsMatchTheScalarOnes) {
  std::vector<uint16_t> halves(65536);
  for (uint32_t h = 0; h <= 0xffff; ++h) halves[h] = static_cast<uint16_t>(h);
  std::vector<float> floats;
  std::mt19937 gen(3);
  for (int i = 0; i < 200'000; ++i)
    floats.push_back(std::bit_cast<float>(static_cast<uint32_t>(gen())));
  for (float f : {0.0f, -0.0f, 65504.0f, 65520.0f, 1e-8f, std::ldexp(1.0f, -25),
                  std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::denorm_min()}) {
    floats.push_back(f);
  }
  for (HalfFormat format : {HalfFormat::kFp16, HalfFormat::kBf16}) {
    std::vector<float> wide(halves.size());
    FromHalf(halves.data(), halves.size(), format, wide.data());
    for (size_t i = 0; i < halves.size(); ++i) {
      const float want = HalfToFloat(halves[i], format);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(wide[i]));
        continue;
      }
      ASSERT_EQ(std::bit_cast<uint32_t>(wide[i]), std::bit_cast<uint32_t>(want))
          << HalfFormatName(format) << " " << std::hex << i;
    }
    std::vector<uint16_t> narrow(floats.size());
    ToHalf(floats.data(), floats.size(), 1.0f, format, narrow.data());
    for (size_t i = 0; i < floats.size(); ++i) {
      // (A NaN's payload may differ: the F16C instructions keep it.)
      if (std::isnan(floats[i])) {
        ASSERT_TRUE(std::isnan(HalfToFloat(narrow[i], format)));
        continue;
      }
      ASSERT_EQ(narrow[i], FloatToHalf(floats[i], format))
          << HalfFormatName(format) << " " << floats[i];
    }
    std::vector<uint16_t> sum(halves.size());
    std::vector<uint16_t> reversed(halves.rbegin(), halves.rend());
    SumHalves(halves.data(), reversed.data(), halves.size(), format, sum.data());
    std::vector<float> acc(halves.size(), 1.0f);
    AddHalves(halves.data(), halves.size(), format, acc.data());
    for (size_t i = 0; i < halves.size(); ++i) {
      const float a = HalfToFloat(halves[i], format);
      const uint16_t want = FloatToHalf(a + HalfToFloat(reversed[i], format), format);
      if (std::isnan(HalfToFloat(want, format))) continue;
      ASSERT_EQ(sum[i], want) << HalfFormatName(format) << " " << i;
      if (!std::isnan(a)) {
        ASSERT_EQ(acc[i], 1.0f + a);
      }
    }
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
