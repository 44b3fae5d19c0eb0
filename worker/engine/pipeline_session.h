#ifndef AIDN_WORKER_ENGINE_PIPELINE_SESSION_H_
#define AIDN_WORKER_ENGINE_PIPELINE_SESSION_H_

// One rank's training step as a stage of a pipeline (synchronous pipeline
// parallelism, GPipe and 1F1B: pipeline_schedule.h), the counterpart of
// CpuSession for a model cut into stages (pipeline_stage.h). A Step takes
// the replica's m micro-batches (every stage gets the same ones: the first
// reads their input, the last their labels) and runs the stage's schedule:
//
//   zero grad ; the schedule's forwards, backwards and transfers ;
//   DDP over the replicas ; tied gradient summed ; update
//
// The arithmetic is a one-rank step's with m micro-batches of gradient
// accumulation: each micro-batch's loss is scaled by 1/m, the gradients
// add up in micro-batch order, and one optimizer step follows the flush.
//
// Activations: a stage keeps those of every micro-batch in flight, from its
// forward to its backward: GPipe holds m micro-batches' at once, 1F1B at
// most P - s on stage s (with the model's activation checkpointing, a GPT
// block keeps only its input). A model that cannot set its activations
// aside (a Sequential) keeps only each micro-batch's input instead and
// runs the forward again, with the same dropout seed, just before the
// backward (GPipe's re-materialisation); a backward that directly follows
// its own forward (the last stage's under 1F1B) needs no second forward.
// The second forward leaves BatchNorm's running statistics alone, so each
// micro-batch updates them once, in micro-batch order, as the one-rank
// run's accumulation does (its batch statistics are the micro-batch's, as
// they are there).
//
// With data parallelism (D replicas of the pipeline) each stage's gradients
// are averaged over its replicas in DDP buckets during the last backward
// (ddp.h), or with shard_optimizer reduce-scattered to the rank that owns
// their slice (ZeRO-1 within the stage). The loss returned is the step's mean over micro-batches
// and replicas, the same on every rank; clipping takes the norm of the whole model's gradient (the
// tied parameter counted once).
//
// Not thread-safe: one session per training thread. The stage model and the
// communicators are borrowed and must outlive the session; every rank of a
// group calls Step in the same order (the communicators' contract).

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/comm/peer_link.h"
#include "worker/engine/data.h"
#include "worker/engine/ddp.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/pipeline_schedule.h"
#include "worker/engine/pipeline_stage.h"

namespace aidn::engine {

struct PipelineSessionOptions {
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  // To the previous and the next stage (not owned); null at the ends.
  PeerLink* prev = nullptr;
  PeerLink* next = nullptr;
  // Every stage of this replica, in stage order (the loss, the clipping
  // norm); null with one stage.
  Communicator* pipeline = nullptr;
  // This stage's replicas (DDP); null or one rank: no averaging.
  Communicator* data = nullptr;
  // The first and the last stage (the tied parameter's two copies); null
  // unless the model has one and there are several stages.
  Communicator* tied = nullptr;
  // DDP gradient bucket size in MB.
  double bucket_mb = 25.0;
  // ZeRO-1 over the replicas (`data` of more than one rank): the buckets'
  // gradients reduce-scattered instead of allreduced, the optimizer
  // stepping this rank's shards of the stage's parameters (its state a
  // 1/D share), the updated weights all-gathered after the step (ddp.h's
  // shard_optimizer). A parameter tied across the two ends stays whole:
  // its gradient is averaged over the replicas on its own, then summed over
  // the ends, and every replica steps it.
  bool shard_optimizer = false;
  // With tensor parallelism inside the stage: the tensor group, and the
  // stage's parameters each of its ranks holds whole. Clipping sums the
  // others' squares over the group and counts these once
  // (TensorParallelSumOfSquares; under shard_optimizer, ShardedSumOfSquares).
  // Null: no tensor group.
  Communicator* tensor = nullptr;
  std::vector<const Parameter*> tensor_whole;
  // With replicas: the first replica's buffers (BatchNorm's running
  // statistics) copied to the others' before the step's first forward, as
  // CpuSessionOptions::broadcast_buffers.
  bool broadcast_buffers = true;
};

class PipelineSession {
 public:
  // INVALID_ARGUMENT for a missing link, pipeline or tied group the stage
  // needs, or a bad optimizer config or bucket size. No collective runs
  // here: the weights must already be equal on the replicas.
  static absl::StatusOr<std::unique_ptr<PipelineSession>> Create(
      const PipelineSessionOptions& options, PipelineStageModel* model,
      const OptimizerConfig& config);
  ~PipelineSession();
  PipelineSession(const PipelineSession&) = delete;
  PipelineSession& operator=(const PipelineSession&) = delete;

  // One optimizer step over the m = micro.size() micro-batches (each with
  // its dropout seed) with learning rate `lr`; returns the mean loss. A
  // failed transfer or collective comes back naming what failed; the step
  // is then not to be repeated.
  absl::StatusOr<double> Step(const std::vector<MicroBatch>& micro, double lr);

  // What the last Step measured on this stage.
  struct Stats {
    // Wall time of the step, and the parts spent in forward and backward
    // (recomputation included) and waiting in transfers to the neighbours.
    double step_seconds = 0;
    double compute_seconds = 0;
    double transfer_seconds = 0;
    // DDP over the replicas and the tied gradient's sum.
    double allreduce_seconds = 0;
    // The most micro-batches in flight at once (forward run, backward
    // not), and the most bytes of their activations (or inputs) kept.
    int peak_in_flight = 0;
    int64_t peak_kept_bytes = 0;
    // Forwards run again before their backward.
    int recomputed = 0;
  };
  const Stats& last_stats() const { return stats_; }

  PipelineStageModel& model() { return *model_; }
  Optimizer& optimizer() { return *optimizer_; }
  // shard_optimizer over several replicas: where this rank's shards lie
  // (the optimizer steps them and the tied parameter, if any); null
  // otherwise.
  const ShardMap* shard_map() const {
    return reducer_ != nullptr ? reducer_->shard_map() : nullptr;
  }

 private:
  PipelineSession(const PipelineSessionOptions& options, PipelineStageModel* model)
      : options_(options), model_(model) {}
  // Runs the stage's actions for `micro`; the summed scaled loss (last
  // stage) into *loss.
  absl::Status RunSchedule(const std::vector<MicroBatch>& micro, double* loss);
  absl::Status Finish(double* loss);

  const PipelineSessionOptions options_;
  PipelineStageModel* model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<DdpReducer> reducer_;
  Stats stats_;
  // Per micro-batch: the input received (kept until its backward).
  std::vector<Tensor> inputs_;
  Tensor output_;
  Tensor grad_output_;
  Tensor grad_input_;
  // The micro-batch whose activations the model holds (-1: none).
  int resident_ = -1;
  // Per micro-batch: its activations are kept by the model (Keep).
  std::vector<bool> kept_;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_PIPELINE_SESSION_H_
