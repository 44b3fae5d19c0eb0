#include "worker/engine/cuda/gpu_resnet.h"

#include <cudnn.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/ddp_kernels.h"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/cuda/status.h"

// cuDNN 9 marks its batch-normalisation calls deprecated in favour of its
// graph API; they are still there (PyTorch uses them) and do what torch's
// BatchNorm2d does. (Pushed and popped: in a unity build the files after
// this one keep the warning.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace aidn::engine::cuda {
namespace {

constexpr float kBnOne = 1.0f;
constexpr float kBnZero = 0.0f;

// A [channels] parameter filled with `value`, and its zeroed gradient.
absl::Status ZeroedParameter(GpuContext* ctx, const std::string& name, int64_t channels,
                             float value, GpuParameter* p) {
  p->name = name;
  AIDN_RETURN_IF_ERROR(p->value.Resize(ctx, {channels}));
  if (value == 0.0f) {
    AIDN_RETURN_IF_ERROR(p->value.Zero(ctx));
  } else {
    Tensor host({channels});
    host.Fill(value);
    AIDN_RETURN_IF_ERROR(p->value.CopyFromHost(ctx, host));
  }
  AIDN_RETURN_IF_ERROR(p->grad.Resize(ctx, {channels}));
  return p->grad.Zero(ctx);
}

}  // namespace

// ------------------------------------------------------------ BatchNorm2d

absl::StatusOr<std::unique_ptr<GpuBatchNorm2d>> GpuBatchNorm2d::Create(GpuContext* ctx,
                                                                       int64_t channels, double eps,
                                                                       double momentum) {
  if (channels <= 0 || channels > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("BatchNorm2d(", channels, "): bad channels"));
  }
  if (eps < CUDNN_BN_MIN_EPSILON) {
    return absl::InvalidArgumentError(
        absl::StrCat("BatchNorm2d eps ", eps, " is below cuDNN's minimum ", CUDNN_BN_MIN_EPSILON));
  }
  std::unique_ptr<GpuBatchNorm2d> bn(new GpuBatchNorm2d(ctx, channels, eps, momentum));
  AIDN_RETURN_IF_ERROR(ZeroedParameter(ctx, "weight", channels, 1.0f, &bn->weight_));
  AIDN_RETURN_IF_ERROR(ZeroedParameter(ctx, "bias", channels, 0.0f, &bn->bias_));
  AIDN_RETURN_IF_ERROR(ZeroedParameter(ctx, "running_mean", channels, 0.0f, &bn->running_mean_));
  AIDN_RETURN_IF_ERROR(ZeroedParameter(ctx, "running_var", channels, 1.0f, &bn->running_var_));
  AIDN_RETURN_IF_ERROR(bn->save_mean_.Resize(ctx, {channels}));
  AIDN_RETURN_IF_ERROR(bn->save_inv_var_.Resize(ctx, {channels}));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnCreateTensorDescriptor(&bn->x_desc_));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnCreateTensorDescriptor(&bn->bn_desc_));
  return bn;
}

GpuBatchNorm2d::~GpuBatchNorm2d() {
  if (x_desc_ != nullptr) cudnnDestroyTensorDescriptor(x_desc_);
  if (bn_desc_ != nullptr) cudnnDestroyTensorDescriptor(bn_desc_);
}

std::string GpuBatchNorm2d::Describe() const {
  return absl::StrCat("BatchNorm2d(", channels_,
                      ", eps=", eps_ == 1e-5 ? "1e-05" : absl::StrCat(eps_),
                      ", momentum=", momentum_, ", affine=True, track_running_stats=True)");
}

absl::Status GpuBatchNorm2d::Prepare(const std::vector<int64_t>& shape) {
  if (shape.size() != 4 || shape[1] != channels_ || shape[0] < 1 || shape[0] > INT32_MAX ||
      shape[2] > INT32_MAX || shape[3] > INT32_MAX) {
    std::string dims;
    for (int64_t d : shape) absl::StrAppend(&dims, dims.empty() ? "" : ", ", d);
    return absl::InvalidArgumentError(
        absl::StrCat(Describe(), " got input [", dims, "], want [N, ", channels_, ", H, W]"));
  }
  if (shape == shape_) return absl::OkStatus();
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetTensor4dDescriptor(
      x_desc_, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, static_cast<int>(shape[0]),
      static_cast<int>(shape[1]), static_cast<int>(shape[2]), static_cast<int>(shape[3])));
  AIDN_RETURN_IF_CUDNN_ERROR(
      cudnnDeriveBNTensorDescriptor(bn_desc_, x_desc_, CUDNN_BATCHNORM_SPATIAL));
  shape_ = shape;
  return absl::OkStatus();
}

absl::Status GpuBatchNorm2d::Forward(const GpuTensor& input, GpuTensor* output, bool training) {
  AIDN_RETURN_IF_ERROR(Prepare(input.shape()));
  AIDN_RETURN_IF_ERROR(output->Resize(ctx_, input.shape()));
  input_ = &input;
  training_ = training;
  if (training && input.dim(0) * input.dim(2) * input.dim(3) <= 1) {
    // As the CPU layer (and torch): one value per channel has no variance.
    return absl::InvalidArgumentError(
        absl::StrCat(Describe(), " needs more than one value per channel to train, got input ",
                     input.ShapeString()));
  }
  synced_ = training && sync_ != nullptr;
  if (synced_) return SyncedForward(input, output);
  if (training) {
    // The running statistics move by `momentum` towards the batch's (the
    // variance's unbiased estimate), as torch's.
    AIDN_RETURN_IF_CUDNN_ERROR(cudnnBatchNormalizationForwardTraining(
        ctx_->cudnn(), CUDNN_BATCHNORM_SPATIAL, &kBnOne, &kBnZero, x_desc_, input.data(), x_desc_,
        output->data(), bn_desc_, weight_.value.data(), bias_.value.data(), momentum_,
        running_mean_.value.data(), running_var_.value.data(), eps_, save_mean_.data(),
        save_inv_var_.data()));
    return absl::OkStatus();
  }
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnBatchNormalizationForwardInference(
      ctx_->cudnn(), CUDNN_BATCHNORM_SPATIAL, &kBnOne, &kBnZero, x_desc_, input.data(), x_desc_,
      output->data(), bn_desc_, weight_.value.data(), bias_.value.data(),
      running_mean_.value.data(), running_var_.value.data(), eps_));
  return absl::OkStatus();
}

absl::Status GpuBatchNorm2d::Backward(const GpuTensor& grad_output, GpuTensor* grad_input) {
  if (input_ == nullptr || !training_) {
    return absl::FailedPreconditionError(Describe() + ": Backward without a training Forward");
  }
  if (grad_output.shape() != input_->shape()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Describe(), " got grad_output ", grad_output.ShapeString()));
  }
  if (synced_) return SyncedBackward(grad_output, grad_input);
  GpuTensor* dx = grad_input != nullptr ? grad_input : &unused_grad_;
  AIDN_RETURN_IF_ERROR(dx->Resize(ctx_, input_->shape()));
  // Data gradient written (beta 0), the weight's and bias's added to
  // (beta 1), from the statistics the forward kept.
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnBatchNormalizationBackward(
      ctx_->cudnn(), CUDNN_BATCHNORM_SPATIAL, &kBnOne, &kBnZero, &kBnOne, &kBnOne, x_desc_,
      input_->data(), x_desc_, grad_output.data(), x_desc_, dx->data(), bn_desc_,
      weight_.value.data(), weight_.grad.data(), bias_.grad.data(), eps_, save_mean_.data(),
      save_inv_var_.data()));
  return absl::OkStatus();
}

absl::Status GpuBatchNorm2d::SyncedForward(const GpuTensor& input, GpuTensor* output) {
  const int64_t n = input.dim(0);
  const int64_t plane = input.dim(2) * input.dim(3);
  const int64_t block = 2 * channels_ + 1;
  cudaStream_t stream = ctx_->stream();
  AIDN_RETURN_IF_ERROR(moments_.Resize(ctx_, {block}));
  AIDN_RETURN_IF_ERROR(gathered_.Resize(ctx_, {sync_->world_size() * block}));
  if (count_.data() == nullptr) {
    AIDN_ASSIGN_OR_RETURN(count_, ctx_->allocator().Allocate(sizeof(double)));
  }
  AIDN_RETURN_IF_ERROR(
      LaunchChannelMoments(stream, input.data(), n, channels_, plane, moments_.data()));
  AIDN_RETURN_IF_ERROR(Annotate(
      sync_->AllGatherOn(stream, moments_.data(), static_cast<size_t>(block), gathered_.data()),
      "sync batchnorm statistics"));
  AIDN_RETURN_IF_ERROR(LaunchCombineMoments(
      stream, gathered_.data(), sync_->world_size(), channels_, eps_, momentum_, /*update=*/true,
      save_mean_.data(), save_inv_var_.data(), static_cast<double*>(count_.data()),
      running_mean_.value.data(), running_var_.value.data()));
  return LaunchNormalizeChannels(stream, input.data(), save_mean_.data(), save_inv_var_.data(),
                                 weight_.value.data(), bias_.value.data(), n, channels_, plane,
                                 output->data());
}

absl::Status GpuBatchNorm2d::SyncedBackward(const GpuTensor& grad_output, GpuTensor* grad_input) {
  const int64_t n = input_->dim(0);
  const int64_t plane = input_->dim(2) * input_->dim(3);
  cudaStream_t stream = ctx_->stream();
  AIDN_RETURN_IF_ERROR(sums_.Resize(ctx_, {2 * channels_}));
  AIDN_RETURN_IF_ERROR(LaunchChannelGradientSums(
      stream, grad_output.data(), input_->data(), save_mean_.data(), save_inv_var_.data(), n,
      channels_, plane, sums_.data(), weight_.grad.data(), bias_.grad.data()));
  // The input gradient needs the sums over every rank's batch (none wanted:
  // no exchange, as on the CPU, and the same on every rank).
  if (grad_input == nullptr) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(grad_input->Resize(ctx_, input_->shape()));
  AIDN_RETURN_IF_ERROR(
      Annotate(sync_->AllReduceSumOn(stream, sums_.data(), static_cast<size_t>(2 * channels_)),
               "sync batchnorm gradients"));
  return LaunchBatchNormInputGradient(stream, grad_output.data(), input_->data(), save_mean_.data(),
                                      save_inv_var_.data(), weight_.value.data(), sums_.data(),
                                      static_cast<const double*>(count_.data()), n, channels_,
                                      plane, grad_input->data());
}

// ---------------------------------------------------------- ResidualBlock

absl::StatusOr<std::unique_ptr<GpuResidualBlock>> GpuResidualBlock::Create(
    GpuContext* ctx, const ResidualBlock& cpu) {
  std::unique_ptr<GpuResidualBlock> block(new GpuResidualBlock(ctx));
  block->describe_ = cpu.Describe();
  block->drop_prob_ = cpu.drop_prob();
  for (auto [from, to] : {std::pair{&cpu.main_path(), &block->main_},
                          std::pair{&cpu.shortcut(), &block->shortcut_}}) {
    for (const auto& [name, layer] : *from) {
      AIDN_ASSIGN_OR_RETURN(std::unique_ptr<GpuLayer> mirrored, MirrorLayer(ctx, *layer));
      to->layers.push_back(std::move(mirrored));
    }
    to->out.resize(to->layers.size());
    to->grad.resize(to->layers.size());
  }
  return block;
}

std::vector<GpuParameter*> GpuResidualBlock::Parameters() {
  std::vector<GpuParameter*> params;
  for (Path* path : {&main_, &shortcut_}) {
    for (auto& layer : path->layers) {
      for (GpuParameter* p : layer->Parameters()) params.push_back(p);
    }
  }
  return params;
}

std::vector<GpuParameter*> GpuResidualBlock::Buffers() {
  std::vector<GpuParameter*> buffers;
  for (Path* path : {&main_, &shortcut_}) {
    for (auto& layer : path->layers) {
      for (GpuParameter* b : layer->Buffers()) buffers.push_back(b);
    }
  }
  return buffers;
}

void GpuResidualBlock::SetBatchNormSync(StreamCollectives* sync) {
  for (Path* path : {&main_, &shortcut_}) {
    for (auto& layer : path->layers) layer->SetBatchNormSync(sync);
  }
}

absl::Status GpuResidualBlock::RunForward(Path& path, const GpuTensor& input, bool training,
                                          const GpuTensor** result) {
  const GpuTensor* x = &input;
  for (size_t i = 0; i < path.layers.size(); ++i) {
    AIDN_RETURN_IF_ERROR(path.layers[i]->Forward(*x, &path.out[i], training));
    x = &path.out[i];
  }
  *result = x;
  return absl::OkStatus();
}

absl::Status GpuResidualBlock::RunBackward(Path& path, const GpuTensor& grad_output,
                                           GpuTensor* grad_input) {
  const GpuTensor* g = &grad_output;
  for (size_t i = path.layers.size(); i-- > 0;) {
    GpuTensor* gin = i > 0 ? &path.grad[i] : grad_input;
    AIDN_RETURN_IF_ERROR(path.layers[i]->Backward(*g, gin));
    g = gin;
  }
  return absl::OkStatus();
}

std::vector<GpuParameter*> GpuResidualBlock::UnusedParameters() {
  if (!dropped_) return {};
  std::vector<GpuParameter*> params;
  for (auto& layer : main_.layers) {
    for (GpuParameter* p : layer->Parameters()) params.push_back(p);
  }
  return params;
}

absl::Status GpuResidualBlock::Forward(const GpuTensor& input, GpuTensor* output, bool training) {
  dropped_ = false;
  scale_ = 1.0f;
  if (training && drop_prob_ > 0) {
    // ResidualBlock::Forward's draw, from the same generator.
    const double u = static_cast<double>(rng_() >> 11) * 0x1p-53;
    dropped_ = u < drop_prob_;
    scale_ = static_cast<float>(1.0 / (1.0 - drop_prob_));
  }
  const GpuTensor* shortcut = nullptr;
  AIDN_RETURN_IF_ERROR(RunForward(shortcut_, input, training, &shortcut));
  if (dropped_) {
    // relu(shortcut): the main path is not computed.
    AIDN_RETURN_IF_ERROR(output->Resize(ctx_, shortcut->shape()));
    AIDN_RETURN_IF_ERROR(
        LaunchRelu(ctx_->stream(), shortcut->data(), output->data(), output->numel()));
    output_ = output;
    return absl::OkStatus();
  }
  const GpuTensor* main = nullptr;
  AIDN_RETURN_IF_ERROR(RunForward(main_, input, training, &main));
  if (main->shape() != shortcut->shape()) {
    return absl::InvalidArgumentError(absl::StrCat(describe_, ": main path ", main->ShapeString(),
                                                   ", shortcut ", shortcut->ShapeString()));
  }
  AIDN_RETURN_IF_ERROR(output->Resize(ctx_, main->shape()));
  // relu(main * scale + shortcut), the CPU's ScaledAddReluKernel.
  AIDN_RETURN_IF_ERROR(LaunchScaledAddRelu(ctx_->stream(), main->data(), scale_, shortcut->data(),
                                           output->data(), output->numel()));
  output_ = output;
  return absl::OkStatus();
}

absl::Status GpuResidualBlock::Backward(const GpuTensor& grad_output, GpuTensor* grad_input) {
  if (output_ == nullptr || grad_output.shape() != output_->shape()) {
    return absl::InvalidArgumentError(
        absl::StrCat(describe_, " backward got ", grad_output.ShapeString()));
  }
  cudaStream_t stream = ctx_->stream();
  // Through the final ReLU: the gradient of the sum, which both paths get.
  AIDN_RETURN_IF_ERROR(sum_grad_.Resize(ctx_, grad_output.shape()));
  AIDN_RETURN_IF_ERROR(LaunchReluBackward(stream, output_->data(), grad_output.data(),
                                          sum_grad_.data(), sum_grad_.numel()));
  if (dropped_) {
    // The shortcut alone; the main path's gradients stay as they were.
    if (!shortcut_.layers.empty()) return RunBackward(shortcut_, sum_grad_, grad_input);
    if (grad_input == nullptr) return absl::OkStatus();
    AIDN_RETURN_IF_ERROR(grad_input->Resize(ctx_, sum_grad_.shape()));
    return grad_input->CopyFrom(ctx_, sum_grad_);
  }
  const GpuTensor* main_grad = &sum_grad_;
  if (scale_ != 1.0f) {
    AIDN_RETURN_IF_ERROR(scaled_grad_.Resize(ctx_, sum_grad_.shape()));
    AIDN_RETURN_IF_ERROR(scaled_grad_.CopyFrom(ctx_, sum_grad_));
    AIDN_RETURN_IF_ERROR(LaunchScale(stream, scaled_grad_.data(), scaled_grad_.numel(), scale_));
    main_grad = &scaled_grad_;
  }
  AIDN_RETURN_IF_ERROR(RunBackward(main_, *main_grad, grad_input));
  if (grad_input == nullptr) {
    return shortcut_.layers.empty() ? absl::OkStatus() : RunBackward(shortcut_, sum_grad_, nullptr);
  }
  const GpuTensor* extra = &sum_grad_;
  if (!shortcut_.layers.empty()) {
    AIDN_RETURN_IF_ERROR(RunBackward(shortcut_, sum_grad_, &short_grad_));
    extra = &short_grad_;
  }
  return LaunchAdd(stream, grad_input->data(), extra->data(), grad_input->data(),
                   grad_input->numel());
}

// -------------------------------------------------------- GlobalAvgPool2d

absl::Status GpuGlobalAvgPool2d::Forward(const GpuTensor& input, GpuTensor* output,
                                         bool /*training*/) {
  if (input.rank() != 4) {
    return absl::InvalidArgumentError(Describe() + " got input " + input.ShapeString());
  }
  input_shape_ = input.shape();
  AIDN_RETURN_IF_ERROR(output->Resize(ctx_, {input.dim(0), input.dim(1), 1, 1}));
  return LaunchPlaneMean(ctx_->stream(), input.data(), input.dim(0) * input.dim(1),
                         input.dim(2) * input.dim(3), output->data());
}

absl::Status GpuGlobalAvgPool2d::Backward(const GpuTensor& grad_output, GpuTensor* grad_input) {
  if (grad_input == nullptr) return absl::OkStatus();
  if (input_shape_.size() != 4 || grad_output.numel() != input_shape_[0] * input_shape_[1]) {
    return absl::InvalidArgumentError(Describe() + " backward got " + grad_output.ShapeString());
  }
  AIDN_RETURN_IF_ERROR(grad_input->Resize(ctx_, input_shape_));
  return LaunchPlaneMeanBackward(ctx_->stream(), grad_output.data(),
                                 input_shape_[0] * input_shape_[1],
                                 input_shape_[2] * input_shape_[3], grad_input->data());
}

}  // namespace aidn::engine::cuda

#pragma GCC diagnostic pop
