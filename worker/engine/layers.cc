#include "worker/engine/layers.h"

#include <algorithm>
#include <sstream>

#include "common/log.h"
#include "worker/engine/cpu_kernels.h"
#include "worker/engine/gemm.h"

namespace aidn::engine {

using cpu::AccumulateKernel;
using cpu::AddScalarInPlace;
using cpu::AddScalarKernel;
using cpu::AddScalarReluInPlace;
using cpu::AddScalarReluKernel;
using cpu::Col2Im;
using cpu::ConvShape;
using cpu::Copy;
using cpu::Im2Col;
using cpu::MaxPool2x2Plane;
using cpu::MaxPool2x2PlaneBackward;
using cpu::MulKernel;
using cpu::ReluGradKernel;
using cpu::ReluInPlace;
using cpu::ReluKernel;
using cpu::SumKernel;

namespace {

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
               int64_t padding, bool bias)
    : in_(in_channels),
      out_(out_channels),
      kernel_(kernel),
      stride_(stride),
      padding_(padding),
      has_bias_(bias),
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
  if (!has_bias_) s += ", bias=False";
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
  const int64_t cached = kChunkFloats / std::max<int64_t>(per_sample, 1);
  const int64_t wide = (kMinGemmColumns + plane - 1) / std::max<int64_t>(plane, 1);
  return std::clamp<int64_t>(std::max(cached, wide), 1, std::max<int64_t>(batch_, 1));
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
  // A 1x1 convolution of stride 1 without padding reads one sample's input
  // [C, P] as its columns; several samples' still go through im2col.
  const bool direct = Pointwise() && chunk == 1;
  if (!direct) EnsureShape(&columns_, {ck, chunk * plane});
  EnsureShape(&rows_, {out_, chunk * plane});
  // One chunk: Backward finds its columns still here.
  columns_kept_ = !direct && chunk >= batch_;
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
    const float* columns = direct ? x + n0 * in_sample : col;
    for (int64_t n = n0; n < n1 && !direct; ++n) {
      Im2Col(x + n * in_sample, s, col + (n - n0) * plane, ld);
    }
    // conv [O, chunk*P] = W [O, CK] x columns [CK, chunk*P]. One sample's
    // [O, P] is its NCHW output already, unless a pool follows.
    float* conv = n1 - n0 == 1 && !fused_pool_ ? y + n0 * out_ * y_plane : rows_.data();
    Sgemm(false, false, out_, ld, ck, 1.0f, w, ck, columns, ld, 0.0f, conv, ld);
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
  const bool direct = Pointwise() && chunk == 1;
  if (grad_input != nullptr && !direct) EnsureShape(&grad_columns_, {ck, chunk * plane});
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
    // (A layer whose batch was one chunk still has them.)
    const float* columns = direct ? x + n0 * in_sample : col;
    for (int64_t n = n0; n < n1 && !direct && !columns_kept_; ++n) {
      Im2Col(x + n * in_sample, s, col + (n - n0) * plane, ld);
    }
    // dW [O, CK] += dconv [O, chunk*P] x columns^T [chunk*P, CK]
    Sgemm(false, true, out_, ck, ld, 1.0f, dconv, ld, columns, ld, 1.0f, gw, ck);
    if (gx == nullptr) continue;
    if (direct) {
      // The columns' gradient is the input's: [C, P].
      Sgemm(true, false, ck, ld, out_, 1.0f, w, ck, dconv, ld, 0.0f, gx + n0 * in_sample, ld);
      continue;
    }
    // dcolumns [CK, chunk*P] = W^T [CK, O] x dconv [O, chunk*P], then col2im.
    float* gcol = grad_columns_.data();
    Sgemm(true, false, ck, ld, out_, 1.0f, w, ck, dconv, ld, 0.0f, gcol, ld);
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
    cpu::MaxPoolPlane(x + p * h * w, w, kernel_, stride_, oh, ow, y + p * oh * ow,
                      arg + p * oh * ow);
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
    cpu::MaxPoolPlaneBackward(g + p * out_plane, arg + p * out_plane, out_plane, gx + p * in_plane);
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
    cpu::DropoutMask(rng_, p_, m, n);
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
