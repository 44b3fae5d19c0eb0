#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_RESNET_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_RESNET_H_

// The ResNets' layers (worker/engine/batchnorm.h, resnet.h) on the GPU,
// with the CPU layers' contracts (gpu_layers.h), so that MirrorLayer, and
// with it GpuModel, mirror a ResNet:
//
//   GpuBatchNorm2d     cuDNN's spatial batch normalisation: training
//                      normalises with the batch's statistics and moves
//                      the running ones by `momentum` (cuDNN keeps the
//                      unbiased variance, as torch); eval uses the running
//                      ones; backward accumulates the weight's and bias's
//                      gradients. Statistics in fp32 (the CPU sums in
//                      double), whatever the context's precision.
//                      SyncBatchNorm (SetBatchNormSync): training runs on
//                      the engine's own kernels (ddp_kernels.h) with the
//                      CPU layer's exchange: each rank's per-channel mean,
//                      sum of squared deviations and count all-gathered
//                      and combined in rank order, sum(dy) and
//                      sum(dy xhat) summed over the ranks in backward (the
//                      weight's and bias's gradients stay the rank's own).
//   GpuResidualBlock   a BasicBlock or Bottleneck: the main path and the
//                      shortcut (identity, or conv1x1 + BatchNorm) mirrored
//                      from the CPU block, relu(main + shortcut). Stochastic
//                      depth as the CPU block: the same draws from the same
//                      seeds (on the host), a skipped main path not computed
//                      and its parameters unused, a kept one scaled by
//                      1 / (1 - drop_prob).
//   GpuGlobalAvgPool2d AdaptiveAvgPool2d((1, 1)) by plane means.
//
#include <cudnn.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/batchnorm.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_layers.h"
#include "worker/engine/cuda/gpu_tensor.h"
#include "worker/engine/resnet.h"

namespace aidn::engine::cuda {

class GpuBatchNorm2d final : public GpuLayer {
 public:
  // Weight 1, bias 0, running mean 0 and variance 1 (MirrorLayer then
  // copies the CPU layer's).
  static absl::StatusOr<std::unique_ptr<GpuBatchNorm2d>> Create(GpuContext* ctx, int64_t channels,
                                                                double eps, double momentum);
  ~GpuBatchNorm2d() override;
  std::string Describe() const override;
  absl::Status Forward(const GpuTensor& input, GpuTensor* output, bool training) override;
  // FAILED_PRECONDITION after an eval Forward (nothing to differentiate).
  absl::Status Backward(const GpuTensor& grad_output, GpuTensor* grad_input) override;
  std::vector<GpuParameter*> Parameters() override { return {&weight_, &bias_}; }
  std::vector<GpuParameter*> Buffers() override { return {&running_mean_, &running_var_}; }
  void SetBatchNormSync(StreamCollectives* sync) override { sync_ = sync; }

 private:
  GpuBatchNorm2d(GpuContext* ctx, int64_t channels, double eps, double momentum)
      : ctx_(ctx), channels_(channels), eps_(eps), momentum_(momentum) {}
  // Describes an input of `shape` to cuDNN (once per shape).
  absl::Status Prepare(const std::vector<int64_t>& shape);
  // SyncBatchNorm's training forward and backward.
  absl::Status SyncedForward(const GpuTensor& input, GpuTensor* output);
  absl::Status SyncedBackward(const GpuTensor& grad_output, GpuTensor* grad_input);

  GpuContext* ctx_;
  int64_t channels_;
  double eps_;
  double momentum_;
  GpuParameter weight_, bias_, running_mean_, running_var_;
  cudnnTensorDescriptor_t x_desc_ = nullptr;
  cudnnTensorDescriptor_t bn_desc_ = nullptr;
  std::vector<int64_t> shape_;
  // The last training Forward's mean and 1/sqrt(var + eps), for Backward.
  GpuTensor save_mean_, save_inv_var_;
  const GpuTensor* input_ = nullptr;
  bool training_ = false;
  GpuTensor unused_grad_;  // Backward's input gradient when none is wanted
  // SyncBatchNorm: the exchange, this rank's moments [2C + 1], every
  // rank's, backward's sums [2C], and the count over every rank (a double).
  StreamCollectives* sync_ = nullptr;
  GpuTensor moments_, gathered_, sums_;
  DeviceBuffer count_;
  bool synced_ = false;  // the last training Forward was synced
};

class GpuResidualBlock final : public GpuLayer {
 public:
  // Mirrors `cpu`'s layers (weights, running statistics and names) and its
  // drop probability.
  static absl::StatusOr<std::unique_ptr<GpuResidualBlock>> Create(GpuContext* ctx,
                                                                  const ResidualBlock& cpu);
  std::string Describe() const override { return describe_; }
  absl::Status Forward(const GpuTensor& input, GpuTensor* output, bool training) override;
  absl::Status Backward(const GpuTensor& grad_output, GpuTensor* grad_input) override;
  // The main path's, then the shortcut's, as ResidualBlock lists them.
  std::vector<GpuParameter*> Parameters() override;
  std::vector<GpuParameter*> Buffers() override;
  void SetBatchNormSync(StreamCollectives* sync) override;
  void SetSeed(uint64_t seed) override { rng_.seed(seed); }
  std::vector<GpuParameter*> UnusedParameters() override;
  bool DrawsOnTheHost() const override { return drop_prob_ > 0; }
  // Whether the last Forward skipped the main path.
  bool dropped() const { return dropped_; }

 private:
  explicit GpuResidualBlock(GpuContext* ctx) : ctx_(ctx) {}
  // One path's layers, their outputs, and the gradients of their inputs.
  struct Path {
    std::vector<std::unique_ptr<GpuLayer>> layers;
    std::vector<GpuTensor> out;
    std::vector<GpuTensor> grad;
  };
  static absl::Status RunForward(Path& path, const GpuTensor& input, bool training,
                                 const GpuTensor** result);
  // The gradient of the path's input into `grad_input` (may be null).
  static absl::Status RunBackward(Path& path, const GpuTensor& grad_output, GpuTensor* grad_input);

  GpuContext* ctx_;
  std::string describe_;
  Path main_;
  Path shortcut_;  // no layers: the identity
  const GpuTensor* output_ = nullptr;
  GpuTensor sum_grad_;    // the gradient through the final ReLU
  GpuTensor short_grad_;  // the shortcut's input gradient
  // Stochastic depth: the CPU block's generator and draw, and the last
  // forward's choice; the main path's gradient scaled.
  double drop_prob_ = 0;
  std::mt19937_64 rng_{0};
  bool dropped_ = false;
  float scale_ = 1.0f;
  GpuTensor scaled_grad_;
};

class GpuGlobalAvgPool2d final : public GpuLayer {
 public:
  explicit GpuGlobalAvgPool2d(GpuContext* ctx) : ctx_(ctx) {}
  std::string Describe() const override { return "AdaptiveAvgPool2d(output_size=(1, 1))"; }
  absl::Status Forward(const GpuTensor& input, GpuTensor* output, bool training) override;
  absl::Status Backward(const GpuTensor& grad_output, GpuTensor* grad_input) override;

 private:
  GpuContext* ctx_;
  std::vector<int64_t> input_shape_;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_RESNET_H_
