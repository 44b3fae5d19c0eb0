#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_PIPELINE_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_PIPELINE_H_

// One rank's training step as a stage of a GPT pipeline on GPUs: the CPU
// PipelineSession's semantics (pipeline_session.h) for a GpuGpt stage
// (GpuGpt::SetStage), its transfers over device links (DeviceLink, in
// stream_collectives.h; NCCL's in nccl_steps.h) queued on the compute
// stream. A Step takes the replica's m micro-batches (every stage gets the
// same ones: the first reads their tokens, the last their targets) and
// runs pipeline_schedule.h's actions for this stage:
//
//   zero grad ; the schedule's forwards, backwards and transfers ;
//   the tied wte's gradient summed over the first and last stages ;
//   update (clipping by the whole model's norm, wte counted once)
//
// The arithmetic is a one-rank step's with m micro-batches of gradient
// accumulation: each micro-batch's loss gradient scaled by 1/m, the
// gradients adding up in micro-batch order, one optimizer step after the
// flush.
//
// Stochastic depth: a stage's blocks skip as the whole decoder's do (each
// stage draws the whole model's draws). Dropout masks are keyed by block,
// so they are the whole decoder's too.
//
// Activations: the GPU decoder holds one micro-batch's at a time, so a
// stage keeps every micro-batch's input from its forward to its backward
// and runs the forward again, from the same dropout seed (so the same
// masks and stochastic depth draws), just before a backward whose
// activations another forward replaced (GPipe's re-materialisation; the
// last stage's backwards under 1F1B follow their own forwards and need
// none).
//
// Data parallelism over replicas of the pipeline is not here yet (a GPU
// pipeline job runs one replica: GpuSession::CreateForGptStage).
//
// Not thread-safe: one session per training thread. The model, context,
// links and collectives are borrowed and must outlive the session; every
// stage calls Step with the same micro-batches.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/cuda/allocator.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/cuda/gpu_gpt.h"
#include "worker/engine/cuda/gpu_optimizer.h"
#include "worker/engine/cuda/gpu_tensor.h"
#include "worker/engine/cuda/stream_collectives.h"
#include "worker/engine/data.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/pipeline_schedule.h"

namespace aidn::engine::cuda {

struct GpuPipelineOptions {
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  // This stage, of `stages`.
  int stage = 0;
  int stages = 1;
  // To the previous and the next stage; null at the ends.
  DeviceLink* prev = nullptr;
  DeviceLink* next = nullptr;
  // Every stage, in stage order (the loss, the clipping norm); null with
  // one stage.
  StreamCollectives* pipeline = nullptr;
  // The first and the last stage (wte's two copies); null with one stage
  // and on the middle ones.
  StreamCollectives* tied = nullptr;
};

class GpuPipelineSession {
 public:
  // `model` set up as stage options.stage of options.stages (SetStage: a
  // whole model for one stage). INVALID_ARGUMENT for a model that is not
  // that stage, a missing link or group the stage needs, or a bad
  // optimizer config.
  static absl::StatusOr<std::unique_ptr<GpuPipelineSession>> Create(
      GpuContext* ctx, GpuGpt* model, const OptimizerConfig& config,
      const GpuPipelineOptions& options);
  ~GpuPipelineSession();
  GpuPipelineSession(const GpuPipelineSession&) = delete;
  GpuPipelineSession& operator=(const GpuPipelineSession&) = delete;

  // One optimizer step over the m = micro.size() micro-batches (tokens,
  // targets in labels, seq_len; each with its dropout seed, or the
  // micro-batch's index) with learning rate `lr`; returns the step's mean
  // loss (the last stage's, the same on every stage). INVALID_ARGUMENT for
  // micro-batches of different sizes or without tokens and targets; a
  // failed transfer or collective comes back naming it, and the step is
  // then not to be repeated.
  absl::StatusOr<double> Step(const std::vector<MicroBatch>& micro, double lr);

  struct Stats {
    // Forwards run again before their backward, and the most micro-batches
    // in flight at once (forward run, backward not).
    int recomputed = 0;
    int peak_in_flight = 0;
  };
  const Stats& last_stats() const { return stats_; }
  GpuOptimizer& optimizer() { return *optimizer_; }

 private:
  GpuPipelineSession(GpuContext* ctx, GpuGpt* model, const GpuPipelineOptions& options)
      : ctx_(ctx), model_(model), options_(options) {}
  bool first() const { return options_.stage == 0; }
  bool last() const { return options_.stage == options_.stages - 1; }
  // Micro-batch mb's forward (its seed set first); the last stage's loss
  // into its slot.
  absl::Status Forward(const std::vector<MicroBatch>& micro, int mb);
  absl::Status RunSchedule(const std::vector<MicroBatch>& micro);
  // Action `a`'s transfer over `link`: one micro-batch's activation or
  // gradient from `send` and into `recv` (either null: that direction
  // left out); an error names the action.
  absl::Status Transfer(const PipelineAction& a, DeviceLink* link, const float* send, float* recv);
  // The step's mean loss from the last stage, to every stage.
  absl::StatusOr<double> MeanLoss(int micro_batches);
  // The host's wait for the stream's work so far: bounded by the pipeline
  // group's wait with more than one stage.
  absl::Status WaitForStream(const char* what);

  GpuContext* ctx_;
  GpuGpt* model_;
  const GpuPipelineOptions options_;
  std::unique_ptr<GpuOptimizer> optimizer_;
  std::vector<GpuParameter*> params_;  // the stage's
  GpuParameter* wte_ = nullptr;        // the tied copy (first and last stage)
  Stats stats_;
  int64_t floats_ = 0;  // one micro-batch's activation, [N, C]
  // Per micro-batch: the input received (kept until its backward).
  std::vector<GpuTensor> inputs_;
  GpuTensor grad_output_;
  GpuTensor grad_input_;
  // The micro-batches' losses (device doubles), and the mean's float.
  DeviceBuffer losses_;
  DeviceBuffer mean_;
  int slots_ = 0;
  cudaEvent_t done_ = nullptr;  // WaitForStream's
  // The micro-batch whose activations the model holds (-1: none).
  int resident_ = -1;
  // Which stage parameters some forward of the step used.
  std::vector<bool> used_;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_PIPELINE_H_
