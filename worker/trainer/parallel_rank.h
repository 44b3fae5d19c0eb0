#ifndef AIDN_WORKER_TRAINER_PARALLEL_RANK_H_
#define AIDN_WORKER_TRAINER_PARALLEL_RANK_H_

// One rank of a model-parallel job (spec.parallel: tensor or pipeline
// above 1): its place on the data x tensor x pipeline grid, its
// part of the task's model, the grid's communicators and the PipelineSession
// or CpuSession stepping it. RankTraining holds one instead of a CpuSession
// for such a job:
//
//   model     a GPT split over the tensor group (Gpt::SetTensorParallel),
//             then, with several stages, cut into this rank's stage (a
//             PipelineSession steps it; else a CpuSession, DDP over the
//             replicas).
//   data      the rank reads the samples of its data-parallel replica
//             (DistributedSampler over the replicas), as every rank of the
//             replica does; the first stage uses their inputs, the last
//             their labels.
//   step      batch_size x grad_accum_steps samples, with a pipeline cut
//             into micro-batches of batch_size / parallel.micro_batches;
//             one optimizer step after them all. Clipping takes the norm of
//             the whole model's gradient (split parameters summed over the
//             tensor group, whole ones once, every stage's).
//   evaluate  a pipeline's stages' weights and buffers gathered on each of
//             its ranks (WholeModel); each tensor group evaluates a share of
//             the set.
//   checkpoint  the ranks of the first replica write the pieces they own:
//             their stage's parameters, buffers and optimizer state (the
//             tied embedding the first stage's), a tensor-parallel slice as
//             the element ranges of the whole tensor it covers, a tensor
//             every tensor rank holds whole by tensor rank 0; one sharded
//             checkpoint over the replica's group. With ZeRO-1 in the
//             stages every rank writes its shards' optimizer state too, over
//             the job's group.
//
// device: gpu (a GPT's pipeline, one replica, no tensor parallelism): the
// stage steps on this rank's GPU (GpuSession::CreateForGptStage, over
// NCCL); the CPU stage and its optimizer stay as the copies that
// evaluation, checkpoints and resumes use, SyncFromGpu bringing them up to
// date.
//
// Not thread-safe: used on the trainer's main thread.

#include <deque>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "aidn/v1/job.pb.h"
#include "worker/engine/comm/cpu_communicator.h"
#include "worker/engine/comm/grid_communicators.h"
#include "worker/engine/comm/kv_store.h"
#include "worker/engine/comm/process_grid.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/gpu_session.h"
#include "worker/engine/pipeline_session.h"
#include "worker/engine/pipeline_stage.h"
#include "worker/engine/shard_map.h"
#include "worker/trainer/checkpoint_loader.h"
#include "worker/trainer/training_task.h"

namespace aidn::trainer {

class ParallelRank {
 public:
  // Builds the grid's communicators (options: this rank in the job, its
  // transport; they meet through `store`), splits and cuts the task's model
  // (whose weights must already be the job's: fresh or resumed, equal on
  // every rank) and the session. Errors: INVALID_ARGUMENT for a spec the
  // model cannot take (permanent), the communicators' otherwise.
  static absl::StatusOr<std::unique_ptr<ParallelRank>> Create(
      const v1::JobSpec& spec, const engine::CpuCommunicatorOptions& options,
      engine::KeyValueStore* store, TrainingTask* task);

  // This rank's replica and the number of replicas (the sampler's rank and
  // world size), its stage and its rank in its tensor group.
  int replica() const { return coords_.data; }
  int replicas() const { return grid_.shape().data; }
  int stage() const { return coords_.pipeline; }
  int tensor_rank() const { return coords_.tensor; }
  // Whether this rank's records count the replica's samples: one rank a
  // replica (its last stage's first tensor rank).
  bool counts_samples() const;
  // Micro-batches per batch_size (1 without a pipeline).
  int micro_batches() const { return micro_batches_; }

  absl::StatusOr<double> Step(const std::vector<engine::MicroBatch>& micro, double lr);
  // device: gpu: the stage's weights (and with `optimizer_state` its
  // optimizer's state and steps) from the GPU into the CPU copies: both
  // before a checkpoint, the weights before an evaluation. OK at once on
  // CPUs.
  absl::Status SyncFromGpu(bool optimizer_state);
  // device: gpu: the stage's GPU session (its figures); null on CPUs.
  const engine::GpuSession* gpu() const { return gpu_.get(); }
  // What the last Step spent in DDP's and the tied gradient's collectives,
  // and waiting (those, and a pipeline's transfers).
  double allreduce_seconds() const;
  double wait_seconds() const;
  engine::Optimizer& optimizer();
  engine::CpuSession::Memory memory() const;

  // The whole model's current weights (this rank's tensor slices of it) in
  // the task's model on every rank of this pipeline, until
  // ReleaseWholeModel (a collective over the pipeline group; nothing
  // without one).
  absl::Status GatherWholeModel();
  void ReleaseWholeModel();
  // The share of an evaluation this rank takes: a tensor group's ranks take
  // the same one (their forward is one).
  int eval_rank() const;
  int eval_world() const;

  // ZeRO-1 over the replicas (strategy: zero1 with several of them): each
  // replica's optimizer holds its shards of its stage's (or tensor rank's)
  // state; the map of them, or null.
  bool sharded() const;
  const engine::ShardMap* shard_map() const;
  // Checkpoints: whether this rank writes (the first replica's ranks;
  // sharded, every rank: its shards' state), the communicator the writers
  // meet on (sharded: the job's, which the caller has) and their ranks in
  // the job, and the pieces this rank writes (valid until the next call).
  bool writes_checkpoints() const { return coords_.data == 0 || sharded(); }
  engine::Communicator* writers() { return comms_.replica.get(); }
  std::vector<int> writer_ranks() const;
  struct Pieces {
    std::vector<engine::ShardMap::Piece> weights;
    std::vector<engine::ShardMap::Piece> state;
  };
  absl::StatusOr<Pieces> CheckpointPieces();
  // A resume's optimizer state, whole entries read and sliced as this rank
  // holds them.
  absl::Status LoadOptimizerState(CheckpointLoader* loader, int64_t optimizer_steps);

 private:
  explicit ParallelRank(engine::ProcessGrid grid) : grid_(std::move(grid)) {}
  // The parameters this rank holds (its stage's, or all), and the buffers.
  const std::vector<engine::Parameter*>& Mine() const;
  std::vector<engine::Parameter*> MyBuffers() const;
  // Whether this rank writes `p`: not the tied parameter on the last stage
  // (the first stage writes it), a whole one on tensor rank 0 only.
  bool Writes(const engine::Parameter& p) const;
  std::optional<engine::Gpt::Split> SplitOf(const engine::Parameter& p) const;
  // Sharded: the pieces of `state`'s shard entries (not the tied
  // parameter's, which is whole) as elements of the whole tensors, views
  // into the entries; those of a parameter every tensor rank holds whole
  // only on tensor rank 0 unless `reading`.
  absl::StatusOr<std::vector<engine::ShardMap::Piece>> ShardedStatePieces(
      const std::vector<engine::Optimizer::StateEntry>& state, bool reading);
  absl::Status LoadShardedOptimizerState(CheckpointLoader* loader, int64_t optimizer_steps);
  void LogSharding() const;
  // Where this rank's part of `p` lies in the whole tensor: runs of
  // `length` elements from `local` in the part and `whole` in the whole,
  // in the part's order (one run for a parameter not split).
  struct Run {
    int64_t local, whole, length;
  };
  std::vector<Run> RunsOf(const engine::Parameter& p) const;
  // `tensor` (this rank's part of `whole`, shaped as p) as pieces of the
  // whole tensor; or elements [begin, end) of the part, at `data`.
  void AddPieces(const std::string& whole, const engine::Parameter& p, const engine::Tensor& tensor,
                 std::vector<engine::ShardMap::Piece>* out);
  void AddPieces(const std::string& whole, const engine::Parameter& p, const float* data,
                 int64_t begin, int64_t end, std::vector<engine::ShardMap::Piece>* out);

  engine::ProcessGrid grid_;
  engine::GridCoords coords_;
  int micro_batches_ = 1;
  TrainingTask* task_ = nullptr;
  engine::GridCommunicators comms_;
  // A pipeline's stage and session, or (one stage) the CpuSession.
  std::unique_ptr<engine::PipelineStageModel> stage_;
  std::unique_ptr<engine::PipelineSession> pipeline_;
  std::unique_ptr<engine::CpuSession> cpu_;
  // device: gpu: the stage on the GPU, which Step runs.
  std::unique_ptr<engine::GpuSession> gpu_;
  // CheckpointPieces' views into the weights and the optimizer state.
  std::deque<engine::Tensor> views_;
};

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_PARALLEL_RANK_H_
