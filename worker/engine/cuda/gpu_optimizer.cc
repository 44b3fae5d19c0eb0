#include "worker/engine/cuda/gpu_optimizer.h"

#include <cuda_runtime.h>

#include <cmath>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {

absl::StatusOr<std::unique_ptr<GpuOptimizer>> GpuOptimizer::Create(
    GpuContext* ctx, const OptimizerConfig& config, const std::vector<GpuParameter*>& params) {
  AIDN_RETURN_IF_ERROR(ValidateOptimizerConfig(config));
  if (params.empty()) return absl::InvalidArgumentError("optimizer got an empty parameter list");
  std::set<std::string> names;
  for (const GpuParameter* p : params) {
    if (p == nullptr) return absl::InvalidArgumentError("optimizer got a null parameter");
    if (!names.insert(p->name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer got two parameters named \"", p->name, "\""));
    }
    if (p->value.numel() > 0 && (p->value.data() == nullptr || p->grad.data() == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", p->name,
                       " holds no memory here (a pipeline stage released it: optimize the "
                       "stage's parameters)"));
    }
    if (p->grad.shape() != p->value.shape()) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", p->name, ": gradient shape ",
                                                     p->grad.ShapeString(), " != value shape ",
                                                     p->value.ShapeString()));
    }
  }
  std::unique_ptr<GpuOptimizer> opt(new GpuOptimizer(ctx, config, params));
  for (const GpuParameter* p : params) {
    opt->shapes_.push_back(p->value.shape());
    if (config.name == "sgd" && config.momentum != 0.0) {
      AIDN_ASSIGN_OR_RETURN(GpuTensor buf, GpuTensor::Empty(ctx, p->value.shape()));
      AIDN_RETURN_IF_ERROR(buf.Zero(ctx));
      opt->momentum_.push_back(std::move(buf));
    } else if (config.name == "adamw") {
      AIDN_ASSIGN_OR_RETURN(GpuTensor m, GpuTensor::Empty(ctx, p->value.shape()));
      AIDN_ASSIGN_OR_RETURN(GpuTensor v, GpuTensor::Empty(ctx, p->value.shape()));
      AIDN_RETURN_IF_ERROR(m.Zero(ctx));
      AIDN_RETURN_IF_ERROR(v.Zero(ctx));
      opt->exp_avg_.push_back(std::move(m));
      opt->exp_avg_sq_.push_back(std::move(v));
    }
  }
  if (config.grad_clip_norm > 0) {
    CachingAllocator& alloc = ctx->allocator();
    AIDN_ASSIGN_OR_RETURN(opt->sum_sq_, alloc.Allocate(sizeof(double) * params.size()));
    AIDN_ASSIGN_OR_RETURN(opt->sum_sq_scratch_,
                          alloc.Allocate(sizeof(double) * kSumOfSquaresBlocks));
    AIDN_ASSIGN_OR_RETURN(opt->norm_, alloc.Allocate(sizeof(double)));
    AIDN_ASSIGN_OR_RETURN(opt->coef_, alloc.Allocate(sizeof(float)));
  }
  return opt;
}

absl::StatusOr<bool> UnscaleAndCheckGradients(
    GpuContext* ctx, const std::vector<GpuParameter*>& parameters, double scale,
    int32_t* device_flag, int32_t* host_flag, const std::function<absl::Status()>& wait,
    const std::function<absl::Status(int32_t*)>& reduce_flag) {
  cudaStream_t stream = ctx->stream();
  AIDN_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(device_flag, 0, sizeof(int32_t), stream));
  const float inv_scale = static_cast<float>(1.0 / scale);
  for (GpuParameter* p : parameters) {
    AIDN_RETURN_IF_ERROR(
        LaunchUnscaleAndCheck(stream, p->grad.data(), p->grad.numel(), inv_scale, device_flag));
  }
  if (reduce_flag) AIDN_RETURN_IF_ERROR(reduce_flag(device_flag));
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(host_flag, device_flag, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  AIDN_RETURN_IF_ERROR(wait());
  return *host_flag != 0;
}

GpuOptimizer::~GpuOptimizer() {
  if (host_args_ != nullptr) cudaFreeHost(host_args_);
}

absl::Status GpuOptimizer::Step(double lr) {
  AIDN_RETURN_IF_ERROR(Prepare(lr));
  return Queue(/*args_in_memory=*/false);
}

absl::Status GpuOptimizer::Prepare(double lr) {
  if (!std::isfinite(lr) || lr < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("learning rate ", lr, " is not finite and >= 0"));
  }
  for (size_t k = 0; k < params_.size(); ++k) {
    const GpuParameter* p = params_[k];
    if (p->value.shape() != shapes_[k] || p->grad.shape() != shapes_[k]) {
      return absl::FailedPreconditionError(
          absl::StrCat("parameter ", p->name, ": value ", p->value.ShapeString(), " or gradient ",
                       p->grad.ShapeString(), " changed shape since the optimizer was created"));
    }
  }
  if (config_.name == "sgd") {
    SgdArgs& a = args_.sgd;
    a.lr = static_cast<float>(lr);
    a.apply_decay = config_.weight_decay != 0.0;
    a.weight_decay = static_cast<float>(config_.weight_decay);
    a.use_momentum = config_.momentum != 0.0;
    a.momentum = static_cast<float>(config_.momentum);
    a.nesterov = config_.nesterov;
    // torch creates the momentum buffer as a copy of the first gradient.
    a.first_step = steps_ == 0;
  } else {
    // As AdamW::Step in optimizer.cc: coefficients in double, then float.
    const double t = static_cast<double>(steps_ + 1);
    const double b1 = config_.beta1;
    const double b2 = config_.beta2;
    const double bc1 = 1.0 - std::pow(b1, t);
    const double bc2 = 1.0 - std::pow(b2, t);
    AdamWArgs& a = args_.adamw;
    a.decay = static_cast<float>(1.0 - lr * config_.weight_decay);
    a.apply_decay = config_.weight_decay != 0.0;
    a.beta1 = static_cast<float>(b1);
    a.one_m_b1 = static_cast<float>(1.0 - b1);
    a.beta2 = static_cast<float>(b2);
    a.one_m_b2 = static_cast<float>(1.0 - b2);
    a.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    a.eps = static_cast<float>(config_.eps);
    a.neg_step = static_cast<float>(-(lr / bc1));
  }
  if (host_args_ != nullptr) *host_args_ = args_;
  prepared_ = true;
  ++steps_;
  return absl::OkStatus();
}

absl::Status GpuOptimizer::EnableArgsInMemory() {
  if (host_args_ == nullptr) {
    AIDN_RETURN_IF_CUDA_ERROR(cudaMallocHost(reinterpret_cast<void**>(&host_args_), sizeof(Args)));
    *host_args_ = args_;
  }
  if (device_args_.data() == nullptr) {
    AIDN_ASSIGN_OR_RETURN(device_args_, ctx_->allocator().Allocate(sizeof(Args)));
  }
  return absl::OkStatus();
}

absl::Status GpuOptimizer::Queue(bool args_in_memory) {
  if (!prepared_) return absl::FailedPreconditionError("optimizer Queue without Prepare");
  prepared_ = false;
  cudaStream_t stream = ctx_->stream();
  const Args* in_memory = nullptr;
  if (args_in_memory) {
    if (host_args_ == nullptr || device_args_.data() == nullptr) {
      return absl::FailedPreconditionError("optimizer arguments in memory were not enabled");
    }
    // Read from pinned memory when the copy runs: in a CUDA graph, at each
    // replay, after the host's Prepare of that step.
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(device_args_.data(), host_args_, sizeof(Args),
                                              cudaMemcpyHostToDevice, stream));
    in_memory = static_cast<const Args*>(device_args_.data());
  }
  const float* scale = nullptr;
  if (config_.grad_clip_norm > 0) {
    double* sum_sq = static_cast<double*>(sum_sq_.data());
    for (size_t k = 0; k < params_.size(); ++k) {
      if (params_[k] == norm_excluded_) {
        // Counted by another rank (a pipeline's tied copy).
        AIDN_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(sum_sq + k, 0, sizeof(double), stream));
        continue;
      }
      AIDN_RETURN_IF_ERROR(LaunchSumOfSquares(stream, params_[k]->grad.data(),
                                              params_[k]->grad.numel(), sum_sq + k,
                                              static_cast<double*>(sum_sq_scratch_.data())));
    }
    const double* sums = sum_sq;
    int count = static_cast<int>(params_.size());
    if (norm_allreduce_) {
      if (norm_total_.data() == nullptr) {
        AIDN_ASSIGN_OR_RETURN(norm_total_, ctx_->allocator().Allocate(sizeof(double)));
      }
      double* total = static_cast<double*>(norm_total_.data());
      AIDN_RETURN_IF_ERROR(LaunchSumDoubles(stream, sum_sq, count, total));
      AIDN_RETURN_IF_ERROR(norm_allreduce_(total));
      sums = total;
      count = 1;
    }
    AIDN_RETURN_IF_ERROR(LaunchClipCoefficient(stream, sums, count, config_.grad_clip_norm,
                                               static_cast<double*>(norm_.data()),
                                               static_cast<float*>(coef_.data())));
    scale = static_cast<const float*>(coef_.data());
    measured_norm_ = true;
  }
  if (config_.name == "sgd") {
    for (size_t k = 0; k < params_.size(); ++k) {
      GpuParameter* p = params_[k];
      if (p->no_grad) continue;
      SgdArgs a = args_.sgd;
      a.apply_decay = a.apply_decay && Decays(*p);
      AIDN_RETURN_IF_ERROR(LaunchSgd(
          stream, p->value.data(), p->grad.data(), a.use_momentum ? momentum_[k].data() : nullptr,
          p->value.numel(), a, scale, in_memory != nullptr ? &in_memory->sgd : nullptr));
    }
  } else {
    for (size_t k = 0; k < params_.size(); ++k) {
      GpuParameter* p = params_[k];
      if (p->no_grad) continue;
      AdamWArgs a = args_.adamw;
      a.apply_decay = a.apply_decay && Decays(*p);
      AIDN_RETURN_IF_ERROR(LaunchAdamW(stream, p->value.data(), p->grad.data(), exp_avg_[k].data(),
                                       exp_avg_sq_[k].data(), p->value.numel(), a, scale,
                                       in_memory != nullptr ? &in_memory->adamw : nullptr));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<double> GpuOptimizer::LastGradNorm() const {
  if (!measured_norm_) return 0.0;
  double norm = 0;
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(&norm, norm_.data(), sizeof(double), cudaMemcpyDeviceToHost, ctx_->stream()));
  // `norm` is read as soon as the copy has landed.
  AIDN_RETURN_IF_ERROR(ctx_->Synchronize());
  return norm;
}

absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> GpuOptimizer::StateToHost() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t k = 0; k < params_.size(); ++k) {
    const std::string& name = params_[k]->name;
    if (!momentum_.empty()) {
      AIDN_ASSIGN_OR_RETURN(Tensor t, momentum_[k].ToHost(ctx_));
      out.emplace_back(name + ".momentum_buffer", std::move(t));
    }
    if (!exp_avg_.empty()) {
      AIDN_ASSIGN_OR_RETURN(Tensor m, exp_avg_[k].ToHost(ctx_));
      out.emplace_back(name + ".exp_avg", std::move(m));
      AIDN_ASSIGN_OR_RETURN(Tensor v, exp_avg_sq_[k].ToHost(ctx_));
      out.emplace_back(name + ".exp_avg_sq", std::move(v));
    }
  }
  return out;
}

absl::Status GpuOptimizer::LoadStateFromHost(
    const std::vector<std::pair<std::string, const Tensor*>>& state, int64_t steps) {
  if (steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer state: steps ", steps, " < 0"));
  }
  std::map<std::string, const Tensor*> given;
  for (const auto& [name, tensor] : state) {
    if (tensor == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state: ", name, " is null"));
    }
    if (!given.emplace(name, tensor).second) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state: ", name, " given twice"));
    }
  }
  // What this optimizer holds, with the shape each must have.
  std::vector<std::pair<std::string, GpuTensor*>> wanted;
  std::vector<const std::vector<int64_t>*> shapes;
  for (size_t k = 0; k < params_.size(); ++k) {
    const std::string& name = params_[k]->name;
    if (!momentum_.empty()) {
      wanted.emplace_back(name + ".momentum_buffer", &momentum_[k]);
      shapes.push_back(&shapes_[k]);
    }
    if (!exp_avg_.empty()) {
      wanted.emplace_back(name + ".exp_avg", &exp_avg_[k]);
      shapes.push_back(&shapes_[k]);
      wanted.emplace_back(name + ".exp_avg_sq", &exp_avg_sq_[k]);
      shapes.push_back(&shapes_[k]);
    }
  }
  for (size_t i = 0; i < wanted.size(); ++i) {
    auto it = given.find(wanted[i].first);
    if (it == given.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer state: ", wanted[i].first, " is missing"));
    }
    if (it->second->shape() != *shapes[i]) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state: ", wanted[i].first,
                                                     " has shape ", it->second->ShapeString(),
                                                     ", the parameter's is different"));
    }
  }
  if (given.size() != wanted.size()) {
    for (const auto& [name, tensor] : given) {
      bool known = false;
      for (const auto& w : wanted) known = known || w.first == name;
      if (!known) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer state: ", name, " is not state of this optimizer (", config_.name, ")"));
      }
    }
  }
  for (auto& [name, device] : wanted) {
    AIDN_RETURN_IF_ERROR(device->CopyFromHost(ctx_, *given.at(name)));
  }
  steps_ = steps;
  return absl::OkStatus();
}

}  // namespace aidn::engine::cuda
