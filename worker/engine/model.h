#ifndef AIDN_WORKER_ENGINE_MODEL_H_
#define AIDN_WORKER_ENGINE_MODEL_H_

// Layers with hand-written forward and backward passes, and the models built
// from them. Shapes: images enter as [N, 1, 28, 28] (an MLP flattens them),
// logits leave as [N, classes].
//
// Not thread-safe: one model per trainer thread. Forward keeps what Backward
// needs, so call them in pairs; layers keep pointers to their forward inputs,
// so the input of Forward must stay alive and unchanged until Backward.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/tensor.h"
#include "worker/engine/units.h"

namespace aidn::engine {

class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::string Describe() const = 0;
  // `training` switches dropout on. Output is resized as needed.
  virtual void Forward(const Tensor& input, Tensor* output, bool training) = 0;
  // Accumulates (+=) this layer's parameter gradients from `grad_output`
  // and, if `grad_input` is not null, writes the gradient of its input.
  virtual void Backward(const Tensor& grad_output, Tensor* grad_input) = 0;
  virtual std::vector<Parameter*> Parameters() { return {}; }
  // State that is not trained but saved with the weights (BatchNorm's
  // running statistics), as torch's buffers: only `value` is used.
  virtual std::vector<Parameter*> Buffers() { return {}; }
  // Parameters the last Forward did not use (a residual block whose branch
  // stochastic depth dropped): Backward leaves their gradients alone, and
  // Sequential does not report them ready.
  virtual std::vector<Parameter*> UnusedParameters() { return {}; }
  // SyncBatchNorm: BatchNorm layers (also inside blocks) normalise with
  // the statistics of every rank's batch over `comm` (not owned; null:
  // each rank its own). A collective error is kept for
  // TakeCollectiveStatus, which returns it once.
  virtual void SetBatchNormSync(Communicator* /*comm*/) {}
  virtual absl::Status TakeCollectiveStatus() { return absl::OkStatus(); }
  // While frozen, BatchNorm layers (also inside blocks) leave their running
  // statistics alone in training forwards: a pipeline stage running a
  // micro-batch's forward again before its backward (pipeline_session.h)
  // updates them once per micro-batch, as a one-rank run does.
  virtual void FreezeRunningStatistics(bool /*frozen*/) {}
  // Sequential offers each layer it is given to the last layer it runs
  // before it. Returning true means this layer takes `next`'s computation
  // over: its Forward then produces what `next` would have output, its
  // Backward takes the gradient of that output, and Sequential no longer
  // runs `next`. Fused layers must compute exactly what the layers one by
  // one compute (see layers.h); a layer fuses nothing unless it says so.
  virtual bool Fuse(const Layer& /*next*/) { return false; }
  // Seeds the layer's randomness (dropout masks) for the next Forward.
  virtual void SetSeed(uint64_t /*seed*/) {}
};

struct ModelConfig {
  // "mlp", "cnn", "resnet18" or "resnet50" (resnet.h).
  std::string name = "mlp";
  // mlp: hidden widths.
  std::vector<int> hidden_sizes = {256, 256};
  // Dropout probability after each hidden activation (0: none).
  double dropout = 0.0;
  // resnet: each residual block's main path skipped with this probability
  // per training forward (ResidualBlock; 0: never).
  double stochastic_depth = 0.0;
  int in_channels = 1;
  int height = 28;
  int width = 28;
  int classes = 10;
};

// A stack of layers, like torch.nn.Sequential. Parameter names follow the
// torch module index: the MLP 784-256-256-10 is 1.weight (after the flatten
// at index 0), 1.bias, 3.weight, ... exactly as nn.Sequential(Flatten(),
// Linear, ReLU, Linear, ReLU, Linear) names them. Add offers each layer to
// the previous one to fuse (Layer::Fuse); fused layers keep their index,
// name and Describe() line, only their computation moves.
class Sequential {
 public:
  // Called during Backward for each parameter as soon as its gradient is
  // final for this pass, in reverse layer order (DDP starts bucket
  // allreduces from here).
  using GradReadyCallback = std::function<void(Parameter*)>;

  // Names the layer's parameters and buffers "<name>.<own name>", with the
  // layer's index as its name unless `name` is given (a torchvision model's
  // "layer1.0", "fc").
  void Add(std::unique_ptr<Layer> layer, const std::string& name = "");
  void Forward(const Tensor& input, Tensor* logits, bool training);
  // `grad_logits` is dL/dlogits for the batch.
  void Backward(const Tensor& grad_logits);
  // A pipeline stage's part (pipeline_stage.h): layers [begin, end) only,
  // from `input` (what layer begin - 1 outputs, or the model's input) into
  // `output`; begin must not be a fused layer. BackwardRange takes the
  // gradient of that output and, if `grad_input` is not null, writes the
  // gradient of `input` into it. Forward and Backward are the whole range.
  void ForwardRange(size_t begin, size_t end, const Tensor& input, Tensor* output, bool training);
  void BackwardRange(size_t begin, size_t end, const Tensor& grad_output, Tensor* grad_input);
  // The parameters, and the buffers, of layers [begin, end), in
  // registration order.
  std::vector<Parameter*> ParametersOf(size_t begin, size_t end) const;
  std::vector<Parameter*> BuffersOf(size_t begin, size_t end) const;
  // Whether layer i has parameters (a unit's layer; a stage starts at one).
  bool HasParameters(size_t i) const { return !layer_parameters_[i].empty(); }
  void SetGradReadyCallback(GradReadyCallback callback) { grad_ready_ = std::move(callback); }
  // Zeroes every gradient (before the first micro-step of a step).
  void ZeroGrad();
  // Reseeds every layer with LayerSeed(seed, index).
  void SetSeed(uint64_t seed);
  // units.h: an empty root, then one unit per layer with parameters.
  std::vector<std::vector<Parameter*>> Units() const;
  // Not owned; null: none.
  void SetUnitHooks(UnitHooks* hooks) { hooks_ = hooks; }

  // The layers in order, fused ones included (the GPU engine mirrors them).
  size_t size() const { return layers_.size(); }
  const Layer& layer(size_t i) const { return *layers_[i]; }

  // In registration (forward) order.
  const std::vector<Parameter*>& Parameters() const { return parameters_; }
  const std::vector<Parameter*>& Buffers() const { return buffers_; }
  // The parameters the last forward's layers did not use
  // (Layer::UnusedParameters).
  std::vector<Parameter*> UnusedParameters() const;
  // Layer::SetBatchNormSync on every layer; the first layer's collective
  // error (Layer::TakeCollectiveStatus), once.
  void SetBatchNormSync(Communicator* comm);
  absl::Status TakeCollectiveStatus();
  // Layer::FreezeRunningStatistics on every layer.
  void FreezeRunningStatistics(bool frozen);
  int64_t ParameterCount() const;
  std::string Describe() const;

 private:
  std::vector<std::unique_ptr<Layer>> layers_;
  // layers_[i] was fused into an earlier layer and is not run.
  std::vector<bool> fused_;
  // The last layer that runs (-1: none yet).
  int last_run_ = -1;
  std::vector<Parameter*> parameters_;
  std::vector<Parameter*> buffers_;
  // layers_[i]'s parameters, for the grad-ready callbacks.
  std::vector<std::vector<Parameter*>> layer_parameters_;
  std::vector<std::vector<Parameter*>> layer_buffers_;
  // Index of the first layer with parameters (-1: none); Backward computes
  // no input gradient at or below it.
  int first_trainable_ = -1;
  std::vector<Tensor> activations_;
  std::vector<Tensor> grads_;
  GradReadyCallback grad_ready_;
  // layers_[i]'s unit (units.h), 0 for a layer without parameters.
  std::vector<int> unit_;
  int num_units_ = 1;
  UnitHooks* hooks_ = nullptr;
};

// The mlp or cnn of the spec, initialised as PyTorch initialises nn.Linear
// and nn.Conv2d (weights and biases uniform in ±1/sqrt(fan_in)), from `seed`.
// INVALID_ARGUMENT for an unknown name or bad sizes.
absl::StatusOr<std::unique_ptr<Sequential>> BuildModel(const ModelConfig& config, uint64_t seed);

// The seed of layer `index` for a model seed (splitmix64 of both): unrelated
// streams per layer. The GPU model seeds its layers the same way.
uint64_t LayerSeed(uint64_t seed, size_t index);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_MODEL_H_
