#include "worker/engine/tensor_parallel.h"

#include <algorithm>

#include "common/log.h"
#include "common/status.h"
#include "worker/engine/cpu_kernels.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/gemm.h"
#include "worker/engine/layers.h"

namespace aidn::engine {
namespace {

using cpu::AccumulateKernel;
using cpu::Copy;

int64_t ShardOf(int64_t features, const Communicator* group, const char* what) {
  AIDN_CHECK(group != nullptr && features > 0 && features % group->world_size() == 0)
      << what << ": " << features << " features do not split over the tensor group";
  return features / group->world_size();
}

}  // namespace

// ---------------------------------------------------------------- column

ColumnParallelLinear::ColumnParallelLinear(int64_t in_features, int64_t out_features,
                                           Communicator* group)
    : in_(in_features),
      shard_(ShardOf(out_features, group, "ColumnParallelLinear")),
      group_(group),
      weight_{"weight",
              Tensor({shard_, in_features}),
              Tensor({shard_, in_features}),
              {out_features, in_features}},
      bias_{"bias", Tensor({shard_}), Tensor({shard_}), {out_features}} {}

void ColumnParallelLinear::LoadShardOf(const Tensor& weight, const Tensor& bias) {
  const int64_t first = group_->rank() * shard_;
  Copy(weight.data() + first * in_, weight_.value.data(), shard_ * in_);
  Copy(bias.data() + first, bias_.value.data(), shard_);
}

absl::Status ColumnParallelLinear::Forward(const Tensor& x, Tensor* y) {
  AIDN_CHECK(x.rank() == 2 && x.dim(1) == in_) << "ColumnParallelLinear got " << x.ShapeString();
  const int64_t n = x.dim(0);
  EnsureShape(y, {n, shard_});
  input_ = &x;
  if (n == 0) return absl::OkStatus();
  float* out = y->data();
  for (int64_t i = 0; i < n; ++i) Copy(bias_.value.data(), out + i * shard_, shard_);
  Sgemm(false, true, n, shard_, in_, 1.0f, x.data(), in_, weight_.value.data(), in_, 1.0f, out,
        shard_);
  return absl::OkStatus();
}

absl::Status ColumnParallelLinear::Backward(const Tensor& grad_y, Tensor* grad_x) {
  AIDN_CHECK(input_ != nullptr) << "ColumnParallelLinear::Backward before Forward";
  const Tensor& x = *input_;
  const int64_t n = x.dim(0);
  AIDN_CHECK(grad_y.rank() == 2 && grad_y.dim(0) == n && grad_y.dim(1) == shard_)
      << "ColumnParallelLinear got grad " << grad_y.ShapeString();
  const float* g = grad_y.data();
  if (n > 0) {
    Sgemm(true, false, shard_, in_, n, 1.0f, g, shard_, x.data(), in_, 1.0f, weight_.grad.data(),
          in_);
    for (int64_t i = 0; i < n; ++i) AccumulateKernel(g + i * shard_, bias_.grad.data(), shard_);
  }
  if (grad_x == nullptr) return absl::OkStatus();
  EnsureShape(grad_x, {n, in_});
  if (n == 0) return absl::OkStatus();
  // This shard's part of dx = g W; the parts sum over the group.
  Sgemm(false, false, n, in_, shard_, 1.0f, g, shard_, weight_.value.data(), in_, 0.0f,
        grad_x->data(), in_);
  return group_->AllReduce(grad_x->data(), static_cast<size_t>(n * in_), ReduceOp::kSum);
}

// ---------------------------------------------------------------- row

RowParallelLinear::RowParallelLinear(int64_t in_features, int64_t out_features, Communicator* group)
    : out_(out_features),
      shard_(ShardOf(in_features, group, "RowParallelLinear")),
      group_(group),
      weight_{"weight",
              Tensor({out_features, shard_}),
              Tensor({out_features, shard_}),
              {out_features, in_features}},
      bias_{"bias", Tensor({out_features}), Tensor({out_features})} {}

void RowParallelLinear::LoadShardOf(const Tensor& weight, const Tensor& bias) {
  const int64_t in = shard_ * group_->world_size();
  const int64_t first = group_->rank() * shard_;
  for (int64_t r = 0; r < out_; ++r) {
    Copy(weight.data() + r * in + first, weight_.value.data() + r * shard_, shard_);
  }
  Copy(bias.data(), bias_.value.data(), out_);
}

absl::Status RowParallelLinear::Forward(const Tensor& x_shard, Tensor* y) {
  AIDN_CHECK(x_shard.rank() == 2 && x_shard.dim(1) == shard_)
      << "RowParallelLinear got " << x_shard.ShapeString();
  const int64_t n = x_shard.dim(0);
  EnsureShape(y, {n, out_});
  input_ = &x_shard;
  if (n == 0) return absl::OkStatus();
  float* out = y->data();
  Sgemm(false, true, n, out_, shard_, 1.0f, x_shard.data(), shard_, weight_.value.data(), shard_,
        0.0f, out, out_);
  if (absl::Status s = group_->AllReduce(out, static_cast<size_t>(n * out_), ReduceOp::kSum);
      !s.ok()) {
    return s;
  }
  // The bias once, after the reduction.
  for (int64_t i = 0; i < n; ++i) AccumulateKernel(bias_.value.data(), out + i * out_, out_);
  return absl::OkStatus();
}

absl::Status RowParallelLinear::Backward(const Tensor& grad_y, Tensor* grad_x_shard) {
  AIDN_CHECK(input_ != nullptr) << "RowParallelLinear::Backward before Forward";
  const Tensor& x = *input_;
  const int64_t n = x.dim(0);
  AIDN_CHECK(grad_y.rank() == 2 && grad_y.dim(0) == n && grad_y.dim(1) == out_)
      << "RowParallelLinear got grad " << grad_y.ShapeString();
  const float* g = grad_y.data();
  if (n > 0) {
    Sgemm(true, false, out_, shard_, n, 1.0f, g, out_, x.data(), shard_, 1.0f, weight_.grad.data(),
          shard_);
    for (int64_t i = 0; i < n; ++i) AccumulateKernel(g + i * out_, bias_.grad.data(), out_);
  }
  if (grad_x_shard == nullptr) return absl::OkStatus();
  EnsureShape(grad_x_shard, {n, shard_});
  if (n > 0) {
    Sgemm(false, false, n, shard_, out_, 1.0f, g, out_, weight_.value.data(), shard_, 0.0f,
          grad_x_shard->data(), shard_);
  }
  return absl::OkStatus();
}

Optimizer::SumOfSquaresReduction TensorParallelSumOfSquares(Communicator* group,
                                                            std::vector<const Parameter*> whole) {
  Optimizer::SumOfSquaresReduction over = SumOfSquaresOver(group);
  return [over, whole = std::move(whole)](double local) -> absl::StatusOr<double> {
    double once = 0;
    for (const Parameter* p : whole) once += SumOfSquares(p->grad);
    AIDN_ASSIGN_OR_RETURN(const double split, over(local - once));
    return split + once;
  };
}

Optimizer::SumOfSquaresReduction ShardedSumOfSquares(const ShardMap& map,
                                                     const std::vector<const Parameter*>& whole,
                                                     const Parameter* tied, bool count_tied,
                                                     Communicator* data, Communicator* tensor,
                                                     Communicator* stages) {
  auto in_whole = [&whole](const Parameter* p) {
    return std::find(whole.begin(), whole.end(), p) != whole.end();
  };
  const std::vector<Parameter*> shards = map.shards();
  std::vector<bool> once(shards.size());
  for (size_t k = 0; k < shards.size(); ++k) {
    once[k] = in_whole(map.parameters()[map.place(k).parameter]);
  }
  const bool tied_once = tied != nullptr && in_whole(tied);
  if (!count_tied) tied = nullptr;
  Optimizer::SumOfSquaresReduction replicas = SumOfSquaresOver(data);
  Optimizer::SumOfSquaresReduction group = tensor != nullptr && tensor->world_size() > 1
                                               ? SumOfSquaresOver(tensor)
                                               : Optimizer::SumOfSquaresReduction();
  Optimizer::SumOfSquaresReduction pipeline =
      stages != nullptr ? SumOfSquaresOver(stages) : Optimizer::SumOfSquaresReduction();
  return
      [shards, once, tied, tied_once, replicas, group, pipeline](double) -> absl::StatusOr<double> {
        double split = 0, kept = 0;
        for (size_t k = 0; k < shards.size(); ++k) {
          (once[k] ? kept : split) += SumOfSquares(shards[k]->grad);
        }
        AIDN_ASSIGN_OR_RETURN(split, replicas(split));
        AIDN_ASSIGN_OR_RETURN(kept, replicas(kept));
        if (tied != nullptr) (tied_once ? kept : split) += SumOfSquares(tied->grad);
        if (group) {
          AIDN_ASSIGN_OR_RETURN(split, group(split));
        }
        const double total = split + kept;
        return pipeline ? pipeline(total) : total;
      };
}

}  // namespace aidn::engine
