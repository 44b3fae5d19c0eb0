// MirrorLayer (gpu_layers.h): the GPU layer computing what a CPU layer
// computes, with its parameters and buffers copied up.
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/batchnorm.h"
#include "worker/engine/cuda/gpu_layers.h"
#include "worker/engine/cuda/gpu_resnet.h"
#include "worker/engine/layers.h"
#include "worker/engine/resnet.h"

namespace aidn::engine::cuda {
namespace {

// Copies the CPU layer's parameters (names, values) into the GPU layer's,
// which have the same order and shapes; gradients start at zero.
absl::Status CopyParameters(GpuContext* ctx, const Layer& cpu, GpuLayer* gpu) {
  // Parameters() is not const in the CPU interface but only lists pointers.
  std::vector<Parameter*> from = const_cast<Layer&>(cpu).Parameters();
  std::vector<GpuParameter*> to = gpu->Parameters();
  if (from.size() != to.size()) {
    return absl::InternalError(absl::StrCat(cpu.Describe(), ": ", from.size(), " CPU parameters, ",
                                            to.size(), " GPU parameters"));
  }
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i]->value.shape() != to[i]->value.shape()) {
      return absl::InternalError(absl::StrCat(cpu.Describe(), ": parameter ", from[i]->name,
                                              " has shape ", from[i]->value.ShapeString(),
                                              ", the GPU's ", to[i]->value.ShapeString()));
    }
    to[i]->name = from[i]->name;
    AIDN_RETURN_IF_ERROR(to[i]->value.CopyFromHost(ctx, from[i]->value));
    AIDN_RETURN_IF_ERROR(to[i]->grad.Zero(ctx));
  }
  // Buffers (running statistics): names and values.
  std::vector<Parameter*> buffers = const_cast<Layer&>(cpu).Buffers();
  std::vector<GpuParameter*> gpu_buffers = gpu->Buffers();
  if (buffers.size() != gpu_buffers.size()) {
    return absl::InternalError(absl::StrCat(cpu.Describe(), ": ", buffers.size(), " CPU buffers, ",
                                            gpu_buffers.size(), " GPU buffers"));
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i]->value.shape() != gpu_buffers[i]->value.shape()) {
      return absl::InternalError(absl::StrCat(cpu.Describe(), ": buffer ", buffers[i]->name,
                                              " has shape ", buffers[i]->value.ShapeString()));
    }
    gpu_buffers[i]->name = buffers[i]->name;
    AIDN_RETURN_IF_ERROR(gpu_buffers[i]->value.CopyFromHost(ctx, buffers[i]->value));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuLayer>> MirrorLayer(GpuContext* ctx, const Layer& cpu) {
  std::unique_ptr<GpuLayer> gpu;
  if (const auto* l = dynamic_cast<const Linear*>(&cpu)) {
    AIDN_ASSIGN_OR_RETURN(gpu, GpuLinear::Create(ctx, l->in_features(), l->out_features()));
  } else if (dynamic_cast<const ReLU*>(&cpu) != nullptr) {
    gpu = std::make_unique<GpuReLU>(ctx);
  } else if (const auto* c = dynamic_cast<const Conv2d*>(&cpu)) {
    AIDN_ASSIGN_OR_RETURN(
        gpu, GpuConv2d::Create(ctx, c->in_channels(), c->out_channels(), c->kernel(), c->stride(),
                               c->padding(), c->has_bias()));
  } else if (const auto* p = dynamic_cast<const MaxPool2d*>(&cpu)) {
    AIDN_ASSIGN_OR_RETURN(gpu, GpuMaxPool2d::Create(ctx, p->kernel(), p->stride()));
  } else if (dynamic_cast<const Flatten*>(&cpu) != nullptr) {
    gpu = std::make_unique<GpuFlatten>();
  } else if (const auto* d = dynamic_cast<const Dropout*>(&cpu)) {
    gpu = std::make_unique<GpuDropout>(ctx, d->p());
  } else if (const auto* bn = dynamic_cast<const BatchNorm2d*>(&cpu)) {
    AIDN_ASSIGN_OR_RETURN(gpu,
                          GpuBatchNorm2d::Create(ctx, bn->channels(), bn->eps(), bn->momentum()));
  } else if (const auto* block = dynamic_cast<const ResidualBlock*>(&cpu)) {
    AIDN_ASSIGN_OR_RETURN(gpu, GpuResidualBlock::Create(ctx, *block));
  } else if (dynamic_cast<const GlobalAvgPool2d*>(&cpu) != nullptr) {
    gpu = std::make_unique<GpuGlobalAvgPool2d>(ctx);
  } else {
    return absl::UnimplementedError("no GPU implementation of " + cpu.Describe());
  }
  AIDN_RETURN_IF_ERROR(CopyParameters(ctx, cpu, gpu.get()));
  return gpu;
}

}  // namespace aidn::engine::cuda
