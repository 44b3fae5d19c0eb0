#ifndef AIDN_WORKER_TRAINER_PIPELINE_RANK_H_
#define AIDN_WORKER_TRAINER_PIPELINE_RANK_H_

// One rank of a pipeline-parallel job (spec.parallel.pipeline > 1, device
// cpu): its place on the data x pipeline grid, its stage of the task's
// model, the grid's communicators and the PipelineSession that steps it.
// RankTraining holds one instead of a CpuSession for such a job:
//
//   data      the rank reads the samples of its data-parallel replica
//             (DistributedSampler over the replicas), as every stage of the
//             replica does; the first stage uses their inputs, the last
//             their labels.
//   step      batch_size x grad_accum_steps samples cut into
//             micro-batches of batch_size / parallel.micro_batches, one
//             optimizer step after them all.
//   evaluate  the whole model's current weights on every rank of a
//             pipeline for the evaluation (WholeModel), each rank taking
//             its share of the evaluation set as under DDP.
//   checkpoint  the ranks of the first replica write the pieces they own
//             (their stage's parameters and optimizer state; the tied
//             embedding the first stage), one sharded checkpoint over the
//             replica's pipeline group.
//
// Not thread-safe: used on the trainer's main thread.

#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "aidn/v1/job.pb.h"
#include "worker/engine/comm/cpu_communicator.h"
#include "worker/engine/comm/grid_communicators.h"
#include "worker/engine/comm/kv_store.h"
#include "worker/engine/comm/process_grid.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/pipeline_session.h"
#include "worker/engine/pipeline_stage.h"
#include "worker/engine/shard_map.h"
#include "worker/trainer/training_task.h"

namespace aidn::trainer {

class PipelineRank {
 public:
  // Builds the grid's communicators (options: this rank in the job, its
  // transport; they meet through `store`), the stage of task's model (whose
  // weights must already be the job's: fresh or resumed, equal on every
  // rank) and the session. Errors: INVALID_ARGUMENT for a spec the
  // pipeline cannot take (permanent), the communicators' otherwise.
  static absl::StatusOr<std::unique_ptr<PipelineRank>> Create(
      const v1::JobSpec& spec, const engine::CpuCommunicatorOptions& options,
      engine::KeyValueStore* store, TrainingTask* task);

  // This rank's replica and the number of replicas (the sampler's rank and
  // world size), and its stage.
  int replica() const { return coords_.data; }
  int replicas() const { return grid_.shape().data; }
  int stage() const { return coords_.pipeline; }
  bool last_stage() const { return stage_->last(); }
  // Micro-batches per batch_size.
  int micro_batches() const { return micro_batches_; }

  absl::StatusOr<double> Step(const std::vector<engine::MicroBatch>& micro, double lr) {
    return session_->Step(micro, lr);
  }
  const engine::PipelineSession::Stats& last_stats() const { return session_->last_stats(); }
  engine::Optimizer& optimizer() { return session_->optimizer(); }
  engine::CpuSession::Memory memory() const;

  // The whole model's current weights in the task's model on every rank
  // of this pipeline, until ReleaseWholeModel (a collective over the
  // pipeline group).
  absl::Status GatherWholeModel();
  void ReleaseWholeModel() { stage_->Narrow(); }

  // Checkpoints: whether this rank writes (the first replica's ranks), the
  // communicator the writers meet on and their ranks in the job, and the
  // pieces this rank writes.
  bool writes_checkpoints() const { return coords_.data == 0; }
  engine::Communicator* writers() { return comms_.pipeline.get(); }
  std::vector<int> writer_ranks() const;
  std::vector<engine::ShardMap::Piece> WeightPieces() const;
  std::vector<engine::ShardMap::Piece> StatePieces() const;
  // Every entry of this stage's optimizer state, the tied parameter's too
  // (a resume reads them all).
  std::vector<engine::ShardMap::Piece> AllStatePieces() const;

 private:
  explicit PipelineRank(engine::ProcessGrid grid) : grid_(std::move(grid)) {}
  // Whether this rank writes `name`'s piece: not the tied parameter's on
  // the last stage (the first stage writes it).
  bool Owns(const std::string& name) const;

  engine::ProcessGrid grid_;
  engine::GridCoords coords_;
  int micro_batches_ = 1;
  TrainingTask* task_ = nullptr;
  engine::GridCommunicators comms_;
  std::unique_ptr<engine::PipelineStageModel> stage_;
  std::unique_ptr<engine::PipelineSession> session_;
};

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_PIPELINE_RANK_H_
