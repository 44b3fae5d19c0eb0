#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_GPT_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_GPT_H_

// The GPT decoder (worker/engine/gpt.h) on the GPU: the same definition,
// parameter names, layouts and operation order, with cuBLAS for the matrix
// products (gpu_gemm.h) and gpt_kernels.h for the rest. In fp32 it computes
// what the CPU decoder computes up to summation order; in bf16 / fp16 the
// matrix products (attention's too) take 16-bit operands with fp32
// accumulation, everything else stays fp32.
//
// Attention is exact and causal. In bf16 with dropout 0 (one setting for
// the whole model), for
// head sizes 32, 64, 96 and 128 where the GPU's shared memory holds the
// tiles, it is fused (flash_attention.h: no [T, T] matrix in memory;
// SetFusedAttention(false) turns that off).
// Otherwise it is computed one sequence at a time with all its heads
// batched through cuBLAS: the scores of that sequence ([n_head, T, T]) live
// in a scratch shared by every block and sequence, and Forward keeps only
// each row's maximum and 1/sum; Backward computes the scores again (one more
// product) and recomputes the probabilities from the kept statistics bit
// for bit. Either way the attention memory is at most one sequence's
// scores, not the CPU's [B, n_head, T, T] a block.
//
// Dropout draws GPU masks (dropout_mask.h, keyed by the seed, the forward's
// count and the site), which are not the CPU's stream: with dropout the
// two agree in distribution only.
//
// Stochastic depth skips whole blocks with the CPU decoder's draws from the
// same seed (with dropout 0; with dropout the CPU's generator draws the
// masks too), a kept block's branches scaled by 1 / (1 - p).
//
// Pipeline stages (SetStage, ForwardStage, BackwardStage): a contiguous run
// of blocks, as the CPU decoder's Gpt::SetStage, the activations coming in
// and going out as device tensors [N, C].
//
// Not there on the GPU: tensor parallelism and activation checkpointing
// (Create refuses a model set up for them).
//
// Everything is queued on the context's stream; the host waits only where
// it reads results (ReadLoss, copies to the host). Not thread-safe.

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/cuda/allocator.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_gemm.h"
#include "worker/engine/cuda/gpu_layers.h"
#include "worker/engine/cuda/gpu_tensor.h"
#include "worker/engine/cuda/gpu_units.h"
#include "worker/engine/gpt.h"
#include "worker/engine/token_positions.h"

namespace aidn::engine::cuda {

class GpuGpt {
 public:
  // Called during Backward with parameters whose gradients are final for
  // this pass (queued): ln_f's, each block's from the last, then wte and
  // wpe, each list in registration order (GpuDdpReducer::OnGradReady's
  // expectation); a pipeline stage reports what it holds, in that order.
  // DDP starts its allreduces from here.
  using GradReadyFn = std::function<absl::Status(const std::vector<GpuParameter*>&)>;

  // A GPU copy of `cpu` (configuration and weights). UNIMPLEMENTED for
  // tensor parallelism, a pipeline stage or activation checkpointing.
  static absl::StatusOr<std::unique_ptr<GpuGpt>> Create(GpuContext* ctx, const Gpt& cpu);

  // As Gpt::Forward, with host arrays of tokens and targets ([batch,
  // seq_len] each); the loss stays on the device (ReadLoss). INVALID_ARGUMENT
  // for a sequence beyond block_size, a token or target out of range, or a
  // training forward without targets (an evaluation's may have none: the
  // logits only).
  absl::Status Forward(const int32_t* tokens, const int32_t* targets, int64_t batch,
                       int64_t seq_len, bool training);
  // Pipeline stages (Gpt::SetStage's semantics): blocks [first_block,
  // end_block); the first stage (first_block 0) embeds the tokens, the last
  // (end_block n_layer) holds ln_f and the head; both hold the tied wte.
  // The weights and gradients of what the stage does not run are released
  // (Parameters() still lists them, with their shapes; StageParameters()
  // what the stage holds). INVALID_ARGUMENT for a bad range;
  // FAILED_PRECONDITION with unit hooks set (not with FSDP) or for a
  // second SetStage. A stage's optimizer and reducers take
  // StageParameters().
  absl::Status SetStage(int first_block, int end_block);
  bool embeds() const { return first_block_ == 0; }
  bool has_head() const { return end_block_ == config_.n_layer; }
  std::vector<GpuParameter*> StageParameters();
  // A stage's Forward: from the tokens (the first stage) or from `input`
  // (device [batch * seq_len, n_embd]: the previous stage's output, read
  // here, in this context's stream order: the caller orders its producer
  // before) otherwise; the last stage takes the targets and computes the
  // loss, the others leave their output in stage_output() (valid until
  // the next ForwardStage). INVALID_ARGUMENT for what the stage lacks.
  // Forward is ForwardStage of a whole model (FAILED_PRECONDITION on a
  // stage).
  absl::Status ForwardStage(const int32_t* tokens, const float* input, const int32_t* targets,
                            int64_t batch, int64_t seq_len, bool training);
  const GpuTensor& stage_output() const { return out_; }
  // A stage's Backward: from the loss (the last stage, times `grad_scale`)
  // or from `grad_output` (device, the next stage's gradient of this
  // stage's output) otherwise; a stage after the first writes the
  // gradient of its input into `grad_input` (may be null). Backward is
  // BackwardStage of a whole model.
  absl::Status BackwardStage(const float* grad_output, GpuTensor* grad_input, double grad_scale,
                             const GradReadyFn& on_ready = nullptr);
  // The last Forward's loss (waits for the stream).
  absl::StatusOr<double> ReadLoss() const;
  // The loss as one device double, valid after the last Forward's kernels.
  const double* device_loss() const { return static_cast<const double*>(loss_.data()); }
  // [batch * seq_len, vocab_size] of the last Forward.
  const GpuTensor& logits() const { return logits_; }

  // Accumulates (+=) every parameter's gradient of the last training
  // Forward's loss times `grad_scale`. FAILED_PRECONDITION without one.
  absl::Status Backward(double grad_scale = 1.0, const GradReadyFn& on_ready = nullptr);
  // Zeroes the gradients (with unit hooks set: none, the hooks own the
  // gradients' memory).
  absl::Status ZeroGrad();
  // As Gpt::SetUnitHooks (gpu_units.h): the root (0) is wte, wpe and ln_f,
  // unit l + 1 block l (skipped blocks too). Null: none. Not owned.
  // FAILED_PRECONDITION on a pipeline stage.
  absl::Status SetUnitHooks(GpuUnitHooks* hooks) {
    if (staged_ && hooks != nullptr) {
      return absl::FailedPreconditionError("gpt: unit hooks on a pipeline stage");
    }
    hooks_ = hooks;
    return absl::OkStatus();
  }
  // Reseeds the dropout masks and stochastic depth's draws of the next
  // Forwards.
  void SetSeed(uint64_t seed);
  // The parameters of the blocks the last training Forward skipped
  // (stochastic depth, as Gpt::UnusedParameters); Backward reports none of
  // them ready and leaves their gradients alone.
  std::vector<GpuParameter*> UnusedParameters();
  // Whether attention may use the fused kernels where they apply (bf16, no
  // attention dropout, a supported head size, shared memory enough on this
  // GPU; on by default); FusedAttention() says whether the next Forward
  // will. A Forward's choice holds for its Backward.
  void SetFusedAttention(bool on) { fused_allowed_ = on; }
  bool FusedAttention() const { return fused_allowed_ && fused_possible_; }

  // In the CPU decoder's registration order, named as there.
  std::vector<GpuParameter*> Parameters();
  const GptConfig& config() const { return config_; }
  // Weights (and gradients) between this model and a CPU decoder of the
  // same configuration, by name. INVALID_ARGUMENT for a mismatch.
  absl::Status CopyWeightsFrom(const Gpt& cpu);
  // Into CPU parameters of the decoder's, in its order (Gpt::Parameters()).
  absl::Status CopyWeightsTo(const std::vector<Parameter*>& cpu) const {
    return CopyDown(cpu, /*grads=*/false);
  }
  absl::Status CopyGradsTo(const std::vector<Parameter*>& cpu) const {
    return CopyDown(cpu, /*grads=*/true);
  }

 private:
  struct Block {
    GpuParameter *ln1_w, *ln1_b, *attn_w, *attn_b, *proj_w, *proj_b;
    GpuParameter *ln2_w, *ln2_b, *fc_w, *fc_b, *fc_proj_w, *fc_proj_b;
    // The last Forward's activations.
    GpuTensor in, ln1, ln1_mean, ln1_rstd, qkv, y, att_max, att_inv, mid, ln2, ln2_mean, ln2_rstd,
        fc, gelu;
    // Stochastic depth: the last Forward passed the stream through.
    bool skipped = false;
  };

  GpuGpt(GpuContext* ctx, const GptConfig& config) : ctx_(ctx), config_(config) {}
  // Checks names, then copies values (or gradients) to the host.
  absl::Status CopyDown(const std::vector<Parameter*>& cpu, bool grads) const;
  absl::Status Shape(int64_t batch, int64_t seq_len);
  absl::Status UploadTokens(const int32_t* tokens, const int32_t* targets, bool training);
  // y [N, out] = x [N, in] W [in, out] (+ b).
  absl::Status Linear(const float* x, const GpuParameter& w, const GpuParameter* b, int64_t in,
                      int64_t out, float* y);
  // dx = dy W^T (null: not wanted), dW += x^T dy, db += column sums of dy.
  absl::Status LinearBackward(const float* dy, const float* x, GpuParameter& w, GpuParameter* b,
                              int64_t in, int64_t out, float* dx);
  absl::Status LayerNormBackward(const float* dout, const float* x, GpuParameter& w,
                                 GpuParameter* b, const GpuTensor& mean, const GpuTensor& rstd,
                                 float* dx);
  // Column sums of g [rows, cols] added to `into`.
  absl::Status ColumnSums(const float* g, int64_t rows, int64_t cols, float* into);
  absl::Status BlockForward(size_t l, float* out, bool drop);
  absl::Status AttentionForward(size_t l, bool drop);
  absl::Status AttentionBackward(size_t l, const float* dy, float* dqkv);
  absl::Status BlockBackward(size_t l);
  // Multiplies a residual branch [N, C] by its dropout mask in place.
  absl::Status DropBranch(float* x, uint64_t site);
  // The gradient of a residual branch from the stream's (dx_): dx_ itself,
  // or into dbranch_ through the branch's mask when the Forward dropped and
  // times `scale` (a kept block's branch under stochastic depth).
  absl::StatusOr<const float*> BranchGrad(uint64_t site, float scale = 1.0f);
  uint64_t Key(uint64_t site) const;
  // Dropout sites: the embedding, then each block's attention
  // probabilities, attention branch and MLP branch.
  uint64_t AttentionSite(size_t l) const { return 1 + 3 * l; }
  uint64_t AttentionBranchSite(size_t l) const { return 2 + 3 * l; }
  uint64_t MlpBranchSite(size_t l) const { return 3 + 3 * l; }

  GpuContext* ctx_;
  GptConfig config_;
  std::vector<std::unique_ptr<GpuParameter>> params_;
  GpuParameter *wte_ = nullptr, *wpe_ = nullptr, *lnf_w_ = nullptr, *lnf_b_ = nullptr;
  std::vector<Block> blocks_;

  GpuUnitHooks* hooks_ = nullptr;
  // The stage's blocks [first_block_, end_block_) (the whole model by
  // default) and whether SetStage ran.
  int first_block_ = 0;
  int end_block_ = 0;
  bool staged_ = false;
  bool fused_allowed_ = true;
  bool fused_possible_ = false;  // Create's verdict for this model and GPU
  bool fused_now_ = false;       // the last Forward's choice
  uint64_t seed_ = 0;
  uint64_t draws_ = 0;    // training forwards since SetSeed
  bool dropped_ = false;  // the last Forward drew masks
  // Stochastic depth: the CPU decoder's generator (seeded by SetSeed) and
  // the kept blocks' branch factor of the last Forward.
  std::mt19937_64 depth_rng_{0};
  float branch_scale_ = 1.0f;
  bool has_forward_ = false;  // a training Forward Backward may follow
  int64_t batch_ = 0;
  int64_t seq_len_ = 0;

  // Tokens and targets on the device, and the positions grouped by token
  // for the embedding's gradient.
  DeviceBuffer tokens_d_, targets_d_, grad_tokens_d_, grad_offsets_d_, grad_positions_d_;
  TokenPositions grad_groups_;

  GpuTensor out_, lnf_, lnf_mean_, lnf_rstd_, logits_, grad_logits_;
  DeviceBuffer row_loss_, loss_;
  // Backward scratch.
  GpuTensor dx_, dtmp_, dbranch_, dbig_, dqkv_, gn_, bias_partials_;
  // One sequence's attention: scores / probabilities, their gradient, and
  // the probabilities after dropout.
  GpuTensor scores_, dscores_, pdrop_;
  // Fused attention's backward scratch ([B, n_head, T]).
  GpuTensor attn_delta_;
  GemmScratch gemm_scratch_;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_GPT_H_
