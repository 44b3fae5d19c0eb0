#ifndef AIDN_WORKER_ENGINE_HALF_H_
#define AIDN_WORKER_ENGINE_HALF_H_

// 16-bit floats on the CPU, for compressed gradient buckets: IEEE fp16
// (binary16) and bfloat16, held as uint16_t. Conversions from float round
// to nearest even (as CUDA's __float2half_rn and __float2bfloat16 do);
// fp16 overflows to infinity, NaN stays NaN.

#include <bit>
#include <cstddef>
#include <cstdint>

namespace aidn::engine {

enum class HalfFormat { kFp16, kBf16 };

inline const char* HalfFormatName(HalfFormat format) {
  return format == HalfFormat::kFp16 ? "fp16" : "bf16";
}

// Every path computed and one selected, without branches, so that the
// bulk conversions (half.cc) vectorise. After F. Giesen's
// float_to_half_fast3_rtne and half_to_float.
inline uint16_t FloatToFp16(float value) {
  constexpr uint32_t kInf = 255u << 23;
  constexpr uint32_t kFp16Max = (127u + 16u) << 23;  // 65536: infinity from here
  constexpr uint32_t kDenormMagic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t u = std::bit_cast<uint32_t>(value);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t special = u > kInf ? 0x7e00u : 0x7c00u;
  // A subnormal half (or zero): the float addition rounds to nearest even.
  const uint32_t sub =
      std::bit_cast<uint32_t>(std::bit_cast<float>(u) + std::bit_cast<float>(kDenormMagic)) -
      kDenormMagic;
  const uint32_t normal =
      (u + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t out = u >= kFp16Max ? special : (u < (113u << 23) ? sub : normal);
  return static_cast<uint16_t>(out | (sign >> 16));
}

inline float Fp16ToFloat(uint16_t half) {
  constexpr uint32_t kShiftedExp = 0x7c00u << 13;
  const uint32_t u = ((half & 0x7fffu) << 13) + ((127u - 15u) << 23);
  const uint32_t exp = (half & 0x7c00u) << 13;
  const uint32_t special = u + ((128u - 16u) << 23);  // infinity or NaN
  // A subnormal: renormalised by a subtraction.
  const uint32_t sub = std::bit_cast<uint32_t>(std::bit_cast<float>(u + (1u << 23)) -
                                               std::bit_cast<float>(113u << 23));
  const uint32_t out = exp == kShiftedExp ? special : (exp == 0 ? sub : u);
  return std::bit_cast<float>(out | (static_cast<uint32_t>(half & 0x8000u) << 16));
}

inline uint16_t FloatToBf16(float value) {
  const uint32_t u = std::bit_cast<uint32_t>(value);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  // A mask rather than a select: GCC vectorises integer arithmetic.
  const uint32_t is_nan = 0u - static_cast<uint32_t>((u & 0x7fffffffu) > 0x7f800000u);
  return static_cast<uint16_t>((nan & is_nan) | (rounded & ~is_nan));
}

inline float Bf16ToFloat(uint16_t half) {
  return std::bit_cast<float>(static_cast<uint32_t>(half) << 16);
}

inline uint16_t FloatToHalf(float value, HalfFormat format) {
  return format == HalfFormat::kFp16 ? FloatToFp16(value) : FloatToBf16(value);
}
inline float HalfToFloat(uint16_t half, HalfFormat format) {
  return format == HalfFormat::kFp16 ? Fp16ToFloat(half) : Bf16ToFloat(half);
}

// Bulk conversions (half.cc; vectorised, as the scalar ones round):
// out[i] = half(in[i] * scale); out[i] = float(in[i]); acc[i] += float(in[i]);
// out[i] = half(float(a[i]) + float(b[i])).
void ToHalf(const float* in, size_t count, float scale, HalfFormat format, uint16_t* out);
void FromHalf(const uint16_t* in, size_t count, HalfFormat format, float* out);
void AddHalves(const uint16_t* in, size_t count, HalfFormat format, float* acc);
void SumHalves(const uint16_t* a, const uint16_t* b, size_t count, HalfFormat format,
               uint16_t* out);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_HALF_H_
