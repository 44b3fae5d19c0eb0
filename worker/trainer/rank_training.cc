#include "worker/trainer/rank_training.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/digest.h"
#include "common/log.h"
#include "common/rpc/client.h"
#include "common/rpc/retry.h"
#include "common/rpc/status_convert.h"
#include "common/status.h"
#include "worker/engine/comm/cpu_communicator.h"
#include "worker/engine/cpu.h"
#include "worker/engine/ddp.h"
#include "worker/engine/device.h"
#include "worker/trainer/checkpoint_loader.h"
#include "worker/trainer/engine_config.h"
#include "worker/trainer/training_state.h"

namespace aidn::trainer {
namespace {

using std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;
using Stub = v1::ClusterService::Stub;

constexpr milliseconds kRpcTimeout{10'000};

double SecondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

google::protobuf::Timestamp Now() {
  google::protobuf::Timestamp ts;
  const int64_t nanos = absl::ToUnixNanos(absl::Now());
  ts.set_seconds(nanos / 1'000'000'000);
  ts.set_nanos(static_cast<int32_t>(nanos % 1'000'000'000));
  return ts;
}

// Joins the rendezvous, retrying while the coordinator is unreachable.
absl::StatusOr<v1::JoinRendezvousResponse> Join(grpc::Channel* channel, Stub* stub,
                                                const TrainerOptions& options) {
  const SteadyClock::time_point deadline = SteadyClock::now() + std::chrono::minutes(30);
  rpc::Backoff backoff;
  while (true) {
    grpc::ClientContext context;
    // The coordinator answers at the job's rendezvous timeout at the latest.
    rpc::PrepareContext(&context, options.token, std::chrono::hours(24));
    v1::JoinRendezvousRequest request;
    request.set_job_id(options.job_id);
    request.set_generation(options.generation);
    request.set_rank(options.rank);
    request.set_worker_id(options.worker_id);
    request.set_address(options.host);
    v1::JoinRendezvousResponse response;
    grpc::Status status = stub->JoinRendezvous(&context, request, &response);
    if (status.ok()) return response;
    // Only an unreachable coordinator is worth another join, not every
    // rpc::Transient failure: it answers DEADLINE_EXCEEDED when the
    // rendezvous timed out and ABORTED when a newer join of this rank
    // replaced this one, and both end the trainer.
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE || !backoff.FitsBefore(deadline)) {
      return rpc::FromGrpcStatus(status);
    }
    rpc::ResetBackoffAfter(status, channel);
    AIDN_LOG(WARNING) << "coordinator unreachable, retrying the rendezvous: "
                      << status.error_message();
    backoff.Sleep(deadline);
  }
}

// The rank process's peak resident set so far (ru_maxrss is in KiB on
// Linux).
int64_t PeakMemoryBytes() {
  struct rusage usage {};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

// The whole, current weights in the model's parameters for a scope: ZeRO-2
// and FSDP hold slices (or stale copies) of them between steps. Every rank
// enters the scope at the same point (a collective).
class FullParameters {
 public:
  explicit FullParameters(engine::CpuSession* session) : session_(session) {
    if (session_ != nullptr) status_ = session_->GatherFullParameters();
  }
  ~FullParameters() {
    if (session_ != nullptr) session_->ReleaseFullParameters();
  }
  FullParameters(const FullParameters&) = delete;
  FullParameters& operator=(const FullParameters&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  engine::CpuSession* session_;
  absl::Status status_;
};

// The directories the coordinator's answer to a commit says are no longer
// wanted: the steps retention retired, and on rank 0 (the one rank that
// reports every checkpoint) any other below it the registry does not hold.
void RemoveRetiredCheckpoints(const std::string& dir, int rank,
                              const v1::CommitCheckpointRequest& request,
                              const v1::CommitCheckpointResponse& response) {
  for (int64_t step : response.retired_steps()) {
    if (absl::Status s = engine::RemoveCheckpoint(dir, step); !s.ok()) {
      AIDN_LOG(WARNING) << "retention: " << s;
    } else {
      AIDN_LOG(INFO) << "retention removed a checkpoint" << Kv("step", step);
    }
  }
  if (rank != 0 || response.held_steps().empty()) return;
  absl::StatusOr<std::vector<int64_t>> removed = engine::RemoveCheckpointsNotHeld(
      dir, request.step(), {response.held_steps().begin(), response.held_steps().end()});
  if (!removed.ok()) {
    AIDN_LOG(WARNING) << "could not remove checkpoints the registry does not hold: "
                      << removed.status();
  } else if (!removed->empty()) {
    AIDN_LOG(INFO) << "removed checkpoints the registry does not hold"
                   << Kv("steps", absl::StrJoin(*removed, ","));
  }
}

}  // namespace

Failure FailureFor(const absl::Status& status, const char* what) {
  const absl::Status annotated(status.code(), absl::StrCat(what, ": ", status.message()));
  // Aborted: a checkpoint a later generation wrote is in the way.
  if (status.code() == absl::StatusCode::kFailedPrecondition ||
      status.code() == absl::StatusCode::kAborted) {
    return {kExitSuperseded, annotated};
  }
  return {kExitFailure, annotated};
}

RankTraining::RankTraining(const TrainerOptions& options, std::shared_ptr<grpc::Channel> channel,
                           StopSignal* stop)
    : options_(options),
      channel_(channel),
      stub_(v1::ClusterService::NewStub(channel)),
      stop_(stop) {}

RankTraining::~RankTraining() {
  // What is left goes now, also when the stop's flush still holds it.
  if (reporter_ != nullptr) reporter_->Close(milliseconds(5000));
}

std::optional<Failure> RankTraining::Setup() {
  absl::StatusOr<v1::JoinRendezvousResponse> joined = Join(channel_.get(), stub_.get(), options_);
  if (!joined.ok()) return FailureFor(joined.status(), "rendezvous");
  rendezvous_ = *std::move(joined);
  spec_ = rendezvous_.spec();
  AIDN_LOG(INFO) << "joined the rendezvous" << Kv("job", options_.job_id)
                 << Kv("generation", options_.generation) << Kv("rank", rendezvous_.rank())
                 << Kv("world_size", rendezvous_.world_size());
  if (std::optional<Failure> f = PrepareCheckpointDir(); f.has_value()) return f;
  const std::string dir = checkpoint_dir_;
  ReporterOptions reporting;
  reporting.token = options_.token;
  reporting.job_id = options_.job_id;
  reporting.generation = options_.generation;
  reporting.rank = options_.rank;
  reporter_ = std::make_shared<Reporter>(
      channel_, stub_, reporting,
      [dir, rank = options_.rank](const auto& request, const auto& response) {
        RemoveRetiredCheckpoints(dir, rank, request, response);
      });
  asks_.emplace(reporter_.get());
  if (stop_ != nullptr) {
    stop_->SetFlush([reporter = reporter_](milliseconds timeout) { reporter->Close(timeout); });
  }

  if (spec_.device() == v1::JobSpec::GPU) {
    engine::DeviceInventory devices = engine::DiscoverDevices();
    if (devices.gpus.empty()) {
      return Failure{kExitPermanent,
                     absl::FailedPreconditionError(absl::StrCat(
                         "device: gpu: this trainer sees no GPU (", devices.gpu_note, ")"))};
    }
  }
  engine::ConfigureCpu(std::max(1, options_.threads));
  absl::StatusOr<std::unique_ptr<TrainingTask>> task =
      TrainingTask::Create(spec_, options_.cache_dir);
  if (!task.ok()) return Failure{kExitPermanent, task.status()};
  task_ = *std::move(task);
  if (spec_.device() == v1::JobSpec::GPU && task_->sequential() == nullptr &&
      task_->gpt() == nullptr) {
    return Failure{kExitPermanent,
                   absl::InvalidArgumentError(absl::StrCat(
                       "device: gpu: the GPU engine has no model ", spec_.model().name()))};
  }
  if (std::optional<Failure> f = Connect(); f.has_value()) return f;
  if (std::optional<Failure> f = LoadNewestCheckpoint(); f.has_value()) return f;
  // Rank 0's weights, loaded or fresh, become everyone's.
  if (absl::Status s = engine::DdpReducer::BroadcastParameters(task_->ModelState(), comm_.get());
      !s.ok()) {
    return FailureFor(s, "initial weights");
  }
  return BuildSession();
}

std::optional<Failure> RankTraining::PrepareCheckpointDir() {
  checkpoint_dir_ = CheckpointDirOf(spec_, options_);
  if (checkpoint_dir_.empty() || rendezvous_.rank() != 0) return std::nullopt;
  // A directory that cannot be made is no passing trouble: fail for good.
  std::error_code error;
  std::filesystem::create_directories(checkpoint_dir_, error);
  if (error) {
    return Failure{kExitPermanent,
                   absl::FailedPreconditionError(absl::StrCat(
                       "checkpoint.dir: cannot create ", checkpoint_dir_, ": ", error.message()))};
  }
  // Left by a writer killed half way; no writer runs now.
  if (absl::Status s = engine::RemoveTemporaries(checkpoint_dir_); !s.ok()) {
    AIDN_LOG(WARNING) << "could not clear unfinished checkpoints: " << s;
  }
  return std::nullopt;
}

std::optional<Failure> RankTraining::Connect() {
  // Gloo's rendezvous goes through the coordinator's KV store for this
  // generation; a stale generation is refused there.
  const milliseconds timeout = PeerTimeoutOf(spec_);
  auto store = std::make_shared<CoordinatorStore>(stub_, options_.token, options_.job_id,
                                                  options_.generation, timeout);
  kv_ = store;
  engine::CpuCommunicatorOptions comm_options;
  engine::GlooOptions& gloo = comm_options.gloo;
  gloo.rank = rendezvous_.rank();
  gloo.world_size = rendezvous_.world_size();
  gloo.host = options_.host;
  gloo.timeout = timeout;
  gloo.prefix = "gloo";
  comm_options.transport = CpuTransportOf(spec_);
  comm_options_ = comm_options;
  absl::StatusOr<engine::CpuCommunicator> comm =
      engine::CreateCpuCommunicator(comm_options, store.get());
  if (!comm.ok()) return FailureFor(comm.status(), "communicator");
  AIDN_LOG(INFO) << "communicator ready" << Kv("transport", comm->transport)
                 << Kv("why", comm->description);
  comm_ = std::move(comm->communicator);
  return std::nullopt;
}

bool RankTraining::Sharded() const { return ShardingOf(spec_) != engine::Sharding::kNone; }

bool RankTraining::GpuSharded() const { return Sharded() && spec_.device() == v1::JobSpec::GPU; }

std::optional<Failure> RankTraining::BuildSession() {
  if (ModelParallel()) {
    absl::StatusOr<std::unique_ptr<ParallelRank>> p =
        ParallelRank::Create(spec_, comm_options_, kv_.get(), task_.get());
    // A spec the model cannot take, or a GPU build without NCCL: the same
    // on every try.
    if (absl::IsInvalidArgument(p.status()) || absl::IsUnimplemented(p.status())) {
      return Failure{kExitPermanent, p.status()};
    }
    if (!p.ok()) return FailureFor(p.status(), "model parallelism");
    parallel_ = *std::move(p);
    optimizer_ = &parallel_->optimizer();
    return std::nullopt;
  }
  engine::CpuSessionOptions o;
  o.communicator = comm_.get();
  o.bucket_mb = BucketMbOf(spec_);
  o.powersgd = PowerSgdOf(spec_);
  o.half = HalfCompressionOf(spec_);
  o.broadcast_buffers = !spec_.ddp().has_broadcast_buffers() || spec_.ddp().broadcast_buffers();
  o.find_unused_parameters = spec_.ddp().find_unused_parameters();
  // ZeRO-2 and FSDP have no ddp: block: a model that skips blocks has its
  // unused parameters left alone as DDP's find_unused_parameters does.
  if (spec_.strategy() == v1::JobSpec::ZERO2 || spec_.strategy() == v1::JobSpec::FSDP) {
    o.find_unused_parameters = spec_.model().stochastic_depth() > 0;
  }
  if (std::optional<Failure> f = SetupSyncBatchNorm(); f.has_value()) return f;
  if (Sharded() && spec_.device() == v1::JobSpec::CPU) {
    // The session makes the optimizer, over this rank's shards.
    o.sharding = ShardingOf(spec_);
    absl::StatusOr<std::unique_ptr<engine::CpuSession>> session =
        engine::CpuSession::Create(o, &task_->model(), OptimizerConfigOf(spec_));
    if (!session.ok()) return Failure{kExitPermanent, session.status()};
    cpu_ = *std::move(session);
    optimizer_ = &cpu_->optimizer();
    if (const engine::ShardMap* map = cpu_->shard_map(); map != nullptr) {
      AIDN_LOG(INFO) << "model state sharded"
                     << Kv("strategy", v1::JobSpec::Strategy_Name(spec_.strategy()))
                     << Kv("device", gpu_ != nullptr ? "gpu" : "cpu")
                     << Kv("groups", map->num_groups()) << Kv("shards", map->shards().size())
                     << Kv("padding_floats",
                           // ZeRO-1's last bucket holds the loss slot.
                           map->padding_floats(spec_.strategy() == v1::JobSpec::ZERO1 ? 1 : 0));
    }
    return std::nullopt;
  }
  std::vector<engine::Parameter*> optimized = task_->Parameters();
  if (GpuSharded()) {
    // ZeRO and FSDP on GPUs: the GPU reducer shards the buckets (ZeRO-1) or
    // the units; the host keeps the same shards' layout, weights and
    // optimizer state (checkpoints).
    const engine::Sharding sharding = ShardingOf(spec_);
    absl::StatusOr<std::unique_ptr<engine::HostShards>> shards =
        sharding == engine::Sharding::kOptimizer
            ? engine::HostShards::ForBuckets(task_->Parameters(), BucketMbOf(spec_),
                                             rendezvous_.rank(), rendezvous_.world_size())
            : engine::HostShards::ForUnits(task_->model().Units(), task_->Parameters(),
                                           rendezvous_.rank(), rendezvous_.world_size());
    if (!shards.ok()) return Failure{kExitPermanent, shards.status()};
    gpu_shards_ = *std::move(shards);
    optimized = gpu_shards_->map().shards();
    AIDN_LOG(INFO) << "model state sharded"
                   << Kv("strategy", v1::JobSpec::Strategy_Name(spec_.strategy()))
                   << Kv("device", "gpu") << Kv("groups", gpu_shards_->map().num_groups())
                   << Kv("shards", gpu_shards_->map().shards().size())
                   << Kv("padding_floats", gpu_shards_->map().padding_floats());
  }
  absl::StatusOr<std::unique_ptr<engine::Optimizer>> optimizer =
      engine::Optimizer::Create(OptimizerConfigOf(spec_), optimized);
  if (!optimizer.ok()) return Failure{kExitPermanent, optimizer.status()};
  owned_optimizer_ = *std::move(optimizer);
  optimizer_ = owned_optimizer_.get();
  if (spec_.device() == v1::JobSpec::GPU) return std::nullopt;  // SetupGpu, after the resume
  absl::StatusOr<std::unique_ptr<engine::CpuSession>> session =
      engine::CpuSession::Create(o, &task_->model(), optimizer_);
  if (!session.ok()) return Failure{kExitPermanent, session.status()};
  cpu_ = *std::move(session);
  return std::nullopt;
}

std::optional<Failure> RankTraining::SetupSyncBatchNorm() {
  if (!spec_.ddp().sync_batchnorm() || rendezvous_.world_size() == 1 ||
      spec_.device() != v1::JobSpec::CPU) {
    return std::nullopt;
  }
  // Its own communicator: the statistics' collectives run on the training
  // thread while the gradient buckets go on the reducer's.
  engine::CpuCommunicatorOptions bn = comm_options_;
  bn.gloo.prefix = "gloo-syncbn";
  absl::StatusOr<engine::CpuCommunicator> comm = engine::CreateCpuCommunicator(bn, kv_.get());
  if (!comm.ok()) return FailureFor(comm.status(), "sync_batchnorm communicator");
  bn_comm_ = std::move(comm->communicator);
  task_->mutable_sequential()->SetBatchNormSync(bn_comm_.get());
  AIDN_LOG(INFO) << "sync batchnorm: statistics over every rank's batch"
                 << Kv("transport", comm->transport);
  return std::nullopt;
}

absl::StatusOr<RankTraining::Plan> RankTraining::MakePlan(
    const engine::DistributedSampler& sampler) const {
  Plan plan;
  plan.batch = spec_.batch_size();
  plan.tokens_per_item = task_->tokens_per_item();
  plan.accum = std::max(1, spec_.grad_accum_steps());
  // Whole optimizer steps per epoch; the tail that does not fill one is
  // left out (every rank runs the same number of steps).
  plan.steps_per_epoch = sampler.num_samples() / (plan.batch * plan.accum);
  if (plan.steps_per_epoch <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch_size x grad_accum_steps (", plan.batch * plan.accum,
        ") is larger than this rank's share of the data (", sampler.num_samples(), ")"));
  }
  plan.total_steps = spec_.epochs() > 0 ? spec_.epochs() * plan.steps_per_epoch : INT64_MAX;
  if (spec_.max_steps() > 0) plan.total_steps = std::min(plan.total_steps, spec_.max_steps());
  plan.log_every = std::max<int64_t>(1, std::min<int64_t>(100, plan.total_steps / 20));
  return plan;
}

std::optional<Failure> RankTraining::SetupGpu() {
  engine::GpuSessionOptions o =
      GpuSessionOptionsOf(spec_, rendezvous_.rank(), rendezvous_.world_size());
  if (o.world_size > 1 || gpu_shards_ != nullptr) {
    // NCCL's unique id goes through the same fenced KV as Gloo's addresses.
    o.store = kv_.get();
  }
  if (gpu_shards_ != nullptr) {
    o.sharding = ShardingOf(spec_);
    o.shards = &gpu_shards_->map();
  }
  absl::StatusOr<std::unique_ptr<engine::GpuSession>> session =
      task_->gpt() != nullptr
          ? engine::GpuSession::CreateForGpt(o, *task_->gpt(), OptimizerConfigOf(spec_))
          : engine::GpuSession::Create(o, *task_->sequential(), OptimizerConfigOf(spec_));
  if (!session.ok()) {
    if (session.status().code() == absl::StatusCode::kUnimplemented ||
        session.status().code() == absl::StatusCode::kInvalidArgument) {
      return Failure{kExitPermanent, session.status()};
    }
    return FailureFor(session.status(), "gpu");
  }
  gpu_ = *std::move(session);
  if (optimizer_->steps() > 0) {
    // Resumed: the CPU optimizer holds the checkpoint's state (Resume).
    std::vector<std::pair<std::string, const engine::Tensor*>> state;
    for (const engine::Optimizer::StateEntry& e : optimizer_->State()) state.push_back(e);
    if (absl::Status s = gpu_->LoadOptimizerState(state, optimizer_->steps()); !s.ok()) {
      return Failure{kExitFailure, s};
    }
  }
  if (resumed_loss_scale_.has_value() && gpu_->loss_scale_state().has_value()) {
    if (absl::Status s = gpu_->RestoreLossScale(*resumed_loss_scale_); !s.ok()) {
      return Failure{kExitFailure,
                     absl::DataLossError(absl::StrCat("resumed checkpoint: ", s.message()))};
    }
    AIDN_LOG(INFO) << "fp16 loss scale restored" << Kv("loss_scale", resumed_loss_scale_->scale)
                   << Kv("growth_tracker", resumed_loss_scale_->growth_tracker);
  }
  AIDN_LOG(INFO) << "training on the GPU" << Kv("device", gpu_->Describe());
  return std::nullopt;
}

std::optional<Failure> RankTraining::SyncFromGpu(bool optimizer_state) {
  if (gpu_ == nullptr) return std::nullopt;
  // Sharded: this rank's shards only (checkpoints hold those), with no
  // collective; otherwise the whole weights.
  if (absl::Status s = gpu_shards_ != nullptr ? gpu_->CopyShardsTo(gpu_shards_->map().shards())
                                              : gpu_->CopyParametersTo(task_->Parameters());
      !s.ok()) {
    return Failure{kExitFailure, s};
  }
  // Running statistics: checkpoints and evaluation read the CPU copies.
  if (absl::Status s = gpu_->CopyBuffersTo(task_->model().Buffers()); !s.ok()) {
    return Failure{kExitFailure, s};
  }
  if (!optimizer_state) return std::nullopt;
  absl::StatusOr<std::vector<std::pair<std::string, engine::Tensor>>> state =
      gpu_->OptimizerState();
  if (!state.ok()) return Failure{kExitFailure, state.status()};
  std::vector<engine::Optimizer::StateEntry> entries;
  for (const auto& [name, tensor] : *state) entries.emplace_back(name, &tensor);
  if (absl::Status s = optimizer_->LoadState(entries, gpu_->optimizer_steps()); !s.ok()) {
    return Failure{kExitFailure, s};
  }
  return std::nullopt;
}

std::optional<Failure> RankTraining::Evaluate(int32_t epoch, int64_t step) {
  TrainingTask::EvalSums mine;
  if (gpu_ != nullptr) {
    // On the device's weights: nothing copied to the CPU (ZeRO-2, FSDP:
    // every unit gathered first, on every rank).
    if (absl::Status s = gpu_->GatherFullParameters(); !s.ok()) {
      return FailureFor(s, "gpu evaluation");
    }
    absl::StatusOr<TrainingTask::EvalSums> sums = task_->EvaluateWith(
        rendezvous_.rank(), rendezvous_.world_size(),
        [this](const engine::MicroBatch& b) -> absl::StatusOr<TrainingTask::BatchResult> {
          AIDN_ASSIGN_OR_RETURN(const engine::GpuSession::EvalResult r, gpu_->Evaluate(b));
          return TrainingTask::BatchResult{r.mean_loss, r.correct};
        });
    gpu_->ReleaseFullParameters();
    if (!sums.ok()) return FailureFor(sums.status(), "gpu evaluation");
    mine = *sums;
  } else {
    FullParameters full(cpu_.get());
    if (!full.status().ok()) return FailureFor(full.status(), "evaluation");
    if (parallel_ != nullptr) {
      if (absl::Status s = parallel_->SyncFromGpu(/*optimizer_state=*/false); !s.ok()) {
        return FailureFor(s, "evaluation");
      }
      if (absl::Status s = parallel_->GatherWholeModel(); !s.ok()) {
        return FailureFor(s, "evaluation");
      }
    }
    // A tensor group's ranks evaluate one share together (its copies' sums
    // leave the means as they are).
    mine = parallel_ ? task_->Evaluate(parallel_->eval_rank(), parallel_->eval_world())
                     : task_->Evaluate(rendezvous_.rank(), rendezvous_.world_size());
    if (parallel_ != nullptr) parallel_->ReleaseWholeModel();
  }
  // Summed over the ranks.
  float sums[3] = {static_cast<float>(mine.loss_sum), static_cast<float>(mine.correct),
                   static_cast<float>(mine.count)};
  if (absl::Status s = comm_->AllReduce(sums, 3, engine::ReduceOp::kSum); !s.ok()) {
    return FailureFor(s, "evaluation");
  }
  v1::MetricRecord record;
  record.set_kind(v1::MetricRecord::EVAL);
  record.set_step(step);
  record.set_epoch(epoch);
  record.set_test_loss(sums[0] / sums[2]);
  record.set_test_accuracy(sums[1] / sums[2]);
  *record.mutable_time() = Now();
  if (rendezvous_.rank() == 0) {
    std::printf("%s\n", task_->EvalLine(epoch, step, sums[0] / sums[2], sums[1] / sums[2]).c_str());
    std::fflush(stdout);
  }
  reporter_->Record(std::move(record));
  return std::nullopt;
}

absl::StatusOr<RankTraining::StepResult> RankTraining::RunStep(
    const Plan& plan, int64_t step, const std::vector<int64_t>& indices) {
  const SteadyClock::time_point start = SteadyClock::now();
  StepResult result;
  result.lr = engine::LearningRate(schedule_, spec_.optimizer().lr(), step, plan.total_steps);
  // The step's micro-batches with their dropout seeds, the same on either
  // device.
  const int64_t first = (step % plan.steps_per_epoch) * plan.batch * plan.accum;
  const int64_t epoch = step / plan.steps_per_epoch;
  // A pipeline cuts each batch into its micro-batches.
  const int64_t cuts = parallel_ ? parallel_->micro_batches() : 1;
  const int64_t size = plan.batch / cuts;
  std::vector<engine::MicroBatch> micro;
  for (int64_t m = 0; m < plan.accum * cuts; ++m) {
    engine::MicroBatch batch = task_->Gather(epoch, indices, static_cast<size_t>(first + m * size),
                                             static_cast<size_t>(size), static_cast<size_t>(m));
    batch.seed =
        engine::DropoutSeed(spec_.seed(), step, plan.accum * cuts, m, DataWorld(), DataRank());
    micro.push_back(batch);
  }
  if (parallel_ != nullptr) {
    AIDN_ASSIGN_OR_RETURN(result.loss, parallel_->Step(micro, result.lr));
    result.allreduce_seconds = parallel_->allreduce_seconds();
    result.wait_seconds = parallel_->wait_seconds();
  } else if (gpu_ != nullptr) {
    absl::StatusOr<double> loss = gpu_->Step(micro, result.lr);
    if (!loss.ok()) {
      return absl::Status(loss.status().code(),
                          absl::StrCat("gpu step: ", loss.status().message()));
    }
    result.loss = *loss;
    if (gpu_->last_step_skipped()) {
      AIDN_LOG(INFO) << "fp16: gradients overflowed, update skipped" << Kv("step", step + 1)
                     << Kv("next_loss_scale", gpu_->loss_scale_state()->scale);
    }
    result.allreduce_seconds = gpu_->last_allreduce_seconds();
    result.wait_seconds = gpu_->last_allreduce_wait_seconds();
    result.comm_bytes = gpu_->last_bytes_sent();
    result.comm_bytes_uncompressed = gpu_->last_bytes_uncompressed();
  } else {
    // "gradient allreduce: ..." or "optimizer: ...".
    AIDN_ASSIGN_OR_RETURN(result.loss, cpu_->Step(micro, result.lr));
    result.comm_bytes = cpu_->last_bytes_sent();
    result.comm_bytes_uncompressed = cpu_->last_bytes_uncompressed();
    result.allreduce_seconds = cpu_->last_allreduce_seconds();
    result.wait_seconds = cpu_->last_allreduce_wait_seconds();
  }
  if (result.comm_bytes != result.comm_bytes_uncompressed && (step + 1) % plan.log_every == 0) {
    AIDN_LOG(INFO) << "compressed gradients" << Kv("step", step + 1)
                   << Kv("bytes_sent", result.comm_bytes)
                   << Kv("uncompressed", result.comm_bytes_uncompressed);
  }
  result.seconds = SecondsSince(start);
  return result;
}

void RankTraining::ReportStep(const Plan& plan, int64_t step, int32_t epoch,
                              const StepResult& result) {
  v1::MetricRecord record;
  record.set_kind(v1::MetricRecord::TRAIN);
  record.set_step(step + 1);
  // Epochs are counted from 1 in records and progress, as people count
  // them: steps of the first epoch and its evaluation both say 1.
  record.set_epoch(epoch + 1);
  // This rank's loss on a GPU, the ranks' mean on the CPU; the coordinator
  // averages the ranks' records.
  record.set_loss(result.loss);
  // A model-parallel replica's ranks share its samples: one counts them.
  const int64_t share = parallel_ == nullptr || parallel_->counts_samples() ? 1 : 0;
  record.set_samples(share * plan.batch * plan.accum);
  record.set_step_seconds(result.seconds);
  record.set_allreduce_seconds(result.allreduce_seconds);
  record.set_compute_seconds(std::max(0.0, result.seconds - result.wait_seconds));
  record.set_lr(result.lr);
  record.set_tokens(share * plan.batch * plan.accum * plan.tokens_per_item);
  record.set_peak_memory_bytes(PeakMemoryBytes());
  if (gpu_ != nullptr) record.set_device_peak_memory_bytes(gpu_->device_peak_bytes());
  if (parallel_ != nullptr && parallel_->gpu() != nullptr) {
    record.set_device_peak_memory_bytes(parallel_->gpu()->device_peak_bytes());
  }
  record.set_gradient_comm_bytes(result.comm_bytes);
  record.set_gradient_comm_bytes_uncompressed(result.comm_bytes_uncompressed);
  if (cpu_ != nullptr || parallel_ != nullptr || gpu_ != nullptr) {
    // ZeRO-2's and FSDP's buffers grow to their size in the first step. A
    // GPU pipeline's stage: its GPU session's, not the CPU copies'.
    const engine::GpuSession* gpu =
        gpu_ != nullptr ? gpu_.get() : (parallel_ != nullptr ? parallel_->gpu() : nullptr);
    if (gpu != nullptr) {
      const engine::GpuSession::StateMemory m = gpu->memory();
      memory_ = {.parameters = m.parameters,
                 .gradients = m.gradients,
                 .optimizer_state = m.optimizer_state,
                 .buffers = m.buffers};
    } else {
      memory_ = parallel_ ? parallel_->memory() : cpu_->memory();
    }
    if (step == start_step_) {
      constexpr double kMiB = 1024.0 * 1024.0;
      AIDN_LOG(INFO) << "model state memory"
                     << Kv("strategy", v1::JobSpec::Strategy_Name(spec_.strategy()))
                     << Kv("device", gpu != nullptr ? "gpu" : "cpu")
                     << Kv("parameters_mib", memory_.parameters / kMiB)
                     << Kv("gradients_mib", memory_.gradients / kMiB)
                     << Kv("optimizer_state_mib", memory_.optimizer_state / kMiB)
                     << Kv("buffers_mib", memory_.buffers / kMiB);
    }
    record.set_parameter_bytes(memory_.parameters);
    record.set_gradient_bytes(memory_.gradients);
    record.set_optimizer_state_bytes(memory_.optimizer_state);
    record.set_buffer_bytes(memory_.buffers);
  }
  *record.mutable_time() = Now();
  reporter_->Record(std::move(record));
  reporter_->Progress(step + 1, epoch + 1, CollectiveSequence(), plan.total_steps);
  if (rendezvous_.rank() == 0 &&
      ((step + 1) % plan.log_every == 0 || step + 1 == plan.total_steps)) {
    // Samples (or tokens, for a language model) of every rank over the step.
    const double items = static_cast<double>(plan.batch * plan.accum * DataWorld() *
                                             std::max<int64_t>(1, plan.tokens_per_item));
    std::printf("step %lld/%lld | loss %.4f | %.1f ms | %.0f %s/s | allreduce %.1f ms\n",
                static_cast<long long>(step + 1), static_cast<long long>(plan.total_steps),
                result.loss, result.seconds * 1e3, items / std::max(result.seconds, 1e-9),
                plan.tokens_per_item > 0 ? "tokens" : "samples", result.allreduce_seconds * 1e3);
    std::fflush(stdout);
  }
}

bool RankTraining::EvaluationDue(const Plan& plan, int64_t step) const {
  const int64_t every = spec_.eval_every_steps();
  return (step + 1) % plan.steps_per_epoch == 0 || step + 1 == plan.total_steps ||
         (every > 0 && (step + 1) % every == 0);
}

std::optional<Failure> RankTraining::AfterStep(const Plan& plan, int64_t step, int32_t epoch) {
  const bool last = step + 1 == plan.total_steps;
  if (EvaluationDue(plan, step)) {
    if (std::optional<Failure> f = Evaluate(epoch + 1, step + 1); f.has_value()) return f;
  }
  const int64_t every = spec_.checkpoint().every_steps();
  // Asked for by the coordinator (a pause): every rank answers, whether it
  // writes or not.
  const bool asked = asks_->Due(step + 1);
  if (!checkpoint_dir_.empty() && ((every > 0 && (step + 1) % every == 0) || last || asked)) {
    // Every rank's records up to the step, not only the writer's, must be
    // stored before the checkpoint counts: they go now.
    reporter_->SendNow();
    return Checkpoint(step + 1, plan.steps_per_epoch, plan.total_steps);
  }
  return std::nullopt;
}

std::optional<Failure> RankTraining::Execute() {
  if (std::optional<Failure> f = Setup(); f.has_value()) return f;
  const engine::DistributedSampler sampler(task_->train_items(), DataWorld(), DataRank(),
                                           spec_.dataset().shuffle(), spec_.seed(),
                                           spec_.dataset().drop_last());
  absl::StatusOr<Plan> plan = MakePlan(sampler);
  if (!plan.ok()) return Failure{kExitPermanent, plan.status()};
  schedule_ = ScheduleOf(spec_);
  if (std::optional<Failure> f = Resume(plan->steps_per_epoch); f.has_value()) return f;
  // A GPU pipeline's stage was made with the model-parallel rank.
  if (spec_.device() == v1::JobSpec::GPU && parallel_ == nullptr) {
    if (std::optional<Failure> f = SetupGpu(); f.has_value()) return f;
  }
  std::vector<int64_t> indices;
  int32_t epoch = -1;
  // Tells the coordinator how long the job is before the first step ends.
  reporter_->Progress(start_step_, static_cast<int32_t>(start_step_ / plan->steps_per_epoch),
                      CollectiveSequence(), plan->total_steps);
  for (int64_t step = start_step_; step < plan->total_steps; ++step) {
    if (reporter_->superseded()) {
      return Failure{kExitSuperseded,
                     absl::FailedPreconditionError("the coordinator ended this generation")};
    }
    if (stop_ != nullptr && stop_->requested()) {
      return Failure{kExitFailure, absl::CancelledError("stopped by a signal")};
    }
    const int32_t step_epoch = static_cast<int32_t>(step / plan->steps_per_epoch);
    if (step_epoch != epoch) {
      epoch = step_epoch;
      indices = sampler.EpochIndices(epoch);
    }
    absl::StatusOr<StepResult> result = RunStep(*plan, step, indices);
    if (!result.ok()) {
      // Already says what failed. INVALID_ARGUMENT (a parameter without a
      // gradient, a bad learning rate) fails the same way again.
      if (absl::IsInvalidArgument(result.status())) return Failure{kExitPermanent, result.status()};
      const Failure f = FailureFor(result.status(), "step");
      return Failure{f.exit_code, result.status()};
    }
    ReportStep(*plan, step, epoch, *result);
    if (std::optional<Failure> f = AfterStep(*plan, step, epoch); f.has_value()) return f;
  }
  // The last commit must reach the coordinator before the exit does.
  reporter_->Close(milliseconds(60'000));
  return std::nullopt;
}

}  // namespace aidn::trainer
