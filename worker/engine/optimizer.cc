#include "worker/engine/optimizer.h"

#include <cmath>
#include <cstring>
#include <map>
#include <set>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/simd.h"

namespace aidn::engine {
namespace {

bool Finite(double x) { return std::isfinite(x); }

}  // namespace

double SumOfSquares(const Tensor& t) {
  // Four partial sums let the loop vectorise without -ffast-math.
  const float* g = t.data();
  const int64_t n = t.numel();
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += static_cast<double>(g[i]) * g[i];
    s1 += static_cast<double>(g[i + 1]) * g[i + 1];
    s2 += static_cast<double>(g[i + 2]) * g[i + 2];
    s3 += static_cast<double>(g[i + 3]) * g[i + 3];
  }
  for (; i < n; ++i) s0 += static_cast<double>(g[i]) * g[i];
  return (s0 + s1) + (s2 + s3);
}

namespace {

double TotalGradNorm(const std::vector<Parameter*>& params) {
  double sum = 0;
  for (const Parameter* p : params) sum += SumOfSquares(p->grad);
  return std::sqrt(sum);
}

// The torch clip coefficient for `total`, or 1 when no clipping applies.
float ClipCoefficientFor(double total, double max_norm) {
  if (!Finite(total)) return 1.0f;
  const double coef = max_norm / (total + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}

// ---------------------------------------------------------------------------
// SGD. The branches are template parameters so each variant's loop has no
// per-element conditionals and vectorises. Every float expression mirrors
// one torch kernel call (add with alpha, mul_, add_) so the roundings match.

// One element of the SGD update. Every float expression mirrors one torch
// kernel call (add with alpha, mul_, add_) so the roundings match.
template <bool kDecay, bool kMomentum, bool kNesterov, bool kFirst, bool kScale>
inline void SgdElement(float* __restrict p, const float* __restrict grad, float* __restrict buf,
                       int64_t i, float lr, float wd, float momentum, float scale) {
  float g = grad[i];
  if constexpr (kScale) g = g * scale;
  if constexpr (kDecay) g = g + wd * p[i];
  if constexpr (kMomentum) {
    float b;
    if constexpr (kFirst) {
      b = g;
    } else {
      b = buf[i] * momentum;
      b = b + g;
    }
    buf[i] = b;
    if constexpr (kNesterov) {
      g = g + momentum * b;
    } else {
      g = b;
    }
  }
  p[i] = p[i] + (-lr) * g;
}

// The branches are template parameters so each variant's loop has no
// per-element conditionals. Blocks of a fixed 16 elements let GCC's -O2
// ("very cheap") vectoriser replace the inner loop entirely; the tail runs
// scalar with the same arithmetic.
template <bool kDecay, bool kMomentum, bool kNesterov, bool kFirst, bool kScale>
AIDN_VECTOR_CLONES void SgdKernel(float* __restrict p, const float* __restrict grad,
                                  float* __restrict buf, int64_t n, float lr, float wd,
                                  float momentum, float scale) {
  constexpr int64_t kBlock = 16;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    float* __restrict pb = p + i;
    const float* __restrict gb = grad + i;
    float* __restrict bb = kMomentum ? buf + i : nullptr;
    for (int64_t j = 0; j < kBlock; ++j) {
      SgdElement<kDecay, kMomentum, kNesterov, kFirst, kScale>(pb, gb, bb, j, lr, wd, momentum,
                                                               scale);
    }
  }
  for (; i < n; ++i) {
    SgdElement<kDecay, kMomentum, kNesterov, kFirst, kScale>(p, grad, buf, i, lr, wd, momentum,
                                                             scale);
  }
}

using SgdFn = void (*)(float*, const float*, float*, int64_t, float, float, float, float);

template <bool kDecay, bool kMomentum, bool kNesterov, bool kFirst>
SgdFn PickSgd4(bool scale) {
  return scale ? &SgdKernel<kDecay, kMomentum, kNesterov, kFirst, true>
               : &SgdKernel<kDecay, kMomentum, kNesterov, kFirst, false>;
}

template <bool kDecay, bool kMomentum, bool kNesterov>
SgdFn PickSgd3(bool first, bool scale) {
  return first ? PickSgd4<kDecay, kMomentum, kNesterov, true>(scale)
               : PickSgd4<kDecay, kMomentum, kNesterov, false>(scale);
}

template <bool kDecay>
SgdFn PickSgd2(bool momentum, bool nesterov, bool first, bool scale) {
  if (!momentum) return PickSgd4<kDecay, false, false, false>(scale);
  return nesterov ? PickSgd3<kDecay, true, true>(first, scale)
                  : PickSgd3<kDecay, true, false>(first, scale);
}

SgdFn PickSgd(bool decay, bool momentum, bool nesterov, bool first, bool scale) {
  return decay ? PickSgd2<true>(momentum, nesterov, first, scale)
               : PickSgd2<false>(momentum, nesterov, first, scale);
}

class Sgd final : public Optimizer {
 public:
  Sgd(const OptimizerConfig& config, std::vector<Parameter*> params)
      : Optimizer(config, std::move(params)) {
    if (config_.momentum != 0.0) {
      buffers_.reserve(params_.size());
      for (const Parameter* p : params_) buffers_.emplace_back(p->value.shape());
    }
  }

  absl::Status Step(double lr) override {
    AIDN_RETURN_IF_ERROR(CheckStep(lr));
    AIDN_ASSIGN_OR_RETURN(const float scale, ClipCoefficient());
    const bool momentum = config_.momentum != 0.0;
    // torch creates the momentum buffer as a copy of the first gradient.
    const SgdFn decayed = PickSgd(config_.weight_decay != 0.0, momentum, config_.nesterov,
                                  steps_ == 0, scale != 1.0f);
    const SgdFn undecayed = PickSgd(false, momentum, config_.nesterov, steps_ == 0, scale != 1.0f);
    for (size_t k = 0; k < params_.size(); ++k) {
      Parameter* p = params_[k];
      if (p->no_grad) continue;
      const SgdFn fn = Decays(*p) ? decayed : undecayed;
      fn(p->value.data(), p->grad.data(), momentum ? buffers_[k].data() : nullptr, p->value.numel(),
         static_cast<float>(lr), static_cast<float>(config_.weight_decay),
         static_cast<float>(config_.momentum), scale);
    }
    ++steps_;
    return absl::OkStatus();
  }

  std::vector<StateEntry> State() const override {
    std::vector<StateEntry> out;
    for (size_t k = 0; k < buffers_.size(); ++k) {
      out.emplace_back(absl::StrCat(params_[k]->name, ".momentum_buffer"), &buffers_[k]);
    }
    return out;
  }

 private:
  std::vector<Tensor*> MutableState() override {
    std::vector<Tensor*> out;
    for (Tensor& t : buffers_) out.push_back(&t);
    return out;
  }

  std::vector<Tensor> buffers_;
};

// ---------------------------------------------------------------------------
// AdamW, mirroring torch 1.13's _single_tensor_adamw: param.mul_(1 - lr*wd);
// exp_avg.mul_(b1).add_(g, alpha=1-b1); exp_avg_sq.mul_(b2).addcmul_(g, g,
// value=1-b2); denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps);
// param.addcdiv_(exp_avg, denom, value=-step_size).

struct AdamScalars {
  float decay;     // 1 - lr * wd
  float beta1;     // b1
  float one_m_b1;  // 1 - b1
  float beta2;     // b2
  float one_m_b2;  // 1 - b2
  float bc2_sqrt;  // sqrt(1 - b2^t)
  float eps;       // eps
  float neg_step;  // -lr / (1 - b1^t)
  float scale;     // clip coefficient
};

template <bool kDecay, bool kScale>
void AdamWKernel(float* __restrict p, const float* __restrict grad, float* __restrict m,
                 float* __restrict v, int64_t n, const AdamScalars s) {
  int64_t i = 0;
#if defined(__SSE2__)
  // By hand: with -fmath-errno (the default) GCC will not vectorise sqrt,
  // and this loop is sqrt- and divide-bound. sqrtps and divps round exactly
  // as their scalar forms, so the tail below gives identical results.
  const __m128 scale = _mm_set1_ps(s.scale);
  const __m128 decay = _mm_set1_ps(s.decay);
  const __m128 beta1 = _mm_set1_ps(s.beta1);
  const __m128 one_m_b1 = _mm_set1_ps(s.one_m_b1);
  const __m128 beta2 = _mm_set1_ps(s.beta2);
  const __m128 one_m_b2 = _mm_set1_ps(s.one_m_b2);
  const __m128 bc2_sqrt = _mm_set1_ps(s.bc2_sqrt);
  const __m128 eps = _mm_set1_ps(s.eps);
  const __m128 neg_step = _mm_set1_ps(s.neg_step);
  for (; i + 4 <= n; i += 4) {
    __m128 g = _mm_loadu_ps(grad + i);
    if constexpr (kScale) g = _mm_mul_ps(g, scale);
    __m128 w = _mm_loadu_ps(p + i);
    if constexpr (kDecay) w = _mm_mul_ps(w, decay);
    const __m128 mi = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(m + i), beta1), _mm_mul_ps(one_m_b1, g));
    const __m128 vi =
        _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(v + i), beta2), _mm_mul_ps(_mm_mul_ps(one_m_b2, g), g));
    _mm_storeu_ps(m + i, mi);
    _mm_storeu_ps(v + i, vi);
    const __m128 denom = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vi), bc2_sqrt), eps);
    _mm_storeu_ps(p + i, _mm_add_ps(w, _mm_div_ps(_mm_mul_ps(neg_step, mi), denom)));
  }
#endif
  for (; i < n; ++i) {
    float g = grad[i];
    if constexpr (kScale) g = g * s.scale;
    float w = p[i];
    if constexpr (kDecay) w = w * s.decay;
    float mi = m[i] * s.beta1;
    mi = mi + s.one_m_b1 * g;
    float vi = v[i] * s.beta2;
    vi = vi + s.one_m_b2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;
    p[i] = w + s.neg_step * mi / denom;
  }
}

class AdamW final : public Optimizer {
 public:
  AdamW(const OptimizerConfig& config, std::vector<Parameter*> params)
      : Optimizer(config, std::move(params)) {
    exp_avg_.reserve(params_.size());
    exp_avg_sq_.reserve(params_.size());
    for (const Parameter* p : params_) {
      exp_avg_.emplace_back(p->value.shape());
      exp_avg_sq_.emplace_back(p->value.shape());
    }
  }

  absl::Status Step(double lr) override {
    AIDN_RETURN_IF_ERROR(CheckStep(lr));
    AdamScalars s;
    AIDN_ASSIGN_OR_RETURN(s.scale, ClipCoefficient());
    const double t = static_cast<double>(steps_ + 1);
    const double b1 = config_.beta1;
    const double b2 = config_.beta2;
    const double bc1 = 1.0 - std::pow(b1, t);
    const double bc2 = 1.0 - std::pow(b2, t);
    s.decay = static_cast<float>(1.0 - lr * config_.weight_decay);
    s.beta1 = static_cast<float>(b1);
    s.one_m_b1 = static_cast<float>(1.0 - b1);
    s.beta2 = static_cast<float>(b2);
    s.one_m_b2 = static_cast<float>(1.0 - b2);
    s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    s.eps = static_cast<float>(config_.eps);
    s.neg_step = static_cast<float>(-(lr / bc1));
    const bool decay = config_.weight_decay != 0.0;
    const bool scale = s.scale != 1.0f;
    auto decayed = decay ? (scale ? &AdamWKernel<true, true> : &AdamWKernel<true, false>)
                         : (scale ? &AdamWKernel<false, true> : &AdamWKernel<false, false>);
    auto undecayed = scale ? &AdamWKernel<false, true> : &AdamWKernel<false, false>;
    for (size_t k = 0; k < params_.size(); ++k) {
      Parameter* p = params_[k];
      if (p->no_grad) continue;
      (Decays(*p) ? decayed : undecayed)(p->value.data(), p->grad.data(), exp_avg_[k].data(),
                                         exp_avg_sq_[k].data(), p->value.numel(), s);
    }
    ++steps_;
    return absl::OkStatus();
  }

  std::vector<StateEntry> State() const override {
    std::vector<StateEntry> out;
    for (size_t k = 0; k < params_.size(); ++k) {
      out.emplace_back(absl::StrCat(params_[k]->name, ".exp_avg"), &exp_avg_[k]);
      out.emplace_back(absl::StrCat(params_[k]->name, ".exp_avg_sq"), &exp_avg_sq_[k]);
    }
    return out;
  }

 private:
  std::vector<Tensor*> MutableState() override {
    std::vector<Tensor*> out;
    for (size_t k = 0; k < params_.size(); ++k) {
      out.push_back(&exp_avg_[k]);
      out.push_back(&exp_avg_sq_[k]);
    }
    return out;
  }

  std::vector<Tensor> exp_avg_;
  std::vector<Tensor> exp_avg_sq_;
};

}  // namespace

absl::Status ValidateOptimizerConfig(const OptimizerConfig& c) {
  auto bad = [](absl::string_view field, double value, absl::string_view want) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.", field, " = ", value, ": must be ", want));
  };
  if (c.name != "sgd" && c.name != "adamw") {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.name \"", c.name, "\" is unknown (want sgd or adamw)"));
  }
  if (!Finite(c.lr) || c.lr < 0) return bad("lr", c.lr, "finite and >= 0");
  if (!Finite(c.weight_decay) || c.weight_decay < 0) {
    return bad("weight_decay", c.weight_decay, "finite and >= 0");
  }
  if (!Finite(c.grad_clip_norm) || c.grad_clip_norm < 0) {
    return bad("grad_clip_norm", c.grad_clip_norm, "finite and >= 0 (0: off)");
  }
  if (c.name == "sgd") {
    if (!Finite(c.momentum) || c.momentum < 0) return bad("momentum", c.momentum, ">= 0");
    if (c.nesterov && c.momentum == 0) {
      return absl::InvalidArgumentError("optimizer.nesterov needs optimizer.momentum > 0");
    }
  } else {
    if (!(c.beta1 >= 0 && c.beta1 < 1)) return bad("beta1", c.beta1, "in [0, 1)");
    if (!(c.beta2 >= 0 && c.beta2 < 1)) return bad("beta2", c.beta2, "in [0, 1)");
    if (!Finite(c.eps) || c.eps < 0) return bad("eps", c.eps, "finite and >= 0");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(
    const OptimizerConfig& config, const std::vector<Parameter*>& params) {
  AIDN_RETURN_IF_ERROR(ValidateOptimizerConfig(config));
  if (params.empty()) return absl::InvalidArgumentError("optimizer got an empty parameter list");
  std::set<std::string> names;
  for (const Parameter* p : params) {
    if (p == nullptr) return absl::InvalidArgumentError("optimizer got a null parameter");
    if (!names.insert(p->name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer got two parameters named \"", p->name, "\""));
    }
    if (p->value.device() != Device::kCpu || p->grad.device() != Device::kCpu) {
      return absl::UnimplementedError(
          absl::StrCat("parameter ", p->name, ": optimizers run on CPU tensors only"));
    }
    if (p->grad.shape() != p->value.shape()) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", p->name, ": gradient shape ",
                                                     p->grad.ShapeString(), " != value shape ",
                                                     p->value.ShapeString()));
    }
  }
  if (config.name == "sgd") return std::unique_ptr<Optimizer>(new Sgd(config, params));
  return std::unique_ptr<Optimizer>(new AdamW(config, params));
}

absl::Status Optimizer::CheckStep(double lr) const {
  if (!Finite(lr) || lr < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("learning rate ", lr, " is not finite and >= 0"));
  }
  // A layer that resized a parameter after Create would make the state
  // buffers stale; refuse rather than write out of bounds.
  for (size_t k = 0; k < params_.size(); ++k) {
    const Parameter* p = params_[k];
    if (p->value.shape() != shapes_[k] || p->grad.shape() != shapes_[k]) {
      return absl::FailedPreconditionError(
          absl::StrCat("parameter ", p->name, ": value ", p->value.ShapeString(), " or gradient ",
                       p->grad.ShapeString(), " changed shape since the optimizer was created"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<float> Optimizer::ClipCoefficient() {
  if (config_.grad_clip_norm <= 0) return 1.0f;
  if (reduce_) {
    double sum = 0;
    for (const Parameter* p : params_) sum += SumOfSquares(p->grad);
    absl::StatusOr<double> total = reduce_(sum);
    if (!total.ok()) {
      return absl::Status(total.status().code(),
                          absl::StrCat("gradient norm: ", total.status().message()));
    }
    last_grad_norm_ = std::sqrt(*total);
  } else {
    last_grad_norm_ = TotalGradNorm(params_);
  }
  return ClipCoefficientFor(last_grad_norm_, config_.grad_clip_norm);
}

absl::Status Optimizer::LoadState(const std::vector<StateEntry>& state, int64_t steps) {
  if (steps < 0) return absl::InvalidArgumentError(absl::StrCat("optimizer steps ", steps, " < 0"));
  const std::vector<StateEntry> mine = State();
  std::map<std::string, const Tensor*> given;
  for (const StateEntry& e : state) {
    if (e.second == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state ", e.first, " is null"));
    }
    if (!given.emplace(e.first, e.second).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer state ", e.first, " is given twice"));
    }
  }
  // Validate everything before touching anything.
  for (const StateEntry& e : mine) {
    auto it = given.find(e.first);
    if (it == given.end()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state ", e.first, " is missing"));
    }
    if (it->second->shape() != e.second->shape()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state ", e.first, " has shape ",
                                                     it->second->ShapeString(), ", want ",
                                                     e.second->ShapeString()));
    }
  }
  if (given.size() != mine.size()) {
    std::set<std::string> known;
    for (const StateEntry& e : mine) known.insert(e.first);
    for (const auto& [name, tensor] : given) {
      if (known.count(name) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer state ", name, " is not a state of this ", config_.name, " optimizer"));
      }
    }
  }
  std::vector<Tensor*> targets = MutableState();
  for (size_t k = 0; k < mine.size(); ++k) {
    const Tensor* src = given[mine[k].first];
    if (src != targets[k] && src->numel() > 0) {
      std::memcpy(targets[k]->data(), src->data(), sizeof(float) * src->numel());
    }
  }
  steps_ = steps;
  return absl::OkStatus();
}

double ClipGradNorm(const std::vector<Parameter*>& params, double max_norm) {
  const double total = TotalGradNorm(params);
  const float coef = ClipCoefficientFor(total, max_norm);
  if (coef != 1.0f) {
    for (Parameter* p : params) {
      float* g = p->grad.data();
      const int64_t n = p->grad.numel();
      for (int64_t i = 0; i < n; ++i) g[i] = g[i] * coef;
    }
  }
  return total;
}

}  // namespace aidn::engine
