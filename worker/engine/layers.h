#ifndef AIDN_WORKER_ENGINE_LAYERS_H_
#define AIDN_WORKER_ENGINE_LAYERS_H_

// The layer types behind BuildModel (internal to the engine; tests use them
// directly). All are batch-first float32 on the CPU, with torch's layouts:
// Linear weight [out, in], Conv2d weight [out, in, kh, kw], images NCHW.
//
// Lifetime contract: a layer may keep a pointer to the `input` of its last
// Forward (Linear, ReLU and Conv2d do) and, once it has fused a ReLU, to its
// `output`, so those tensors must stay alive and unchanged until the
// matching Backward. Sequential's own activations satisfy this; a caller
// that drives layers by hand must keep its input tensors around.
//
// Fusion (Layer::Fuse): Linear takes over a ReLU after it; Conv2d a ReLU
// and then a MaxPool2d(2) (stride 2), or the pool alone. A fused layer
// computes exactly what the layers one by one would, bit for bit, without
// the full passes over the activations between them.
//
// Buffers (outputs, gradients, im2col columns, masks) are resized only when
// a shape changes, so repeated steps at a fixed batch size allocate nothing.

#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "worker/engine/model.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

// Resizes `t` to `shape` unless it already has exactly that shape, so that
// the steady state performs no allocation at all (not even of a shape vector).
void EnsureShape(Tensor* t, std::initializer_list<int64_t> shape);
void EnsureShape(Tensor* t, const std::vector<int64_t>& shape);

// U(-bound, bound) with bound = 1/sqrt(fan_in): torch's default for
// nn.Linear and nn.Conv2d (kaiming_uniform_ with a = sqrt(5) for the weight,
// the same bound for the bias). The uniform is computed by hand from 24 bits
// of the generator so that the values do not depend on the standard library.
void InitUniform(Parameter* p, int64_t fan_in, std::mt19937_64* rng);

// y = x W^T + b. Input [N, in], output [N, out].
class Linear final : public Layer {
 public:
  Linear(int64_t in_features, int64_t out_features);
  std::string Describe() const override;
  void Forward(const Tensor& input, Tensor* output, bool training) override;
  void Backward(const Tensor& grad_output, Tensor* grad_input) override;
  std::vector<Parameter*> Parameters() override { return {&weight_, &bias_}; }
  // Takes over a ReLU: Forward writes max(x W^T + b, 0).
  bool Fuse(const Layer& next) override;

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }

 private:
  int64_t in_;
  int64_t out_;
  Parameter weight_;
  Parameter bias_;
  bool fused_relu_ = false;
  const Tensor* input_ = nullptr;
  // Fused ReLU: the output of the last Forward (its mask) and the masked
  // output gradient.
  const Tensor* output_ = nullptr;
  Tensor masked_grad_;
};

// max(x, 0), any shape.
class ReLU final : public Layer {
 public:
  std::string Describe() const override { return "ReLU()"; }
  void Forward(const Tensor& input, Tensor* output, bool training) override;
  void Backward(const Tensor& grad_output, Tensor* grad_input) override;

 private:
  const Tensor* input_ = nullptr;
};

// 2-D convolution (cross-correlation, as torch), square kernel, stride and
// zero padding. Input [N, C, H, W], output [N, O, OH, OW] with
// OH = (H + 2 padding - kernel) / stride + 1. Implemented as im2col + GEMM
// (gemm.h: oneDNN where every dimension is at least 32, else OpenBLAS),
// a chunk of samples at a time so that each chunk's columns, GEMM output
// and their gradients stay in cache (L2) between the passes over them:
//   P = OH * OW >= kPerSampleMinPlane  one sample per chunk: the GEMM's rows
//       are long enough, and its [O, P] output is the sample's NCHW output
//       (and the gradient's input) as it is (the CNN's first layer: CK = 9,
//       P = 676).
//   smaller planes  several samples, up to kChunkFloats of columns and rows
//       and at least kMinGemmColumns columns, to keep the GEMM's N large, at
//       the price of a scatter to NCHW in Forward and a gather in Backward
//       (the CNN's second layer: P = 121; a ResNet's 7x7 and 4x4 stages,
//       whose columns outgrow L2 rather than run GEMMs of N = 49 or 16).
// Backward rebuilds the columns from the input (the layer keeps a pointer
// to it) instead of keeping the whole batch's from Forward: a rebuild into
// cache costs less than their round trip through memory. A batch that was
// one chunk keeps its columns, and a 1x1 convolution of stride 1 without
// padding (a bottleneck's) uses a sample's input as its columns and writes
// its input gradient straight from the GEMM.
class Conv2d final : public Layer {
 public:
  // Without `bias` (torch's bias=False, as before a BatchNorm) the layer
  // has its weight only.
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride = 1,
         int64_t padding = 0, bool bias = true);
  std::string Describe() const override;
  void Forward(const Tensor& input, Tensor* output, bool training) override;
  void Backward(const Tensor& grad_output, Tensor* grad_input) override;
  std::vector<Parameter*> Parameters() override {
    if (!has_bias_) return {&weight_};
    return {&weight_, &bias_};
  }
  // Takes over a ReLU, then a MaxPool2d with kernel 2 and stride 2 (or the
  // pool alone): the output is then max_pool(max(conv, 0)), [N, O, OH/2,
  // OW/2], computed per output plane while the GEMM's result is in cache.
  bool Fuse(const Layer& next) override;

  // in_channels * kernel * kernel.
  int64_t fan_in() const { return in_ * kernel_ * kernel_; }
  int64_t in_channels() const { return in_; }
  int64_t out_channels() const { return out_; }
  int64_t kernel() const { return kernel_; }
  int64_t stride() const { return stride_; }
  int64_t padding() const { return padding_; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }
  bool has_bias() const { return has_bias_; }

 private:
  int64_t in_;
  int64_t out_;
  int64_t kernel_;
  int64_t stride_;
  int64_t padding_;
  // Without a bias, bias_ stays zero (its gradient is summed but unused).
  bool has_bias_;
  static constexpr int64_t kPerSampleMinPlane = 256;
  static constexpr int64_t kChunkFloats = int64_t{1} << 17;  // 512 KiB
  static constexpr int64_t kMinGemmColumns = 256;
  // Samples per chunk.
  int64_t ChunkSamples() const;
  // 1x1, stride 1, no padding: a sample's input is its columns.
  bool Pointwise() const { return kernel_ == 1 && stride_ == 1 && padding_ == 0; }

  // The output plane (n, o) from the convolution's plane `conv` (bias not
  // yet added): bias, then the fused ReLU and pool.
  void Epilogue(const float* conv, int64_t n, int64_t o, float* y);
  // The gradient of the convolution's plane (n, o) into `dconv`, from the
  // gradient of the output `g`: through the fused pool and ReLU.
  void Prologue(const float* g, int64_t n, int64_t o, float* dconv) const;

  bool fused_relu_ = false;
  bool fused_pool_ = false;
  // Geometry of the last Forward.
  int64_t batch_ = 0;
  int64_t height_ = 0;
  int64_t width_ = 0;
  int64_t out_height_ = 0;
  int64_t out_width_ = 0;
  Parameter weight_;
  Parameter bias_;
  // Per chunk: the columns [C*k*k, chunk*P] (sample n's at n*P in each
  // row), the convolution or its gradient [O, chunk*P], and the gradient of
  // the columns [C*k*k, chunk*P].
  Tensor columns_;
  Tensor rows_;
  Tensor grad_columns_;
  // Whether columns_ holds the last Forward's columns of its whole batch
  // (one chunk), which Backward then uses as they are.
  bool columns_kept_ = false;
  // Fused pool: one plane [P] after bias and ReLU, before pooling.
  Tensor plane_;
  const Tensor* input_ = nullptr;
  // Fused: the output of the last Forward (the ReLU's mask) and, with the
  // pool, each output's winner: its offset in the convolution's plane.
  const Tensor* output_ = nullptr;
  std::vector<int32_t> argmax_;
};

// Max pooling without padding; stride defaults to the kernel size. Backward
// routes each output gradient to the input element that won (the first
// maximum in row-major window order, as torch).
class MaxPool2d final : public Layer {
 public:
  explicit MaxPool2d(int64_t kernel, int64_t stride = 0);
  std::string Describe() const override;
  void Forward(const Tensor& input, Tensor* output, bool training) override;
  void Backward(const Tensor& grad_output, Tensor* grad_input) override;

  int64_t kernel() const { return kernel_; }
  int64_t stride() const { return stride_; }

 private:
  int64_t kernel_;
  int64_t stride_;
  std::vector<int64_t> input_shape_;
  // Per output element: offset of the winner within its input plane.
  std::vector<int32_t> argmax_;
};

// [N, d1, d2, ...] -> [N, d1*d2*...] (torch's Flatten(start_dim=1)).
class Flatten final : public Layer {
 public:
  std::string Describe() const override { return "Flatten(start_dim=1, end_dim=-1)"; }
  void Forward(const Tensor& input, Tensor* output, bool training) override;
  void Backward(const Tensor& grad_output, Tensor* grad_input) override;

 private:
  std::vector<int64_t> input_shape_;
};

// Inverted dropout: in training each element is kept with probability 1-p
// and scaled by 1/(1-p) (p = 1 zeroes everything); in evaluation it is the
// identity. Masks come from a std::mt19937_64 that SetSeed re-seeds; each
// training Forward draws a fresh mask from it.
class Dropout final : public Layer {
 public:
  explicit Dropout(double p);
  std::string Describe() const override;
  void Forward(const Tensor& input, Tensor* output, bool training) override;
  void Backward(const Tensor& grad_output, Tensor* grad_input) override;
  void SetSeed(uint64_t seed) override { rng_.seed(seed); }

  double p() const { return p_; }
  // The last training mask: 0 or 1/(1-p) per element.
  const Tensor& mask() const { return mask_; }

 private:
  double p_;
  std::mt19937_64 rng_{0};
  bool last_training_ = false;
  Tensor mask_;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_LAYERS_H_
