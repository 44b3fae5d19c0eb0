#include "worker/engine/half.h"

#include "worker/engine/simd.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace aidn::engine {
namespace {

// Loops in fixed blocks, so that -O2 vectorises every clone (simd.h).
constexpr size_t kBlock = 16;

// The scalar conversions of half.h without branches (every path computed,
// one selected), so that GCC vectorises the loops; the same bits.
inline uint16_t Fp16Of(float value) {
  constexpr uint32_t kInf = 255u << 23;
  constexpr uint32_t kFp16Max = (127u + 16u) << 23;
  constexpr uint32_t kDenormMagic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t u = std::bit_cast<uint32_t>(value);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t special = u > kInf ? 0x7e00u : 0x7c00u;
  const uint32_t sub =
      std::bit_cast<uint32_t>(std::bit_cast<float>(u) + std::bit_cast<float>(kDenormMagic)) -
      kDenormMagic;
  const uint32_t normal =
      (u + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t out = u >= kFp16Max ? special : (u < (113u << 23) ? sub : normal);
  return static_cast<uint16_t>(out | (sign >> 16));
}

inline float FloatOfFp16(uint16_t half) {
  constexpr uint32_t kShiftedExp = 0x7c00u << 13;
  const uint32_t u = ((half & 0x7fffu) << 13) + ((127u - 15u) << 23);
  const uint32_t exp = (half & 0x7c00u) << 13;
  const uint32_t special = u + ((128u - 16u) << 23);
  const uint32_t sub = std::bit_cast<uint32_t>(std::bit_cast<float>(u + (1u << 23)) -
                                               std::bit_cast<float>(113u << 23));
  const uint32_t out = exp == kShiftedExp ? special : (exp == 0 ? sub : u);
  return std::bit_cast<float>(out | (static_cast<uint32_t>(half & 0x8000u) << 16));
}

inline uint16_t Bf16Of(float value) {
  const uint32_t u = std::bit_cast<uint32_t>(value);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  // A mask rather than a select: GCC vectorises integer arithmetic.
  const uint32_t is_nan = 0u - static_cast<uint32_t>((u & 0x7fffffffu) > 0x7f800000u);
  return static_cast<uint16_t>((nan & is_nan) | (rounded & ~is_nan));
}

inline float FloatOfBf16(uint16_t half) {
  return std::bit_cast<float>(static_cast<uint32_t>(half) << 16);
}

AIDN_VECTOR_CLONES void ToFp16(const float* __restrict in, size_t n, float scale,
                               uint16_t* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) out[i + j] = Fp16Of(in[i + j] * scale);
  }
  for (; i < n; ++i) out[i] = Fp16Of(in[i] * scale);
}
AIDN_VECTOR_CLONES void ToBf16(const float* __restrict in, size_t n, float scale,
                               uint16_t* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) out[i + j] = Bf16Of(in[i + j] * scale);
  }
  for (; i < n; ++i) out[i] = Bf16Of(in[i] * scale);
}
AIDN_VECTOR_CLONES void FromFp16(const uint16_t* __restrict in, size_t n, float* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) out[i + j] = FloatOfFp16(in[i + j]);
  }
  for (; i < n; ++i) out[i] = FloatOfFp16(in[i]);
}
AIDN_VECTOR_CLONES void FromBf16(const uint16_t* __restrict in, size_t n, float* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) out[i + j] = FloatOfBf16(in[i + j]);
  }
  for (; i < n; ++i) out[i] = FloatOfBf16(in[i]);
}
AIDN_VECTOR_CLONES void AddFp16(const uint16_t* __restrict in, size_t n, float* __restrict acc) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) acc[i + j] += FloatOfFp16(in[i + j]);
  }
  for (; i < n; ++i) acc[i] += FloatOfFp16(in[i]);
}
AIDN_VECTOR_CLONES void AddBf16(const uint16_t* __restrict in, size_t n, float* __restrict acc) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) acc[i + j] += FloatOfBf16(in[i + j]);
  }
  for (; i < n; ++i) acc[i] += FloatOfBf16(in[i]);
}
// (out may alias a or b: Gloo's reduction callback.)
AIDN_VECTOR_CLONES void SumFp16(const uint16_t* a, const uint16_t* b, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j)
      out[i + j] = Fp16Of(FloatOfFp16(a[i + j]) + FloatOfFp16(b[i + j]));
  }
  for (; i < n; ++i) out[i] = Fp16Of(FloatOfFp16(a[i]) + FloatOfFp16(b[i]));
}
AIDN_VECTOR_CLONES void SumBf16(const uint16_t* a, const uint16_t* b, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j)
      out[i + j] = Bf16Of(FloatOfBf16(a[i + j]) + FloatOfBf16(b[i + j]));
  }
  for (; i < n; ++i) out[i] = Bf16Of(FloatOfBf16(a[i]) + FloatOfBf16(b[i]));
}

#if defined(__x86_64__) && defined(__GNUC__)
// fp16 through the F16C instructions, 8 at a time (round to nearest even,
// as above; only a NaN's payload may differ: any NaN stays one), the tail
// as above.
#define AIDN_F16C __attribute__((target("avx2,f16c")))
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

AIDN_F16C void ToFp16F16c(const float* in, size_t n, float scale, uint16_t* out) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(in + i), s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(x, kRound));
  }
  for (; i < n; ++i) out[i] = Fp16Of(in[i] * scale);
}
AIDN_F16C void FromFp16F16c(const uint16_t* in, size_t n, float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  for (; i < n; ++i) out[i] = FloatOfFp16(in[i]);
}
AIDN_F16C void AddFp16F16c(const uint16_t* in, size_t n, float* acc) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), x));
  }
  for (; i < n; ++i) acc[i] += FloatOfFp16(in[i]);
}
AIDN_F16C void SumFp16F16c(const uint16_t* a, const uint16_t* b, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_add_ps(x, y), kRound));
  }
  for (; i < n; ++i) out[i] = Fp16Of(FloatOfFp16(a[i]) + FloatOfFp16(b[i]));
}

bool HaveF16c() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return have;
}
#else
bool HaveF16c() { return false; }
void ToFp16F16c(const float*, size_t, float, uint16_t*) {}
void FromFp16F16c(const uint16_t*, size_t, float*) {}
void AddFp16F16c(const uint16_t*, size_t, float*) {}
void SumFp16F16c(const uint16_t*, const uint16_t*, size_t, uint16_t*) {}
#endif

}  // namespace

void ToHalf(const float* in, size_t count, float scale, HalfFormat format, uint16_t* out) {
  if (format == HalfFormat::kBf16) return ToBf16(in, count, scale, out);
  HaveF16c() ? ToFp16F16c(in, count, scale, out) : ToFp16(in, count, scale, out);
}

void FromHalf(const uint16_t* in, size_t count, HalfFormat format, float* out) {
  if (format == HalfFormat::kBf16) return FromBf16(in, count, out);
  HaveF16c() ? FromFp16F16c(in, count, out) : FromFp16(in, count, out);
}

void AddHalves(const uint16_t* in, size_t count, HalfFormat format, float* acc) {
  if (format == HalfFormat::kBf16) return AddBf16(in, count, acc);
  HaveF16c() ? AddFp16F16c(in, count, acc) : AddFp16(in, count, acc);
}

void SumHalves(const uint16_t* a, const uint16_t* b, size_t count, HalfFormat format,
               uint16_t* out) {
  if (format == HalfFormat::kBf16) return SumBf16(a, b, count, out);
  HaveF16c() ? SumFp16F16c(a, b, count, out) : SumFp16(a, b, count, out);
}

}  // namespace aidn::engine
