#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_LAYERS_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_LAYERS_H_

// The CPU engine's layers (layers.h) on the GPU, fp32 (GEMMs and
// convolutions optionally in bf16 / fp16, see Precision), same layouts (Linear
// weight [out, in], Conv2d weight [out, in, kh, kw], NCHW) and the same
// contracts: Backward accumulates (+=) parameter gradients and writes the
// input gradient when asked; a layer keeps pointers to its Forward input
// (and, when it fused a ReLU, its output) until the matching Backward.
//
//   GpuLinear     cuBLAS SGEMMs (row-major shapes mapped onto column-major
//                 calls, see gpu_layers.cc) + a bias(+ReLU) kernel
//   GpuConv2d     cuDNN forward / backward data / backward filter, the
//                 algorithm chosen once per input shape and cached, the
//                 workspace from the context; own bias(+ReLU) kernel
//   GpuMaxPool2d  cuDNN max pooling
//   GpuReLU, GpuFlatten (a view, no copy), GpuDropout (dropout_mask.h)
//
// Fusion: Linear and Conv2d take over a following ReLU (the bias kernel
// applies it). Pooling is not fused on the GPU (the CPU's Conv2d also takes
// over the pool); results are the same, layer by layer.
//
// Every operation is queued on the context's stream; errors come back as
// absl::Status (INVALID_ARGUMENT for a shape the layer cannot take).
// Not thread-safe.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_tensor.h"
#include "worker/engine/cuda/stream_collectives.h"
#include "worker/engine/model.h"

namespace aidn::engine::cuda {

// A trainable tensor and its gradient, named as the CPU Parameter it mirrors.
struct GpuParameter {
  std::string name;
  GpuTensor value;
  GpuTensor grad;
  // As Parameter::no_grad: no forward of the step used it (on any rank,
  // with DDP), so the optimizer leaves it and its state alone (torch's
  // "grad is None").
  bool no_grad = false;
  // A ZeRO-1 shard (flat, a piece of a parameter): the whole parameter's
  // shape, which weight decay follows (empty: not a shard).
  std::vector<int64_t> whole_shape;
};

class GpuLayer {
 public:
  virtual ~GpuLayer() = default;
  // The CPU layer's Describe() line.
  virtual std::string Describe() const = 0;
  virtual absl::Status Forward(const GpuTensor& input, GpuTensor* output, bool training) = 0;
  virtual absl::Status Backward(const GpuTensor& grad_output, GpuTensor* grad_input) = 0;
  virtual std::vector<GpuParameter*> Parameters() { return {}; }
  // State that is not trained but saved with the weights (BatchNorm's
  // running statistics; only `value` is used), as Layer::Buffers.
  virtual std::vector<GpuParameter*> Buffers() { return {}; }
  // As Layer::Fuse: true when this layer takes `next`'s computation over.
  virtual bool Fuse(const GpuLayer& /*next*/) { return false; }
  virtual void SetSeed(uint64_t /*seed*/) {}
  // As Layer::UnusedParameters: those the last Forward did not use (a
  // residual block that skipped its main path).
  virtual std::vector<GpuParameter*> UnusedParameters() { return {}; }
  // Whether Forward draws on the host (dropout masks, stochastic depth), so
  // that a CUDA graph would replay one draw.
  virtual bool DrawsOnTheHost() const { return false; }
  // As Layer::SetBatchNormSync: BatchNorm layers (those inside blocks too)
  // normalise with the statistics of every rank's batch, exchanged through
  // `sync` (not owned; null: the rank's own batch).
  virtual void SetBatchNormSync(StreamCollectives* /*sync*/) {}
};

// A GPU layer computing what `cpu` computes, with a copy of its parameters
// (names included). UNIMPLEMENTED for a layer type the GPU engine lacks.
absl::StatusOr<std::unique_ptr<GpuLayer>> MirrorLayer(GpuContext* ctx, const Layer& cpu);

class GpuLinear final : public GpuLayer {
 public:
  // Zero-initialised parameters [out, in] and [out].
  static absl::StatusOr<std::unique_ptr<GpuLinear>> Create(GpuContext* ctx, int64_t in_features,
                                                           int64_t out_features);
  std::string Describe() const override;
  absl::Status Forward(const GpuTensor& input, GpuTensor* output, bool training) override;
  absl::Status Backward(const GpuTensor& grad_output, GpuTensor* grad_input) override;
  std::vector<GpuParameter*> Parameters() override { return {&weight_, &bias_}; }
  bool Fuse(const GpuLayer& next) override;
  GpuParameter& weight() { return weight_; }
  GpuParameter& bias() { return bias_; }

 private:
  GpuLinear(GpuContext* ctx, int64_t in, int64_t out) : ctx_(ctx), in_(in), out_(out) {}
  GpuContext* ctx_;
  int64_t in_;
  int64_t out_;
  GpuParameter weight_;
  GpuParameter bias_;
  bool fused_relu_ = false;
  const GpuTensor* input_ = nullptr;
  const GpuTensor* output_ = nullptr;
  GpuTensor masked_grad_;
  GpuTensor bias_partials_;  // LaunchBiasGrad's scratch
  // bf16 / fp16: the forward's input and weight, and the gradient, rounded.
  DeviceBuffer x_half_;
  DeviceBuffer w_half_;
  DeviceBuffer g_half_;
};

class GpuReLU final : public GpuLayer {
 public:
  explicit GpuReLU(GpuContext* ctx) : ctx_(ctx) {}
  std::string Describe() const override { return "ReLU()"; }
  absl::Status Forward(const GpuTensor& input, GpuTensor* output, bool training) override;
  absl::Status Backward(const GpuTensor& grad_output, GpuTensor* grad_input) override;

 private:
  GpuContext* ctx_;
  const GpuTensor* input_ = nullptr;
};

class GpuConv2d final : public GpuLayer {
 public:
  // Without `bias` (torch's bias=False, as before a BatchNorm) there is no
  // bias to add or differentiate (bias() stays zero and is not a parameter).
  static absl::StatusOr<std::unique_ptr<GpuConv2d>> Create(GpuContext* ctx, int64_t in_channels,
                                                           int64_t out_channels, int64_t kernel,
                                                           int64_t stride, int64_t padding,
                                                           bool bias = true);
  ~GpuConv2d() override;
  std::string Describe() const override;
  absl::Status Forward(const GpuTensor& input, GpuTensor* output, bool training) override;
  absl::Status Backward(const GpuTensor& grad_output, GpuTensor* grad_input) override;
  std::vector<GpuParameter*> Parameters() override {
    if (!has_bias_) return {&weight_};
    return {&weight_, &bias_};
  }
  bool Fuse(const GpuLayer& next) override;
  GpuParameter& weight() { return weight_; }
  GpuParameter& bias() { return bias_; }

  // The algorithms chosen for one input shape, and the math type each runs
  // with.
  struct Algorithms {
    cudnnConvolutionFwdAlgo_t forward{};
    cudnnConvolutionBwdDataAlgo_t backward_data{};
    cudnnConvolutionBwdFilterAlgo_t backward_filter{};
    cudnnMathType_t forward_math = CUDNN_FMA_MATH;
    cudnnMathType_t backward_data_math = CUDNN_FMA_MATH;
    cudnnMathType_t backward_filter_math = CUDNN_FMA_MATH;
    size_t workspace_bytes = 0;
  };
  // How many shapes have had algorithms chosen (for tests of the cache).
  size_t cached_shapes() const { return algorithms_.size(); }
  // The algorithms of the last Forward's shape (null before one).
  const Algorithms* current_algorithms() const { return current_; }

 private:
  GpuConv2d(GpuContext* ctx, int64_t in, int64_t out, int64_t kernel, int64_t stride,
            int64_t padding)
      : ctx_(ctx), in_(in), out_(out), kernel_(kernel), stride_(stride), padding_(padding) {}
  absl::Status Init();
  // Sets the descriptors for an input of [n, in, h, w] and picks (or looks
  // up) the algorithms.
  absl::Status Prepare(int64_t n, int64_t h, int64_t w);
  absl::Status ChooseAlgorithms(Algorithms* algos);
  // Backward's weight and input gradients with 16-bit operands, from the
  // pre-activation gradient `g` (fp32).
  absl::Status BackwardHalf(const float* g, void* ws, GpuTensor* grad_input);

  GpuContext* ctx_;
  int64_t in_;
  int64_t out_;
  int64_t kernel_;
  int64_t stride_;
  int64_t padding_;
  bool has_bias_ = true;
  GpuParameter weight_;
  GpuParameter bias_;
  bool fused_relu_ = false;
  cudnnTensorDescriptor_t x_desc_ = nullptr;
  cudnnTensorDescriptor_t y_desc_ = nullptr;
  cudnnFilterDescriptor_t w_desc_ = nullptr;
  cudnnConvolutionDescriptor_t conv_desc_ = nullptr;
  // The shape the descriptors describe: n, h, w, and the output's.
  std::tuple<int64_t, int64_t, int64_t> shape_{-1, -1, -1};
  int64_t out_h_ = 0;
  int64_t out_w_ = 0;
  std::map<std::tuple<int64_t, int64_t, int64_t>, Algorithms> algorithms_;
  const Algorithms* current_ = nullptr;
  const GpuTensor* input_ = nullptr;
  const GpuTensor* output_ = nullptr;
  GpuTensor masked_grad_;
  GpuTensor bias_partials_;  // LaunchBiasGrad's scratch
  // cuDNN's data type for x, y and w: float, or the 16-bit type of bf16 /
  // fp16, whose operands and results pass through these buffers.
  cudnnDataType_t data_type_ = CUDNN_DATA_FLOAT;
  DeviceBuffer x_half_;
  DeviceBuffer w_half_;
  DeviceBuffer y_half_;
  DeviceBuffer g_half_;
  DeviceBuffer dw_half_;
  DeviceBuffer dx_half_;
};

class GpuMaxPool2d final : public GpuLayer {
 public:
  static absl::StatusOr<std::unique_ptr<GpuMaxPool2d>> Create(GpuContext* ctx, int64_t kernel,
                                                              int64_t stride);
  ~GpuMaxPool2d() override;
  std::string Describe() const override;
  absl::Status Forward(const GpuTensor& input, GpuTensor* output, bool training) override;
  absl::Status Backward(const GpuTensor& grad_output, GpuTensor* grad_input) override;

 private:
  GpuMaxPool2d(GpuContext* ctx, int64_t kernel, int64_t stride)
      : ctx_(ctx), kernel_(kernel), stride_(stride) {}
  GpuContext* ctx_;
  int64_t kernel_;
  int64_t stride_;
  absl::Status Init();
  cudnnPoolingDescriptor_t pool_desc_ = nullptr;
  cudnnTensorDescriptor_t x_desc_ = nullptr;
  cudnnTensorDescriptor_t y_desc_ = nullptr;
  const GpuTensor* input_ = nullptr;
  const GpuTensor* output_ = nullptr;
};

class GpuFlatten final : public GpuLayer {
 public:
  std::string Describe() const override { return "Flatten(start_dim=1, end_dim=-1)"; }
  // `output` becomes a view of `input`.
  absl::Status Forward(const GpuTensor& input, GpuTensor* output, bool training) override;
  // `grad_input` becomes a view of `grad_output`.
  absl::Status Backward(const GpuTensor& grad_output, GpuTensor* grad_input) override;

 private:
  std::vector<int64_t> input_shape_;
};

// Inverted dropout with dropout_mask.h's counter-based mask: a pure function
// of the seed (SetSeed), the number of training forwards since, and the
// element index. Backward recomputes the mask instead of storing it.
class GpuDropout final : public GpuLayer {
 public:
  // p in [0, 1].
  GpuDropout(GpuContext* ctx, double p) : ctx_(ctx), p_(p) {}
  std::string Describe() const override;
  absl::Status Forward(const GpuTensor& input, GpuTensor* output, bool training) override;
  absl::Status Backward(const GpuTensor& grad_output, GpuTensor* grad_input) override;
  void SetSeed(uint64_t seed) override {
    seed_ = seed;
    draws_ = 0;
  }
  bool DrawsOnTheHost() const override { return p_ > 0; }
  // The key of the last training Forward's mask (dropout_mask.h).
  uint64_t last_key() const { return key_; }
  double p() const { return p_; }

 private:
  GpuContext* ctx_;
  double p_;
  uint64_t seed_ = 0;
  uint64_t draws_ = 0;
  uint64_t key_ = 0;
  bool last_training_ = false;
  int64_t last_numel_ = 0;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_LAYERS_H_
