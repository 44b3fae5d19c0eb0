#ifndef AIDN_WORKER_ENGINE_GPT_H_
#define AIDN_WORKER_ENGINE_GPT_H_

// A GPT-2-style decoder on the CPU, with hand-written forward and backward
// passes in llm.c's manner:
//
//   x = drop(wte[tokens] + wpe[positions])
//   n_layer times:
//     x = x + drop(c_proj(attention(c_attn(ln_1(x)))))   causal, n_head heads
//     x = x + drop(mlp.c_proj(gelu_tanh(mlp.c_fc(ln_2(x)))))
//   logits = ln_f(x) wte^T                               the LM head is wte
//
// Parameters carry Hugging Face's GPT2LMHeadModel names and layouts
// ("transformer.h.0.attn.c_attn.weight" is [n_embd, 3 n_embd]: its Conv1D
// keeps weights as [in, out]), so checkpoints and safetensors exports load
// into transformers' GPT-2 and into nanoGPT after its usual transposes.
// Initialisation is GPT-2's: weights N(0, 0.02), the residual projections
// (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 n_layer)), biases 0,
// LayerNorm weight 1 and bias 0 (eps 1e-5).
//
// Attention is exact: scores q k^T / sqrt(head_dim) per (sequence, head),
// the causal softmax over positions 0..t of row t, then dropout on the
// probabilities and their product with v, as nanoGPT's explicit path.
//
// Forward keeps every activation Backward needs (the attention
// probabilities too: [B, n_head, T, T] per layer). Buffers are sized on the
// first step and reused while B and T stay the same.
//
// Not thread-safe: one model per training thread.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/tensor.h"
#include "worker/engine/units.h"

namespace aidn::engine {

struct GptConfig {
  int n_layer = 6;
  int n_head = 6;
  int n_embd = 384;
  // The longest sequence (rows of wpe).
  int block_size = 256;
  int vocab_size = 256;
  // Dropout probability on the embeddings, the attention probabilities and
  // both residual branches, in [0, 1).
  double dropout = 0.0;
  // Biases in the linear layers and LayerNorms (GPT-2 has them).
  bool bias = true;
  // Stochastic depth (LayerDrop): each block is skipped whole with this
  // probability per training forward (the residual stream passes through,
  // its parameters get no gradient that step), a kept block's two branches
  // scaled by 1 / (1 - p), as the ResNets' blocks; in [0, 1). The draws come
  // from the stream the embedding dropout uses, the same on every rank of a
  // tensor-parallel group.
  double stochastic_depth = 0.0;
};

// INVALID_ARGUMENT naming the field: sizes below 1, n_embd not a multiple
// of n_head, dropout outside [0, 1), or a model beyond 2^31 elements in one
// tensor.
absl::Status ValidateGptConfig(const GptConfig& config);

// The named configurations: "gpt2" (124M: 12 layers, 12 heads, 768 wide,
// context 1024, vocabulary 50257), "gpt2-medium" (350M), "gpt-char"
// (nanoGPT's character-level model: 6 layers, 6 heads, 384 wide, context
// 256, bytes; 10.7M), "gpt-mini" (4, 4, 128, 128, bytes) and "gpt-nano"
// (2, 2, 32, 32, bytes; for tests). NOT_FOUND lists the names otherwise.
absl::StatusOr<GptConfig> NamedGptConfig(const std::string& name);

// "n_layer=6,n_head=6,n_embd=384,block_size=256,vocab_size=256,bias=1":
// the sizes that rebuild a model, as checkpoints and exports carry them in
// their safetensors metadata ("aidn.gpt"; dropout is left out). Parse takes
// the fields in any order, all of them; INVALID_ARGUMENT naming what is
// missing, unknown or not a number, or a config ValidateGptConfig refuses.
std::string FormatGptConfig(const GptConfig& config);
absl::StatusOr<GptConfig> ParseGptConfig(const std::string& text);

class Gpt {
 public:
  // Called during Backward for each parameter as soon as its gradient is
  // final for this pass, in reverse order of use (DDP starts bucket
  // allreduces from here); wte, used first and last, comes last.
  using GradReadyCallback = std::function<void(Parameter*)>;

  // INVALID_ARGUMENT for a bad config (ValidateGptConfig).
  static absl::StatusOr<std::unique_ptr<Gpt>> Create(const GptConfig& config, uint64_t seed);

  // Runs `batch` sequences of `seq_len` tokens (row-major [batch, seq_len],
  // each in [0, vocab_size)) and returns the mean cross-entropy of the
  // logits against `targets` (same shape), as F.cross_entropy over the
  // flattened positions. `training` switches dropout on. Programmer errors
  // (abort): seq_len beyond block_size, a token or target out of range.
  double Forward(const int32_t* tokens, const int32_t* targets, int64_t batch, int64_t seq_len,
                 bool training);
  // Logits only ([batch * seq_len, vocab]), no loss, for generation and
  // evaluation; Backward must not follow.
  const Tensor& Logits(const int32_t* tokens, int64_t batch, int64_t seq_len);
  // Accumulates (+=) every parameter's gradient of the last Forward's loss,
  // scaled by `grad_scale` (1/k with k micro-batches a step). Gradients have
  // no storage until the first ZeroGrad or Backward gives it (zeroed) to
  // them, unless unit hooks are set: the strategy behind them provides it.
  void Backward(double grad_scale = 1.0);

  void SetGradReadyCallback(GradReadyCallback callback) { grad_ready_ = std::move(callback); }
  // units.h: the root (wte, wpe, ln_f), then one unit per block.
  std::vector<std::vector<Parameter*>> Units();
  // Not owned; null: none.
  void SetUnitHooks(UnitHooks* hooks) { hooks_ = hooks; }
  void ZeroGrad();
  // Reseeds the dropout streams for the next Forward.
  void SetSeed(uint64_t seed);
  // Activation checkpointing: Forward keeps only each block's input, and
  // Backward runs each block's forward again (with the same dropout masks)
  // just before the block's backward, trading that compute for the
  // activations' memory ([B, n_head, T, T] attention probabilities and
  // ~17 [N, n_embd] tensors a block). The gradients are bitwise those
  // without it.
  void SetActivationCheckpointing(bool on);
  bool activation_checkpointing() const { return checkpointing_; }

  // Pipeline parallelism (pipeline_stage.h): this model runs blocks
  // [first_block, end_block) only. The first stage (first_block 0) embeds
  // the tokens; a later one takes the previous stage's output ([N, n_embd])
  // as its input. The last stage (end_block n_layer) ends with ln_f, the
  // LM head and the loss; an earlier one ends with its last block's output.
  // Both ends hold wte (tied), so a pipeline of several stages sums its
  // gradient over the two. Other blocks' activation buffers are freed; the
  // parameters are left as they are (a stage may release the others').
  // SetStage(0, n_layer) is the whole model again.
  void SetStage(int first_block, int end_block);
  bool embeds() const { return first_block_ == 0; }
  bool has_head() const { return end_block_ == config_.n_layer; }
  // A stage's forward: tokens (first stage) or `input` [batch * seq_len,
  // n_embd] (the others), targets (last stage; else ignored). Returns the
  // loss on the last stage, 0 on the others, whose output stage_output()
  // holds until the next forward.
  double ForwardStage(const int32_t* tokens, const Tensor* input, const int32_t* targets,
                      int64_t batch, int64_t seq_len, bool training);
  const Tensor& stage_output() const { return out_; }
  // A stage's backward: from the loss (last stage) or from `grad_output`,
  // the gradient of stage_output(); writes the gradient of the stage's
  // input into `grad_input` (stages after the first; may be null).
  void BackwardStage(const Tensor* grad_output, Tensor* grad_input, double grad_scale);
  // The parameters this stage holds, in registration order (all of them
  // without SetStage).
  const std::vector<Parameter*>& StageParameters() const { return stage_parameters_; }

  // Tensor parallelism (Megatron-LM's scheme) over `group`'s T ranks (not
  // owned; it must outlive the model), this model being its rank t. From
  // the whole weights the model holds now (so that a model built from a
  // seed splits into the dense model's slices) it keeps its slice of every
  // split parameter: wte's rows of its 1/T of the vocabulary, c_attn's q,
  // k and v columns of its 1/T of the heads (and their biases),
  // attn.c_proj's rows for those heads, mlp.c_fc's 1/T of the columns
  // (and biases) and mlp.c_proj's rows for them; the LayerNorms, wpe and
  // the row-parallel layers' biases stay whole, their gradients the same on
  // every rank. Forward then all-reduces the embedding and each block's two
  // row-parallel outputs (the bias added after the sum), and the loss is
  // the vocabulary-parallel cross-entropy (each rank's logits stay its own;
  // the maxima, exponent sums and target logits are reduced); backward
  // all-reduces the input gradient of each column-parallel layer and the
  // LM head's. Attention dropout draws from a stream of each rank's own
  // (its heads are not the others'); the other masks are the same on every
  // rank. Logits() gathers the whole vocabulary's logits. Every rank of the
  // group calls Forward and Backward in the same order; a collective's
  // error is kept (TakeCollectiveStatus) and the rest of the pass does not
  // communicate. Call once, before the first Forward; a null group or one
  // of one rank changes nothing. INVALID_ARGUMENT unless T divides n_head
  // and vocab_size; FAILED_PRECONDITION when called again or too late.
  absl::Status SetTensorParallel(Communicator* group);
  int tensor_parallel_size() const { return tp_size_; }
  // Seconds spent in the tensor group's collectives since the last call.
  double TakeTensorParallelSeconds() { return std::exchange(tp_seconds_, 0.0); }
  // The first error of a tensor-parallel collective since the last call,
  // or OK; the pass it failed in is to be thrown away.
  absl::Status TakeCollectiveStatus();
  // Where a split parameter's shard lies in the whole tensor: along `dim`
  // (0: rows, or the only one; 1: columns), the concatenation of `ranges`.
  struct Split {
    int dim = 0;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    // The whole tensor's.
    std::vector<int64_t> whole_shape;
  };
  // nullopt for a parameter kept whole (and for all without tensor
  // parallelism).
  std::optional<Split> SplitOf(const Parameter& p) const;

  // One forward's activations set aside, so that several micro-batches can
  // be in flight between their forward and backward (a pipeline stage
  // keeps one per micro-batch). Opaque; movable.
  class Stash;
  // Exchanges what the model holds for its next Backward (the stage's
  // activations, tokens, targets and dropout state) with `stash`: after a
  // Forward it takes them aside (the model then holds an empty stash's),
  // before the Backward it gives them back. O(1): buffers move, nothing is
  // copied.
  void SwapActivations(Stash* stash);

  // In registration order: wte, wpe, each block's, ln_f.
  const std::vector<Parameter*>& Parameters() const { return parameters_; }
  // The parameters of the blocks the last training Forward skipped
  // (stochastic_depth); Backward reports none of them ready.
  std::vector<Parameter*> UnusedParameters();
  int64_t ParameterCount() const;
  // The same count from a configuration alone (without building the model).
  static int64_t ParameterCount(const GptConfig& config);
  // The logits of the last Forward, [batch * seq_len, vocab] (under tensor
  // parallelism this rank's vocabulary's columns only).
  const Tensor& logits() const { return logits_; }
  // The same, the whole vocabulary's: under tensor parallelism gathered
  // from the group (a collective), else logits().
  const Tensor& WholeLogits();
  const GptConfig& config() const { return config_; }

 private:
  // What a block's Backward needs from its Forward besides its input.
  struct Activations {
    Tensor ln1;        // [N, C]
    Tensor ln1_mean;   // [N]
    Tensor ln1_rstd;   // [N]
    Tensor qkv;        // [N, 3C]
    Tensor att;        // [B, H, T, T] softmax probabilities (0 above the diagonal)
    Tensor att_mask;   // [B, H, T, T] dropout mask (training with dropout)
    Tensor y;          // [N, C] the heads' outputs side by side
    Tensor attn_mask;  // [N, C] dropout mask of the attention branch
    Tensor mid;        // [N, C] the residual stream after attention
    Tensor ln2;        // [N, C]
    Tensor ln2_mean;   // [N]
    Tensor ln2_rstd;   // [N]
    Tensor fc;         // [N, 4C] before GELU
    Tensor gelu;       // [N, 4C]
    Tensor mlp_mask;   // [N, C] dropout mask of the MLP branch
  };
  struct Block {
    Parameter ln1_w, ln1_b, attn_w, attn_b, proj_w, proj_b;
    Parameter ln2_w, ln2_b, fc_w, fc_b, fc_proj_w, fc_proj_b;
    Tensor in;  // [N, C] the block's input (the residual stream) in the last Forward
    // The rest of the last Forward's activations (unused with activation
    // checkpointing, which keeps them in shared_ while the block runs).
    Activations acts;
    // Activation checkpointing: the dropout streams as the block's Forward
    // found them, so that the recomputation draws the same masks.
    std::mt19937_64 rng;
    std::mt19937_64 tp_rng;
    // stochastic_depth: the last Forward passed the stream through.
    bool skipped = false;
  };

  explicit Gpt(const GptConfig& config);
  void Init(uint64_t seed);
  void Register(Parameter* p, std::string name, std::vector<int64_t> shape);
  // Sizes the activation buffers for [batch, seq_len].
  void Shape(int64_t batch, int64_t seq_len);
  // Embeddings (or a stage's input) through the stage's blocks, and on the
  // last stage ln_f and the logits.
  void ForwardTrunk(const int32_t* tokens, const Tensor* input, bool training);
  // Backward's parts: the LM head and ln_f into dx_, the stage's blocks
  // (dx_ becomes the gradient of their input), the embeddings from dx_.
  void HeadBackward(double grad_scale);
  void BlocksBackward();
  void EmbeddingBackward();
  // Tensor parallelism (gpt_tensor_parallel.cc). Sums `n` floats over the
  // group in place (nothing without one, or after an error).
  void TensorAllReduce(float* data, int64_t n);
  // y [N, C] = x [N, in] W (+ b): a row-parallel layer's output, summed
  // over the group before the bias.
  void RowParallelForward(const float* x, const Parameter& w, const Parameter& b, int64_t in,
                          float* y);
  // The embeddings of tokens_ into x [N, C]: this rank's vocabulary's rows,
  // summed over the group, plus wpe.
  void EmbedVocabParallel(float* x);
  // The mean cross-entropy of logits_ (this rank's vocabulary) against
  // targets_, and grad_logits_ (this rank's columns).
  double VocabParallelCrossEntropy();

  std::mt19937_64& AttentionRng() { return tp_ != nullptr ? tp_rng_ : rng_; }
  // A block's forward from b.in into `out` ([N, C]), keeping its
  // activations in `a`.
  void BlockForward(Block& b, Activations& a, float* out, bool drop);
  Activations& ActsOf(Block& b) { return checkpointing_ ? shared_ : b.acts; }
  void AttentionForward(Activations& a, bool drop);
  void AttentionBackward(Activations& a, const float* dy, float* dqkv);
  // Gives every gradient without storage zeroed storage of its own.
  void EnsureGrads();
  // Reports a layer's weight, then its bias when the model has biases.
  void Ready(Parameter& weight, Parameter& bias);
  // The gradient of a residual branch from the stream's (dx_): through the
  // branch's dropout mask when the last Forward drew one, times `scale`.
  const float* BranchGrad(const Tensor& mask, float scale = 1.0f);
  // Multiplies a residual branch's output [N, C] by its dropout mask (when
  // `drop`) and by branch_scale_.
  void ScaleBranch(const Tensor& mask, bool drop, float* branch);
  // A bias's gradient, or null without biases.
  float* BiasGrad(Parameter& bias) { return config_.bias ? bias.grad.data() : nullptr; }

  GptConfig config_;
  Parameter wte_, wpe_, lnf_w_, lnf_b_;
  std::vector<Block> blocks_;
  std::vector<Parameter*> parameters_;
  GradReadyCallback grad_ready_;
  UnitHooks* hooks_ = nullptr;
  std::mt19937_64 rng_{0};

  // SetTensorParallel: the group, this rank in it and the widths it holds
  // (the whole ones without): vocabulary rows from vocab_begin_, heads,
  // attention width (heads_local_ x head size) and MLP width.
  Communicator* tp_ = nullptr;
  int tp_rank_ = 0;
  int tp_size_ = 1;
  int64_t vocab_begin_ = 0;
  int64_t vocab_local_ = 0;
  int64_t heads_local_ = 0;
  int64_t cl_ = 0;
  int64_t fl_ = 0;
  absl::Status tp_status_;
  double tp_seconds_ = 0;
  std::mt19937_64 tp_rng_{0};
  Tensor full_logits_;  // GatherLogits

  // SetStage: the blocks this model runs, and its parameters.
  int first_block_ = 0;
  int end_block_ = 0;
  std::vector<Parameter*> stage_parameters_;

  bool checkpointing_ = false;
  Activations shared_;  // activation checkpointing: the running block's
  Tensor recomputed_;   // activation checkpointing: a recomputed block's output

  int64_t batch_ = 0;
  int64_t seq_len_ = 0;
  bool dropped_ = false;    // the last Forward drew dropout masks
  float branch_scale_ = 1;  // stochastic_depth: a kept block's branches' factor
  int64_t stage_rows_ = 0;  // positions of the last Forward (0: none yet)
  std::vector<int32_t> tokens_;
  std::vector<int32_t> targets_;
  Tensor emb_mask_;  // [N, C]
  Tensor out_;       // [N, C] the last block's output
  Tensor lnf_;       // [N, C]
  Tensor lnf_mean_;  // [N]
  Tensor lnf_rstd_;  // [N]
  Tensor logits_;    // [N, V]
  // Backward scratch.
  Tensor grad_logits_;  // [N, V]
  Tensor dx_;           // [N, C] the residual stream's gradient
  Tensor dtmp_;         // [N, C]
  Tensor dbranch_;      // [N, C] a residual branch's gradient through its dropout
  Tensor dbig_;         // [N, 4C]
  Tensor dqkv_;         // [N, 3C]
  Tensor datt_;         // [T, T] one (sequence, head) at a time
  Tensor patt_;         // [T, T] probabilities after dropout, likewise
};

class Gpt::Stash {
 public:
  // Bytes of activations it holds.
  int64_t bytes() const;

 private:
  friend class Gpt;
  std::vector<Tensor> in;
  std::vector<Activations> acts;
  std::vector<std::mt19937_64> rng, tp_rng;
  std::vector<char> skipped;
  Tensor emb_mask, out, lnf, lnf_mean, lnf_rstd, grad_logits;
  std::vector<int32_t> tokens, targets;
  int64_t batch = 0, seq_len = 0, rows = 0;
  bool dropped = false;
  float branch_scale = 1;
};

// The part of `whole` a tensor-parallel rank holds (Gpt::SplitOf): the
// rows (dim 0, or a vector's elements) or columns in split.ranges, side by
// side.
Tensor SliceOfSplit(const Tensor& whole, const Gpt::Split& split);

// A model from a safetensors file of its weights under GPT-2's names (a
// checkpoint's model.safetensors or an export) whose metadata carries its
// sizes ("aidn.gpt", FormatGptConfig). INVALID_ARGUMENT when the file holds
// no GPT (no "aidn.gpt") or tensors that do not fit it; the reader's errors
// otherwise.
absl::StatusOr<std::unique_ptr<Gpt>> LoadGpt(const std::string& path);

// How Generate picks each next token.
struct SampleOptions {
  // Tokens to add.
  int64_t length = 200;
  // The most likely token (ties: the lowest id) instead of a draw.
  bool greedy = false;
  // Draw among the top_k most likely tokens only (0: among all).
  int top_k = 0;
  // Logits are divided by it before the softmax; > 0.
  double temperature = 1.0;
  // Seeds the draws: the same seed, prompt and weights give the same text.
  uint64_t seed = 0;
};

// Continues `prompt` (at least one token, each in [0, vocab_size)) by
// options.length tokens and returns prompt and continuation together. Each
// token comes from the logits at the last position of the last block_size
// tokens, recomputed whole (no key/value cache: fine for the small models
// the CPU trains, quadratic in the context). INVALID_ARGUMENT naming the
// problem for an empty prompt, a token out of range, a negative length or
// top_k, or a temperature that is not > 0.
absl::StatusOr<std::vector<int32_t>> Generate(Gpt& gpt, std::vector<int32_t> prompt,
                                              const SampleOptions& options);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_GPT_H_
