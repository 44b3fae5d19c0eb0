#include "worker/trainer/rank_training.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/digest.h"
#include "common/log.h"
#include "common/rpc/client.h"
#include "common/rpc/retry.h"
#include "common/status.h"
#include "worker/trainer/checkpoint_loader.h"
#include "worker/trainer/engine_config.h"
#include "worker/trainer/training_state.h"

// RankTraining's checkpoints: finding and loading the newest, resuming the
// training state and optimizer state from it, and writing new ones.

namespace aidn::trainer {
namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kRpcTimeout{10'000};

// int64 values through a float collective: the bits travel unchanged
// (broadcast copies, it never adds).
absl::Status BroadcastInts(engine::Communicator* comm, int64_t* values, size_t count) {
  std::vector<float> buffer(count * 2);
  std::memcpy(buffer.data(), values, count * sizeof(int64_t));
  AIDN_RETURN_IF_ERROR(comm->Broadcast(buffer.data(), buffer.size(), 0));
  std::memcpy(values, buffer.data(), count * sizeof(int64_t));
  return absl::OkStatus();
}

}  // namespace

std::optional<Failure> RankTraining::LoadNewestCheckpoint() {
  // ZeRO, FSDP and pipelines: every rank writes and reads its own pieces.
  const bool every_rank =
      (Sharded() && (spec_.device() == v1::JobSpec::CPU || GpuSharded())) || ModelParallel();
  if (every_rank && !checkpoint_dir_.empty()) {
    if (absl::Status s = CheckSharedDirectory(
            checkpoint_dir_, absl::StrCat(options_.job_id, "-g", options_.generation), comm_.get());
        !s.ok()) {
      if (absl::IsFailedPrecondition(s)) return Failure{kExitPermanent, s};
      return FailureFor(s, "checkpoint.dir");
    }
  }
  CheckpointLoader::Options o;
  o.dir = checkpoint_dir_;
  o.job_id = options_.job_id;
  o.every_rank = every_rank;
  o.comm = comm_.get();
  o.report_invalid = [this](const v1::Checkpoint& c, const std::string& path,
                            const absl::Status& why) { ReportInvalid(c, path, why); };
  loader_ = std::make_unique<CheckpointLoader>(std::move(o));
  const std::vector<v1::Checkpoint> candidates(rendezvous_.resume_candidates().begin(),
                                               rendezvous_.resume_candidates().end());
  if (absl::Status s = loader_->LoadNewest(candidates, task_->ModelState()); !s.ok()) {
    // Another job's checkpoint the spec names that cannot be read.
    if (absl::IsFailedPrecondition(s)) return Failure{kExitPermanent, s};
    return FailureFor(s, "resume");
  }
  return std::nullopt;
}

void RankTraining::ReportInvalid(const v1::Checkpoint& checkpoint, const std::string& path,
                                 const absl::Status& why) {
  const std::string reason = absl::StrCat(path, ": ", why.message());
  AIDN_LOG(WARNING) << "skipping a checkpoint that fails verification: " << reason;
  v1::ReportCheckpointInvalidRequest request;
  request.set_job_id(options_.job_id);
  request.set_generation(options_.generation);
  request.set_rank(rendezvous_.rank());
  request.set_step(checkpoint.step());
  request.set_reason(reason);
  rpc::Backoff backoff;
  constexpr int kAttempts = 8;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    if (attempt > 0) backoff.Sleep();
    grpc::ClientContext context;
    rpc::PrepareContext(&context, options_.token, kRpcTimeout);
    v1::ReportCheckpointInvalidResponse response;
    grpc::Status status = stub_->ReportCheckpointInvalid(&context, request, &response);
    rpc::ResetBackoffAfter(status, channel_.get());
    if (!rpc::Transient(status)) {
      if (!status.ok()) {
        AIDN_LOG(WARNING) << "could not report the bad checkpoint: " << status.error_message();
      }
      return;
    }
  }
  AIDN_LOG(WARNING) << "gave up reporting the bad checkpoint: the coordinator stayed unreachable"
                    << Kv("attempts", kAttempts);
}

std::optional<Failure> RankTraining::Resume(int64_t steps_per_epoch) {
  TrainingState::Broadcast header = TrainingState::EncodeNone();
  if (const engine::CheckpointReader* reader = loader_->reader();
      reader != nullptr && rendezvous_.rank() == 0) {
    absl::StatusOr<TrainingState> state = TrainingState::Decode(reader->state());
    if (!state.ok()) return Failure{kExitFailure, state.status()};
    // The manifest's step, which LoadNewestCheckpoint checked.
    state->step = reader->step();
    header = state->EncodeBroadcast();
  }
  if (absl::Status s = BroadcastInts(comm_.get(), header.data(), header.size()); !s.ok()) {
    return FailureFor(s, "resume");
  }
  std::optional<TrainingState> resumed = TrainingState::DecodeBroadcast(header);
  if (!resumed.has_value()) return std::nullopt;
  resumed_loss_scale_ = resumed->loss_scale;
  // Another world size (checkpoint.resume_from, whose global batch the
  // coordinator checked) reads the same samples per step: the step goes on
  // where it stopped as long as the epochs have as many steps.
  if (resumed->steps_per_epoch != steps_per_epoch) {
    return Failure{kExitPermanent, absl::FailedPreconditionError(absl::StrCat(
                                       "the checkpoint of step ", resumed->step, " was made with ",
                                       resumed->world_size, " ranks and ", resumed->steps_per_epoch,
                                       " steps per epoch; this job has ", rendezvous_.world_size(),
                                       " and ", steps_per_epoch))};
  }
  if (resumed->world_size != rendezvous_.world_size()) {
    AIDN_LOG(INFO) << "resharding a checkpoint" << Kv("written_by", resumed->world_size)
                   << Kv("world_size", rendezvous_.world_size());
  }
  if (std::optional<Failure> f = ResumeOptimizerState(resumed->optimizer_steps); f.has_value()) {
    return f;
  }
  start_step_ = resumed->step;
  loader_->Close();
  return std::nullopt;
}

std::optional<Failure> RankTraining::ResumeOptimizerState(int64_t optimizer_steps) {
  // Sharded: this rank's pieces (its shards'); otherwise the whole entries.
  if (parallel_ != nullptr) {
    if (absl::Status s = parallel_->LoadOptimizerState(loader_.get(), optimizer_steps); !s.ok()) {
      return FailureFor(s, "resume");
    }
    return std::nullopt;
  }
  std::vector<engine::ShardMap::Piece> pieces;
  if (gpu_shards_ != nullptr) {
    absl::StatusOr<std::vector<engine::ShardMap::Piece>> mine =
        gpu_shards_->map().StatePieces(optimizer_->State());
    if (!mine.ok()) return Failure{kExitFailure, mine.status()};
    pieces = *std::move(mine);
  } else if (Sharded() && cpu_ != nullptr) {
    absl::StatusOr<std::vector<engine::ShardMap::Piece>> mine = cpu_->StatePieces();
    if (!mine.ok()) return Failure{kExitFailure, mine.status()};
    pieces = *std::move(mine);
  } else {
    for (const auto& [name, tensor] : optimizer_->State()) {
      pieces.push_back(
          {name, name, tensor->shape(), 0, static_cast<size_t>(tensor->numel()), tensor});
    }
  }
  if (absl::Status s = loader_->LoadOptimizerState(pieces, optimizer_steps, optimizer_); !s.ok()) {
    return FailureFor(s, "resume");
  }
  return std::nullopt;
}

std::optional<Failure> RankTraining::Checkpoint(int64_t step, int64_t steps_per_epoch,
                                                int64_t total_steps) {
  const SteadyClock::time_point start = SteadyClock::now();
  // ZeRO and FSDP: every rank writes the pieces it holds; DDP: rank 0
  // holds everything and writes it.
  // Model parallelism: the first replica's ranks write the pieces they own
  // (with ZeRO-1 in the stages, every rank its shards' state).
  const bool sharded =
      (Sharded() && (cpu_ != nullptr || gpu_shards_ != nullptr)) || parallel_ != nullptr;
  if (parallel_ != nullptr && !parallel_->writes_checkpoints()) return std::nullopt;
  if (!sharded && rendezvous_.rank() != 0) return std::nullopt;
  if (std::optional<Failure> f = SyncFromGpu(/*optimizer_state=*/true); f.has_value()) return f;
  // A GPU pipeline's stage: its weights and optimizer state (and steps,
  // which the state below records) into the CPU copies.
  if (parallel_ != nullptr) {
    if (absl::Status s = parallel_->SyncFromGpu(/*optimizer_state=*/true); !s.ok()) {
      return FailureFor(s, "checkpoint");
    }
  }
  std::map<std::string, std::string> metadata = {{"aidn.job", options_.job_id},
                                                 {"aidn.step", absl::StrCat(step)},
                                                 {"aidn.model", spec_.model().name()}};
  for (auto& [key, value] : task_->Metadata()) metadata[key] = value;
  const int64_t accum = std::max(1, spec_.grad_accum_steps());
  TrainingState state = TrainingState::At(step, steps_per_epoch, spec_.batch_size() * accum);
  state.total_steps = total_steps;
  state.seed = spec_.seed();
  state.world_size = rendezvous_.world_size();
  state.optimizer = spec_.optimizer().name();
  state.optimizer_steps = optimizer_->steps();
  state.model = spec_.model().name();
  state.job = options_.job_id;
  state.generation = options_.generation;
  // fp16: the scale the next step would use, so that a resume does not
  // start again at 2^16 and overflow its way back down.
  if (gpu_ != nullptr) state.loss_scale = gpu_->loss_scale_state();

  absl::StatusOr<engine::WrittenCheckpoint> written;
  if (sharded) {
    engine::ShardContents contents;
    if (parallel_ != nullptr) {
      absl::StatusOr<ParallelRank::Pieces> pieces = parallel_->CheckpointPieces();
      if (!pieces.ok()) return FailureFor(pieces.status(), "checkpoint");
      contents.weights = std::move(pieces->weights);
      contents.optimizer_state = std::move(pieces->state);
    } else {
      absl::StatusOr<std::vector<engine::ShardMap::Piece>> pieces =
          gpu_shards_ != nullptr ? gpu_shards_->map().StatePieces(optimizer_->State())
                                 : cpu_->StatePieces();
      contents.weights =
          gpu_shards_ != nullptr ? gpu_shards_->map().WeightPieces() : cpu_->WeightPieces();
      if (!pieces.ok()) return FailureFor(pieces.status(), "checkpoint");
      contents.optimizer_state = *std::move(pieces);
      // Buffers (BatchNorm's running statistics) are whole on every rank:
      // rank 0's go in, as DDP's checkpoint holds them.
      if (rendezvous_.rank() == 0) {
        for (const engine::Parameter* b : task_->model().Buffers()) {
          contents.weights.push_back({b->name, b->name, b->value.shape(), 0,
                                      static_cast<size_t>(b->value.numel()), &b->value});
        }
      }
    }
    // The model's order (TrainingTask::ModelState): parameters, then buffers.
    for (const engine::Parameter* p : task_->Parameters()) contents.parameters.push_back(p->name);
    for (const engine::Parameter* b : task_->model().Buffers()) {
      contents.parameters.push_back(b->name);
    }
    contents.model_metadata = std::move(metadata);
    contents.state = state.Encode();
    written = engine::WriteShardedCheckpoint(
        checkpoint_dir_, step, absl::StrCat("g", options_.generation), contents,
        parallel_ != nullptr && !parallel_->sharded() ? parallel_->writers() : comm_.get());
    // Rank 0 does not see the other ranks' files: no passing trouble.
    if (absl::IsFailedPrecondition(written.status())) {
      return Failure{kExitPermanent, written.status()};
    }
  } else {
    engine::CheckpointContents contents;
    for (const engine::Parameter* p : task_->ModelState()) contents.model.push_back(p);
    contents.model_metadata = std::move(metadata);
    for (const engine::Optimizer::StateEntry& e : optimizer_->State()) {
      contents.optimizer_state.emplace_back(e.first, e.second);
    }
    contents.state = state.Encode();
    written = engine::WriteCheckpoint(checkpoint_dir_, step, contents);
  }
  if (!written.ok()) return FailureFor(written.status(), "checkpoint");
  AIDN_LOG(INFO) << "checkpoint written" << Kv("step", step) << Kv("path", written->path)
                 << Kv("bytes", written->bytes)
                 << Kv("ms", static_cast<int64_t>(SecondsSince(start) * 1e3));
  v1::CommitCheckpointRequest request;
  request.set_job_id(options_.job_id);
  request.set_generation(options_.generation);
  request.set_rank(rendezvous_.rank());
  request.set_step(step);
  request.set_path(written->path);
  request.set_bytes(written->bytes);
  // Rank 0's manifest names every rank's files.
  if (!written->manifest.empty()) request.set_manifest_sha256(Sha256Hex(written->manifest));
  if (parallel_ != nullptr) {
    for (int r : parallel_->writer_ranks()) request.add_writer_ranks(r);
  } else {
    for (int r = 0; r < (sharded ? rendezvous_.world_size() : 1); ++r) request.add_writer_ranks(r);
  }
  // After the step's records (ReportStep): the reporter sends those first.
  reporter_->Commit(std::move(request));
  return std::nullopt;
}

}  // namespace aidn::trainer
