#ifndef AIDN_WORKER_TRAINER_RANK_TRAINING_H_
#define AIDN_WORKER_TRAINER_RANK_TRAINING_H_

// One rank's training, from the rendezvous to the last step: joins the
// generation's rendezvous, builds the communicator (Gloo or shared memory
// over the coordinator's KV store), loads the data, resumes from the newest
// checkpoint that verifies, then steps (engine::CpuSession or
// engine::GpuSession), reports each step (reporter.h), evaluates after each
// epoch and writes checkpoints.
//
// Not thread-safe: Execute runs once, on the trainer's main thread.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/gpu_session.h"
#include "worker/engine/host_shards.h"
#include "worker/engine/loss_scale.h"
#include "worker/engine/lr_schedule.h"
#include "worker/engine/optimizer.h"
#include "worker/trainer/checkpoint_ask.h"
#include "worker/trainer/checkpoint_loader.h"
#include "worker/trainer/coordinator_store.h"
#include "worker/trainer/parallel_rank.h"
#include "worker/trainer/reporter.h"
#include "worker/trainer/stop_signal.h"
#include "worker/trainer/trainer.h"
#include "worker/trainer/training_task.h"

namespace aidn::trainer {

// A failure that decides the exit code.
struct Failure {
  int exit_code;
  absl::Status status;
};

// FAILED_PRECONDITION (the coordinator fenced this generation off) is
// kExitSuperseded, anything else kExitFailure; `what` prefixes the message.
Failure FailureFor(const absl::Status& status, const char* what);

class RankTraining {
 public:
  // `stop` (not owned; may be null) is asked at every step boundary.
  RankTraining(const TrainerOptions& options, std::shared_ptr<grpc::Channel> channel,
               StopSignal* stop);
  ~RankTraining();

  // Trains to the end: nullopt on success, else the failure. A stop
  // request ends it at a step boundary with a CANCELLED failure.
  std::optional<Failure> Execute();

 private:
  // The job's length, fixed by the spec and this rank's share of the data.
  struct Plan {
    int64_t batch = 0;
    // Tokens per item (language models; 0 otherwise).
    int64_t tokens_per_item = 0;
    int64_t accum = 1;
    int64_t steps_per_epoch = 0;
    int64_t total_steps = 0;
    int64_t log_every = 1;
  };
  // What one step measured.
  struct StepResult {
    double loss = 0;
    double lr = 0;
    double seconds = 0;
    double allreduce_seconds = 0;
    double wait_seconds = 0;
    // DDP on cpu: the gradient collectives' payload bytes, and without
    // compression.
    int64_t comm_bytes = 0;
    int64_t comm_bytes_uncompressed = 0;
  };

  std::optional<Failure> Setup();
  std::optional<Failure> PrepareCheckpointDir();
  std::optional<Failure> Connect();
  // The newest resume candidate that verifies, into the model (rank 0's,
  // or every rank's under ZeRO and FSDP), reporting each one that does not.
  std::optional<Failure> LoadNewestCheckpoint();
  std::optional<Failure> BuildSession();
  // ddp.sync_batchnorm on CPU: a communicator of its own for the statistics.
  std::optional<Failure> SetupSyncBatchNorm();
  void ReportInvalid(const v1::Checkpoint& checkpoint, const std::string& path,
                     const absl::Status& why);
  absl::StatusOr<Plan> MakePlan(const engine::DistributedSampler& sampler) const;
  // Every rank gets rank 0's resumed step, and the optimizer state it
  // holds: rank 0's whole one (DDP), or its own pieces read from the
  // checkpoint (ZeRO, FSDP).
  std::optional<Failure> Resume(int64_t steps_per_epoch);
  std::optional<Failure> ResumeOptimizerState(int64_t optimizer_steps);
  bool Sharded() const;
  // A GPU job's ZeRO or FSDP (gpu_shards_; one rank too, as on the CPU):
  // sharded checkpoints, every rank reading and writing its own pieces.
  bool GpuSharded() const;
  bool ModelParallel() const {
    return spec_.parallel().pipeline() > 1 || spec_.parallel().tensor() > 1;
  }
  // The sampler's rank and world size: this rank's data-parallel replica
  // and their number (the rank and world size without model parallelism).
  int DataRank() const { return parallel_ ? parallel_->replica() : rendezvous_.rank(); }
  int DataWorld() const { return parallel_ ? parallel_->replicas() : rendezvous_.world_size(); }
  // device: gpu: mirrors the CPU model (weights after the broadcast or the
  // resume) and the resumed optimizer state onto the GPU.
  std::optional<Failure> SetupGpu();
  // device: gpu: the GPU's weights (and optimizer state) into the CPU copies.
  std::optional<Failure> SyncFromGpu(bool optimizer_state);

  // Step `step`'s micro-batches (the same on either device) and its update.
  absl::StatusOr<StepResult> RunStep(const Plan& plan, int64_t step,
                                     const std::vector<int64_t>& indices);
  // The step's metric record, progress beat and (rank 0) log line.
  void ReportStep(const Plan& plan, int64_t step, int32_t epoch, const StepResult& result);
  // Evaluation after an epoch (or the last step), checkpoint when due.
  std::optional<Failure> AfterStep(const Plan& plan, int64_t step, int32_t epoch);
  std::optional<Failure> Evaluate(int32_t epoch, int64_t step);
  // Whether an evaluation is due after `step` (counted from 0).
  bool EvaluationDue(const Plan& plan, int64_t step) const;
  // The state after `step`: rank 0's whole (DDP), or every rank's shard
  // (ZeRO, FSDP); committed in the background.
  std::optional<Failure> Checkpoint(int64_t step, int64_t steps_per_epoch, int64_t total_steps);
  // Collectives completed, CPU and GPU ones together.
  int64_t CollectiveSequence() const {
    const engine::GpuSession* gpu = parallel_ != nullptr ? parallel_->gpu() : gpu_.get();
    return comm_->sequence() + (gpu != nullptr ? gpu->collective_sequence() : 0) +
           (bn_comm_ != nullptr ? bn_comm_->sequence() : 0);
  }

  const TrainerOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::ClusterService::Stub> stub_;
  StopSignal* const stop_;
  v1::JoinRendezvousResponse rendezvous_;
  v1::JobSpec spec_;
  // The model and its data.
  std::unique_ptr<TrainingTask> task_;
  std::unique_ptr<engine::Communicator> comm_;
  // ddp.sync_batchnorm: the BatchNorm layers' own.
  std::unique_ptr<engine::Communicator> bn_comm_;
  // The optimizer: owned here (DDP; a GPU job's ZeRO or FSDP, over
  // gpu_shards_'s shards), or the CPU session's (ZeRO, FSDP: over this
  // rank's shards).
  std::unique_ptr<engine::Optimizer> owned_optimizer_;
  engine::Optimizer* optimizer_ = nullptr;
  // device: cpu: the step runs here, over model_ and optimizer_.
  std::unique_ptr<engine::CpuSession> cpu_;
  // Model parallelism (parallel.tensor or parallel.pipeline > 1): the step
  // runs here instead, over this rank's part of the model.
  std::unique_ptr<ParallelRank> parallel_;
  // How Connect made the communicator (a pipeline's groups are made alike).
  engine::CpuCommunicatorOptions comm_options_;
  // Shared with the stop signal's flush.
  std::shared_ptr<Reporter> reporter_;
  // Checkpoints the coordinator asks for (a pause).
  std::optional<CheckpointAskFollower> asks_;
  std::shared_ptr<CoordinatorStore> kv_;
  // device: gpu: the step runs here; task_'s model and optimizer_ stay the CPU
  // copies that checkpoints, resumes and evaluation use (SyncFromGpu).
  std::unique_ptr<engine::GpuSession> gpu_;
  // device: gpu with strategy zero1, zero2 or fsdp: the shards' layout the GPU reducer follows, and
  // their weights on the host; optimizer_ is over its shards (the GPU optimizer's state comes back
  // into it by name), so checkpoints are sharded as a CPU job's.
  std::unique_ptr<engine::HostShards> gpu_shards_;
  std::string checkpoint_dir_;
  // The step training starts after: 0, or the resumed checkpoint's.
  int64_t start_step_ = 0;
  // The checkpoint Setup loaded the weights from, until Resume has the
  // optimizer state from it.
  std::unique_ptr<CheckpointLoader> loader_;
  // fp16: the resumed checkpoint's loss scaler, for SetupGpu.
  std::optional<engine::LossScaleState> resumed_loss_scale_;
  engine::LrScheduleConfig schedule_;
  // The session's model-state bytes, reported with every step.
  engine::CpuSession::Memory memory_;
};

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_RANK_TRAINING_H_
