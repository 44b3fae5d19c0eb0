#ifndef AIDN_WORKER_ENGINE_TENSOR_PARALLEL_H_
#define AIDN_WORKER_ENGINE_TENSOR_PARALLEL_H_

// Megatron-LM's tensor-parallel linear layers over a tensor group of T
// ranks (a Communicator of that group; process_grid.h). A pair of them,
// column then row, splits a transformer's MLP (or attention: QKV columns,
// output projection rows) so that each rank holds 1/T of the weights and
// the pair costs one all-reduce forward and one backward:
//
//   ColumnParallelLinear: W [out, in] split by output rows; rank t holds
//     rows [t*out/T, (t+1)*out/T) and that piece of the bias. Forward is
//     local (the "f" operator: identity); backward all-reduces the input
//     gradient (f's backward), each rank having the part its rows give.
//   RowParallelLinear: W [out, in] split by input columns; rank t holds
//     columns [t*in/T, (t+1)*in/T) and takes that slice of the input (what
//     a column-parallel layer before it outputs). Forward all-reduces the
//     partial products (the "g" operator), then adds the whole bias, which
//     every rank holds; backward is local (g's backward: identity).
//
// Layouts as torch's nn.Linear (weight [out, in], input [N, in]); float32
// on the CPU. Every rank of the group calls Forward and Backward in the
// same order (the collective contract). Gradients accumulate (+=), as the
// engine's layers do. A collective's error comes back as its status; the
// layer is then unusable, as the communicator is.

#include <cstdint>

#include <vector>
#include "absl/status/status.h"

#include "worker/engine/comm/communicator.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/shard_map.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

class ColumnParallelLinear {
 public:
  // `group` (not owned) is the tensor group; out_features % its size == 0.
  ColumnParallelLinear(int64_t in_features, int64_t out_features, Communicator* group);

  // x [N, in] (the whole input, the same on every rank) -> y [N, out/T].
  absl::Status Forward(const Tensor& x, Tensor* y);
  // grad_y [N, out/T] -> the weight and bias gradients of this shard, and,
  // if grad_x is not null, the whole input gradient [N, in] (all-reduced).
  absl::Status Backward(const Tensor& grad_y, Tensor* grad_x);

  // This rank's rows of a whole weight [out, in] and bias [out].
  void LoadShardOf(const Tensor& weight, const Tensor& bias);

  int64_t shard_features() const { return shard_; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }

 private:
  const int64_t in_;
  const int64_t shard_;
  Communicator* group_;
  Parameter weight_;
  Parameter bias_;
  const Tensor* input_ = nullptr;
};

class RowParallelLinear {
 public:
  // `group` (not owned) is the tensor group; in_features % its size == 0.
  RowParallelLinear(int64_t in_features, int64_t out_features, Communicator* group);

  // x_shard [N, in/T] -> y [N, out], the same on every rank.
  absl::Status Forward(const Tensor& x_shard, Tensor* y);
  // grad_y [N, out] (the same on every rank) -> this shard's weight
  // gradient, the bias gradient (whole, the same on every rank) and, if
  // grad_x_shard is not null, the gradient of this rank's input slice.
  absl::Status Backward(const Tensor& grad_y, Tensor* grad_x_shard);

  // This rank's columns of a whole weight [out, in], and the whole bias.
  void LoadShardOf(const Tensor& weight, const Tensor& bias);

  int64_t shard_features() const { return shard_; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }

 private:
  const int64_t out_;
  const int64_t shard_;
  Communicator* group_;
  Parameter weight_;
  Parameter bias_;
  const Tensor* input_ = nullptr;
};

// The clipping norm's sum of squares over a tensor group: the split
// parameters' squares summed over the ranks, those of the parameters every
// rank holds whole (`whole`: the same values and gradients everywhere)
// counted once. The same bits on every rank. A collective.
Optimizer::SumOfSquaresReduction TensorParallelSumOfSquares(Communicator* group,
                                                            std::vector<const Parameter*> whole);

// The same under ZeRO-1 over `data` (ddp.h's shard_optimizer), the
// optimizer stepping this rank's shards (`map`): the squares of the shards
// of split parameters summed over `data` and `tensor`, of parameters in
// `whole` over `data` only; `tied` (stepped whole on every replica; null
// for none) added where `count_tied`, with the split ones unless in
// `whole`; the result summed over `stages` (a pipeline's; null for one
// stage). `tensor` may be null (no tensor parallelism). A collective.
Optimizer::SumOfSquaresReduction ShardedSumOfSquares(const ShardMap& map,
                                                     const std::vector<const Parameter*>& whole,
                                                     const Parameter* tied, bool count_tied,
                                                     Communicator* data, Communicator* tensor,
                                                     Communicator* stages);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_TENSOR_PARALLEL_H_
