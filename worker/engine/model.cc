#include "worker/engine/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "worker/engine/layers.h"
#include "worker/engine/resnet.h"

namespace aidn::engine {

// ---------------------------------------------------------------- Sequential

void Sequential::Add(std::unique_ptr<Layer> layer, const std::string& name) {
  AIDN_CHECK(layer != nullptr) << "Sequential::Add(nullptr)";
  const size_t index = layers_.size();
  const std::string prefix = name.empty() ? absl::StrCat(index) : name;
  std::vector<Parameter*> params = layer->Parameters();
  for (Parameter* p : params) {
    // torch's nn.Sequential names a child's parameters "<index>.<name>".
    p->name = absl::StrCat(prefix, ".", p->name);
    parameters_.push_back(p);
  }
  std::vector<Parameter*> buffers = layer->Buffers();
  for (Parameter* b : buffers) {
    b->name = absl::StrCat(prefix, ".", b->name);
    buffers_.push_back(b);
  }
  layer_buffers_.push_back(std::move(buffers));
  if (!params.empty() && first_trainable_ < 0) first_trainable_ = static_cast<int>(index);
  // Only parameter-free layers are fused: a fused layer's gradients would
  // never be reported ready.
  const bool fused =
      params.empty() && last_run_ >= 0 && layers_[static_cast<size_t>(last_run_)]->Fuse(*layer);
  fused_.push_back(fused);
  if (!fused) last_run_ = static_cast<int>(index);
  unit_.push_back(params.empty() ? 0 : num_units_++);
  layer_parameters_.push_back(std::move(params));
  layers_.push_back(std::move(layer));
  activations_.resize(layers_.size());
  grads_.resize(layers_.size());
}

void Sequential::Forward(const Tensor& input, Tensor* logits, bool training) {
  ForwardRange(0, layers_.size(), input, logits, training);
}

void Sequential::ForwardRange(size_t begin, size_t end, const Tensor& input, Tensor* output,
                              bool training) {
  AIDN_CHECK(begin < end && end <= layers_.size() && !fused_[begin])
      << "Sequential::ForwardRange(" << begin << ", " << end << ") of " << layers_.size()
      << " layers";
  const Tensor* x = &input;
  const size_t last = end - 1;
  if (hooks_ != nullptr) hooks_->BeforeForward(0);
  for (size_t i = begin; i < end; ++i) {
    if (fused_[i]) continue;
    // The last layer writes straight into the caller's tensor; the others
    // into activations_ that stay alive until Backward (layers keep pointers
    // to their inputs, fused ones to their outputs).
    Tensor* y = i == last ? output : &activations_[i];
    const int unit = hooks_ != nullptr ? unit_[i] : 0;
    if (unit > 0) hooks_->BeforeForward(unit);
    layers_[i]->Forward(*x, y, training);
    if (unit > 0) hooks_->AfterForward(unit);
    x = y;
  }
  if (hooks_ != nullptr) hooks_->AfterForward(0);
  // The last layers were fused into an earlier one, which wrote into its
  // own activation (it needs that until Backward).
  if (x != output) {
    EnsureShape(output, x->shape());
    if (x->numel() > 0) std::memcpy(output->data(), x->data(), sizeof(float) * x->numel());
  }
}

void Sequential::Backward(const Tensor& grad_logits) {
  BackwardRange(0, layers_.size(), grad_logits, nullptr);
}

void Sequential::BackwardRange(size_t begin, size_t end, const Tensor& grad_output,
                               Tensor* grad_input) {
  AIDN_CHECK(begin < end && end <= layers_.size())
      << "Sequential::BackwardRange(" << begin << ", " << end << ")";
  const Tensor* g = &grad_output;
  if (hooks_ != nullptr) hooks_->BeforeBackward(0);
  for (int i = static_cast<int>(end) - 1; i >= static_cast<int>(begin); --i) {
    if (fused_[static_cast<size_t>(i)]) continue;
    // The input of the model needs no gradient, and neither does anything
    // before the first layer with parameters (as torch's autograd skips the
    // first Linear's dx GEMM). The range's first layer writes the caller's.
    Tensor* gi = i > first_trainable_ && first_trainable_ >= 0 ? &grads_[i] : nullptr;
    if (i == static_cast<int>(begin)) gi = grad_input;
    const int unit = hooks_ != nullptr ? unit_[static_cast<size_t>(i)] : 0;
    if (unit > 0) hooks_->BeforeBackward(unit);
    layers_[i]->Backward(*g, gi);
    if (unit > 0) hooks_->AfterBackward(unit);
    if (grad_ready_) {
      const std::vector<Parameter*>& params = layer_parameters_[static_cast<size_t>(i)];
      const std::vector<Parameter*> unused = layers_[i]->UnusedParameters();
      for (auto it = params.rbegin(); it != params.rend(); ++it) {
        if (std::find(unused.begin(), unused.end(), *it) == unused.end()) grad_ready_(*it);
      }
    }
    if (gi == nullptr) break;
    g = gi;
  }
  if (hooks_ != nullptr) hooks_->AfterBackward(0);
}

std::vector<Parameter*> Sequential::UnusedParameters() const {
  std::vector<Parameter*> unused;
  for (const std::unique_ptr<Layer>& layer : layers_) {
    for (Parameter* p : layer->UnusedParameters()) unused.push_back(p);
  }
  return unused;
}

void Sequential::SetBatchNormSync(Communicator* comm) {
  for (const std::unique_ptr<Layer>& layer : layers_) layer->SetBatchNormSync(comm);
}

void Sequential::FreezeRunningStatistics(bool frozen) {
  for (const std::unique_ptr<Layer>& layer : layers_) layer->FreezeRunningStatistics(frozen);
}

absl::Status Sequential::TakeCollectiveStatus() {
  absl::Status first;
  for (const std::unique_ptr<Layer>& layer : layers_) first.Update(layer->TakeCollectiveStatus());
  return first;
}

std::vector<Parameter*> Sequential::ParametersOf(size_t begin, size_t end) const {
  std::vector<Parameter*> params;
  for (size_t i = begin; i < end && i < layers_.size(); ++i) {
    params.insert(params.end(), layer_parameters_[i].begin(), layer_parameters_[i].end());
  }
  return params;
}

std::vector<Parameter*> Sequential::BuffersOf(size_t begin, size_t end) const {
  std::vector<Parameter*> buffers;
  for (size_t i = begin; i < end && i < layers_.size(); ++i) {
    buffers.insert(buffers.end(), layer_buffers_[i].begin(), layer_buffers_[i].end());
  }
  return buffers;
}

std::vector<std::vector<Parameter*>> Sequential::Units() const {
  std::vector<std::vector<Parameter*>> units(static_cast<size_t>(num_units_));
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (unit_[i] > 0) units[static_cast<size_t>(unit_[i])] = layer_parameters_[i];
  }
  return units;
}

void Sequential::ZeroGrad() {
  for (Parameter* p : parameters_) p->grad.Zero();
}

uint64_t LayerSeed(uint64_t seed, size_t index) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void Sequential::SetSeed(uint64_t seed) {
  for (size_t i = 0; i < layers_.size(); ++i) layers_[i]->SetSeed(LayerSeed(seed, i));
}

int64_t Sequential::ParameterCount() const {
  int64_t n = 0;
  for (const Parameter* p : parameters_) n += p->value.numel();
  return n;
}

std::string Sequential::Describe() const {
  std::string s = "Sequential(\n";
  for (size_t i = 0; i < layers_.size(); ++i) {
    absl::StrAppend(&s, "  (", i, "): ", layers_[i]->Describe(), "\n");
  }
  return s + ")";
}

// ---------------------------------------------------------------- BuildModel

void InitUniform(Parameter* p, int64_t fan_in, std::mt19937_64* rng) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  float* v = p->value.data();
  for (int64_t i = 0; i < p->value.numel(); ++i) {
    const double u = static_cast<double>((*rng)() >> 40) * 0x1p-24;  // [0, 1)
    v[i] = static_cast<float>((2.0 * u - 1.0) * bound);
  }
}

namespace {

std::unique_ptr<Linear> MakeLinear(int64_t in, int64_t out, std::mt19937_64* rng) {
  auto layer = std::make_unique<Linear>(in, out);
  InitUniform(&layer->weight(), in, rng);
  InitUniform(&layer->bias(), in, rng);
  return layer;
}

std::unique_ptr<Conv2d> MakeConv(int64_t in, int64_t out, int64_t kernel, std::mt19937_64* rng) {
  auto layer = std::make_unique<Conv2d>(in, out, kernel);
  InitUniform(&layer->weight(), layer->fan_in(), rng);
  InitUniform(&layer->bias(), layer->fan_in(), rng);
  return layer;
}

// Keeps BuildModel's allocations bounded for absurd specs.
constexpr int64_t kMaxWidth = 1 << 20;

}  // namespace

absl::StatusOr<std::unique_ptr<Sequential>> BuildModel(const ModelConfig& config, uint64_t seed) {
  if (config.in_channels <= 0 || config.height <= 0 || config.width <= 0 || config.classes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model input must be positive: in_channels ", config.in_channels, ", height ",
                     config.height, ", width ", config.width, ", classes ", config.classes));
  }
  if (!(config.dropout >= 0.0 && config.dropout < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dropout must be in [0, 1), got ", config.dropout));
  }
  if (config.name == "resnet18" || config.name == "resnet50") return BuildResNet(config, seed);
  std::mt19937_64 rng(seed);
  auto model = std::make_unique<Sequential>();
  if (config.name == "mlp") {
    int64_t width = int64_t{config.in_channels} * config.height * config.width;
    if (width > kMaxWidth) {
      return absl::InvalidArgumentError(absl::StrCat("mlp input width ", width, " is too large"));
    }
    for (size_t i = 0; i < config.hidden_sizes.size(); ++i) {
      const int h = config.hidden_sizes[i];
      if (h <= 0 || h > kMaxWidth) {
        return absl::InvalidArgumentError(
            absl::StrCat("mlp hidden_sizes[", i, "] = ", h, " must be in [1, ", kMaxWidth, "]"));
      }
    }
    model->Add(std::make_unique<Flatten>());
    for (int h : config.hidden_sizes) {
      model->Add(MakeLinear(width, h, &rng));
      model->Add(std::make_unique<ReLU>());
      if (config.dropout > 0.0) model->Add(std::make_unique<Dropout>(config.dropout));
      width = h;
    }
    model->Add(MakeLinear(width, config.classes, &rng));
    return model;
  }
  if (config.name == "cnn") {
    // conv 3x3 (no padding) then pool 2, twice.
    const int64_t h = ((config.height - 2) / 2 - 2) / 2;
    const int64_t w = ((config.width - 2) / 2 - 2) / 2;
    if (config.height < 8 || config.width < 8 || h <= 0 || w <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cnn needs images of at least 8x8, got ", config.height, "x", config.width));
    }
    if (64 * h * w > kMaxWidth) {
      return absl::InvalidArgumentError("cnn input is too large");
    }
    model->Add(MakeConv(config.in_channels, 32, 3, &rng));
    model->Add(std::make_unique<ReLU>());
    model->Add(std::make_unique<MaxPool2d>(2));
    model->Add(MakeConv(32, 64, 3, &rng));
    model->Add(std::make_unique<ReLU>());
    model->Add(std::make_unique<MaxPool2d>(2));
    model->Add(std::make_unique<Flatten>());
    model->Add(MakeLinear(64 * h * w, 128, &rng));
    model->Add(std::make_unique<ReLU>());
    // The fully connected hidden activation is the cnn's only dropout site.
    if (config.dropout > 0.0) model->Add(std::make_unique<Dropout>(config.dropout));
    model->Add(MakeLinear(128, config.classes, &rng));
    return model;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown model \"", config.name, "\" (want \"mlp\", \"cnn\", \"resnet18\" or \"resnet50\")"));
}

}  // namespace aidn::engine
