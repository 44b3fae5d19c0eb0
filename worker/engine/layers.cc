#include "worker/engine/layers.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/log.h"
#include "worker/engine/gemm.h"
#include "worker/engine/simd.h"

namespace aidn::engine {
namespace {

int Int(int64_t v) { return static_cast<int>(v); }

// Copies `n` floats.
void Copy(const float* src, float* dst, int64_t n) {
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

// Elementwise kernels. GCC at -O2 (the RelWithDebInfo default) vectorises
// only loops whose trip count it knows, so the bulk runs in fixed blocks of
// kBlock and the tail in a scalar loop; AIDN_VECTOR_CLONES (simd.h) adds
// AVX2 and AVX-512 versions. The selects load both operands
// unconditionally so they compile to compare-and-mask instead of branches
// (a branch per element mispredicts half the time on ReLU inputs).
constexpr int64_t kBlock = 16;

AIDN_VECTOR_CLONES void ReluKernel(const float* __restrict x, float* __restrict y, int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] = std::max(x[i + j], 0.0f);
  }
  for (; i < n; ++i) y[i] = std::max(x[i], 0.0f);
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

// One sample's convolution geometry.
struct ConvShape {
  int64_t channels;
  int64_t height;
  int64_t width;
  int64_t kernel;
  int64_t stride;
  int64_t padding;
  int64_t out_height;
  int64_t out_width;
};

// im2col of one sample x [C, H, W]: row (c, ki, kj), at dst + row * ld,
// column (oh, ow) = x[c, oh*s-p+ki, ow*s-p+kj], or 0 in the padding.
AIDN_VECTOR_CLONES void Im2Col(const float* __restrict x, const ConvShape& s, float* __restrict dst,
                               int64_t ld) {
  const int64_t k = s.kernel;
  const int64_t ow_n = s.out_width;
  for (int64_t c = 0; c < s.channels; ++c) {
    const float* xp = x + c * s.height * s.width;
    for (int64_t ki = 0; ki < k; ++ki) {
      for (int64_t kj = 0; kj < k; ++kj) {
        int64_t lo;
        int64_t hi;
        ValidColumns(kj, s.stride, s.padding, s.width, ow_n, &lo, &hi);
        float* row = dst + ((c * k + ki) * k + kj) * ld;
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
  for (int64_t c = 0; c < s.channels; ++c) {
    float* xp = gx + c * s.height * s.width;
    for (int64_t ki = 0; ki < k; ++ki) {
      for (int64_t kj = 0; kj < k; ++kj) {
        int64_t lo;
        int64_t hi;
        ValidColumns(kj, s.stride, s.padding, s.width, ow_n, &lo, &hi);
        const float* row = src + ((c * k + ki) * k + kj) * ld;
        for (int64_t oh = 0; oh < s.out_height; ++oh) {
          const int64_t ih = oh * s.stride - s.padding + ki;
          if (ih < 0 || ih >= s.height) continue;
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

std::string FormatDouble(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

void EnsureShape(Tensor* t, std::initializer_list<int64_t> shape) {
  const std::vector<int64_t>& have = t->shape();
  if (!std::equal(have.begin(), have.end(), shape.begin(), shape.end())) {
    t->Resize(std::vector<int64_t>(shape));
  }
}

void EnsureShape(Tensor* t, const std::vector<int64_t>& shape) {
  if (t->shape() != shape) t->Resize(shape);
}

// ---------------------------------------------------------------- Linear

Linear::Linear(int64_t in_features, int64_t out_features)
    : in_(in_features),
      out_(out_features),
      weight_{"weight", Tensor({out_features, in_features}), Tensor({out_features, in_features})},
      bias_{"bias", Tensor({out_features}), Tensor({out_features})} {
  AIDN_CHECK(in_ > 0 && out_ > 0) << "Linear(" << in_ << ", " << out_ << ")";
}

std::string Linear::Describe() const {
  return "Linear(in_features=" + std::to_string(in_) + ", out_features=" + std::to_string(out_) +
         ", bias=True)";
}

void Linear::Forward(const Tensor& input, Tensor* output, bool /*training*/) {
  AIDN_CHECK(input.rank() == 2 && input.dim(1) == in_)
      << Describe() << " got input " << input.ShapeString();
  const int64_t n = input.dim(0);
  EnsureShape(output, {n, out_});
  input_ = &input;
  if (n == 0) return;
  // The bias is written first and the GEMM accumulates onto it (beta = 1),
  // so the bias costs no separate pass over the output.
  float* y = output->data();
  const float* b = bias_.value.data();
  for (int64_t i = 0; i < n; ++i) Copy(b, y + i * out_, out_);
  Sgemm(false, true, n, out_, in_, 1.0f, input.data(), in_, weight_.value.data(), in_, 1.0f, y,
        out_);
  if (fused_relu_) {
    output_ = output;
    ReluInPlace(y, n * out_);
  }
}

bool Linear::Fuse(const Layer& next) {
  if (fused_relu_ || dynamic_cast<const ReLU*>(&next) == nullptr) return false;
  fused_relu_ = true;
  return true;
}

void Linear::Backward(const Tensor& grad_output, Tensor* grad_input) {
  AIDN_CHECK(input_ != nullptr) << "Linear::Backward before Forward";
  const Tensor& x = *input_;
  const int64_t n = x.dim(0);
  AIDN_CHECK(grad_output.rank() == 2 && grad_output.dim(0) == n && grad_output.dim(1) == out_)
      << Describe() << " got grad_output " << grad_output.ShapeString();
  const float* g = grad_output.data();
  if (fused_relu_ && n > 0) {
    // The ReLU's backward: x > 0 exactly where its output y > 0.
    AIDN_CHECK(output_ != nullptr && output_->numel() == n * out_)
        << "Linear::Backward before Forward";
    EnsureShape(&masked_grad_, {n, out_});
    ReluGradKernel(output_->data(), g, masked_grad_.data(), n * out_);
    g = masked_grad_.data();
  }
  if (n > 0) {
    // dW += g^T x
    Sgemm(true, false, out_, in_, n, 1.0f, g, out_, x.data(), in_, 1.0f, weight_.grad.data(), in_);
    float* gb = bias_.grad.data();
    for (int64_t i = 0; i < n; ++i) AccumulateKernel(g + i * out_, gb, out_);
  }
  if (grad_input != nullptr) {
    EnsureShape(grad_input, {n, in_});
    if (n > 0) {
      // dx = g W
      Sgemm(false, false, n, in_, out_, 1.0f, g, out_, weight_.value.data(), in_, 0.0f,
            grad_input->data(), in_);
    }
  }
}

// ---------------------------------------------------------------- ReLU

void ReLU::Forward(const Tensor& input, Tensor* output, bool /*training*/) {
  EnsureShape(output, input.shape());
  input_ = &input;
  ReluKernel(input.data(), output->data(), input.numel());
}

void ReLU::Backward(const Tensor& grad_output, Tensor* grad_input) {
  AIDN_CHECK(input_ != nullptr) << "ReLU::Backward before Forward";
  AIDN_CHECK(grad_output.numel() == input_->numel())
      << "ReLU got grad_output " << grad_output.ShapeString() << " for input "
      << input_->ShapeString();
  if (grad_input == nullptr) return;
  EnsureShape(grad_input, input_->shape());
  ReluGradKernel(input_->data(), grad_output.data(), grad_input->data(), input_->numel());
}

// ---------------------------------------------------------------- Conv2d

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride,
               int64_t padding)
    : in_(in_channels),
      out_(out_channels),
      kernel_(kernel),
      stride_(stride),
      padding_(padding),
      weight_{"weight", Tensor({out_channels, in_channels, kernel, kernel}),
              Tensor({out_channels, in_channels, kernel, kernel})},
      bias_{"bias", Tensor({out_channels}), Tensor({out_channels})} {
  AIDN_CHECK(in_ > 0 && out_ > 0 && kernel_ > 0 && stride_ > 0 && padding_ >= 0)
      << "bad Conv2d geometry";
}

std::string Conv2d::Describe() const {
  std::string s = "Conv2d(" + std::to_string(in_) + ", " + std::to_string(out_) +
                  ", kernel_size=(" + std::to_string(kernel_) + ", " + std::to_string(kernel_) +
                  "), stride=(" + std::to_string(stride_) + ", " + std::to_string(stride_) + ")";
  if (padding_ != 0) {
    s += ", padding=(" + std::to_string(padding_) + ", " + std::to_string(padding_) + ")";
  }
  return s + ")";
}

bool Conv2d::Fuse(const Layer& next) {
  if (fused_pool_) return false;
  if (!fused_relu_ && dynamic_cast<const ReLU*>(&next) != nullptr) {
    fused_relu_ = true;
    return true;
  }
  const auto* pool = dynamic_cast<const MaxPool2d*>(&next);
  if (pool == nullptr || pool->kernel() != 2 || pool->stride() != 2) return false;
  fused_pool_ = true;
  return true;
}

void Conv2d::Epilogue(const float* conv, int64_t n, int64_t o, float* y) {
  const int64_t plane = out_height_ * out_width_;
  const float b = bias_.value[o];
  if (!fused_pool_) {
    if (conv == y) {
      fused_relu_ ? AddScalarReluInPlace(y, b, plane) : AddScalarInPlace(y, b, plane);
    } else {
      fused_relu_ ? AddScalarReluKernel(conv, b, y, plane) : AddScalarKernel(conv, b, y, plane);
    }
    return;
  }
  // Bias and ReLU into a cached plane, then the pool as MaxPool2d computes it.
  float* t = plane_.data();
  fused_relu_ ? AddScalarReluKernel(conv, b, t, plane) : AddScalarKernel(conv, b, t, plane);
  const int64_t pooled = (out_height_ / 2) * (out_width_ / 2);
  MaxPool2x2Plane(t, out_height_, out_width_, y, argmax_.data() + (n * out_ + o) * pooled);
}

void Conv2d::Prologue(const float* g, int64_t n, int64_t o, float* dconv) const {
  const int64_t plane = out_height_ * out_width_;
  if (fused_pool_) {
    const int64_t pooled = (out_height_ / 2) * (out_width_ / 2);
    const int64_t at = (n * out_ + o) * pooled;
    MaxPool2x2PlaneBackward(g, fused_relu_ ? output_->data() + at : nullptr, argmax_.data() + at,
                            out_height_, out_width_, dconv);
  } else if (fused_relu_) {
    ReluGradKernel(output_->data() + (n * out_ + o) * plane, g, dconv, plane);
  } else {
    Copy(g, dconv, plane);
  }
}

int64_t Conv2d::ChunkSamples() const {
  const int64_t plane = out_height_ * out_width_;
  if (plane >= kPerSampleMinPlane) return 1;
  const int64_t per_sample = (fan_in() + out_) * plane;
  return std::clamp<int64_t>(kChunkFloats / std::max<int64_t>(per_sample, 1), 1,
                             std::max<int64_t>(batch_, 1));
}

void Conv2d::Forward(const Tensor& input, Tensor* output, bool /*training*/) {
  AIDN_CHECK(input.rank() == 4 && input.dim(1) == in_)
      << Describe() << " got input " << input.ShapeString();
  batch_ = input.dim(0);
  height_ = input.dim(2);
  width_ = input.dim(3);
  out_height_ = (height_ + 2 * padding_ - kernel_) / stride_ + 1;
  out_width_ = (width_ + 2 * padding_ - kernel_) / stride_ + 1;
  AIDN_CHECK(height_ + 2 * padding_ >= kernel_ && width_ + 2 * padding_ >= kernel_)
      << Describe() << " input " << input.ShapeString() << " is smaller than the kernel";
  AIDN_CHECK(!fused_pool_ || (out_height_ >= 2 && out_width_ >= 2))
      << Describe() << " output " << out_height_ << "x" << out_width_
      << " is smaller than the fused MaxPool2d's kernel 2";
  const ConvShape s{in_, height_, width_, kernel_, stride_, padding_, out_height_, out_width_};
  const int64_t plane = out_height_ * out_width_;
  const int64_t ck = fan_in();
  const int64_t in_sample = in_ * height_ * width_;
  // The layer's output plane: pooled or not.
  const int64_t y_height = fused_pool_ ? out_height_ / 2 : out_height_;
  const int64_t y_width = fused_pool_ ? out_width_ / 2 : out_width_;
  const int64_t y_plane = y_height * y_width;
  const int64_t chunk = ChunkSamples();
  EnsureShape(output, {batch_, out_, y_height, y_width});
  input_ = &input;
  output_ = output;
  EnsureShape(&columns_, {ck, chunk * plane});
  EnsureShape(&rows_, {out_, chunk * plane});
  if (fused_pool_) {
    EnsureShape(&plane_, {plane});
    argmax_.resize(static_cast<size_t>(batch_ * out_ * y_plane));
  }
  if (batch_ == 0) return;
  const float* x = input.data();
  const float* w = weight_.value.data();
  float* col = columns_.data();
  float* y = output->data();

  for (int64_t n0 = 0; n0 < batch_; n0 += chunk) {
    const int64_t n1 = std::min(batch_, n0 + chunk);
    const int64_t ld = (n1 - n0) * plane;
    for (int64_t n = n0; n < n1; ++n) Im2Col(x + n * in_sample, s, col + (n - n0) * plane, ld);
    // conv [O, chunk*P] = W [O, CK] x columns [CK, chunk*P]. One sample's
    // [O, P] is its NCHW output already, unless a pool follows.
    float* conv = n1 - n0 == 1 && !fused_pool_ ? y + n0 * out_ * y_plane : rows_.data();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Int(out_), Int(ld), Int(ck), 1.0f, w,
                Int(ck), col, Int(ld), 0.0f, conv, Int(ld));
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t o = 0; o < out_; ++o) {
        Epilogue(conv + o * ld + (n - n0) * plane, n, o, y + (n * out_ + o) * y_plane);
      }
    }
  }
}

void Conv2d::Backward(const Tensor& grad_output, Tensor* grad_input) {
  AIDN_CHECK(input_ != nullptr) << "Conv2d::Backward before Forward";
  const int64_t y_height = fused_pool_ ? out_height_ / 2 : out_height_;
  const int64_t y_width = fused_pool_ ? out_width_ / 2 : out_width_;
  AIDN_CHECK(grad_output.rank() == 4 && grad_output.dim(0) == batch_ &&
             grad_output.dim(1) == out_ && grad_output.dim(2) == y_height &&
             grad_output.dim(3) == y_width)
      << Describe() << " got grad_output " << grad_output.ShapeString();
  const ConvShape s{in_, height_, width_, kernel_, stride_, padding_, out_height_, out_width_};
  const int64_t plane = out_height_ * out_width_;
  const int64_t y_plane = y_height * y_width;
  const int64_t ck = fan_in();
  const int64_t in_sample = in_ * height_ * width_;
  const int64_t chunk = ChunkSamples();
  if (grad_input != nullptr) EnsureShape(grad_input, {batch_, in_, height_, width_});
  if (batch_ == 0) return;
  const bool fused = fused_relu_ || fused_pool_;
  if (grad_input != nullptr) EnsureShape(&grad_columns_, {ck, chunk * plane});
  const float* x = input_->data();
  const float* g = grad_output.data();
  const float* w = weight_.value.data();
  float* col = columns_.data();
  float* gw = weight_.grad.data();
  float* gb = bias_.grad.data();
  float* gx = grad_input != nullptr ? grad_input->data() : nullptr;

  for (int64_t n0 = 0; n0 < batch_; n0 += chunk) {
    const int64_t n1 = std::min(batch_, n0 + chunk);
    const int64_t ld = (n1 - n0) * plane;
    // The gradient of the chunk's convolution, dconv [O, chunk*P]: one
    // sample's grad_output as it is, else gathered (through the fused
    // layers), summing the bias gradient on the way.
    const float* dconv = g + n0 * out_ * y_plane;
    if (n1 - n0 == 1 && !fused) {
      for (int64_t o = 0; o < out_; ++o) gb[o] += SumKernel(dconv + o * plane, plane);
    } else {
      float* d = rows_.data();
      for (int64_t n = n0; n < n1; ++n) {
        for (int64_t o = 0; o < out_; ++o) {
          float* dst = d + o * ld + (n - n0) * plane;
          Prologue(g + (n * out_ + o) * y_plane, n, o, dst);
          gb[o] += SumKernel(dst, plane);
        }
      }
      dconv = d;
    }
    // The columns again rather than kept from Forward: rebuilt into cache
    // they cost less than a round trip of the whole batch's through memory.
    for (int64_t n = n0; n < n1; ++n) Im2Col(x + n * in_sample, s, col + (n - n0) * plane, ld);
    // dW [O, CK] += dconv [O, chunk*P] x columns^T [chunk*P, CK]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Int(out_), Int(ck), Int(ld), 1.0f, dconv,
                Int(ld), col, Int(ld), 1.0f, gw, Int(ck));
    if (gx == nullptr) continue;
    // dcolumns [CK, chunk*P] = W^T [CK, O] x dconv [O, chunk*P], then col2im.
    float* gcol = grad_columns_.data();
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Int(ck), Int(ld), Int(out_), 1.0f, w,
                Int(ck), dconv, Int(ld), 0.0f, gcol, Int(ld));
    for (int64_t n = n0; n < n1; ++n) {
      float* gx_n = gx + n * in_sample;
      std::fill(gx_n, gx_n + in_sample, 0.0f);
      Col2Im(gcol + (n - n0) * plane, ld, s, gx_n);
    }
  }
}

// ---------------------------------------------------------------- MaxPool2d

MaxPool2d::MaxPool2d(int64_t kernel, int64_t stride)
    : kernel_(kernel), stride_(stride > 0 ? stride : kernel) {
  AIDN_CHECK(kernel_ > 0) << "MaxPool2d kernel " << kernel_;
}

std::string MaxPool2d::Describe() const {
  return "MaxPool2d(kernel_size=" + std::to_string(kernel_) +
         ", stride=" + std::to_string(stride_) + ", padding=0, dilation=1, ceil_mode=False)";
}

void MaxPool2d::Forward(const Tensor& input, Tensor* output, bool /*training*/) {
  AIDN_CHECK(input.rank() == 4 && input.dim(2) >= kernel_ && input.dim(3) >= kernel_)
      << Describe() << " got input " << input.ShapeString();
  input_shape_.assign(input.shape().begin(), input.shape().end());
  const int64_t planes = input.dim(0) * input.dim(1);
  const int64_t h = input.dim(2);
  const int64_t w = input.dim(3);
  const int64_t oh = (h - kernel_) / stride_ + 1;
  const int64_t ow = (w - kernel_) / stride_ + 1;
  EnsureShape(output, {input.dim(0), input.dim(1), oh, ow});
  argmax_.resize(static_cast<size_t>(planes * oh * ow));
  const float* x = input.data();
  float* y = output->data();
  int32_t* arg = argmax_.data();
  if (kernel_ == 2 && stride_ == 2) {
    for (int64_t p = 0; p < planes; ++p) {
      MaxPool2x2Plane(x + p * h * w, h, w, y + p * oh * ow, arg + p * oh * ow);
    }
    return;
  }
  for (int64_t p = 0; p < planes; ++p) {
    const float* xp = x + p * h * w;
    for (int64_t i = 0; i < oh; ++i) {
      for (int64_t j = 0; j < ow; ++j) {
        const int64_t top = i * stride_;
        const int64_t left = j * stride_;
        int64_t best = top * w + left;
        float best_value = xp[best];
        for (int64_t ki = 0; ki < kernel_; ++ki) {
          for (int64_t kj = 0; kj < kernel_; ++kj) {
            const int64_t idx = (top + ki) * w + left + kj;
            // Strictly greater: the first maximum wins, as in torch.
            if (xp[idx] > best_value) {
              best_value = xp[idx];
              best = idx;
            }
          }
        }
        const int64_t out_idx = (p * oh + i) * ow + j;
        y[out_idx] = best_value;
        arg[out_idx] = static_cast<int32_t>(best);
      }
    }
  }
}

void MaxPool2d::Backward(const Tensor& grad_output, Tensor* grad_input) {
  AIDN_CHECK(input_shape_.size() == 4) << "MaxPool2d::Backward before Forward";
  AIDN_CHECK(grad_output.numel() == static_cast<int64_t>(argmax_.size()))
      << Describe() << " got grad_output " << grad_output.ShapeString();
  if (grad_input == nullptr) return;
  EnsureShape(grad_input, input_shape_);
  const int64_t planes = input_shape_[0] * input_shape_[1];
  const int64_t in_plane = input_shape_[2] * input_shape_[3];
  const int64_t out_plane = grad_output.numel() / std::max<int64_t>(planes, 1);
  const float* g = grad_output.data();
  float* gx = grad_input->data();
  const int32_t* arg = argmax_.data();
  if (kernel_ == 2 && stride_ == 2) {
    for (int64_t p = 0; p < planes; ++p) {
      MaxPool2x2PlaneBackward(g + p * out_plane, nullptr, arg + p * out_plane, input_shape_[2],
                              input_shape_[3], gx + p * in_plane);
    }
    return;
  }
  grad_input->Zero();
  for (int64_t p = 0; p < planes; ++p) {
    float* gp = gx + p * in_plane;
    for (int64_t i = 0; i < out_plane; ++i) {
      // += : windows may overlap when stride < kernel.
      gp[arg[p * out_plane + i]] += g[p * out_plane + i];
    }
  }
}

// ---------------------------------------------------------------- Flatten

void Flatten::Forward(const Tensor& input, Tensor* output, bool /*training*/) {
  AIDN_CHECK(input.rank() >= 1) << "Flatten got a scalar";
  input_shape_.assign(input.shape().begin(), input.shape().end());
  const int64_t n = input.dim(0);
  EnsureShape(output, {n, n > 0 ? input.numel() / n : 0});
  Copy(input.data(), output->data(), input.numel());
}

void Flatten::Backward(const Tensor& grad_output, Tensor* grad_input) {
  AIDN_CHECK(!input_shape_.empty()) << "Flatten::Backward before Forward";
  if (grad_input == nullptr) return;
  EnsureShape(grad_input, input_shape_);
  AIDN_CHECK(grad_output.numel() == grad_input->numel())
      << "Flatten got grad_output " << grad_output.ShapeString();
  Copy(grad_output.data(), grad_input->data(), grad_output.numel());
}

// ---------------------------------------------------------------- Dropout

Dropout::Dropout(double p) : p_(p) {
  AIDN_CHECK(p >= 0.0 && p <= 1.0) << "dropout probability " << p << " not in [0, 1]";
}

std::string Dropout::Describe() const {
  return "Dropout(p=" + FormatDouble(p_) + ", inplace=False)";
}

void Dropout::Forward(const Tensor& input, Tensor* output, bool training) {
  EnsureShape(output, input.shape());
  last_training_ = training;
  const int64_t n = input.numel();
  const float* x = input.data();
  float* y = output->data();
  if (!training) {
    Copy(x, y, n);
    return;
  }
  EnsureShape(&mask_, input.shape());
  float* m = mask_.data();
  if (p_ >= 1.0) {
    mask_.Zero();
  } else {
    // Two 32-bit uniforms per 64-bit draw; keep when u < (1-p) 2^32.
    const uint64_t threshold = static_cast<uint64_t>((1.0 - p_) * 4294967296.0);
    const float scale = static_cast<float>(1.0 / (1.0 - p_));
    int64_t i = 0;
    // Arithmetic rather than a select: a random branch mispredicts often.
    for (; i + 1 < n; i += 2) {
      const uint64_t r = rng_();
      m[i] = scale * static_cast<float>((r & 0xffffffffu) < threshold);
      m[i + 1] = scale * static_cast<float>((r >> 32) < threshold);
    }
    if (i < n) m[i] = scale * static_cast<float>((rng_() & 0xffffffffu) < threshold);
  }
  MulKernel(x, m, y, n);
}

void Dropout::Backward(const Tensor& grad_output, Tensor* grad_input) {
  if (grad_input == nullptr) return;
  EnsureShape(grad_input, grad_output.shape());
  const int64_t n = grad_output.numel();
  const float* g = grad_output.data();
  float* gx = grad_input->data();
  if (!last_training_) {
    Copy(g, gx, n);
    return;
  }
  AIDN_CHECK(mask_.numel() == n) << "Dropout got grad_output " << grad_output.ShapeString();
  MulKernel(g, mask_.data(), gx, n);
}

}  // namespace aidn::engine
