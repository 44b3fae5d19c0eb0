#ifndef AIDN_WORKER_ENGINE_RESNET_H_
#define AIDN_WORKER_ENGINE_RESNET_H_

// ResNet-18 and ResNet-50 (He et al., 2016) as torchvision 0.14 defines
// them, with a small-image stem for 28-32 px inputs (the usual CIFAR
// adaptation: conv1 a 3x3, stride 1 convolution and no max pool):
//
//   conv1 (3x3, 64, no bias), bn1, relu,
//   layer1..layer4: residual blocks of 64, 128, 256 and 512 planes (2, 2,
//     2, 2 BasicBlocks for ResNet-18; 3, 4, 6, 3 Bottlenecks, 4x wide, for
//     ResNet-50), the first block of layers 2-4 with stride 2,
//   avgpool (to 1x1), flatten, fc.
//
// Parameter and buffer names are torchvision's ("layer1.0.conv1.weight",
// "layer2.0.downsample.1.running_var", "fc.bias"), so a state dict loads
// into torchvision's model with conv1 and maxpool replaced as above
// (strict=False: num_batches_tracked is not kept). Initialisation as
// torchvision's: convolutions Kaiming-normal (fan_out, ReLU gain),
// BatchNorm weight 1 and bias 0, fc as torch's nn.Linear; drawn from aidn's
// own generator.

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/engine/batchnorm.h"
#include "worker/engine/layers.h"
#include "worker/engine/model.h"

namespace aidn::engine {

// A residual block: relu(main(x) + shortcut(x)).
//   BasicBlock   main = conv3x3(stride), bn1, relu, conv3x3, bn2
//   Bottleneck   main = conv1x1, bn1, relu, conv3x3(stride), bn2, relu,
//                       conv1x1 (4x planes), bn3 (torchvision's v1.5:
//                       the stride in the 3x3)
// The shortcut is the identity, or conv1x1(stride) and a BatchNorm
// ("downsample.0", "downsample.1") when the shape changes.
//
// Stochastic depth (`drop_prob` > 0, training only): each forward skips
// the main path with that probability, as LayerDrop does: the output is
// relu(shortcut(x)), the main path is not computed (its BatchNorm
// statistics stay) and its parameters are unused (UnusedParameters); a
// kept main path is scaled by 1 / (1 - drop_prob). The draws come from a
// generator SetSeed seeds.
class ResidualBlock final : public Layer {
 public:
  ResidualBlock(int64_t in_planes, int64_t planes, int64_t stride, bool bottleneck,
                double drop_prob = 0.0);
  std::string Describe() const override;
  void Forward(const Tensor& input, Tensor* output, bool training) override;
  void Backward(const Tensor& grad_output, Tensor* grad_input) override;
  std::vector<Parameter*> Parameters() override;
  std::vector<Parameter*> Buffers() override;
  std::vector<Parameter*> UnusedParameters() override;
  void SetSeed(uint64_t seed) override { rng_.seed(seed); }
  void SetBatchNormSync(Communicator* comm) override;
  void FreezeRunningStatistics(bool frozen) override;
  absl::Status TakeCollectiveStatus() override;

  int64_t out_planes() const { return out_planes_; }
  double drop_prob() const { return drop_prob_; }
  // The main path's and the shortcut's layers (empty: the identity), in
  // order, with their names (the GPU engine mirrors them).
  const std::vector<std::pair<std::string, std::unique_ptr<Layer>>>& main_path() const {
    return main_;
  }
  const std::vector<std::pair<std::string, std::unique_ptr<Layer>>>& shortcut() const {
    return shortcut_;
  }
  // The convolutions in registration order (for initialisation).
  std::vector<Conv2d*> Convolutions();

 private:
  int64_t in_planes_;
  int64_t planes_;
  int64_t out_planes_;
  int64_t stride_;
  bool bottleneck_;
  double drop_prob_;
  std::mt19937_64 rng_{0};
  // The last forward skipped the main path, or scaled it by `scale_`.
  bool dropped_ = false;
  float scale_ = 1.0f;
  Tensor scaled_grad_;
  // The main path's layers with their names, and the shortcut's (empty:
  // the identity).
  std::vector<std::pair<std::string, std::unique_ptr<Layer>>> main_;
  std::vector<std::pair<std::string, std::unique_ptr<Layer>>> shortcut_;
  // Each main and shortcut layer's output, and their gradients.
  std::vector<Tensor> main_out_;
  std::vector<Tensor> main_grad_;
  std::vector<Tensor> short_out_;
  std::vector<Tensor> short_grad_;
  Tensor sum_grad_;
  const Tensor* input_ = nullptr;
  const Tensor* output_ = nullptr;
};

// torch's AdaptiveAvgPool2d((1, 1)): [N, C, H, W] -> [N, C, 1, 1].
class GlobalAvgPool2d final : public Layer {
 public:
  std::string Describe() const override { return "AdaptiveAvgPool2d(output_size=(1, 1))"; }
  void Forward(const Tensor& input, Tensor* output, bool training) override;
  void Backward(const Tensor& grad_output, Tensor* grad_input) override;

 private:
  std::vector<int64_t> input_shape_;
};

// "resnet18" or "resnet50" over config.in_channels x height x width images
// and config.classes classes, every block with config.stochastic_depth as
// its drop probability. INVALID_ARGUMENT for another name, images smaller
// than 8x8 or a drop probability outside [0, 1).
absl::StatusOr<std::unique_ptr<Sequential>> BuildResNet(const ModelConfig& config, uint64_t seed);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_RESNET_H_
