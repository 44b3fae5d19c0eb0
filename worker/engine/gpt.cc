#include "worker/engine/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numbers>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/gpt_shapes.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/engine/cpu_kernels.h"
#include "worker/engine/gemm.h"
#include "worker/engine/gpt_kernels.h"
#include "worker/engine/layers.h"
#include "worker/engine/loss.h"
#include "worker/engine/model.h"
#include "worker/engine/safetensors.h"

namespace aidn::engine {
namespace {

using gpt_kernels::FillNormal;
using gpt_kernels::GeluBackward;
using gpt_kernels::GeluForward;
using gpt_kernels::LayerNormBackward;
using gpt_kernels::LayerNormForward;
using gpt_kernels::LinearBackward;
using gpt_kernels::LinearForward;

constexpr double kInitStd = 0.02;

}  // namespace

absl::Status ValidateGptConfig(const GptConfig& c) {
  for (const auto& [name, value] : {std::pair<const char*, int>{"n_layer", c.n_layer},
                                    {"n_head", c.n_head},
                                    {"n_embd", c.n_embd},
                                    {"block_size", c.block_size},
                                    {"vocab_size", c.vocab_size}}) {
    if (value < 1) return absl::InvalidArgumentError(absl::StrCat("gpt ", name, " must be >= 1"));
  }
  if (c.n_embd % c.n_head != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt n_embd (", c.n_embd, ") must be a multiple of n_head (", c.n_head, ")"));
  }
  if (!(c.dropout >= 0.0 && c.dropout < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt dropout must be in [0, 1), got ", c.dropout));
  }
  if (!(c.stochastic_depth >= 0.0 && c.stochastic_depth < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt stochastic_depth must be in [0, 1), got ", c.stochastic_depth));
  }
  const int64_t widest = std::max<int64_t>(c.vocab_size, 4 * int64_t{c.n_embd});
  if (widest * c.n_embd > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError("gpt vocab_size * n_embd is beyond 2^31 elements");
  }
  return absl::OkStatus();
}

absl::StatusOr<GptConfig> NamedGptConfig(const std::string& name) {
  const GptShape* shape = FindGptShape(name);
  if (shape == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("no gpt configuration named \"", name, "\" (", kGptShapeNames, ")"));
  }
  GptConfig config;
  config.n_layer = shape->n_layer;
  config.n_head = shape->n_head;
  config.n_embd = shape->n_embd;
  config.block_size = shape->block_size;
  config.vocab_size = shape->vocab_size;
  return config;
}

std::string FormatGptConfig(const GptConfig& c) {
  return absl::StrCat("n_layer=", c.n_layer, ",n_head=", c.n_head, ",n_embd=", c.n_embd,
                      ",block_size=", c.block_size, ",vocab_size=", c.vocab_size,
                      ",bias=", c.bias ? 1 : 0);
}

absl::StatusOr<GptConfig> ParseGptConfig(const std::string& text) {
  GptConfig config;
  int bias = -1;
  struct Field {
    const char* name;
    int* value;
    bool seen = false;
  };
  Field fields[] = {{"n_layer", &config.n_layer},       {"n_head", &config.n_head},
                    {"n_embd", &config.n_embd},         {"block_size", &config.block_size},
                    {"vocab_size", &config.vocab_size}, {"bias", &bias}};
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, '=');
    Field* field = nullptr;
    for (Field& f : fields) {
      if (kv.first == f.name) field = &f;
    }
    if (field == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpt config \"", text, "\": unknown field \"", kv.first, "\""));
    }
    if (!absl::SimpleAtoi(kv.second, field->value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpt config \"", text, "\": ", kv.first, " is not a number"));
    }
    field->seen = true;
  }
  for (const Field& f : fields) {
    if (!f.seen) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpt config \"", text, "\": ", f.name, " is missing"));
    }
  }
  if (bias != 0 && bias != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt config \"", text, "\": bias must be 0 or 1"));
  }
  config.bias = bias == 1;
  if (absl::Status s = ValidateGptConfig(config); !s.ok()) return s;
  return config;
}

Gpt::Gpt(const GptConfig& config) : config_(config) {}

absl::StatusOr<std::unique_ptr<Gpt>> Gpt::Create(const GptConfig& config, uint64_t seed) {
  if (absl::Status s = ValidateGptConfig(config); !s.ok()) return s;
  std::unique_ptr<Gpt> gpt(new Gpt(config));
  gpt->Init(seed);
  return gpt;
}

void Gpt::Register(Parameter* p, std::string name, std::vector<int64_t> shape) {
  p->name = std::move(name);
  p->value = Tensor(shape);
  // Storage comes with the first ZeroGrad or Backward (EnsureGrads), or
  // from a sharded strategy's buffers: a model built only to be sharded
  // never holds all its gradients at once.
  p->grad = Tensor::View(nullptr, std::move(shape));
  parameters_.push_back(p);
}

void Gpt::EnsureGrads() {
  for (Parameter* p : stage_parameters_) {
    if (p->grad.data() == nullptr && p->grad.numel() > 0) p->grad = Tensor(p->grad.shape());
  }
}

void Gpt::Init(uint64_t seed) {
  const int64_t c = config_.n_embd;
  const bool bias = config_.bias;
  Register(&wte_, "transformer.wte.weight", {config_.vocab_size, c});
  Register(&wpe_, "transformer.wpe.weight", {config_.block_size, c});
  blocks_.resize(static_cast<size_t>(config_.n_layer));
  for (size_t l = 0; l < blocks_.size(); ++l) {
    Block& b = blocks_[l];
    const std::string h = absl::StrCat("transformer.h.", l, ".");
    Register(&b.ln1_w, h + "ln_1.weight", {c});
    if (bias) Register(&b.ln1_b, h + "ln_1.bias", {c});
    Register(&b.attn_w, h + "attn.c_attn.weight", {c, 3 * c});
    if (bias) Register(&b.attn_b, h + "attn.c_attn.bias", {3 * c});
    Register(&b.proj_w, h + "attn.c_proj.weight", {c, c});
    if (bias) Register(&b.proj_b, h + "attn.c_proj.bias", {c});
    Register(&b.ln2_w, h + "ln_2.weight", {c});
    if (bias) Register(&b.ln2_b, h + "ln_2.bias", {c});
    Register(&b.fc_w, h + "mlp.c_fc.weight", {c, 4 * c});
    if (bias) Register(&b.fc_b, h + "mlp.c_fc.bias", {4 * c});
    Register(&b.fc_proj_w, h + "mlp.c_proj.weight", {4 * c, c});
    if (bias) Register(&b.fc_proj_b, h + "mlp.c_proj.bias", {c});
  }
  Register(&lnf_w_, "transformer.ln_f.weight", {c});
  if (bias) Register(&lnf_b_, "transformer.ln_f.bias", {c});
  end_block_ = config_.n_layer;
  stage_parameters_ = parameters_;
  vocab_local_ = config_.vocab_size;
  heads_local_ = config_.n_head;
  cl_ = c;
  fl_ = 4 * c;

  const double proj_std = kInitStd / std::sqrt(2.0 * config_.n_layer);
  for (size_t i = 0; i < parameters_.size(); ++i) {
    Parameter* p = parameters_[i];
    const std::string& n = p->name;
    auto ends_with = [&n](const char* suffix) {
      const size_t len = std::char_traits<char>::length(suffix);
      return n.size() >= len && n.compare(n.size() - len, len, suffix) == 0;
    };
    if (ends_with("ln_1.weight") || ends_with("ln_2.weight") || ends_with("ln_f.weight")) {
      p->value.Fill(1.0f);
    } else if (p->value.rank() == 1) {
      p->value.Zero();
    } else {
      const bool residual = ends_with("c_proj.weight");
      FillNormal(LayerSeed(seed, i), residual ? proj_std : kInitStd, p->value.data(),
                 p->value.numel());
    }
  }
}

int64_t Gpt::ParameterCount() const {
  int64_t n = 0;
  for (const Parameter* p : parameters_) n += p->value.numel();
  return n;
}

int64_t Gpt::ParameterCount(const GptConfig& config) {
  const int64_t c = config.n_embd;
  const int64_t b = config.bias ? 1 : 0;
  // ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj.
  const int64_t block = (c + b * c) + (c * 3 * c + b * 3 * c) + (c * c + b * c) + (c + b * c) +
                        (c * 4 * c + b * 4 * c) + (4 * c * c + b * c);
  return int64_t{config.vocab_size} * c + int64_t{config.block_size} * c +
         int64_t{config.n_layer} * block + (c + b * c);
}

std::vector<std::vector<Parameter*>> Gpt::Units() {
  std::vector<std::vector<Parameter*>> units;
  std::vector<Parameter*>& root = units.emplace_back();
  root = {&wte_, &wpe_, &lnf_w_};
  if (config_.bias) root.push_back(&lnf_b_);
  for (Block& b : blocks_) {
    std::vector<Parameter*>& unit = units.emplace_back();
    for (Parameter* p : {&b.ln1_w, &b.ln1_b, &b.attn_w, &b.attn_b, &b.proj_w, &b.proj_b, &b.ln2_w,
                         &b.ln2_b, &b.fc_w, &b.fc_b, &b.fc_proj_w, &b.fc_proj_b}) {
      if (p->value.numel() > 0) unit.push_back(p);
    }
  }
  return units;
}

void Gpt::ZeroGrad() {
  EnsureGrads();
  for (Parameter* p : stage_parameters_) p->grad.Zero();
}

void Gpt::SetStage(int first_block, int end_block) {
  AIDN_CHECK(0 <= first_block && first_block < end_block && end_block <= config_.n_layer)
      << "gpt: stage of blocks [" << first_block << ", " << end_block << ") of " << config_.n_layer;
  first_block_ = first_block;
  end_block_ = end_block;
  // The next forward sizes the stage's buffers; other blocks' go.
  batch_ = 0;
  seq_len_ = 0;
  for (int l = 0; l < config_.n_layer; ++l) {
    if (l >= first_block && l < end_block) continue;
    blocks_[static_cast<size_t>(l)].in = Tensor();
    blocks_[static_cast<size_t>(l)].acts = Activations();
  }
  std::vector<Parameter*> mine;
  if (embeds() || has_head()) mine.push_back(&wte_);
  if (embeds()) mine.push_back(&wpe_);
  const std::vector<std::vector<Parameter*>> units = Units();
  for (int l = first_block; l < end_block; ++l) {
    for (Parameter* p : units[static_cast<size_t>(l) + 1]) mine.push_back(p);
  }
  if (has_head()) {
    mine.push_back(&lnf_w_);
    if (config_.bias) mine.push_back(&lnf_b_);
  }
  stage_parameters_ = std::move(mine);
}

void Gpt::Shape(int64_t batch, int64_t seq_len) {
  AIDN_CHECK(batch >= 1 && seq_len >= 1 && seq_len <= config_.block_size)
      << "gpt: batch " << batch << ", sequence length " << seq_len << " (block_size "
      << config_.block_size << ")";
  if (batch == batch_ && seq_len == seq_len_) return;
  batch_ = batch;
  seq_len_ = seq_len;
  const int64_t n = batch * seq_len;
  const int64_t c = config_.n_embd;
  const int64_t h = heads_local_;
  auto shape_acts = [&](Activations& a) {
    EnsureShape(&a.ln1, {n, c});
    EnsureShape(&a.ln1_mean, {n});
    EnsureShape(&a.ln1_rstd, {n});
    EnsureShape(&a.qkv, {n, 3 * cl_});
    EnsureShape(&a.att, {batch, h, seq_len, seq_len});
    EnsureShape(&a.y, {n, cl_});
    EnsureShape(&a.mid, {n, c});
    EnsureShape(&a.ln2, {n, c});
    EnsureShape(&a.ln2_mean, {n});
    EnsureShape(&a.ln2_rstd, {n});
    EnsureShape(&a.fc, {n, fl_});
    EnsureShape(&a.gelu, {n, fl_});
    if (config_.dropout > 0.0) {
      EnsureShape(&a.att_mask, {batch, h, seq_len, seq_len});
      EnsureShape(&a.attn_mask, {n, c});
      EnsureShape(&a.mlp_mask, {n, c});
    }
  };
  for (int l = first_block_; l < end_block_; ++l) {
    Block& b = blocks_[static_cast<size_t>(l)];
    EnsureShape(&b.in, {n, c});
    if (!checkpointing_) shape_acts(b.acts);
  }
  if (checkpointing_) {
    shape_acts(shared_);
    EnsureShape(&recomputed_, {n, c});
  }
  if (config_.dropout > 0.0) EnsureShape(&emb_mask_, {n, c});
  EnsureShape(&out_, {n, c});
  EnsureShape(&lnf_, {n, c});
  EnsureShape(&lnf_mean_, {n});
  EnsureShape(&lnf_rstd_, {n});
  if (has_head()) {
    EnsureShape(&logits_, {n, vocab_local_});
    EnsureShape(&grad_logits_, {n, vocab_local_});
  }
  EnsureShape(&dx_, {n, c});
  EnsureShape(&dtmp_, {n, c});
  EnsureShape(&dbranch_, {n, c});
  EnsureShape(&dbig_, {n, fl_});
  EnsureShape(&dqkv_, {n, 3 * cl_});
  EnsureShape(&datt_, {seq_len, seq_len});
  EnsureShape(&patt_, {seq_len, seq_len});
}

void Gpt::AttentionForward(Activations& a, bool drop) {
  const int64_t t_len = seq_len_;
  // This rank's heads (all of them without tensor parallelism), side by
  // side in rows of width c: q, k and v in rows of 3c.
  const int64_t c = cl_;
  const int64_t heads = heads_local_;
  const int64_t hd = config_.n_embd / config_.n_head;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t s = 0; s < batch_; ++s) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = a.qkv.data() + s * t_len * 3 * c + h * hd;
      const float* k = q + c;
      const float* v = q + 2 * c;
      float* att = a.att.data() + (s * heads + h) * t_len * t_len;
      Sgemm(false, true, t_len, t_len, hd, scale, q, 3 * c, k, 3 * c, 0.0f, att, t_len);
      for (int64_t t = 0; t < t_len; ++t) {
        float* row = att + t * t_len;
        float max = row[0];
        for (int64_t j = 1; j <= t; ++j) max = std::max(max, row[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j <= t; ++j) {
          row[j] = std::exp(row[j] - max);
          sum += row[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j <= t; ++j) row[j] *= inv;
        std::fill(row + t + 1, row + t_len, 0.0f);
      }
      const float* p = att;
      if (drop) {
        float* mask = a.att_mask.data() + (s * heads + h) * t_len * t_len;
        cpu::DropoutMask(AttentionRng(), config_.dropout, mask, t_len * t_len);
        cpu::MulKernel(att, mask, patt_.data(), t_len * t_len);
        p = patt_.data();
      }
      Sgemm(false, false, t_len, hd, t_len, 1.0f, p, t_len, v, 3 * c, 0.0f,
            a.y.data() + s * t_len * c + h * hd, c);
    }
  }
}

void Gpt::AttentionBackward(Activations& a, const float* dy, float* dqkv) {
  const int64_t t_len = seq_len_;
  // This rank's heads (all of them without tensor parallelism), side by
  // side in rows of width c: q, k and v in rows of 3c.
  const int64_t c = cl_;
  const int64_t heads = heads_local_;
  const int64_t hd = config_.n_embd / config_.n_head;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t s = 0; s < batch_; ++s) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t offset = s * t_len * 3 * c + h * hd;
      const float* q = a.qkv.data() + offset;
      const float* k = q + c;
      const float* v = q + 2 * c;
      float* dq = dqkv + offset;
      float* dk = dq + c;
      float* dv = dq + 2 * c;
      const float* g = dy + s * t_len * c + h * hd;
      const float* att = a.att.data() + (s * heads + h) * t_len * t_len;
      const float* mask = dropped_ ? a.att_mask.data() + (s * heads + h) * t_len * t_len : nullptr;
      const float* p = att;
      if (mask != nullptr) {
        cpu::MulKernel(att, mask, patt_.data(), t_len * t_len);
        p = patt_.data();
      }
      float* datt = datt_.data();
      // dP = dy v^T; dv = P^T dy.
      Sgemm(false, true, t_len, t_len, hd, 1.0f, g, c, v, 3 * c, 0.0f, datt, t_len);
      Sgemm(true, false, t_len, hd, t_len, 1.0f, p, t_len, g, c, 0.0f, dv, 3 * c);
      if (mask != nullptr) {
        for (int64_t i = 0; i < t_len * t_len; ++i) datt[i] *= mask[i];
      }
      // Through the softmax, row by row: dS = A (dA - sum(A dA)).
      for (int64_t t = 0; t < t_len; ++t) {
        const float* a = att + t * t_len;
        float* d = datt + t * t_len;
        float dot = 0.0f;
        for (int64_t j = 0; j <= t; ++j) dot += a[j] * d[j];
        for (int64_t j = 0; j <= t; ++j) d[j] = a[j] * (d[j] - dot);
        std::fill(d + t + 1, d + t_len, 0.0f);
      }
      // S = scale q k^T: dq = scale dS k, dk = scale dS^T q.
      Sgemm(false, false, t_len, hd, t_len, scale, datt, t_len, k, 3 * c, 0.0f, dq, 3 * c);
      Sgemm(true, false, t_len, hd, t_len, scale, datt, t_len, q, 3 * c, 0.0f, dk, 3 * c);
    }
  }
}

void Gpt::BlockForward(Block& b, Activations& a, float* out, bool drop) {
  const int64_t n = batch_ * seq_len_;
  const int64_t c = config_.n_embd;
  const bool bias = config_.bias;
  LayerNormForward(b.in.data(), b.ln1_w.value.data(), bias ? b.ln1_b.value.data() : nullptr, n, c,
                   a.ln1.data(), a.ln1_mean.data(), a.ln1_rstd.data());
  LinearForward(a.ln1.data(), b.attn_w.value.data(), bias ? b.attn_b.value.data() : nullptr, n, c,
                3 * cl_, a.qkv.data());
  AttentionForward(a, drop);
  // mid = in + drop(y Wproj + b).
  RowParallelForward(a.y.data(), b.proj_w, b.proj_b, cl_, a.mid.data());
  if (drop) cpu::DropoutMask(rng_, config_.dropout, a.attn_mask.data(), n * c);
  ScaleBranch(a.attn_mask, drop, a.mid.data());
  cpu::AccumulateKernel(b.in.data(), a.mid.data(), n * c);
  LayerNormForward(a.mid.data(), b.ln2_w.value.data(), bias ? b.ln2_b.value.data() : nullptr, n, c,
                   a.ln2.data(), a.ln2_mean.data(), a.ln2_rstd.data());
  LinearForward(a.ln2.data(), b.fc_w.value.data(), bias ? b.fc_b.value.data() : nullptr, n, c, fl_,
                a.fc.data());
  GeluForward(a.fc.data(), a.gelu.data(), n * fl_);
  RowParallelForward(a.gelu.data(), b.fc_proj_w, b.fc_proj_b, fl_, out);
  if (drop) cpu::DropoutMask(rng_, config_.dropout, a.mlp_mask.data(), n * c);
  ScaleBranch(a.mlp_mask, drop, out);
  cpu::AccumulateKernel(a.mid.data(), out, n * c);
}

void Gpt::ScaleBranch(const Tensor& mask, bool drop, float* branch) {
  const int64_t count = batch_ * seq_len_ * config_.n_embd;
  if (drop) {
    for (int64_t i = 0; i < count; ++i) branch[i] *= mask[i];
  }
  if (branch_scale_ != 1.0f) {
    for (int64_t i = 0; i < count; ++i) branch[i] *= branch_scale_;
  }
}

void Gpt::ForwardTrunk(const int32_t* tokens, const Tensor* input, bool training) {
  const int64_t n = batch_ * seq_len_;
  const int64_t c = config_.n_embd;
  const bool bias = config_.bias;
  const bool drop = training && config_.dropout > 0.0;
  dropped_ = drop;
  const bool depth = training && config_.stochastic_depth > 0.0;
  branch_scale_ = depth ? static_cast<float>(1.0 / (1.0 - config_.stochastic_depth)) : 1.0f;
  if (hooks_ != nullptr) hooks_->BeforeForward(0);
  // Embeddings (or the previous stage's output) into the first block's
  // input (or out_ without blocks).
  float* x = first_block_ == end_block_ ? out_.data()
                                        : blocks_[static_cast<size_t>(first_block_)].in.data();
  if (!embeds()) {
    AIDN_CHECK(input != nullptr && input->numel() == n * c)
        << "gpt: a stage's input must be [" << n << ", " << c << "]";
    std::memcpy(x, input->data(), sizeof(float) * static_cast<size_t>(n * c));
  }
  if (embeds()) {
    tokens_.assign(tokens, tokens + n);
    if (tp_ != nullptr) {
      EmbedVocabParallel(x);
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const int32_t tok = tokens[i];
        AIDN_CHECK(tok >= 0 && tok < config_.vocab_size) << "gpt: token " << tok << " at " << i;
        const float* te = wte_.value.data() + int64_t{tok} * c;
        const float* pe = wpe_.value.data() + (i % seq_len_) * c;
        for (int64_t j = 0; j < c; ++j) x[i * c + j] = te[j] + pe[j];
      }
    }
  }
  if (drop && embeds()) {
    cpu::DropoutMask(rng_, config_.dropout, emb_mask_.data(), n * c);
    for (int64_t i = 0; i < n * c; ++i) x[i] *= emb_mask_[i];
  }
  const size_t end = static_cast<size_t>(end_block_);
  for (size_t l = static_cast<size_t>(first_block_); l < end; ++l) {
    Block& b = blocks_[l];
    float* next = l + 1 < end ? blocks_[l + 1].in.data() : out_.data();
    const int unit = static_cast<int>(l) + 1;
    if (hooks_ != nullptr) hooks_->BeforeForward(unit);
    b.skipped = depth && static_cast<double>(rng_() >> 11) * 0x1p-53 < config_.stochastic_depth;
    if (b.skipped) {
      std::memcpy(next, b.in.data(), sizeof(float) * static_cast<size_t>(n * c));
    } else {
      if (checkpointing_) {
        b.rng = rng_;
        b.tp_rng = tp_rng_;
      }
      BlockForward(b, ActsOf(b), next, drop);
    }
    if (hooks_ != nullptr) hooks_->AfterForward(unit);
  }
  if (!has_head()) {
    if (hooks_ != nullptr) hooks_->AfterForward(0);
    return;
  }
  LayerNormForward(out_.data(), lnf_w_.value.data(), bias ? lnf_b_.value.data() : nullptr, n, c,
                   lnf_.data(), lnf_mean_.data(), lnf_rstd_.data());
  // logits = ln_f(x) wte^T.
  // This rank's vocabulary (all of it without tensor parallelism).
  Sgemm(false, true, n, vocab_local_, c, 1.0f, lnf_.data(), c, wte_.value.data(), c, 0.0f,
        logits_.data(), vocab_local_);
  if (hooks_ != nullptr) hooks_->AfterForward(0);
}

const Tensor& Gpt::Logits(const int32_t* tokens, int64_t batch, int64_t seq_len) {
  AIDN_CHECK(embeds() && has_head()) << "gpt: Logits of a pipeline stage";
  Shape(batch, seq_len);
  ForwardTrunk(tokens, nullptr, /*training=*/false);
  targets_.clear();  // no loss: a Backward now is a programmer error
  // Tensor parallelism: the ranks' vocabularies side by side.
  return WholeLogits();
}

double Gpt::Forward(const int32_t* tokens, const int32_t* targets, int64_t batch, int64_t seq_len,
                    bool training) {
  return ForwardStage(tokens, nullptr, targets, batch, seq_len, training);
}

double Gpt::ForwardStage(const int32_t* tokens, const Tensor* input, const int32_t* targets,
                         int64_t batch, int64_t seq_len, bool training) {
  Shape(batch, seq_len);
  ForwardTrunk(tokens, input, training);
  // Backward's "after a forward" check: the positions this forward ran.
  stage_rows_ = batch * seq_len;
  if (!has_head()) return 0.0;
  targets_.assign(targets, targets + batch * seq_len);
  for (const int32_t t : targets_) {
    AIDN_CHECK(t >= 0 && t < config_.vocab_size) << "gpt: target " << t;
  }
  if (tp_ != nullptr) return VocabParallelCrossEntropy();
  return SoftmaxCrossEntropy(logits_, targets_, &grad_logits_);
}

void Gpt::Ready(Parameter& weight, Parameter& bias) {
  if (!grad_ready_) return;
  grad_ready_(&weight);
  if (config_.bias) grad_ready_(&bias);
}

const float* Gpt::BranchGrad(const Tensor& mask, float scale) {
  if (!dropped_ && scale == 1.0f) return dx_.data();
  if (dropped_) {
    cpu::MulKernel(dx_.data(), mask.data(), dbranch_.data(), dx_.numel());
  } else {
    std::memcpy(dbranch_.data(), dx_.data(), sizeof(float) * static_cast<size_t>(dx_.numel()));
  }
  if (scale != 1.0f) {
    float* g = dbranch_.data();
    for (int64_t i = 0; i < dbranch_.numel(); ++i) g[i] *= scale;
  }
  return dbranch_.data();
}

std::vector<Parameter*> Gpt::UnusedParameters() {
  std::vector<Parameter*> unused;
  // Asked after every forward: nothing built unless a block was skipped.
  const auto skipped = [](const Block& b) { return b.skipped; };
  if (std::none_of(blocks_.begin() + first_block_, blocks_.begin() + end_block_, skipped)) {
    return unused;
  }
  const std::vector<std::vector<Parameter*>> units = Units();
  for (int l = first_block_; l < end_block_; ++l) {
    if (!blocks_[static_cast<size_t>(l)].skipped) continue;
    const std::vector<Parameter*>& unit = units[static_cast<size_t>(l) + 1];
    unused.insert(unused.end(), unit.begin(), unit.end());
  }
  return unused;
}

void Gpt::Backward(double grad_scale) { BackwardStage(nullptr, nullptr, grad_scale); }

void Gpt::BackwardStage(const Tensor* grad_output, Tensor* grad_input, double grad_scale) {
  const int64_t n = batch_ * seq_len_;
  const int64_t c = config_.n_embd;
  AIDN_CHECK(stage_rows_ == n && (!has_head() || static_cast<int64_t>(targets_.size()) == n))
      << "gpt: Backward without a Forward";
  // With unit hooks the strategy gives each unit its gradients' memory.
  if (hooks_ == nullptr) EnsureGrads();
  // The dropout streams as Forward left them (recomputations rewind them).
  const std::mt19937_64 after_forward = rng_;
  const std::mt19937_64 tp_after_forward = tp_rng_;
  if (hooks_ != nullptr) hooks_->BeforeBackward(0);
  if (!has_head()) {
    AIDN_CHECK(grad_output != nullptr && grad_output->numel() == n * c)
        << "gpt: a stage's output gradient must be [" << n << ", " << c << "]";
    std::memcpy(dx_.data(), grad_output->data(), sizeof(float) * static_cast<size_t>(n * c));
  } else {
    HeadBackward(grad_scale);
  }
  BlocksBackward();
  if (!embeds()) {
    // The last stage's copy of the tied wte (its head's part) is final.
    if (has_head() && grad_ready_) grad_ready_(&wte_);
    if (grad_input != nullptr) {
      EnsureShape(grad_input, {n, c});
      std::memcpy(grad_input->data(), dx_.data(), sizeof(float) * static_cast<size_t>(n * c));
    }
    if (hooks_ != nullptr) hooks_->AfterBackward(0);
    rng_ = after_forward;
    tp_rng_ = tp_after_forward;
    return;
  }
  EmbeddingBackward();
  if (hooks_ != nullptr) hooks_->AfterBackward(0);
  rng_ = after_forward;
  tp_rng_ = tp_after_forward;
}

void Gpt::HeadBackward(double grad_scale) {
  const int64_t n = batch_ * seq_len_;
  const int64_t c = config_.n_embd;
  const int64_t vocab = vocab_local_;
  float* dlogits = grad_logits_.data();
  if (grad_scale != 1.0) {
    const float s = static_cast<float>(grad_scale);
    for (int64_t i = 0; i < n * vocab; ++i) dlogits[i] *= s;
  }
  // The LM head: dlnf = dlogits wte, dwte += dlogits^T lnf (each rank's
  // vocabulary's part of dlnf, summed over the ranks).
  Sgemm(false, false, n, c, vocab, 1.0f, dlogits, vocab, wte_.value.data(), c, 0.0f, dtmp_.data(),
        c);
  TensorAllReduce(dtmp_.data(), n * c);
  Sgemm(true, false, vocab, c, n, 1.0f, dlogits, vocab, lnf_.data(), c, 1.0f, wte_.grad.data(), c);
  dx_.Zero();
  LayerNormBackward(dtmp_.data(), out_.data(), lnf_w_.value.data(), lnf_mean_.data(),
                    lnf_rstd_.data(), n, c, dx_.data(), lnf_w_.grad.data(), BiasGrad(lnf_b_));
  Ready(lnf_w_, lnf_b_);
}

void Gpt::BlocksBackward() {
  const int64_t n = batch_ * seq_len_;
  const int64_t c = config_.n_embd;
  for (size_t l = static_cast<size_t>(end_block_); l-- > static_cast<size_t>(first_block_);) {
    Block& b = blocks_[l];
    const int unit = static_cast<int>(l) + 1;
    if (hooks_ != nullptr) hooks_->BeforeBackward(unit);
    if (b.skipped) {
      // The stream passed through: dx_ is already the input's gradient.
      if (hooks_ != nullptr) hooks_->AfterBackward(unit);
      continue;
    }
    Activations& a = ActsOf(b);
    if (checkpointing_) {
      // The block's forward again, from its kept input and with the masks
      // its first run drew.
      rng_ = b.rng;
      tp_rng_ = b.tp_rng;
      BlockForward(b, a, recomputed_.data(), dropped_);
    }
    // The MLP branch: dx_ holds d(block output) = d(mid) + d(branch).
    // Under tensor parallelism the column-parallel layers' input gradients
    // are each rank's part, summed over the ranks.
    LinearBackward(BranchGrad(a.mlp_mask, branch_scale_), a.gelu.data(), b.fc_proj_w.value.data(),
                   n, fl_, c, dbig_.data(), b.fc_proj_w.grad.data(), BiasGrad(b.fc_proj_b));
    GeluBackward(a.fc.data(), dbig_.data(), n * fl_);
    LinearBackward(dbig_.data(), a.ln2.data(), b.fc_w.value.data(), n, c, fl_, dtmp_.data(),
                   b.fc_w.grad.data(), BiasGrad(b.fc_b));
    TensorAllReduce(dtmp_.data(), n * c);
    LayerNormBackward(dtmp_.data(), a.mid.data(), b.ln2_w.value.data(), a.ln2_mean.data(),
                      a.ln2_rstd.data(), n, c, dx_.data(), b.ln2_w.grad.data(), BiasGrad(b.ln2_b));
    Ready(b.fc_proj_w, b.fc_proj_b);
    Ready(b.fc_w, b.fc_b);
    Ready(b.ln2_w, b.ln2_b);
    // The attention branch: dx_ now holds d(mid) = d(in) + d(branch).
    LinearBackward(BranchGrad(a.attn_mask, branch_scale_), a.y.data(), b.proj_w.value.data(), n,
                   cl_, c, dtmp_.data(), b.proj_w.grad.data(), BiasGrad(b.proj_b));
    AttentionBackward(a, dtmp_.data(), dqkv_.data());
    LinearBackward(dqkv_.data(), a.ln1.data(), b.attn_w.value.data(), n, c, 3 * cl_, dtmp_.data(),
                   b.attn_w.grad.data(), BiasGrad(b.attn_b));
    TensorAllReduce(dtmp_.data(), n * c);
    LayerNormBackward(dtmp_.data(), b.in.data(), b.ln1_w.value.data(), a.ln1_mean.data(),
                      a.ln1_rstd.data(), n, c, dx_.data(), b.ln1_w.grad.data(), BiasGrad(b.ln1_b));
    Ready(b.proj_w, b.proj_b);
    Ready(b.attn_w, b.attn_b);
    Ready(b.ln1_w, b.ln1_b);
    if (hooks_ != nullptr) hooks_->AfterBackward(unit);
  }
}

void Gpt::EmbeddingBackward() {
  const int64_t n = batch_ * seq_len_;
  const int64_t c = config_.n_embd;
  const float* demb = BranchGrad(emb_mask_);
  for (int64_t i = 0; i < n; ++i) {
    const float* g = demb + i * c;
    // This rank's rows of wte: its vocabulary's tokens.
    const int64_t row = int64_t{tokens_[static_cast<size_t>(i)]} - vocab_begin_;
    if (row >= 0 && row < vocab_local_) {
      cpu::AccumulateKernel(g, wte_.grad.data() + row * c, c);
    }
    cpu::AccumulateKernel(g, wpe_.grad.data() + (i % seq_len_) * c, c);
  }
  if (grad_ready_) {
    grad_ready_(&wpe_);
    grad_ready_(&wte_);
  }
}

void Gpt::SwapActivations(Stash* s) {
  const size_t blocks = blocks_.size();
  s->in.resize(blocks);
  s->acts.resize(blocks);
  s->rng.resize(blocks);
  s->tp_rng.resize(blocks);
  s->skipped.resize(blocks);
  for (int l = first_block_; l < end_block_; ++l) {
    Block& b = blocks_[static_cast<size_t>(l)];
    const bool skipped = s->skipped[static_cast<size_t>(l)] != 0;
    s->skipped[static_cast<size_t>(l)] = b.skipped ? 1 : 0;
    b.skipped = skipped;
    std::swap(b.in, s->in[static_cast<size_t>(l)]);
    std::swap(b.acts, s->acts[static_cast<size_t>(l)]);
    std::swap(b.rng, s->rng[static_cast<size_t>(l)]);
    std::swap(b.tp_rng, s->tp_rng[static_cast<size_t>(l)]);
  }
  std::swap(emb_mask_, s->emb_mask);
  std::swap(out_, s->out);
  std::swap(lnf_, s->lnf);
  std::swap(lnf_mean_, s->lnf_mean);
  std::swap(lnf_rstd_, s->lnf_rstd);
  std::swap(grad_logits_, s->grad_logits);
  std::swap(tokens_, s->tokens);
  std::swap(targets_, s->targets);
  std::swap(stage_rows_, s->rows);
  std::swap(dropped_, s->dropped);
  std::swap(branch_scale_, s->branch_scale);
  // An empty stash brings batch 0: the next Forward sizes its buffers.
  std::swap(batch_, s->batch);
  std::swap(seq_len_, s->seq_len);
}

int64_t Gpt::Stash::bytes() const {
  int64_t floats = 0;
  auto add = [&floats](const Tensor& t) { floats += t.numel(); };
  for (const Tensor& t : in) add(t);
  for (const Activations& a : acts) {
    for (const Tensor* t :
         {&a.ln1, &a.ln1_mean, &a.ln1_rstd, &a.qkv, &a.att, &a.att_mask, &a.y, &a.attn_mask, &a.mid,
          &a.ln2, &a.ln2_mean, &a.ln2_rstd, &a.fc, &a.gelu, &a.mlp_mask}) {
      add(*t);
    }
  }
  for (const Tensor* t : {&emb_mask, &out, &lnf, &lnf_mean, &lnf_rstd, &grad_logits}) add(*t);
  return 4 * floats + 4 * static_cast<int64_t>(tokens.size() + targets.size());
}

void Gpt::SetActivationCheckpointing(bool on) {
  if (on == checkpointing_) return;
  checkpointing_ = on;
  // The next Forward sizes what the mode keeps; the other mode's buffers go.
  batch_ = 0;
  seq_len_ = 0;
  shared_ = Activations();
  recomputed_ = Tensor();
  for (Block& b : blocks_) b.acts = Activations();
}

}  // namespace aidn::engine
