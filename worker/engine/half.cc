#include "worker/engine/half.h"

#include "worker/engine/simd.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace aidn::engine {
namespace {

// Loops in fixed blocks, so that -O2 vectorises every clone (simd.h).
constexpr size_t kBlock = 16;

AIDN_VECTOR_CLONES void ToFp16(const float* __restrict in, size_t n, float scale,
                               uint16_t* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) out[i + j] = FloatToFp16(in[i + j] * scale);
  }
  for (; i < n; ++i) out[i] = FloatToFp16(in[i] * scale);
}
AIDN_VECTOR_CLONES void ToBf16(const float* __restrict in, size_t n, float scale,
                               uint16_t* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) out[i + j] = FloatToBf16(in[i + j] * scale);
  }
  for (; i < n; ++i) out[i] = FloatToBf16(in[i] * scale);
}
AIDN_VECTOR_CLONES void FromFp16(const uint16_t* __restrict in, size_t n, float* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) out[i + j] = Fp16ToFloat(in[i + j]);
  }
  for (; i < n; ++i) out[i] = Fp16ToFloat(in[i]);
}
AIDN_VECTOR_CLONES void FromBf16(const uint16_t* __restrict in, size_t n, float* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) out[i + j] = Bf16ToFloat(in[i + j]);
  }
  for (; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}
AIDN_VECTOR_CLONES void AddFp16(const uint16_t* __restrict in, size_t n, float* __restrict acc) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) acc[i + j] += Fp16ToFloat(in[i + j]);
  }
  for (; i < n; ++i) acc[i] += Fp16ToFloat(in[i]);
}
AIDN_VECTOR_CLONES void AddBf16(const uint16_t* __restrict in, size_t n, float* __restrict acc) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) acc[i + j] += Bf16ToFloat(in[i + j]);
  }
  for (; i < n; ++i) acc[i] += Bf16ToFloat(in[i]);
}
// (out may alias a or b: Gloo's reduction callback.)
AIDN_VECTOR_CLONES void SumFp16(const uint16_t* a, const uint16_t* b, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j)
      out[i + j] = FloatToFp16(Fp16ToFloat(a[i + j]) + Fp16ToFloat(b[i + j]));
  }
  for (; i < n; ++i) out[i] = FloatToFp16(Fp16ToFloat(a[i]) + Fp16ToFloat(b[i]));
}
AIDN_VECTOR_CLONES void SumBf16(const uint16_t* a, const uint16_t* b, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j)
      out[i + j] = FloatToBf16(Bf16ToFloat(a[i + j]) + Bf16ToFloat(b[i + j]));
  }
  for (; i < n; ++i) out[i] = FloatToBf16(Bf16ToFloat(a[i]) + Bf16ToFloat(b[i]));
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
  for (; i < n; ++i) out[i] = FloatToFp16(in[i] * scale);
}
AIDN_F16C void FromFp16F16c(const uint16_t* in, size_t n, float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  for (; i < n; ++i) out[i] = Fp16ToFloat(in[i]);
}
AIDN_F16C void AddFp16F16c(const uint16_t* in, size_t n, float* acc) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), x));
  }
  for (; i < n; ++i) acc[i] += Fp16ToFloat(in[i]);
}
AIDN_F16C void SumFp16F16c(const uint16_t* a, const uint16_t* b, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_add_ps(x, y), kRound));
  }
  for (; i < n; ++i) out[i] = FloatToFp16(Fp16ToFloat(a[i]) + Fp16ToFloat(b[i]));
}

// GCC's __builtin_cpu_supports knows "f16c", clang 14's does not: the bit
// is read from CPUID leaf 1 (ECX bit 29); "avx2" also covers the OS saving
// the YMM registers.
bool HaveF16c() {
  static const bool have = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    return __builtin_cpu_supports("avx2") && (ecx & bit_F16C) != 0;
  }();
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
