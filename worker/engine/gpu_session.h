#ifndef AIDN_WORKER_ENGINE_GPU_SESSION_H_
#define AIDN_WORKER_ENGINE_GPU_SESSION_H_

// One rank's training on a GPU, behind a plain C++ interface so that the
// trainer (service code) never includes a CUDA header: the model mirrored
// onto the device (cuda/gpu_model.h), its optimizer, and with more than one
// rank an NCCL communicator (comm/nccl_communicator.h) whose id goes through
// the generation's KeyValueStore and a DDP reducer (cuda/gpu_ddp.h). Each
// Step averages the gradients over the ranks between backward and the
// update, in buckets whose allreduce overlaps the rest of backward; the
// host waits once per step, polling NCCL for errors against the timeout.
// Gradient accumulation: a Step takes several micro-batches and
// communicates only after the last one's backward.
//
// Two libraries implement it: aidn_gpu_session (CUDA builds) and
// aidn_gpu_session_none (every build), whose Create answers UNIMPLEMENTED;
// each binary links one (aidn-worker: none; aidn-worker-gpu: CUDA). With
// CUDA but without NCCL, world_size > 1 answers UNIMPLEMENTED.
//
// Not thread-safe: one session per trainer thread.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/kv_store.h"
#include "worker/engine/data.h"
#include "worker/engine/gpt.h"
#include "worker/engine/half.h"
#include "worker/engine/loss_scale.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/powersgd.h"
#include "worker/engine/shard_map.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

struct GpuSessionOptions {
  // CUDA device (a worker's trainer sees only its own GPU, as device 0).
  int device = 0;
  // TF32 tensor-core math for GEMMs and convolutions (spec allow_tf32).
  bool allow_tf32 = false;
  // Any cuDNN convolution algorithm, not only deterministic non-transform
  // ones (spec fast_convolutions).
  bool fast_convolutions = false;
  // What GEMMs and convolutions multiply in (spec precision): "fp32",
  // "bf16" or "fp16" (with dynamic loss scaling). INVALID_ARGUMENT for
  // anything else.
  std::string precision = "fp32";
  // Steps from captured CUDA graphs (spec cuda_graphs; GpuTrainer::
  // SetCudaGraphs): one rank only for now (the NCCL allreduce is not
  // captured), and only for steps without dropout or fp16 loss scaling.
  bool cuda_graphs = false;
  int rank = 0;
  int world_size = 1;
  // world_size > 1 or sharding: where rank 0 publishes the NCCL unique id
  // ("nccl/id").
  KeyValueStore* store = nullptr;
  // NCCL initialisation and each gradient allreduce.
  std::chrono::milliseconds timeout{300'000};
  // DDP gradient bucket size (spec bucket_mb), world_size > 1.
  double bucket_mb = 25.0;
  // Buckets allreduced in 16 bits (spec ddp.compression fp16 | bf16; the
  // CPU reducer's semantics, cuda/gpu_ddp.h), world_size > 1.
  std::optional<HalfFormat> compression;
  // PowerSGD compression of the buckets (spec ddp.compression powersgd;
  // the CPU reducer's semantics, cuda/gpu_powersgd.h), world_size > 1. Not
  // with `compression`.
  std::optional<PowerSgdOptions> powersgd;
  // Rank 0's buffers (BatchNorm's running statistics) broadcast to every
  // rank before each step's first forward (spec ddp.broadcast_buffers,
  // torch's default), world_size > 1.
  bool broadcast_buffers = true;
  // BatchNorm over every rank's batch (spec ddp.sync_batchnorm; torch's
  // SyncBatchNorm, batchnorm.h's exchange on the DDP communicator's NCCL
  // stream), world_size > 1.
  bool sync_batchnorm = false;
  // DDP's find_unused_parameters (spec ddp.find_unused_parameters;
  // cuda/gpu_ddp.h): a forward may skip parameters (stochastic depth),
  // world_size > 1. With one rank what no forward of a step used is left
  // alone without it.
  bool find_unused_parameters = false;
  // ZeRO (spec strategy zero1, zero2, fsdp; one rank too, over NCCL as
  // with more, so that one GPU runs the sharded step): what the ranks
  // shard, and the layout of this rank's shards (a HostShards' map built
  // from the model's parameters: ForBuckets with the same bucket_mb for
  // kOptimizer, ForUnits over the model's units otherwise; not owned, read
  // by Create only). kOptimizer (ZeRO-1, cuda/gpu_ddp.h): the buckets are
  // reduce-scattered, the optimizer steps this rank's shards, the weights
  // are all-gathered after each update; not with compression.
  // kGradients (ZeRO-2), kShardGradOp, kFullShard (FSDP; cuda/gpu_fsdp.h):
  // the units' gradients are reduce-scattered as backward leaves each, and
  // ZeRO-2 keeps whole weights, FSDP only its slices, gathered unit by unit
  // as forward and backward reach them; find_unused_parameters lets a
  // forward skip units. The optimizer's state is named as the shards.
  Sharding sharding = Sharding::kNone;
  const ShardMap* shards = nullptr;
  // FSDP's mixed precision (spec fsdp.param_dtype, fsdp.reduce_dtype;
  // cuda/gpu_fsdp.h): the units' weights all-gathered, and their gradients
  // reduce-scattered, in 16 bits over fp32 shards.
  std::optional<HalfFormat> fsdp_param_half;
  std::optional<HalfFormat> fsdp_reduce_half;
};

// Whether this binary can train on a GPU: false in the library without CUDA
// (aidn_gpu_session_none), which the CPU-only worker binary links so that
// its trainers do not load cuBLAS, cuDNN and NCCL (half a gigabyte, about
// 0.2 s of every trainer's start).
bool GpuSessionAvailable();

class GpuSession {
 public:
  // Mirrors `model` (its current weights: every rank passes the same, rank
  // 0's after the broadcast) with an optimizer of `optimizer`.
  // FAILED_PRECONDITION without a usable device, UNIMPLEMENTED without CUDA
  // (or NCCL for world_size > 1), INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<GpuSession>> Create(const GpuSessionOptions& options,
                                                            const Sequential& model,
                                                            const OptimizerConfig& optimizer);
  // The same for a GPT decoder (cuda/gpu_gpt.h), whose micro-batches carry
  // tokens, targets (MicroBatch::labels) and their sequence length.
  // fp16 with dynamic loss scaling as Create's. UNIMPLEMENTED for CUDA
  // graphs and what the GPU decoder lacks (tensor or pipeline parallelism,
  // activation checkpointing).
  static absl::StatusOr<std::unique_ptr<GpuSession>> CreateForGpt(const GpuSessionOptions& options,
                                                                  const Gpt& model,
                                                                  const OptimizerConfig& optimizer);
  // A GPT pipeline stage on this rank's GPU (cuda/gpu_pipeline.h): the
  // decoder's blocks split evenly over `stages` = options.world_size ranks
  // (one replica), this rank running stage options.rank; the activations
  // and their gradients go to the neighbours over NCCL (one communicator
  // of the job, its id through options.store), wte's gradient is summed
  // over the first and last stages (an NCCL split), and clipping takes the
  // whole model's norm. Step runs the stage's schedule (GPipe or 1F1B) over
  // the micro-batches and returns the step's mean loss on every stage.
  // The session's weights and optimizer state are the stage's: the
  // parameters it does not hold are left alone by CopyParametersTo, and
  // OptimizerState names only its own. Evaluation goes through the CPU
  // copy (Evaluate answers UNIMPLEMENTED). INVALID_ARGUMENT for stages that
  // do not divide n_layer, a world size other than `stages`, fp16, CUDA
  // graphs or ZeRO; UNIMPLEMENTED without CUDA or NCCL.
  static absl::StatusOr<std::unique_ptr<GpuSession>> CreateForGptStage(
      const GpuSessionOptions& options, const Gpt& model, int stages, bool gpipe,
      const OptimizerConfig& optimizer);
  virtual ~GpuSession() = default;

  // As Sequential::SetSeed (dropout).
  virtual void SetSeed(uint64_t seed) = 0;
  // One optimizer step over micro-batches (gradient accumulation; each
  // with its dropout seed if it has one) with learning rate `lr`: per
  // micro-batch forward, loss, backward (gradients scaled by 1/k and
  // summed), then gradients averaged over the ranks, update. Returns this
  // rank's loss, the mean over its micro-batches, before the update.
  virtual absl::StatusOr<double> Step(const std::vector<MicroBatch>& micro, double lr) = 0;
  // One batch (images [N, C, H, W], labels [N]), with the current seed.
  absl::StatusOr<double> Step(const Tensor& images, const std::vector<int32_t>& labels, double lr) {
    return Step({MicroBatch{&images, &labels, std::nullopt}}, lr);
  }
  // Seconds the NCCL stream spent from the first bucket's allreduce to the
  // last's end in the last Step, overlapped with backward (0 with one rank).
  virtual double last_allreduce_seconds() const = 0;
  // The part of it that backward did not hide (the step waited for it).
  virtual double last_allreduce_wait_seconds() const = 0;
  // Bytes the last Step handed NCCL per rank for its gradients, and what
  // uncompressed float buckets would have taken (0 with one rank).
  virtual int64_t last_bytes_sent() const = 0;
  virtual int64_t last_bytes_uncompressed() const = 0;
  // fp16: whether the last Step skipped its update (its gradients
  // overflowed).
  virtual bool last_step_skipped() const = 0;
  // fp16: the loss scaler's state (the scale the next Step uses), which a
  // checkpoint keeps (nullopt in fp32 / bf16), and a resume's restoring of
  // it: FAILED_PRECONDITION in fp32 / bf16, INVALID_ARGUMENT for a bad
  // state (nothing changes then).
  virtual std::optional<LossScaleState> loss_scale_state() const = 0;
  virtual absl::Status RestoreLossScale(const LossScaleState& state) = 0;
  // Collectives completed (the progress beat's collective_seq).
  virtual int64_t collective_sequence() const = 0;

  // One evaluation batch on the device's current weights, in eval mode (no
  // dropout, BatchNorm's running statistics): images and labels, or a
  // GPT's tokens, targets (labels) and sequence length. The batch's mean
  // loss and how many predictions were right (the first largest logit at
  // the label; per token for a GPT), as the CPU's evaluation counts them:
  // the trainer evaluates without copying the weights to the CPU.
  // INVALID_ARGUMENT for a bad batch.
  struct EvalResult {
    double mean_loss = 0;
    int64_t correct = 0;
  };
  virtual absl::StatusOr<EvalResult> Evaluate(const MicroBatch& batch) = 0;

  // The device's weights into CPU parameters of the same model (checkpoints,
  // exports). ZeRO-2 and FSDP: a collective (every rank calls it at the
  // same point), which gathers every unit for the copy.
  virtual absl::Status CopyParametersTo(const std::vector<Parameter*>& cpu) = 0;
  // ZeRO: this rank's shards' weights into the host's (HostShards::map()'s
  // shards(), the layout the session was made with), no collective.
  // FAILED_PRECONDITION without sharding, INVALID_ARGUMENT for other shards.
  virtual absl::Status CopyShardsTo(const std::vector<Parameter*>& shards) = 0;
  // ZeRO-2 and FSDP: every unit's whole, current weights on the device
  // until ReleaseFullParameters (evaluation runs on them with no
  // collective per batch). A collective: every rank calls both at the same
  // points. OK at once for other strategies.
  virtual absl::Status GatherFullParameters() = 0;
  virtual void ReleaseFullParameters() = 0;
  // The same for the model's buffers (Sequential::Buffers(): running
  // statistics; none for a GPT).
  virtual absl::Status CopyBuffersTo(const std::vector<Parameter*>& cpu) = 0;
  // Optimizer state, named as Optimizer::State() names it, and its steps.
  virtual absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> OptimizerState() = 0;
  virtual int64_t optimizer_steps() const = 0;
  // A resume: state as Optimizer::State() lists it, and the steps taken.
  virtual absl::Status LoadOptimizerState(
      const std::vector<std::pair<std::string, const Tensor*>>& state, int64_t steps) = 0;

  // Bytes of model state on the device, as the CPU session counts them:
  // the weights (ZeRO-1: its buckets' buffers; ZeRO-2: whole units; FSDP:
  // the slices), the gradients (DDP's buckets, padding included; ZeRO-2
  // and FSDP: the shards), the optimizer state and the buffers (running
  // statistics, and ZeRO-2's and FSDP's pool buffers for gathered weights
  // and unit gradients at their most).
  struct StateMemory {
    int64_t parameters = 0;
    int64_t gradients = 0;
    int64_t optimizer_state = 0;
    int64_t buffers = 0;
  };
  virtual StateMemory memory() const = 0;
  // The most device memory the session's allocator has held so far.
  virtual int64_t device_peak_bytes() const = 0;
  // "NVIDIA H100 80GB HBM3 (device 0), NCCL 2 ranks" for the trainer's log.
  virtual std::string Describe() const = 0;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_GPU_SESSION_H_
