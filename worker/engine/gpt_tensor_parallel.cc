// The GPT's tensor parallelism (Gpt::SetTensorParallel, gpt.h): slicing
// the weights, and the collectives Megatron-LM's scheme puts around the
// column- and row-parallel layers, the vocabulary-parallel embedding and
// the vocabulary-parallel cross-entropy.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/log.h"
#include "worker/engine/cpu_kernels.h"
#include "worker/engine/gpt.h"
#include "worker/engine/gpt_kernels.h"
#include "worker/engine/layers.h"

namespace aidn::engine {
namespace {

// Splitmix64 of the seed and the rank: unrelated attention-dropout streams.
uint64_t RankSeed(uint64_t seed, int rank) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (static_cast<uint64_t>(rank) + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

Tensor SliceOfSplit(const Tensor& whole, const Gpt::Split& split) {
  int64_t width = 0;
  for (const auto& [begin, end] : split.ranges) width += end - begin;
  if (whole.rank() == 1 || split.dim == 0) {
    const int64_t row = whole.rank() == 1 ? 1 : whole.dim(1);
    std::vector<int64_t> shape = whole.shape();
    shape[0] = width;
    Tensor shard(shape);
    float* out = shard.data();
    for (const auto& [begin, end] : split.ranges) {
      std::memcpy(out, whole.data() + begin * row, sizeof(float) * (end - begin) * row);
      out += (end - begin) * row;
    }
    return shard;
  }
  const int64_t rows = whole.dim(0);
  const int64_t cols = whole.dim(1);
  Tensor shard({rows, width});
  for (int64_t r = 0; r < rows; ++r) {
    float* out = shard.data() + r * width;
    for (const auto& [begin, end] : split.ranges) {
      std::memcpy(out, whole.data() + r * cols + begin, sizeof(float) * (end - begin));
      out += end - begin;
    }
  }
  return shard;
}

void Gpt::SetSeed(uint64_t seed) {
  rng_.seed(seed);
  tp_rng_.seed(RankSeed(seed, tp_rank_));
}

absl::Status Gpt::SetTensorParallel(Communicator* group) {
  if (group == nullptr || group->world_size() == 1) return absl::OkStatus();
  if (tp_ != nullptr || batch_ != 0) {
    return absl::FailedPreconditionError(
        "gpt: tensor parallelism is set once, before the first forward");
  }
  const int t = group->world_size();
  if (config_.n_head % t != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpt: n_head ", config_.n_head, " does not divide among ", t, " tensor-parallel ranks"));
  }
  if (config_.vocab_size % t != 0) {
    return absl::InvalidArgumentError(absl::StrCat("gpt: vocab_size ", config_.vocab_size,
                                                   " does not divide among ", t,
                                                   " tensor-parallel ranks"));
  }
  tp_ = group;
  tp_rank_ = group->rank();
  tp_size_ = t;
  vocab_local_ = config_.vocab_size / t;
  vocab_begin_ = tp_rank_ * vocab_local_;
  heads_local_ = config_.n_head / t;
  cl_ = config_.n_embd / t;
  fl_ = 4 * int64_t{config_.n_embd} / t;
  for (Parameter* p : parameters_) {
    const std::optional<Split> split = SplitOf(*p);
    if (!split.has_value()) continue;
    p->value = SliceOfSplit(p->value, *split);
    p->grad = Tensor::View(nullptr, p->value.shape());
  }
  tp_rng_.seed(RankSeed(0, tp_rank_));
  return absl::OkStatus();
}

absl::Status Gpt::TakeCollectiveStatus() { return std::exchange(tp_status_, absl::OkStatus()); }

std::optional<Gpt::Split> Gpt::SplitOf(const Parameter& p) const {
  if (tp_ == nullptr) return std::nullopt;
  const int64_t c = config_.n_embd;
  const int64_t r = tp_rank_;
  const int64_t f = 4 * c;
  if (&p == &wte_) {
    return Split{0, {{vocab_begin_, vocab_begin_ + vocab_local_}}, {config_.vocab_size, c}};
  }
  for (const Block& b : blocks_) {
    // Column-parallel: q, k and v of this rank's heads; its MLP columns.
    if (&p == &b.attn_w || (config_.bias && &p == &b.attn_b)) {
      Split s;
      s.dim = &p == &b.attn_w ? 1 : 0;
      for (int64_t part = 0; part < 3; ++part) {
        s.ranges.emplace_back(part * c + r * cl_, part * c + (r + 1) * cl_);
      }
      s.whole_shape =
          &p == &b.attn_w ? std::vector<int64_t>{c, 3 * c} : std::vector<int64_t>{3 * c};
      return s;
    }
    if (&p == &b.fc_w) return Split{1, {{r * fl_, (r + 1) * fl_}}, {c, f}};
    if (config_.bias && &p == &b.fc_b) return Split{0, {{r * fl_, (r + 1) * fl_}}, {f}};
    // Row-parallel: the rows of those heads and columns.
    if (&p == &b.proj_w) return Split{0, {{r * cl_, (r + 1) * cl_}}, {c, c}};
    if (&p == &b.fc_proj_w) return Split{0, {{r * fl_, (r + 1) * fl_}}, {f, c}};
  }
  return std::nullopt;
}

void Gpt::TensorAllReduce(float* data, int64_t n) {
  if (tp_ == nullptr || !tp_status_.ok() || n == 0) return;
  const auto start = std::chrono::steady_clock::now();
  tp_status_ = tp_->AllReduce(data, static_cast<size_t>(n), ReduceOp::kSum);
  tp_seconds_ += SecondsSince(start);
}

void Gpt::RowParallelForward(const float* x, const Parameter& w, const Parameter& b, int64_t in,
                             float* y) {
  const int64_t n = batch_ * seq_len_;
  const int64_t c = config_.n_embd;
  const float* bias = config_.bias ? b.value.data() : nullptr;
  if (tp_ == nullptr) {
    gpt_kernels::LinearForward(x, w.value.data(), bias, n, in, c, y);
    return;
  }
  gpt_kernels::LinearForward(x, w.value.data(), nullptr, n, in, c, y);
  TensorAllReduce(y, n * c);
  if (bias == nullptr) return;
  for (int64_t r = 0; r < n; ++r) cpu::AccumulateKernel(bias, y + r * c, c);
}

void Gpt::EmbedVocabParallel(float* x) {
  const int64_t n = batch_ * seq_len_;
  const int64_t c = config_.n_embd;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t tok = tokens_[static_cast<size_t>(i)];
    AIDN_CHECK(tok >= 0 && tok < config_.vocab_size) << "gpt: token " << tok << " at " << i;
    const int64_t row = tok - vocab_begin_;
    float* xi = x + i * c;
    if (row >= 0 && row < vocab_local_) {
      std::memcpy(xi, wte_.value.data() + row * c, sizeof(float) * c);
    } else {
      std::fill(xi, xi + c, 0.0f);
    }
  }
  // One rank holds each token's row: the sum is that row.
  TensorAllReduce(x, n * c);
  for (int64_t i = 0; i < n; ++i) {
    cpu::AccumulateKernel(wpe_.value.data() + (i % seq_len_) * c, x + i * c, c);
  }
}

double Gpt::VocabParallelCrossEntropy() {
  const int64_t n = batch_ * seq_len_;
  const int64_t v = vocab_local_;
  EnsureShape(&grad_logits_, {n, v});
  // Each row's maximum over the whole vocabulary: the ranks' maxima.
  std::vector<float> local(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits_.data() + i * v;
    local[static_cast<size_t>(i)] = *std::max_element(row, row + v);
  }
  std::vector<float> all(static_cast<size_t>(n) * static_cast<size_t>(tp_size_));
  if (tp_status_.ok()) {
    const auto start = std::chrono::steady_clock::now();
    tp_status_ = tp_->AllGather(local.data(), local.size(), all.data());
    tp_seconds_ += SecondsSince(start);
  }
  std::vector<float> max(static_cast<size_t>(n), -INFINITY);
  for (int rank = 0; rank < tp_size_; ++rank) {
    for (int64_t i = 0; i < n; ++i) {
      float& m = max[static_cast<size_t>(i)];
      m = std::max(m, all[static_cast<size_t>(rank * n + i)]);
    }
  }
  // Per row: the sum of exp(logit - max) over the vocabulary, and the
  // target's logit (from the rank that holds it), summed over the ranks.
  std::vector<float> sums(2 * static_cast<size_t>(n), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits_.data() + i * v;
    const float m = max[static_cast<size_t>(i)];
    double sum = 0.0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(static_cast<double>(row[j] - m));
    sums[static_cast<size_t>(i)] = static_cast<float>(sum);
    const int64_t target = targets_[static_cast<size_t>(i)] - vocab_begin_;
    if (target >= 0 && target < v) sums[static_cast<size_t>(n + i)] = row[target] - m;
  }
  TensorAllReduce(sums.data(), 2 * n);
  double total = 0.0;
  const double scale = 1.0 / static_cast<double>(n);
  for (int64_t i = 0; i < n; ++i) {
    const double sum = sums[static_cast<size_t>(i)];
    total += std::log(sum) - static_cast<double>(sums[static_cast<size_t>(n + i)]);
    const float* row = logits_.data() + i * v;
    float* g = grad_logits_.data() + i * v;
    const float m = max[static_cast<size_t>(i)];
    const int64_t target = targets_[static_cast<size_t>(i)] - vocab_begin_;
    for (int64_t j = 0; j < v; ++j) {
      const double softmax = std::exp(static_cast<double>(row[j] - m)) / sum;
      g[j] = static_cast<float>((softmax - (j == target ? 1.0 : 0.0)) * scale);
    }
  }
  return total / static_cast<double>(n);
}

const Tensor& Gpt::WholeLogits() {
  if (tp_ == nullptr) return logits_;
  const int64_t n = batch_ * seq_len_;
  const int64_t v = vocab_local_;
  std::vector<float> all(static_cast<size_t>(n * v * tp_size_));
  if (tp_status_.ok()) tp_status_ = tp_->AllGather(logits_.data(), n * v, all.data());
  // Rank r's block is [N, v]: its columns of every row.
  EnsureShape(&full_logits_, {n, int64_t{config_.vocab_size}});
  for (int rank = 0; rank < tp_size_; ++rank) {
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(full_logits_.data() + i * config_.vocab_size + rank * v,
                  all.data() + (rank * n + i) * v, sizeof(float) * v);
    }
  }
  return full_logits_;
}

}  // namespace aidn::engine
