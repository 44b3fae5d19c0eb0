#include "worker/engine/layers.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "common/log.h"

namespace aidn::engine {
namespace {

int Int(int64_t v) { return static_cast<int>(v); }

// Copies `n` floats.
void Copy(const float* src, float* dst, int64_t n) {
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

// Elementwise kernels. GCC at -O2 (the RelWithDebInfo default) vectorises
// only loops whose trip count it knows, so the bulk runs in fixed blocks of
// kBlock and the tail in a scalar loop. The selects load both operands
// unconditionally so they compile to compare-and-mask instead of branches
// (a branch per element mispredicts half the time on ReLU inputs).
constexpr int64_t kBlock = 16;

void ReluKernel(const float* __restrict x, float* __restrict y, int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] = std::max(x[i + j], 0.0f);
  }
  for (; i < n; ++i) y[i] = std::max(x[i], 0.0f);
}

// gx = x > 0 ? g : 0
void ReluGradKernel(const float* __restrict x, const float* __restrict g, float* __restrict gx,
                    int64_t n) {
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

// y = a * b
void MulKernel(const float* __restrict a, const float* __restrict b, float* __restrict y,
               int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] = a[i + j] * b[i + j];
  }
  for (; i < n; ++i) y[i] = a[i] * b[i];
}

// y += x
void AccumulateKernel(const float* __restrict x, float* __restrict y, int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] += x[i + j];
  }
  for (; i < n; ++i) y[i] += x[i];
}

// y = x + c
void AddScalarKernel(const float* __restrict x, float c, float* __restrict y, int64_t n) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) y[i + j] = x[i + j] + c;
  }
  for (; i < n; ++i) y[i] = x[i] + c;
}

float SumKernel(const float* __restrict x, int64_t n) {
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
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Int(n), Int(out_), Int(in_), 1.0f,
              input.data(), Int(in_), weight_.value.data(), Int(in_), 1.0f, y, Int(out_));
}

void Linear::Backward(const Tensor& grad_output, Tensor* grad_input) {
  AIDN_CHECK(input_ != nullptr) << "Linear::Backward before Forward";
  const Tensor& x = *input_;
  const int64_t n = x.dim(0);
  AIDN_CHECK(grad_output.rank() == 2 && grad_output.dim(0) == n && grad_output.dim(1) == out_)
      << Describe() << " got grad_output " << grad_output.ShapeString();
  const float* g = grad_output.data();
  if (n > 0) {
    // dW += g^T x
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Int(out_), Int(in_), Int(n), 1.0f, g,
                Int(out_), x.data(), Int(in_), 1.0f, weight_.grad.data(), Int(in_));
    float* gb = bias_.grad.data();
    for (int64_t i = 0; i < n; ++i) AccumulateKernel(g + i * out_, gb, out_);
  }
  if (grad_input != nullptr) {
    EnsureShape(grad_input, {n, in_});
    if (n > 0) {
      // dx = g W
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Int(n), Int(in_), Int(out_), 1.0f, g,
                  Int(out_), weight_.value.data(), Int(in_), 0.0f, grad_input->data(), Int(in_));
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
  const int64_t plane = out_height_ * out_width_;
  const int64_t cols = batch_ * plane;  // GEMM columns
  const int64_t ck = fan_in();
  EnsureShape(output, {batch_, out_, out_height_, out_width_});
  EnsureShape(&columns_, {ck, cols});
  EnsureShape(&rows_, {out_, cols});
  if (batch_ == 0) return;

  // im2col: row (c, ki, kj), column (n, oh, ow) = x[n, c, oh*s-p+ki, ow*s-p+kj] or 0.
  const float* x = input.data();
  float* col = columns_.data();
  for (int64_t c = 0; c < in_; ++c) {
    for (int64_t ki = 0; ki < kernel_; ++ki) {
      for (int64_t kj = 0; kj < kernel_; ++kj) {
        int64_t lo;
        int64_t hi;
        ValidColumns(kj, stride_, padding_, width_, out_width_, &lo, &hi);
        float* row = col + ((c * kernel_ + ki) * kernel_ + kj) * cols;
        for (int64_t n = 0; n < batch_; ++n) {
          const float* xp = x + (n * in_ + c) * height_ * width_;
          float* dst = row + n * plane;
          for (int64_t oh = 0; oh < out_height_; ++oh) {
            const int64_t ih = oh * stride_ - padding_ + ki;
            float* d = dst + oh * out_width_;
            if (ih < 0 || ih >= height_) {
              std::fill(d, d + out_width_, 0.0f);
              continue;
            }
            // Output column ow reads xp[base + ow * stride]; base + lo * stride >= 0.
            const int64_t base = ih * width_ + kj - padding_;
            std::fill(d, d + lo, 0.0f);
            if (stride_ == 1) {
              Copy(xp + base + lo, d + lo, hi - lo);
            } else {
              for (int64_t ow = lo; ow < hi; ++ow) d[ow] = xp[base + ow * stride_];
            }
            std::fill(d + hi, d + out_width_, 0.0f);
          }
        }
      }
    }
  }

  // rows [O, N*P] = W [O, CK] x columns [CK, N*P]: one GEMM for the batch.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Int(out_), Int(cols), Int(ck), 1.0f,
              weight_.value.data(), Int(ck), col, Int(cols), 0.0f, rows_.data(), Int(cols));

  // Scatter to NCHW, adding the bias on the way.
  const float* r = rows_.data();
  const float* b = bias_.value.data();
  float* y = output->data();
  for (int64_t n = 0; n < batch_; ++n) {
    for (int64_t o = 0; o < out_; ++o) {
      AddScalarKernel(r + o * cols + n * plane, b[o], y + (n * out_ + o) * plane, plane);
    }
  }
}

void Conv2d::Backward(const Tensor& grad_output, Tensor* grad_input) {
  AIDN_CHECK(grad_output.rank() == 4 && grad_output.dim(0) == batch_ &&
             grad_output.dim(1) == out_ && grad_output.dim(2) == out_height_ &&
             grad_output.dim(3) == out_width_)
      << Describe() << " got grad_output " << grad_output.ShapeString();
  const int64_t plane = out_height_ * out_width_;
  const int64_t cols = batch_ * plane;
  const int64_t ck = fan_in();
  if (grad_input != nullptr) EnsureShape(grad_input, {batch_, in_, height_, width_});
  if (batch_ == 0) return;

  // Gather grad_output into [O, N*P] and sum the bias gradient.
  const float* g = grad_output.data();
  float* r = rows_.data();
  float* gb = bias_.grad.data();
  for (int64_t n = 0; n < batch_; ++n) {
    for (int64_t o = 0; o < out_; ++o) {
      const float* src = g + (n * out_ + o) * plane;
      Copy(src, r + o * cols + n * plane, plane);
      gb[o] += SumKernel(src, plane);
    }
  }
  // dW [O, CK] += rows [O, N*P] x columns^T [N*P, CK]
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Int(out_), Int(ck), Int(cols), 1.0f, r,
              Int(cols), columns_.data(), Int(cols), 1.0f, weight_.grad.data(), Int(ck));
  if (grad_input == nullptr) return;

  // dcolumns [CK, N*P] = W^T [CK, O] x rows [O, N*P], then col2im.
  EnsureShape(&grad_columns_, {ck, cols});
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Int(ck), Int(cols), Int(out_), 1.0f,
              weight_.value.data(), Int(ck), r, Int(cols), 0.0f, grad_columns_.data(), Int(cols));
  grad_input->Zero();
  float* gx = grad_input->data();
  const float* gcol = grad_columns_.data();
  for (int64_t c = 0; c < in_; ++c) {
    for (int64_t ki = 0; ki < kernel_; ++ki) {
      for (int64_t kj = 0; kj < kernel_; ++kj) {
        int64_t lo;
        int64_t hi;
        ValidColumns(kj, stride_, padding_, width_, out_width_, &lo, &hi);
        const float* row = gcol + ((c * kernel_ + ki) * kernel_ + kj) * cols;
        for (int64_t n = 0; n < batch_; ++n) {
          float* xp = gx + (n * in_ + c) * height_ * width_;
          const float* src = row + n * plane;
          for (int64_t oh = 0; oh < out_height_; ++oh) {
            const int64_t ih = oh * stride_ - padding_ + ki;
            if (ih < 0 || ih >= height_) continue;
            const float* s = src + oh * out_width_;
            const int64_t base = ih * width_ + kj - padding_;
            if (stride_ == 1) {
              AccumulateKernel(s + lo, xp + base + lo, hi - lo);
            } else {
              for (int64_t ow = lo; ow < hi; ++ow) xp[base + ow * stride_] += s[ow];
            }
          }
        }
      }
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
  grad_input->Zero();
  const int64_t planes = input_shape_[0] * input_shape_[1];
  const int64_t in_plane = input_shape_[2] * input_shape_[3];
  const int64_t out_plane = grad_output.numel() / std::max<int64_t>(planes, 1);
  const float* g = grad_output.data();
  float* gx = grad_input->data();
  const int32_t* arg = argmax_.data();
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
