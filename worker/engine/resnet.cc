#include "worker/engine/resnet.h"

#include <cmath>
#include <cstring>
#include <numbers>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "worker/engine/cpu_kernels.h"

namespace aidn::engine {
namespace {

using NamedLayers = std::vector<std::pair<std::string, std::unique_ptr<Layer>>>;

// torchvision's kaiming_normal_(mode="fan_out", nonlinearity="relu"):
// N(0, 2 / fan_out), fan_out = out_channels x kernel x kernel; Box-Muller
// over 53-bit uniforms of the generator.
void InitKaimingNormal(Conv2d* conv, std::mt19937_64* rng) {
  const double fan_out =
      static_cast<double>(conv->out_channels() * conv->kernel() * conv->kernel());
  const double std = std::sqrt(2.0 / fan_out);
  Tensor& w = conv->weight().value;
  for (int64_t i = 0; i < w.numel(); ++i) {
    const double u1 = (static_cast<double>((*rng)() >> 11) + 1.0) * 0x1p-53;  // (0, 1]
    const double u2 = static_cast<double>((*rng)() >> 11) * 0x1p-53;          // [0, 1)
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    w.data()[i] = static_cast<float>(z * std);
  }
}

// Names the layers' parameters and buffers "<name>.<own name>" and lists
// them in order.
void Collect(NamedLayers& layers, std::vector<Parameter*>* params,
             std::vector<Parameter*>* buffers) {
  for (auto& [name, layer] : layers) {
    for (Parameter* p : layer->Parameters()) params->push_back(p);
    for (Parameter* b : layer->Buffers()) buffers->push_back(b);
  }
}

void Rename(NamedLayers& layers) {
  for (auto& [name, layer] : layers) {
    for (Parameter* p : layer->Parameters()) p->name = absl::StrCat(name, ".", p->name);
    for (Parameter* b : layer->Buffers()) b->name = absl::StrCat(name, ".", b->name);
  }
}

// Forward through `layers` from `input`, each output kept in outs[i];
// returns the last output (or the input when there are no layers).
const Tensor* RunForward(NamedLayers& layers, std::vector<Tensor>& outs, const Tensor& input,
                         bool training) {
  const Tensor* x = &input;
  for (size_t i = 0; i < layers.size(); ++i) {
    layers[i].second->Forward(*x, &outs[i], training);
    x = &outs[i];
  }
  return x;
}

// Backward through `layers` from `grad`; the first layer's input gradient
// goes into `grad_input` (null: not needed), the others' into grads[i].
void RunBackward(NamedLayers& layers, std::vector<Tensor>& grads, const Tensor& grad,
                 Tensor* grad_input) {
  const Tensor* g = &grad;
  for (size_t i = layers.size(); i-- > 0;) {
    Tensor* gin = i > 0 ? &grads[i] : grad_input;
    layers[i].second->Backward(*g, gin);
    g = gin;
  }
}

}  // namespace

ResidualBlock::ResidualBlock(int64_t in_planes, int64_t planes, int64_t stride, bool bottleneck,
                             double drop_prob)
    : in_planes_(in_planes),
      planes_(planes),
      out_planes_(bottleneck ? 4 * planes : planes),
      stride_(stride),
      bottleneck_(bottleneck),
      drop_prob_(drop_prob) {
  AIDN_CHECK(in_planes > 0 && planes > 0 && stride > 0 && drop_prob >= 0 && drop_prob < 1)
      << "bad ResidualBlock";
  auto conv = [](int64_t in, int64_t out, int64_t kernel, int64_t stride) {
    return std::make_unique<Conv2d>(in, out, kernel, stride, kernel / 2, /*bias=*/false);
  };
  if (bottleneck) {
    main_.emplace_back("conv1", conv(in_planes, planes, 1, 1));
    main_.emplace_back("bn1", std::make_unique<BatchNorm2d>(planes));
    main_.emplace_back("relu", std::make_unique<ReLU>());
    main_.emplace_back("conv2", conv(planes, planes, 3, stride));
    main_.emplace_back("bn2", std::make_unique<BatchNorm2d>(planes));
    main_.emplace_back("relu", std::make_unique<ReLU>());
    main_.emplace_back("conv3", conv(planes, out_planes_, 1, 1));
    main_.emplace_back("bn3", std::make_unique<BatchNorm2d>(out_planes_));
  } else {
    main_.emplace_back("conv1", conv(in_planes, planes, 3, stride));
    main_.emplace_back("bn1", std::make_unique<BatchNorm2d>(planes));
    main_.emplace_back("relu", std::make_unique<ReLU>());
    main_.emplace_back("conv2", conv(planes, planes, 3, 1));
    main_.emplace_back("bn2", std::make_unique<BatchNorm2d>(planes));
  }
  if (stride != 1 || in_planes != out_planes_) {
    shortcut_.emplace_back("downsample.0", conv(in_planes, out_planes_, 1, stride));
    shortcut_.emplace_back("downsample.1", std::make_unique<BatchNorm2d>(out_planes_));
  }
  Rename(main_);
  Rename(shortcut_);
  main_out_.resize(main_.size());
  main_grad_.resize(main_.size());
  short_out_.resize(shortcut_.size());
  short_grad_.resize(shortcut_.size());
}

std::string ResidualBlock::Describe() const {
  return absl::StrCat(bottleneck_ ? "Bottleneck(" : "BasicBlock(", in_planes_, ", ", planes_,
                      ", stride=", stride_, shortcut_.empty() ? "" : ", downsample",
                      drop_prob_ > 0 ? absl::StrCat(", stochastic_depth=", drop_prob_) : "", ")");
}

std::vector<Parameter*> ResidualBlock::Parameters() {
  std::vector<Parameter*> params, buffers;
  Collect(main_, &params, &buffers);
  Collect(shortcut_, &params, &buffers);
  return params;
}

std::vector<Parameter*> ResidualBlock::Buffers() {
  std::vector<Parameter*> params, buffers;
  Collect(main_, &params, &buffers);
  Collect(shortcut_, &params, &buffers);
  return buffers;
}

std::vector<Parameter*> ResidualBlock::UnusedParameters() {
  if (!dropped_) return {};
  std::vector<Parameter*> params, buffers;
  Collect(main_, &params, &buffers);
  return params;
}

void ResidualBlock::SetBatchNormSync(Communicator* comm) {
  for (NamedLayers* layers : {&main_, &shortcut_}) {
    for (auto& [name, layer] : *layers) layer->SetBatchNormSync(comm);
  }
}

void ResidualBlock::FreezeRunningStatistics(bool frozen) {
  for (NamedLayers* layers : {&main_, &shortcut_}) {
    for (auto& [name, layer] : *layers) layer->FreezeRunningStatistics(frozen);
  }
}

absl::Status ResidualBlock::TakeCollectiveStatus() {
  absl::Status first;
  for (NamedLayers* layers : {&main_, &shortcut_}) {
    for (auto& [name, layer] : *layers) first.Update(layer->TakeCollectiveStatus());
  }
  return first;
}

std::vector<Conv2d*> ResidualBlock::Convolutions() {
  std::vector<Conv2d*> convs;
  for (NamedLayers* layers : {&main_, &shortcut_}) {
    for (auto& [name, layer] : *layers) {
      if (auto* c = dynamic_cast<Conv2d*>(layer.get())) convs.push_back(c);
    }
  }
  return convs;
}

void ResidualBlock::Forward(const Tensor& input, Tensor* output, bool training) {
  AIDN_CHECK(input.rank() == 4 && input.dim(1) == in_planes_)
      << Describe() << " got input " << input.ShapeString();
  input_ = &input;
  dropped_ = false;
  scale_ = 1.0f;
  if (training && drop_prob_ > 0) {
    const double u = static_cast<double>(rng_() >> 11) * 0x1p-53;
    dropped_ = u < drop_prob_;
    scale_ = static_cast<float>(1.0 / (1.0 - drop_prob_));
  }
  const Tensor* shortcut = RunForward(shortcut_, short_out_, input, training);
  const float* b = shortcut->data();
  if (dropped_) {
    EnsureShape(output, shortcut->shape());
    cpu::ReluKernel(b, output->data(), output->numel());
    output_ = output;
    return;
  }
  const Tensor* main = RunForward(main_, main_out_, input, training);
  AIDN_CHECK(main->shape() == shortcut->shape())
      << Describe() << ": main path " << main->ShapeString() << ", shortcut "
      << shortcut->ShapeString();
  EnsureShape(output, main->shape());
  cpu::ScaledAddReluKernel(main->data(), scale_, b, output->data(), output->numel());
  output_ = output;
}

void ResidualBlock::Backward(const Tensor& grad_output, Tensor* grad_input) {
  AIDN_CHECK(output_ != nullptr && grad_output.shape() == output_->shape())
      << Describe() << " backward got " << grad_output.ShapeString();
  // Through the final ReLU: the gradient of the sum, which both paths get.
  EnsureShape(&sum_grad_, grad_output.shape());
  float* gs = sum_grad_.data();
  cpu::ReluGradKernel(output_->data(), grad_output.data(), gs, sum_grad_.numel());
  if (dropped_) {
    // The shortcut alone; the main path's gradients stay as they were.
    if (shortcut_.empty()) {
      if (grad_input != nullptr) {
        EnsureShape(grad_input, sum_grad_.shape());
        std::memcpy(grad_input->data(), gs, sizeof(float) * sum_grad_.numel());
      }
      return;
    }
    RunBackward(shortcut_, short_grad_, sum_grad_, grad_input);
    return;
  }
  if (scale_ == 1.0f) {
    RunBackward(main_, main_grad_, sum_grad_, grad_input);
  } else {
    EnsureShape(&scaled_grad_, sum_grad_.shape());
    for (int64_t i = 0; i < sum_grad_.numel(); ++i) scaled_grad_.data()[i] = gs[i] * scale_;
    RunBackward(main_, main_grad_, scaled_grad_, grad_input);
  }
  if (grad_input == nullptr) {
    RunBackward(shortcut_, short_grad_, sum_grad_, nullptr);
    return;
  }
  const Tensor* extra = &sum_grad_;
  if (!shortcut_.empty()) {
    RunBackward(shortcut_, short_grad_, sum_grad_, &short_grad_[0]);
    extra = &short_grad_[0];
  }
  cpu::AccumulateKernel(extra->data(), grad_input->data(), grad_input->numel());
}

void GlobalAvgPool2d::Forward(const Tensor& input, Tensor* output, bool /*training*/) {
  AIDN_CHECK(input.rank() == 4) << Describe() << " got input " << input.ShapeString();
  input_shape_ = input.shape();
  const int64_t planes = input.dim(0) * input.dim(1);
  const int64_t plane = input.dim(2) * input.dim(3);
  EnsureShape(output, {input.dim(0), input.dim(1), 1, 1});
  const float* x = input.data();
  for (int64_t p = 0; p < planes; ++p) {
    double sum = 0;
    for (int64_t j = 0; j < plane; ++j) sum += x[p * plane + j];
    output->data()[p] = static_cast<float>(sum / static_cast<double>(plane));
  }
}

void GlobalAvgPool2d::Backward(const Tensor& grad_output, Tensor* grad_input) {
  if (grad_input == nullptr) return;
  EnsureShape(grad_input, input_shape_);
  const int64_t planes = input_shape_[0] * input_shape_[1];
  const int64_t plane = input_shape_[2] * input_shape_[3];
  const float scale = 1.0f / static_cast<float>(plane);
  for (int64_t p = 0; p < planes; ++p) {
    const float v = grad_output.data()[p] * scale;
    for (int64_t j = 0; j < plane; ++j) grad_input->data()[p * plane + j] = v;
  }
}

absl::StatusOr<std::unique_ptr<Sequential>> BuildResNet(const ModelConfig& config, uint64_t seed) {
  std::vector<int> blocks;
  bool bottleneck = false;
  if (config.name == "resnet18") {
    blocks = {2, 2, 2, 2};
  } else if (config.name == "resnet50") {
    blocks = {3, 4, 6, 3};
    bottleneck = true;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown ResNet \"", config.name, "\" (want resnet18 or resnet50)"));
  }
  if (!(config.stochastic_depth >= 0 && config.stochastic_depth < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("stochastic_depth must be in [0, 1), got ", config.stochastic_depth));
  }
  if (config.height < 8 || config.width < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        config.name, " needs images of at least 8x8, got ", config.height, "x", config.width));
  }
  std::mt19937_64 rng(seed);
  auto model = std::make_unique<Sequential>();
  auto conv1 = std::make_unique<Conv2d>(config.in_channels, 64, 3, 1, 1, /*bias=*/false);
  InitKaimingNormal(conv1.get(), &rng);
  model->Add(std::move(conv1), "conv1");
  model->Add(std::make_unique<BatchNorm2d>(64), "bn1");
  model->Add(std::make_unique<ReLU>(), "relu");
  int64_t in = 64;
  for (size_t l = 0; l < blocks.size(); ++l) {
    const int64_t planes = int64_t{64} << l;
    for (int b = 0; b < blocks[l]; ++b) {
      const int64_t stride = l > 0 && b == 0 ? 2 : 1;
      auto block =
          std::make_unique<ResidualBlock>(in, planes, stride, bottleneck, config.stochastic_depth);
      for (Conv2d* c : block->Convolutions()) InitKaimingNormal(c, &rng);
      in = block->out_planes();
      model->Add(std::move(block), absl::StrCat("layer", l + 1, ".", b));
    }
  }
  model->Add(std::make_unique<GlobalAvgPool2d>(), "avgpool");
  model->Add(std::make_unique<Flatten>(), "flatten");
  auto fc = std::make_unique<Linear>(in, config.classes);
  InitUniform(&fc->weight(), in, &rng);
  InitUniform(&fc->bias(), in, &rng);
  model->Add(std::move(fc), "fc");
  return model;
}

}  // namespace aidn::engine
