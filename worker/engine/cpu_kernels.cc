#include "worker/engine/cpu_kernels.h"

// Why the loops look as they do: GCC at -O2 (the RelWithDebInfo default)
// vectorises only loops whose trip count it knows, so the bulk runs in
// fixed blocks of kBlock and the tail in a scalar loop; AIDN_VECTOR_CLONES
// (simd.h) adds AVX2 and AVX-512 versions. The selects load both operands
// unconditionally so they compile to compare-and-mask instead of branches
// (a branch per element mispredicts half the time on ReLU inputs).

#include <algorithm>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "worker/engine/simd.h"

namespace aidn::engine::cpu {

constexpr int64_t kBlock = 16;

AIDN_VECTOR_CLONES void ReluKernel(const float* __restrict x, float* __restrict y, int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] = std::max(x[i + j], 0.0f);
  }
  for (; i < n; ++i) y[i] = std::max(x[i], 0.0f);
}

AIDN_VECTOR_CLONES void ScaledAddReluKernel(const float* __restrict a, float scale,
                                            const float* __restrict b, float* __restrict y,
                                            int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] = std::max(a[i + j] * scale + b[i + j], 0.0f);
  }
  for (; i < n; ++i) y[i] = std::max(a[i] * scale + b[i], 0.0f);
}

// gx = x > 0 ? g : 0
AIDN_VECTOR_CLONES void ReluGradKernel(const float* __restrict x, const float* __restrict g,
                                       float* __restrict gx, int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) {
      const float gj = g[i + j];
      gx[i + j] = x[i + j] > 0.0f ? gj : 0.0f;
    }
  }
  for (; i < n; ++i) {
    const float gi = g[i];
    gx[i] = x[i] > 0.0f ? gi : 0.0f;
  }
}

AIDN_VECTOR_CLONES void ReluInPlace(float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] = std::max(y[i + j], 0.0f);
  }
  for (; i < n; ++i) y[i] = std::max(y[i], 0.0f);
}

// y = max(x + c, 0)
AIDN_VECTOR_CLONES void AddScalarReluKernel(const float* __restrict x, float c, float* __restrict y,
                                            int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] = std::max(x[i + j] + c, 0.0f);
  }
  for (; i < n; ++i) y[i] = std::max(x[i] + c, 0.0f);
}

// y += c
AIDN_VECTOR_CLONES void AddScalarInPlace(float* y, float c, int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] += c;
  }
  for (; i < n; ++i) y[i] += c;
}

// y = max(y + c, 0)
AIDN_VECTOR_CLONES void AddScalarReluInPlace(float* y, float c, int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] = std::max(y[i + j] + c, 0.0f);
  }
  for (; i < n; ++i) y[i] = std::max(y[i] + c, 0.0f);
}

// y = a * b
AIDN_VECTOR_CLONES void MulKernel(const float* __restrict a, const float* __restrict b,
                                  float* __restrict y, int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] = a[i + j] * b[i + j];
  }
  for (; i < n; ++i) y[i] = a[i] * b[i];
}

// y += x
AIDN_VECTOR_CLONES void AccumulateKernel(const float* __restrict x, float* __restrict y,
                                         int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] += x[i + j];
  }
  for (; i < n; ++i) y[i] += x[i];
}

// y = x + c
AIDN_VECTOR_CLONES void AddScalarKernel(const float* __restrict x, float c, float* __restrict y,
                                        int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] = x[i + j] + c;
  }
  for (; i < n; ++i) y[i] = x[i] + c;
}

AIDN_VECTOR_CLONES float SumKernel(const float* __restrict x, int64_t n) {
  float partial[kBlock] = {};
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) partial[j] += x[i + j];
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < kBlock; ++j) sum += partial[j];
  for (; i < n; ++i) sum += x[i];
  return sum;
}

namespace {

// The output columns [lo, hi) whose input column ow * stride - padding + k
// lies inside [0, width); the rest read the zero padding.
void ValidColumns(int64_t k, int64_t stride, int64_t padding, int64_t width, int64_t out_width,
                  int64_t* lo, int64_t* hi) {
  const int64_t first = padding - k;             // ow * stride >= first
  const int64_t last = width - 1 + padding - k;  // ow * stride <= last
  *lo = first <= 0 ? 0 : std::min(out_width, (first + stride - 1) / stride);
  *hi = last < 0 ? 0 : std::min(out_width, last / stride + 1);
  if (*hi < *lo) *hi = *lo;
}

// Copies for the short spans of im2col (an output row: a few to a few dozen
// floats), where a memcpy call costs more than the copy: straight-line code
// of 16-byte pieces, the last one overlapping the one before. (GCC turns a
// copy loop, even one of fixed blocks, back into a memcpy call.)
inline void CopySpan(const float* __restrict src, float* __restrict dst, int64_t n) {
  constexpr size_t k4 = 4 * sizeof(float);
  if (n > 16) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else if (n >= 4) {
    std::memcpy(dst, src, k4);
    if (n > 8) std::memcpy(dst + 4, src + 4, k4);
    if (n > 12) std::memcpy(dst + 8, src + 8, k4);
    std::memcpy(dst + n - 4, src + n - 4, k4);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
  }
}

// The same spans' accumulation for col2im, which cannot overlap: blocks of 8
// and 4, then single floats.
inline void AddSpan(const float* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int64_t j = 0; j < 8; ++j) dst[i + j] += src[i + j];
  }
  if (i + 4 <= n) {
    for (int64_t j = 0; j < 4; ++j) dst[i + j] += src[i + j];
    i += 4;
  }
  for (; i < n; ++i) dst[i] += src[i];
}

// Each kernel column's valid output columns [lo, hi) (ValidColumns), for
// kernels up to kMaxKernel wide; wider ones compute them per row.
constexpr int64_t kMaxKernel = 16;
struct ColumnRanges {
  int64_t lo[kMaxKernel];
  int64_t hi[kMaxKernel];
  explicit ColumnRanges(const ConvShape& s) {
    for (int64_t kj = 0; kj < std::min(s.kernel, kMaxKernel); ++kj) {
      ValidColumns(kj, s.stride, s.padding, s.width, s.out_width, &lo[kj], &hi[kj]);
    }
  }
  void Get(const ConvShape& s, int64_t kj, int64_t* l, int64_t* h) const {
    if (kj < kMaxKernel) {
      *l = lo[kj];
      *h = hi[kj];
    } else {
      ValidColumns(kj, s.stride, s.padding, s.width, s.out_width, l, h);
    }
  }
};

// Stride 1 with "same" padding (output as wide as the input: 3x3 with
// padding 1): a kernel row's valid output rows read one contiguous run of
// the input, shifted by kj - padding. One copy of the run, then the
// |shift| columns at the row ends that the shift wrapped into the
// neighbouring input row are zeroed; the copy leaves out the run's first
// or last |shift| values, which would lie outside the plane.
void Im2ColSameRow(const float* __restrict xp, const ConvShape& s, int64_t ki, int64_t kj,
                   float* __restrict d) {
  const int64_t w = s.width;
  const int64_t shift = kj - s.padding;
  const int64_t oh0 = std::clamp<int64_t>(s.padding - ki, 0, s.out_height);
  const int64_t oh1 = std::clamp<int64_t>(s.height + s.padding - ki, oh0, s.out_height);
  std::fill(d, d + oh0 * w, 0.0f);
  std::fill(d + oh1 * w, d + s.out_height * w, 0.0f);
  if (oh1 == oh0) return;
  const int64_t run = (oh1 - oh0) * w;
  const int64_t src = (oh0 - s.padding + ki) * w + shift;
  const int64_t t0 = shift < 0 ? -shift : 0;
  const int64_t t1 = run - (shift > 0 ? shift : 0);
  float* out = d + oh0 * w;
  std::memcpy(out + t0, xp + (src + t0), static_cast<size_t>(t1 - t0) * sizeof(float));
  for (int64_t oh = 0; oh < oh1 - oh0; ++oh) {
    float* r = out + oh * w;
    if (shift < 0) std::fill(r, r - shift, 0.0f);
    if (shift > 0) std::fill(r + w - shift, r + w, 0.0f);
  }
}

}  // namespace

// im2col of one sample x [C, H, W]: row (c, ki, kj), at dst + row * ld,
// column (oh, ow) = x[c, oh*s-p+ki, ow*s-p+kj], or 0 in the padding.
AIDN_VECTOR_CLONES void Im2Col(const float* __restrict x, const ConvShape& s, float* __restrict dst,
                               int64_t ld) {
  const int64_t k = s.kernel;
  const int64_t ow_n = s.out_width;
  const bool same = s.stride == 1 && s.out_width == s.width && s.padding < s.width;
  const ColumnRanges ranges(s);
  for (int64_t c = 0; c < s.channels; ++c) {
    const float* xp = x + c * s.height * s.width;
    for (int64_t ki = 0; ki < k; ++ki) {
      for (int64_t kj = 0; kj < k; ++kj) {
        float* row = dst + ((c * k + ki) * k + kj) * ld;
        if (same) {
          Im2ColSameRow(xp, s, ki, kj, row);
          continue;
        }
        int64_t lo;
        int64_t hi;
        ranges.Get(s, kj, &lo, &hi);
        for (int64_t oh = 0; oh < s.out_height; ++oh) {
          const int64_t ih = oh * s.stride - s.padding + ki;
          float* d = row + oh * ow_n;
          if (ih < 0 || ih >= s.height) {
            std::fill(d, d + ow_n, 0.0f);
            continue;
          }
          // Output column ow reads xp[base + ow * stride]; base + lo * stride >= 0.
          const int64_t base = ih * s.width + kj - s.padding;
          std::fill(d, d + lo, 0.0f);
          if (s.stride == 1) {
            CopySpan(xp + base + lo, d + lo, hi - lo);
          } else {
            for (int64_t ow = lo; ow < hi; ++ow) d[ow] = xp[base + ow * s.stride];
          }
          std::fill(d + hi, d + ow_n, 0.0f);
        }
      }
    }
  }
}

// The adjoint of Im2Col: adds each column entry back onto the input element
// it was read from. `gx` [C, H, W] must hold zeros (or what to add to).
AIDN_VECTOR_CLONES void Col2Im(const float* __restrict src, int64_t ld, const ConvShape& s,
                               float* __restrict gx) {
  const int64_t k = s.kernel;
  const int64_t ow_n = s.out_width;
  const ColumnRanges ranges(s);
  for (int64_t c = 0; c < s.channels; ++c) {
    float* xp = gx + c * s.height * s.width;
    for (int64_t ki = 0; ki < k; ++ki) {
      // The output rows whose input row ih = oh * stride - padding + ki is
      // in the plane.
      const int64_t first = s.padding - ki;
      const int64_t oh0 =
          std::clamp<int64_t>(first <= 0 ? 0 : (first + s.stride - 1) / s.stride, 0, s.out_height);
      const int64_t last = s.height - 1 + s.padding - ki;
      const int64_t oh1 =
          last < 0 ? oh0 : std::clamp<int64_t>(last / s.stride + 1, oh0, s.out_height);
      for (int64_t kj = 0; kj < k; ++kj) {
        int64_t lo;
        int64_t hi;
        ranges.Get(s, kj, &lo, &hi);
        const float* row = src + ((c * k + ki) * k + kj) * ld;
        for (int64_t oh = oh0; oh < oh1; ++oh) {
          const int64_t ih = oh * s.stride - s.padding + ki;
          const float* r = row + oh * ow_n;
          const int64_t base = ih * s.width + kj - s.padding;
          if (s.stride == 1) {
            AddSpan(r + lo, xp + base + lo, hi - lo);
          } else {
            for (int64_t ow = lo; ow < hi; ++ow) xp[base + ow * s.stride] += r[ow];
          }
        }
      }
    }
  }
}

// MaxPool2d with kernel 2 and stride 2 (the CNN's), one plane [h, w] ->
// [h/2, w/2]: each output the first maximum of its window in row-major
// order (strictly greater replaces), `arg` its offset in the plane.
void MaxPool2x2Plane(const float* __restrict x, int64_t h, int64_t w, float* __restrict y,
                     int32_t* __restrict arg) {
  const int64_t oh = h / 2;
  const int64_t ow = w / 2;
  for (int64_t i = 0; i < oh; ++i) {
    const float* r0 = x + 2 * i * w;
    const float* r1 = r0 + w;
    float* yi = y + i * ow;
    int32_t* ai = arg + i * ow;
    const int32_t top = static_cast<int32_t>(2 * i * w);
    int64_t j = 0;
#if defined(__SSE2__)
    // Four windows at a time: even and odd columns of both rows, then the
    // same compare-and-select chain as the scalar loop below.
    const __m128i step = _mm_set_epi32(6, 4, 2, 0);
    const __m128i one = _mm_set1_epi32(1);
    const __m128i down = _mm_set1_epi32(static_cast<int32_t>(w));
    // The last block overlaps the one before rather than leaving a scalar
    // tail (whose compares are data-dependent branches); recomputing a
    // window writes the same output.
    for (; ow >= 4 && j < ow; j += 4) {
      if (j + 4 > ow) j = ow - 4;
      const __m128 a0 = _mm_loadu_ps(r0 + 2 * j);
      const __m128 a1 = _mm_loadu_ps(r0 + 2 * j + 4);
      const __m128 b0 = _mm_loadu_ps(r1 + 2 * j);
      const __m128 b1 = _mm_loadu_ps(r1 + 2 * j + 4);
      const __m128 tl = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
      const __m128 tr = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1));
      const __m128 bl = _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(2, 0, 2, 0));
      const __m128 br = _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 1, 3, 1));
      const __m128i off_tl = _mm_add_epi32(_mm_set1_epi32(top + static_cast<int32_t>(2 * j)), step);
      const __m128i off_tr = _mm_add_epi32(off_tl, one);
      const __m128i off_bl = _mm_add_epi32(off_tl, down);
      const __m128i off_br = _mm_add_epi32(off_bl, one);
      __m128 best = tl;
      __m128i best_off = off_tl;
      __m128 m = _mm_cmpgt_ps(tr, best);
      __m128i mi = _mm_castps_si128(m);
      best = _mm_or_ps(_mm_and_ps(m, tr), _mm_andnot_ps(m, best));
      best_off = _mm_or_si128(_mm_and_si128(mi, off_tr), _mm_andnot_si128(mi, best_off));
      m = _mm_cmpgt_ps(bl, best);
      mi = _mm_castps_si128(m);
      best = _mm_or_ps(_mm_and_ps(m, bl), _mm_andnot_ps(m, best));
      best_off = _mm_or_si128(_mm_and_si128(mi, off_bl), _mm_andnot_si128(mi, best_off));
      m = _mm_cmpgt_ps(br, best);
      mi = _mm_castps_si128(m);
      best = _mm_or_ps(_mm_and_ps(m, br), _mm_andnot_ps(m, best));
      best_off = _mm_or_si128(_mm_and_si128(mi, off_br), _mm_andnot_si128(mi, best_off));
      _mm_storeu_ps(yi + j, best);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ai + j), best_off);
    }
#endif
    for (; j < ow; ++j) {
      int32_t best_off = top + static_cast<int32_t>(2 * j);
      float best = r0[2 * j];
      if (r0[2 * j + 1] > best) {
        best = r0[2 * j + 1];
        best_off = top + static_cast<int32_t>(2 * j + 1);
      }
      if (r1[2 * j] > best) {
        best = r1[2 * j];
        best_off = top + static_cast<int32_t>(w + 2 * j);
      }
      if (r1[2 * j + 1] > best) {
        best = r1[2 * j + 1];
        best_off = top + static_cast<int32_t>(w + 2 * j + 1);
      }
      yi[j] = best;
      ai[j] = best_off;
    }
  }
}

// The backward of MaxPool2x2Plane: writes every element of the input
// gradient plane (the windows do not overlap), the window's winner gets its
// output's gradient and everything else 0, so no zeroing pass is needed.
// With `y` (the pooled outputs) not null, a ReLU before the pool is folded
// in: an output's gradient passes only where y > 0 (the winner's input was
// positive).
void MaxPool2x2PlaneBackward(const float* __restrict g, const float* __restrict y,
                             const int32_t* __restrict arg, int64_t h, int64_t w,
                             float* __restrict gx) {
  const int64_t oh = h / 2;
  const int64_t ow = w / 2;
  for (int64_t i = 0; i < oh; ++i) {
    float* r0 = gx + 2 * i * w;
    float* r1 = r0 + w;
    const float* gi = g + i * ow;
    const int32_t* ai = arg + i * ow;
    const int32_t top = static_cast<int32_t>(2 * i * w);
    int64_t j = 0;
#if defined(__SSE2__)
    const __m128i step = _mm_set_epi32(6, 4, 2, 0);
    const __m128i one = _mm_set1_epi32(1);
    const __m128i down = _mm_set1_epi32(static_cast<int32_t>(w));
    const float* yi = y != nullptr ? y + i * ow : nullptr;
    // As in MaxPool2x2Plane, an overlapping last block (rewriting the same
    // values) instead of a scalar tail.
    for (; ow >= 4 && j < ow; j += 4) {
      if (j + 4 > ow) j = ow - 4;
      __m128 gv = _mm_loadu_ps(gi + j);
      if (yi != nullptr) gv = _mm_and_ps(_mm_cmpgt_ps(_mm_loadu_ps(yi + j), _mm_setzero_ps()), gv);
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ai + j));
      const __m128i off_tl = _mm_add_epi32(_mm_set1_epi32(top + static_cast<int32_t>(2 * j)), step);
      const __m128i off_bl = _mm_add_epi32(off_tl, down);
      const __m128 tl = _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(a, off_tl)), gv);
      const __m128 tr =
          _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(a, _mm_add_epi32(off_tl, one))), gv);
      const __m128 bl = _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(a, off_bl)), gv);
      const __m128 br =
          _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(a, _mm_add_epi32(off_bl, one))), gv);
      _mm_storeu_ps(r0 + 2 * j, _mm_unpacklo_ps(tl, tr));
      _mm_storeu_ps(r0 + 2 * j + 4, _mm_unpackhi_ps(tl, tr));
      _mm_storeu_ps(r1 + 2 * j, _mm_unpacklo_ps(bl, br));
      _mm_storeu_ps(r1 + 2 * j + 4, _mm_unpackhi_ps(bl, br));
    }
#endif
    for (; j < ow; ++j) {
      const int32_t a = ai[j] - top - static_cast<int32_t>(2 * j);
      const float gj = gi[j];
      const float gv = y == nullptr || y[i * ow + j] > 0.0f ? gj : 0.0f;
      r0[2 * j] = a == 0 ? gv : 0.0f;
      r0[2 * j + 1] = a == 1 ? gv : 0.0f;
      r1[2 * j] = a == w ? gv : 0.0f;
      r1[2 * j + 1] = a == w + 1 ? gv : 0.0f;
    }
    // An odd width leaves a column no window reads.
    if (w % 2 != 0) {
      r0[w - 1] = 0.0f;
      r1[w - 1] = 0.0f;
    }
  }
  // And an odd height a row.
  if (h % 2 != 0) std::fill(gx + (h - 1) * w, gx + h * w, 0.0f);
}

void MaxPoolPlane(const float* __restrict x, int64_t w, int64_t kernel, int64_t stride, int64_t oh,
                  int64_t ow, float* __restrict y, int32_t* __restrict arg) {
  for (int64_t i = 0; i < oh; ++i) {
    for (int64_t j = 0; j < ow; ++j) {
      const int64_t top = i * stride;
      const int64_t left = j * stride;
      int64_t best = top * w + left;
      float best_value = x[best];
      for (int64_t ki = 0; ki < kernel; ++ki) {
        for (int64_t kj = 0; kj < kernel; ++kj) {
          const int64_t idx = (top + ki) * w + left + kj;
          // Strictly greater: the first maximum wins, as in torch.
          if (x[idx] > best_value) {
            best_value = x[idx];
            best = idx;
          }
        }
      }
      const int64_t out_idx = i * ow + j;
      y[out_idx] = best_value;
      arg[out_idx] = static_cast<int32_t>(best);
    }
  }
}

void MaxPoolPlaneBackward(const float* __restrict g, const int32_t* __restrict arg,
                          int64_t out_plane, float* __restrict gx) {
  for (int64_t i = 0; i < out_plane; ++i) {
    // += : windows may overlap when stride < kernel.
    gx[arg[i]] += g[i];
  }
}

void DropoutMask(std::mt19937_64& rng, double p, float* m, int64_t n) {
  // Two 32-bit uniforms per 64-bit draw; keep when u < (1-p) 2^32.
  const uint64_t threshold = static_cast<uint64_t>((1.0 - p) * 4294967296.0);
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  int64_t i = 0;
  // Arithmetic rather than a select: a random branch mispredicts often.
  for (; i + 1 < n; i += 2) {
    const uint64_t r = rng();
    m[i] = scale * static_cast<float>((r & 0xffffffffu) < threshold);
    m[i + 1] = scale * static_cast<float>((r >> 32) < threshold);
  }
  if (i < n) m[i] = scale * static_cast<float>((rng() & 0xffffffffu) < threshold);
}

}  // namespace aidn::engine::cpu
