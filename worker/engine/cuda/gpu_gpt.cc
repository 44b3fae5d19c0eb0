#include "worker/engine/cuda/gpu_gpt.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/dropout_mask.h"
#include "worker/engine/cuda/flash_attention.h"
#include "worker/engine/cuda/gpt_kernels.h"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/cuda/status.h"
#include "worker/engine/token_positions.h"

namespace aidn::engine::cuda {
namespace {

absl::Status EnsureDeviceBytes(GpuContext* ctx, DeviceBuffer* buf, size_t bytes) {
  if (buf->bytes() >= bytes && buf->data() != nullptr) return absl::OkStatus();
  buf->Release();
  AIDN_ASSIGN_OR_RETURN(*buf, ctx->allocator().Allocate(std::max<size_t>(bytes, 1)));
  return absl::OkStatus();
}

template <typename T>
absl::Status UploadVector(GpuContext* ctx, const std::vector<T>& host, DeviceBuffer* buf) {
  const size_t bytes = sizeof(T) * host.size();
  AIDN_RETURN_IF_ERROR(EnsureDeviceBytes(ctx, buf, bytes));
  if (bytes == 0) return absl::OkStatus();
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(buf->data(), host.data(), bytes, cudaMemcpyHostToDevice, ctx->stream()));
  return absl::OkStatus();
}

GemmOperand AsStored(const float* data, int64_t ld) { return {data, ld, false, 0, nullptr}; }
GemmOperand AsTransposed(const float* data, int64_t ld) { return {data, ld, true, 0, nullptr}; }

}  // namespace

absl::StatusOr<std::unique_ptr<GpuGpt>> GpuGpt::Create(GpuContext* ctx, const Gpt& cpu) {
  const GptConfig& config = cpu.config();
  if (cpu.tensor_parallel_size() > 1) {
    return absl::UnimplementedError("the GPU decoder has no tensor parallelism yet");
  }
  if (cpu.StageParameters().size() != cpu.Parameters().size()) {
    return absl::UnimplementedError("the GPU decoder runs whole models, not pipeline stages");
  }
  if (cpu.activation_checkpointing()) {
    return absl::UnimplementedError("the GPU decoder has no activation checkpointing yet");
  }
  std::unique_ptr<GpuGpt> gpt(new GpuGpt(ctx, config));
  std::map<std::string, GpuParameter*> by_name;
  for (const Parameter* p : cpu.Parameters()) {
    auto gp = std::make_unique<GpuParameter>();
    gp->name = p->name;
    AIDN_ASSIGN_OR_RETURN(gp->value, GpuTensor::FromHost(ctx, p->value));
    AIDN_ASSIGN_OR_RETURN(gp->grad, GpuTensor::Empty(ctx, p->value.shape()));
    AIDN_RETURN_IF_ERROR(gp->grad.Zero(ctx));
    by_name[p->name] = gp.get();
    gpt->params_.push_back(std::move(gp));
  }
  auto find = [&by_name](const std::string& name) -> GpuParameter* {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : it->second;
  };
  gpt->wte_ = find("transformer.wte.weight");
  gpt->wpe_ = find("transformer.wpe.weight");
  gpt->lnf_w_ = find("transformer.ln_f.weight");
  gpt->lnf_b_ = find("transformer.ln_f.bias");
  gpt->blocks_.resize(static_cast<size_t>(config.n_layer));
  gpt->end_block_ = config.n_layer;
  for (size_t l = 0; l < gpt->blocks_.size(); ++l) {
    Block& b = gpt->blocks_[l];
    const std::string h = absl::StrCat("transformer.h.", l, ".");
    b.ln1_w = find(h + "ln_1.weight");
    b.ln1_b = find(h + "ln_1.bias");
    b.attn_w = find(h + "attn.c_attn.weight");
    b.attn_b = find(h + "attn.c_attn.bias");
    b.proj_w = find(h + "attn.c_proj.weight");
    b.proj_b = find(h + "attn.c_proj.bias");
    b.ln2_w = find(h + "ln_2.weight");
    b.ln2_b = find(h + "ln_2.bias");
    b.fc_w = find(h + "mlp.c_fc.weight");
    b.fc_b = find(h + "mlp.c_fc.bias");
    b.fc_proj_w = find(h + "mlp.c_proj.weight");
    b.fc_proj_b = find(h + "mlp.c_proj.bias");
  }
  AIDN_RETURN_IF_ERROR(EnsureDeviceBytes(ctx, &gpt->loss_, sizeof(double)));
  // Fused attention rounds to bf16 (fp16 keeps the cuBLAS path, in fp16).
  gpt->fused_possible_ = ctx->options().precision == Precision::kBf16 && config.dropout == 0.0 &&
                         FlashAttentionFits(config.n_embd / config.n_head, ctx->device());
  return gpt;
}

std::vector<GpuParameter*> GpuGpt::Parameters() {
  std::vector<GpuParameter*> out;
  out.reserve(params_.size());
  for (auto& p : params_) out.push_back(p.get());
  return out;
}

absl::Status GpuGpt::CopyWeightsFrom(const Gpt& cpu) {
  const std::vector<Parameter*>& src = cpu.Parameters();
  if (src.size() != params_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the CPU decoder has ", src.size(),
                                                   " parameters, the GPU one ", params_.size()));
  }
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i]->name != params_[i]->name || src[i]->value.shape() != params_[i]->value.shape()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", i, " is ", src[i]->name, " on the CPU and ", params_[i]->name,
                       " ", params_[i]->value.ShapeString(), " on the GPU"));
    }
  }
  for (size_t i = 0; i < src.size(); ++i) {
    // A stage's released weights stay released.
    if (params_[i]->value.data() == nullptr) continue;
    AIDN_RETURN_IF_ERROR(params_[i]->value.CopyFromHost(ctx_, src[i]->value));
  }
  return absl::OkStatus();
}

absl::Status GpuGpt::CopyDown(const std::vector<Parameter*>& cpu, bool grads) const {
  if (cpu.size() != params_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the GPU decoder has ", params_.size(),
                                                   " parameters, the CPU list ", cpu.size()));
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (cpu[i]->name != params_[i]->name) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", i, " is ", params_[i]->name,
                                                     " on the GPU, ", cpu[i]->name, " here"));
    }
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    const GpuParameter& p = *params_[i];
    // What a stage released is not copied (the CPU tensor is left alone).
    if ((grads ? p.grad.data() : p.value.data()) == nullptr) continue;
    AIDN_RETURN_IF_ERROR(grads ? p.grad.CopyToHost(ctx_, &cpu[i]->grad)
                               : p.value.CopyToHost(ctx_, &cpu[i]->value));
  }
  return absl::OkStatus();
}

absl::Status GpuGpt::ZeroGrad() {
  if (hooks_ != nullptr) return absl::OkStatus();
  for (auto& p : params_) {
    if (p->grad.data() != nullptr) AIDN_RETURN_IF_ERROR(p->grad.Zero(ctx_));
  }
  return absl::OkStatus();
}

absl::Status GpuGpt::SetStage(int first_block, int end_block) {
  if (first_block < 0 || first_block >= end_block || end_block > config_.n_layer) {
    return absl::InvalidArgumentError(absl::StrCat("gpt: stage of blocks [", first_block, ", ",
                                                   end_block, ") of ", config_.n_layer));
  }
  if (hooks_ != nullptr || staged_) {
    return absl::FailedPreconditionError("gpt: a stage is set once, on a model without unit hooks");
  }
  first_block_ = first_block;
  end_block_ = end_block;
  staged_ = true;
  has_forward_ = false;
  const std::vector<GpuParameter*> mine = StageParameters();
  for (auto& p : params_) {
    if (std::find(mine.begin(), mine.end(), p.get()) != mine.end()) continue;
    std::vector<int64_t> shape = p->value.shape();
    p->value = GpuTensor::View(nullptr, shape);
    p->grad = GpuTensor::View(nullptr, std::move(shape));
  }
  for (int l = 0; l < config_.n_layer; ++l) {
    if (l >= first_block && l < end_block) continue;
    Block& b = blocks_[static_cast<size_t>(l)];
    b.skipped = false;
    for (GpuTensor* t : {&b.in, &b.ln1, &b.ln1_mean, &b.ln1_rstd, &b.qkv, &b.y, &b.att_max,
                         &b.att_inv, &b.mid, &b.ln2, &b.ln2_mean, &b.ln2_rstd, &b.fc, &b.gelu}) {
      *t = GpuTensor();
    }
  }
  // The head's buffers on the last stage only, the tokens' on the first.
  if (!has_head()) {
    for (GpuTensor* t : {&lnf_, &lnf_mean_, &lnf_rstd_, &logits_, &grad_logits_}) *t = GpuTensor();
  }
  if (!embeds()) {
    for (DeviceBuffer* d : {&tokens_d_, &grad_tokens_d_, &grad_offsets_d_, &grad_positions_d_}) {
      d->Release();
    }
  }
  return absl::OkStatus();
}

std::vector<GpuParameter*> GpuGpt::StageParameters() {
  // Registration order: wte, wpe, the blocks', ln_f.
  std::vector<GpuParameter*> mine;
  for (auto& p : params_) {
    GpuParameter* q = p.get();
    bool held = false;
    if (q == wte_) {
      held = embeds() || has_head();
    } else if (q == wpe_) {
      held = embeds();
    } else if (q == lnf_w_ || q == lnf_b_) {
      held = has_head();
    } else {
      for (int l = first_block_; l < end_block_ && !held; ++l) {
        const Block& b = blocks_[static_cast<size_t>(l)];
        for (const GpuParameter* r : {b.ln1_w, b.ln1_b, b.attn_w, b.attn_b, b.proj_w, b.proj_b,
                                      b.ln2_w, b.ln2_b, b.fc_w, b.fc_b, b.fc_proj_w, b.fc_proj_b}) {
          held = held || r == q;
        }
      }
    }
    if (held) mine.push_back(q);
  }
  return mine;
}

void GpuGpt::SetSeed(uint64_t seed) {
  seed_ = seed;
  draws_ = 0;
  depth_rng_.seed(seed);
}

std::vector<GpuParameter*> GpuGpt::UnusedParameters() {
  std::vector<GpuParameter*> unused;
  for (int l = first_block_; l < end_block_; ++l) {
    const Block& b = blocks_[static_cast<size_t>(l)];
    if (!b.skipped) continue;
    for (GpuParameter* p : {b.ln1_w, b.ln1_b, b.attn_w, b.attn_b, b.proj_w, b.proj_b, b.ln2_w,
                            b.ln2_b, b.fc_w, b.fc_b, b.fc_proj_w, b.fc_proj_b}) {
      if (p != nullptr) unused.push_back(p);
    }
  }
  return unused;
}

uint64_t GpuGpt::Key(uint64_t site) const {
  // draws_ counts the forward in flight (1 for the first after SetSeed).
  const uint64_t sites = 1 + 3 * blocks_.size();
  return DropoutKey(seed_, (draws_ - 1) * sites + site);
}

absl::Status GpuGpt::Shape(int64_t batch, int64_t seq_len) {
  if (batch < 1 || seq_len < 1 || seq_len > config_.block_size) {
    return absl::InvalidArgumentError(absl::StrCat("gpt: batch ", batch, ", sequence length ",
                                                   seq_len, " (block_size ", config_.block_size,
                                                   ")"));
  }
  batch_ = batch;
  seq_len_ = seq_len;
  // Fixed here for this Forward and its Backward.
  fused_now_ = FusedAttention();
  const int64_t n = batch * seq_len;
  const int64_t c = config_.n_embd;
  const int64_t h = config_.n_head;
  for (int l = first_block_; l < end_block_; ++l) {
    Block& b = blocks_[static_cast<size_t>(l)];
    for (auto [t, shape] : std::initializer_list<std::pair<GpuTensor*, std::vector<int64_t>>>{
             {&b.in, {n, c}},
             {&b.ln1, {n, c}},
             {&b.ln1_mean, {n}},
             {&b.ln1_rstd, {n}},
             {&b.qkv, {n, 3 * c}},
             {&b.y, {n, c}},
             {&b.att_max, {batch * h * seq_len}},
             {&b.att_inv, {batch * h * seq_len}},
             {&b.mid, {n, c}},
             {&b.ln2, {n, c}},
             {&b.ln2_mean, {n}},
             {&b.ln2_rstd, {n}},
             {&b.fc, {n, 4 * c}},
             {&b.gelu, {n, 4 * c}}}) {
      AIDN_RETURN_IF_ERROR(t->Resize(ctx_, shape));
    }
  }
  // The head's tensors on the last stage only.
  const int64_t v = has_head() ? config_.vocab_size : 0;
  const int64_t nh = has_head() ? n : 0;
  for (auto [t, shape] : std::initializer_list<std::pair<GpuTensor*, std::vector<int64_t>>>{
           {&out_, {n, c}},
           {&lnf_, {nh, c}},
           {&lnf_mean_, {nh}},
           {&lnf_rstd_, {nh}},
           {&logits_, {n, v}},
           {&grad_logits_, {n, v}},
           {&dx_, {n, c}},
           {&dtmp_, {n, c}},
           {&dbranch_, {n, c}},
           {&dbig_, {n, 4 * c}},
           {&dqkv_, {n, 3 * c}},
           {&gn_, {n, c}},
           {&attn_delta_, {fused_now_ ? batch * h * seq_len : 0}},
           {&scores_, {fused_now_ ? 0 : h, seq_len, seq_len}},
           {&dscores_, {fused_now_ ? 0 : h, seq_len, seq_len}},
           {&pdrop_, {config_.dropout > 0.0 ? h : 0, seq_len, seq_len}}}) {
    AIDN_RETURN_IF_ERROR(t->Resize(ctx_, shape));
  }
  int64_t partials = 0;
  for (const int64_t cols : {c, 3 * c, 4 * c}) {
    partials = std::max(partials, BiasGradScratchFloats(n, cols, 1));
  }
  AIDN_RETURN_IF_ERROR(bias_partials_.Resize(ctx_, {std::max<int64_t>(partials, 1)}));
  return EnsureDeviceBytes(ctx_, &row_loss_, sizeof(double) * static_cast<size_t>(n));
}

absl::Status GpuGpt::UploadTokens(const int32_t* tokens, const int32_t* targets, bool training) {
  const int64_t n = batch_ * seq_len_;
  const int32_t vocab = config_.vocab_size;
  for (int64_t i = 0; i < n; ++i) {
    if (tokens != nullptr && (tokens[i] < 0 || tokens[i] >= vocab)) {
      return absl::InvalidArgumentError(absl::StrCat("gpt: token ", tokens[i], " at ", i,
                                                     " is outside the vocabulary of ", vocab));
    }
    if (targets != nullptr && (targets[i] < 0 || targets[i] >= vocab)) {
      return absl::InvalidArgumentError(absl::StrCat("gpt: target ", targets[i], " at ", i,
                                                     " is outside the vocabulary of ", vocab));
    }
  }
  if (tokens != nullptr) {
    AIDN_RETURN_IF_ERROR(UploadVector(ctx_, std::vector<int32_t>(tokens, tokens + n), &tokens_d_));
  }
  if (targets != nullptr) {
    AIDN_RETURN_IF_ERROR(
        UploadVector(ctx_, std::vector<int32_t>(targets, targets + n), &targets_d_));
  }
  if (!training) return absl::OkStatus();
  // The positions grouped by token: the order the CPU adds them to wte's
  // gradient.
  grad_groups_ = GroupPositionsByToken(tokens, n, vocab);
  AIDN_RETURN_IF_ERROR(UploadVector(ctx_, grad_groups_.tokens, &grad_tokens_d_));
  AIDN_RETURN_IF_ERROR(UploadVector(ctx_, grad_groups_.offsets, &grad_offsets_d_));
  return UploadVector(ctx_, grad_groups_.positions, &grad_positions_d_);
}

absl::Status GpuGpt::Linear(const float* x, const GpuParameter& w, const GpuParameter* b,
                            int64_t in, int64_t out, float* y) {
  const int64_t n = batch_ * seq_len_;
  AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, n, out, in, 1.0f, AsStored(x, in),
                                    AsStored(w.value.data(), out), 0.0f, y, out, 0, 1,
                                    &gemm_scratch_));
  if (b == nullptr) return absl::OkStatus();
  return LaunchBiasActivation(ctx_->stream(), y, b->value.data(), y, n * out, out, 1, false);
}

absl::Status GpuGpt::ColumnSums(const float* g, int64_t rows, int64_t cols, float* into) {
  return LaunchBiasGrad(ctx_->stream(), g, into, rows, cols, 1, bias_partials_.data(),
                        bias_partials_.numel());
}

absl::Status GpuGpt::LinearBackward(const float* dy, const float* x, GpuParameter& w,
                                    GpuParameter* b, int64_t in, int64_t out, float* dx) {
  const int64_t n = batch_ * seq_len_;
  // dy feeds both products: rounded to 16 bits once.
  AIDN_ASSIGN_OR_RETURN(const GemmOperand g,
                        RoundOperand(ctx_, AsStored(dy, out), n, out, 1, &gemm_scratch_.shared));
  if (dx != nullptr) {
    AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, n, in, out, 1.0f, g, AsTransposed(w.value.data(), out),
                                      0.0f, dx, in, 0, 1, &gemm_scratch_));
  }
  AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, in, out, n, 1.0f, AsTransposed(x, in), g, 1.0f,
                                    w.grad.data(), out, 0, 1, &gemm_scratch_));
  if (b == nullptr) return absl::OkStatus();
  return ColumnSums(dy, n, out, b->grad.data());
}

absl::Status GpuGpt::LayerNormBackward(const float* dout, const float* x, GpuParameter& w,
                                       GpuParameter* b, const GpuTensor& mean,
                                       const GpuTensor& rstd, float* dx) {
  const int64_t n = batch_ * seq_len_;
  const int64_t c = config_.n_embd;
  AIDN_RETURN_IF_ERROR(LaunchLayerNormBackward(ctx_->stream(), dout, x, w.value.data(), mean.data(),
                                               rstd.data(), n, c, dx, gn_.data()));
  AIDN_RETURN_IF_ERROR(ColumnSums(gn_.data(), n, c, w.grad.data()));
  if (b == nullptr) return absl::OkStatus();
  return ColumnSums(dout, n, c, b->grad.data());
}

absl::Status GpuGpt::DropBranch(float* x, uint64_t site) {
  const double p = config_.dropout;
  return LaunchDropout(ctx_->stream(), x, x, batch_ * seq_len_ * config_.n_embd, Key(site),
                       DropoutThreshold(p), static_cast<float>(1.0 / (1.0 - p)));
}

absl::StatusOr<const float*> GpuGpt::BranchGrad(uint64_t site, float scale) {
  if (!dropped_ && scale == 1.0f) return static_cast<const float*>(dx_.data());
  cudaStream_t stream = ctx_->stream();
  if (dropped_) {
    const double p = config_.dropout;
    AIDN_RETURN_IF_ERROR(LaunchDropout(stream, dx_.data(), dbranch_.data(), dx_.numel(), Key(site),
                                       DropoutThreshold(p), static_cast<float>(1.0 / (1.0 - p))));
  } else {
    AIDN_RETURN_IF_ERROR(dbranch_.CopyFrom(ctx_, dx_));
  }
  // A kept block's branch was scaled (stochastic depth), after its mask.
  if (scale != 1.0f)
    AIDN_RETURN_IF_ERROR(LaunchScale(stream, dbranch_.data(), dbranch_.numel(), scale));
  return static_cast<const float*>(dbranch_.data());
}

absl::Status GpuGpt::AttentionForward(size_t l, bool drop) {
  Block& b = blocks_[l];
  const int64_t t = seq_len_;
  const int64_t c = config_.n_embd;
  const int64_t heads = config_.n_head;
  const int64_t hd = c / heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const double p = config_.dropout;
  if (fused_now_) {
    // The log-sum-exp of each row in att_max.
    return LaunchFlashAttentionForward(ctx_->stream(), b.qkv.data(), batch_, t, heads, hd, scale,
                                       b.y.data(), b.att_max.data());
  }
  for (int64_t s = 0; s < batch_; ++s) {
    const float* q = b.qkv.data() + s * t * 3 * c;
    const float* k = q + c;
    const float* v = q + 2 * c;
    // scores[h] = scale q_h k_h^T, every head at once (heads hd apart).
    AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, t, t, hd, scale, {q, 3 * c, false, hd},
                                      {k, 3 * c, true, hd}, 0.0f, scores_.data(), t, t * t, heads,
                                      &gemm_scratch_));
    const int64_t rows = heads * t;
    AIDN_RETURN_IF_ERROR(LaunchCausalSoftmax(ctx_->stream(), scores_.data(), rows, t,
                                             b.att_max.data() + s * rows,
                                             b.att_inv.data() + s * rows));
    const float* probs = scores_.data();
    if (drop) {
      AIDN_RETURN_IF_ERROR(LaunchDropout(ctx_->stream(), scores_.data(), pdrop_.data(), rows * t,
                                         Mix64(Key(AttentionSite(l)) + s), DropoutThreshold(p),
                                         static_cast<float>(1.0 / (1.0 - p))));
      probs = pdrop_.data();
    }
    // y_h = P_h v_h into the sequence's rows, head h at column h * hd.
    AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, t, hd, t, 1.0f, {probs, t, false, t * t},
                                      {v, 3 * c, false, hd}, 0.0f, b.y.data() + s * t * c, c, hd,
                                      heads, &gemm_scratch_));
  }
  return absl::OkStatus();
}

absl::Status GpuGpt::AttentionBackward(size_t l, const float* dy, float* dqkv) {
  Block& b = blocks_[l];
  const int64_t t = seq_len_;
  const int64_t c = config_.n_embd;
  const int64_t heads = config_.n_head;
  const int64_t hd = c / heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const double p = config_.dropout;
  const int64_t rows = heads * t;
  if (fused_now_) {
    return LaunchFlashAttentionBackward(ctx_->stream(), b.qkv.data(), b.y.data(), dy,
                                        b.att_max.data(), batch_, t, heads, hd, scale, dqkv,
                                        attn_delta_.data());
  }
  for (int64_t s = 0; s < batch_; ++s) {
    const float* q = b.qkv.data() + s * t * 3 * c;
    const float* k = q + c;
    const float* v = q + 2 * c;
    float* dq = dqkv + s * t * 3 * c;
    float* dk = dq + c;
    float* dv = dq + 2 * c;
    const float* g = dy + s * t * c;
    // The probabilities again, from the same product and statistics.
    AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, t, t, hd, scale, {q, 3 * c, false, hd},
                                      {k, 3 * c, true, hd}, 0.0f, scores_.data(), t, t * t, heads,
                                      &gemm_scratch_));
    AIDN_RETURN_IF_ERROR(LaunchCausalSoftmaxRecompute(ctx_->stream(), scores_.data(), rows, t,
                                                      b.att_max.data() + s * rows,
                                                      b.att_inv.data() + s * rows));
    const float* probs = scores_.data();
    const uint64_t key = dropped_ ? Mix64(Key(AttentionSite(l)) + s) : 0;
    const float keep_scale = static_cast<float>(1.0 / (1.0 - p));
    if (dropped_) {
      AIDN_RETURN_IF_ERROR(LaunchDropout(ctx_->stream(), scores_.data(), pdrop_.data(), rows * t,
                                         key, DropoutThreshold(p), keep_scale));
      probs = pdrop_.data();
    }
    // dP = dy v^T; dv = P^T dy.
    AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, t, t, hd, 1.0f, {g, c, false, hd}, {v, 3 * c, true, hd},
                                      0.0f, dscores_.data(), t, t * t, heads, &gemm_scratch_));
    AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, t, hd, t, 1.0f, {probs, t, true, t * t},
                                      {g, c, false, hd}, 0.0f, dv, 3 * c, hd, heads,
                                      &gemm_scratch_));
    if (dropped_) {
      AIDN_RETURN_IF_ERROR(LaunchDropout(ctx_->stream(), dscores_.data(), dscores_.data(), rows * t,
                                         key, DropoutThreshold(p), keep_scale));
    }
    AIDN_RETURN_IF_ERROR(
        LaunchCausalSoftmaxBackward(ctx_->stream(), scores_.data(), dscores_.data(), rows, t));
    // S = scale q k^T: dq = scale dS k, dk = scale dS^T q.
    AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, t, hd, t, scale, {dscores_.data(), t, false, t * t},
                                      {k, 3 * c, false, hd}, 0.0f, dq, 3 * c, hd, heads,
                                      &gemm_scratch_));
    AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, t, hd, t, scale, {dscores_.data(), t, true, t * t},
                                      {q, 3 * c, false, hd}, 0.0f, dk, 3 * c, hd, heads,
                                      &gemm_scratch_));
  }
  return absl::OkStatus();
}

absl::Status GpuGpt::BlockForward(size_t l, float* out, bool drop) {
  Block& b = blocks_[l];
  const int64_t n = batch_ * seq_len_;
  const int64_t c = config_.n_embd;
  cudaStream_t stream = ctx_->stream();
  AIDN_RETURN_IF_ERROR(LaunchLayerNorm(stream, b.in.data(), b.ln1_w->value.data(),
                                       b.ln1_b != nullptr ? b.ln1_b->value.data() : nullptr, n, c,
                                       b.ln1.data(), b.ln1_mean.data(), b.ln1_rstd.data()));
  AIDN_RETURN_IF_ERROR(Linear(b.ln1.data(), *b.attn_w, b.attn_b, c, 3 * c, b.qkv.data()));
  AIDN_RETURN_IF_ERROR(AttentionForward(l, drop));
  // mid = in + drop(y Wproj + b).
  AIDN_RETURN_IF_ERROR(Linear(b.y.data(), *b.proj_w, b.proj_b, c, c, b.mid.data()));
  if (drop) AIDN_RETURN_IF_ERROR(DropBranch(b.mid.data(), AttentionBranchSite(l)));
  if (branch_scale_ != 1.0f) {
    AIDN_RETURN_IF_ERROR(LaunchScale(stream, b.mid.data(), n * c, branch_scale_));
  }
  AIDN_RETURN_IF_ERROR(LaunchAdd(stream, b.mid.data(), b.in.data(), b.mid.data(), n * c));
  AIDN_RETURN_IF_ERROR(LaunchLayerNorm(stream, b.mid.data(), b.ln2_w->value.data(),
                                       b.ln2_b != nullptr ? b.ln2_b->value.data() : nullptr, n, c,
                                       b.ln2.data(), b.ln2_mean.data(), b.ln2_rstd.data()));
  AIDN_RETURN_IF_ERROR(Linear(b.ln2.data(), *b.fc_w, b.fc_b, c, 4 * c, b.fc.data()));
  AIDN_RETURN_IF_ERROR(LaunchGelu(stream, b.fc.data(), b.gelu.data(), n * 4 * c));
  AIDN_RETURN_IF_ERROR(Linear(b.gelu.data(), *b.fc_proj_w, b.fc_proj_b, 4 * c, c, out));
  if (drop) AIDN_RETURN_IF_ERROR(DropBranch(out, MlpBranchSite(l)));
  if (branch_scale_ != 1.0f) AIDN_RETURN_IF_ERROR(LaunchScale(stream, out, n * c, branch_scale_));
  return LaunchAdd(stream, out, b.mid.data(), out, n * c);
}

absl::Status GpuGpt::Forward(const int32_t* tokens, const int32_t* targets, int64_t batch,
                             int64_t seq_len, bool training) {
  if (!embeds() || !has_head()) {
    return absl::FailedPreconditionError("gpt: Forward of a pipeline stage (ForwardStage)");
  }
  return ForwardStage(tokens, nullptr, targets, batch, seq_len, training);
}

absl::Status GpuGpt::ForwardStage(const int32_t* tokens, const float* input, const int32_t* targets,
                                  int64_t batch, int64_t seq_len, bool training) {
  has_forward_ = false;
  if (embeds() ? tokens == nullptr : input == nullptr) {
    return absl::InvalidArgumentError(embeds() ? "gpt: the first stage needs tokens"
                                               : "gpt: a later stage needs its input");
  }
  if (has_head() && training && targets == nullptr) {
    return absl::InvalidArgumentError("gpt: the last stage needs targets to train");
  }
  AIDN_RETURN_IF_ERROR(Shape(batch, seq_len));
  AIDN_RETURN_IF_ERROR(UploadTokens(embeds() ? tokens : nullptr, has_head() ? targets : nullptr,
                                    training && embeds()));
  const int64_t n = batch * seq_len;
  const int64_t c = config_.n_embd;
  const bool drop = training && config_.dropout > 0.0;
  dropped_ = drop;
  if (training) ++draws_;
  cudaStream_t stream = ctx_->stream();
  const size_t first = static_cast<size_t>(first_block_);
  const size_t end = static_cast<size_t>(end_block_);
  float* x = first == end ? out_.data() : blocks_[first].in.data();
  if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->BeforeForward(0));
  if (embeds()) {
    AIDN_RETURN_IF_ERROR(LaunchEmbedding(stream, static_cast<const int32_t*>(tokens_d_.data()),
                                         wte_->value.data(), wpe_->value.data(), x, n, seq_len, c));
    if (drop) AIDN_RETURN_IF_ERROR(DropBranch(x, 0));
  } else {
    // The previous stage's output.
    AIDN_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(x, input, sizeof(float) * n * c, cudaMemcpyDeviceToDevice, stream));
  }
  // Stochastic depth: the CPU decoder's draws, one per block (with dropout
  // its generator draws the masks too, so the two skip differently then,
  // as their masks differ).
  const double p_skip = config_.stochastic_depth;
  const bool depth = training && p_skip > 0.0;
  branch_scale_ = depth ? static_cast<float>(1.0 / (1.0 - p_skip)) : 1.0f;
  // A stage draws the whole model's draws and keeps its blocks', so that
  // its blocks skip as the whole decoder's do.
  const auto draw = [&] { return static_cast<double>(depth_rng_() >> 11) * 0x1p-53 < p_skip; };
  if (depth) {
    for (size_t l = 0; l < first; ++l) draw();
  }
  for (size_t l = first; l < end; ++l) {
    Block& b = blocks_[l];
    float* next = l + 1 < end ? blocks_[l + 1].in.data() : out_.data();
    b.skipped = depth && draw();
    const int unit = static_cast<int>(l) + 1;
    if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->BeforeForward(unit));
    if (b.skipped) {
      // The stream passes through.
      AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(next, b.in.data(), sizeof(float) * n * c,
                                                cudaMemcpyDeviceToDevice, stream));
    } else {
      AIDN_RETURN_IF_ERROR(BlockForward(l, next, drop));
    }
    if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->AfterForward(unit));
  }
  if (depth) {
    for (size_t l = end; l < blocks_.size(); ++l) draw();
  }
  if (!has_head()) {
    // The stage's output (stage_output()) goes to the next stage.
    if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->AfterForward(0));
    has_forward_ = training;
    return absl::OkStatus();
  }
  AIDN_RETURN_IF_ERROR(LaunchLayerNorm(stream, out_.data(), lnf_w_->value.data(),
                                       lnf_b_ != nullptr ? lnf_b_->value.data() : nullptr, n, c,
                                       lnf_.data(), lnf_mean_.data(), lnf_rstd_.data()));
  // logits = ln_f(x) wte^T.
  const int64_t v = config_.vocab_size;
  AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, n, v, c, 1.0f, AsStored(lnf_.data(), c),
                                    AsTransposed(wte_->value.data(), c), 0.0f, logits_.data(), v, 0,
                                    1, &gemm_scratch_));
  if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->AfterForward(0));
  if (targets == nullptr) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(LaunchSoftmaxCrossEntropy(
      stream, logits_.data(), static_cast<const int32_t*>(targets_d_.data()), n, v,
      training ? grad_logits_.data() : nullptr, 1.0, static_cast<double*>(row_loss_.data()),
      static_cast<double*>(loss_.data())));
  has_forward_ = training;
  return absl::OkStatus();
}

absl::StatusOr<double> GpuGpt::ReadLoss() const {
  double loss = 0;
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(&loss, loss_.data(), sizeof(double), cudaMemcpyDeviceToHost, ctx_->stream()));
  AIDN_RETURN_IF_ERROR(ctx_->Synchronize());
  return loss;
}

absl::Status GpuGpt::BlockBackward(size_t l) {
  Block& b = blocks_[l];
  const int64_t c = config_.n_embd;
  // The MLP branch: dx_ holds d(block output) = d(mid) + d(branch).
  AIDN_ASSIGN_OR_RETURN(const float* dmlp, BranchGrad(MlpBranchSite(l), branch_scale_));
  AIDN_RETURN_IF_ERROR(
      LinearBackward(dmlp, b.gelu.data(), *b.fc_proj_w, b.fc_proj_b, 4 * c, c, dbig_.data()));
  AIDN_RETURN_IF_ERROR(
      LaunchGeluBackward(ctx_->stream(), b.fc.data(), dbig_.data(), dbig_.numel()));
  AIDN_RETURN_IF_ERROR(
      LinearBackward(dbig_.data(), b.ln2.data(), *b.fc_w, b.fc_b, c, 4 * c, dtmp_.data()));
  AIDN_RETURN_IF_ERROR(LayerNormBackward(dtmp_.data(), b.mid.data(), *b.ln2_w, b.ln2_b, b.ln2_mean,
                                         b.ln2_rstd, dx_.data()));
  // The attention branch: dx_ now holds d(mid) = d(in) + d(branch).
  AIDN_ASSIGN_OR_RETURN(const float* dattn, BranchGrad(AttentionBranchSite(l), branch_scale_));
  AIDN_RETURN_IF_ERROR(LinearBackward(dattn, b.y.data(), *b.proj_w, b.proj_b, c, c, dtmp_.data()));
  AIDN_RETURN_IF_ERROR(AttentionBackward(l, dtmp_.data(), dqkv_.data()));
  AIDN_RETURN_IF_ERROR(
      LinearBackward(dqkv_.data(), b.ln1.data(), *b.attn_w, b.attn_b, c, 3 * c, dtmp_.data()));
  return LayerNormBackward(dtmp_.data(), b.in.data(), *b.ln1_w, b.ln1_b, b.ln1_mean, b.ln1_rstd,
                           dx_.data());
}

absl::Status GpuGpt::Backward(double grad_scale, const GradReadyFn& on_ready) {
  if (!embeds() || !has_head()) {
    return absl::FailedPreconditionError("gpt: Backward of a pipeline stage (BackwardStage)");
  }
  return BackwardStage(nullptr, nullptr, grad_scale, on_ready);
}

absl::Status GpuGpt::BackwardStage(const float* grad_output, GpuTensor* grad_input,
                                   double grad_scale, const GradReadyFn& on_ready) {
  if (!has_forward_) {
    return absl::FailedPreconditionError("gpt: Backward without a training Forward with targets");
  }
  if (!has_head() && grad_output == nullptr) {
    return absl::InvalidArgumentError("gpt: a stage before the last needs its output's gradient");
  }
  has_forward_ = false;
  const int64_t n = batch_ * seq_len_;
  const int64_t c = config_.n_embd;
  const int64_t v = config_.vocab_size;
  cudaStream_t stream = ctx_->stream();
  auto ready = [&on_ready](std::vector<GpuParameter*> ps) -> absl::Status {
    if (!on_ready) return absl::OkStatus();
    std::erase(ps, nullptr);
    return on_ready(ps);
  };
  if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->BeforeBackward(0));
  if (has_head()) {
    if (grad_scale != 1.0) {
      AIDN_RETURN_IF_ERROR(
          LaunchScale(stream, grad_logits_.data(), n * v, static_cast<float>(grad_scale)));
    }
    // The LM head: dlnf = dlogits wte, dwte += dlogits^T lnf. dlogits is
    // both products' first operand: rounded once, into the scratch's `a`
    // (which neither product then touches).
    AIDN_ASSIGN_OR_RETURN(const GemmOperand g, RoundOperand(ctx_, AsStored(grad_logits_.data(), v),
                                                            n, v, 1, &gemm_scratch_.a));
    AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, n, c, v, 1.0f, g, AsStored(wte_->value.data(), c), 0.0f,
                                      dtmp_.data(), c, 0, 1, &gemm_scratch_));
    GemmOperand gt = g;
    gt.transposed = true;
    AIDN_RETURN_IF_ERROR(RowMajorGemm(ctx_, v, c, n, 1.0f, gt, AsStored(lnf_.data(), c), 1.0f,
                                      wte_->grad.data(), c, 0, 1, &gemm_scratch_));
    AIDN_RETURN_IF_ERROR(dx_.Zero(ctx_));
    AIDN_RETURN_IF_ERROR(LayerNormBackward(dtmp_.data(), out_.data(), *lnf_w_, lnf_b_, lnf_mean_,
                                           lnf_rstd_, dx_.data()));
    AIDN_RETURN_IF_ERROR(ready({lnf_w_, lnf_b_}));
  } else {
    // The next stage's gradient of this stage's output.
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dx_.data(), grad_output, sizeof(float) * n * c,
                                              cudaMemcpyDeviceToDevice, stream));
  }
  for (size_t l = static_cast<size_t>(end_block_); l-- > static_cast<size_t>(first_block_);) {
    const Block& b = blocks_[l];
    const int unit = static_cast<int>(l) + 1;
    if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->BeforeBackward(unit));
    // A skipped block: the stream's gradient passes through, its
    // parameters get none (and are not reported).
    if (!b.skipped) AIDN_RETURN_IF_ERROR(BlockBackward(l));
    if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->AfterBackward(unit));
    if (b.skipped) continue;
    // In registration order, as the reducer expects each report's list.
    AIDN_RETURN_IF_ERROR(ready({b.ln1_w, b.ln1_b, b.attn_w, b.attn_b, b.proj_w, b.proj_b, b.ln2_w,
                                b.ln2_b, b.fc_w, b.fc_b, b.fc_proj_w, b.fc_proj_b}));
  }
  if (!embeds()) {
    // The last stage's wte (its head's part) is final; the stage's input
    // gradient goes to the previous stage.
    if (grad_input != nullptr) AIDN_RETURN_IF_ERROR(grad_input->CopyFrom(ctx_, dx_));
    if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->AfterBackward(0));
    return has_head() ? ready({wte_}) : absl::OkStatus();
  }
  // The embeddings.
  AIDN_ASSIGN_OR_RETURN(const float* demb, BranchGrad(0));
  AIDN_RETURN_IF_ERROR(LaunchTokenGrad(stream, demb, wte_->grad.data(),
                                       static_cast<const int32_t*>(grad_tokens_d_.data()),
                                       static_cast<const int32_t*>(grad_offsets_d_.data()),
                                       static_cast<const int32_t*>(grad_positions_d_.data()),
                                       static_cast<int64_t>(grad_groups_.tokens.size()), c));
  AIDN_RETURN_IF_ERROR(LaunchPositionGrad(stream, demb, wpe_->grad.data(), batch_, seq_len_, c));
  if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->AfterBackward(0));
  return ready({wte_, wpe_});
}

}  // namespace aidn::engine::cuda
