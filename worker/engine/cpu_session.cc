#include "worker/engine/cpu_session.h"

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace aidn::engine {

absl::StatusOr<std::unique_ptr<CpuSession>> CpuSession::Create(const CpuSessionOptions& options,
                                                               Sequential* model,
                                                               Optimizer* optimizer) {
  if (model == nullptr) {
    return absl::InvalidArgumentError("cpu session: needs a model and an optimizer");
  }
  auto classifier = std::make_unique<Classifier>(model);
  TrainableModel* borrowed = classifier.get();
  absl::StatusOr<std::unique_ptr<CpuSession>> session = Create(options, borrowed, optimizer);
  if (session.ok()) (*session)->owned_ = std::move(classifier);
  return session;
}

// Each rank's sum in two floats (high and low part), gathered and added in
// double in rank order, so every rank computes the same bits.
Optimizer::SumOfSquaresReduction SumOfSquaresOver(Communicator* comm) {
  return [comm](double local) -> absl::StatusOr<double> {
    const float hi = static_cast<float>(local);
    const float mine[2] = {hi, static_cast<float>(local - static_cast<double>(hi))};
    std::vector<float> all(2 * static_cast<size_t>(comm->world_size()));
    AIDN_RETURN_IF_ERROR(comm->AllGather(mine, 2, all.data()));
    double sum = 0;
    for (size_t i = 0; i < all.size(); i += 2) {
      sum += static_cast<double>(all[i]) + static_cast<double>(all[i + 1]);
    }
    return sum;
  };
}

absl::StatusOr<std::unique_ptr<CpuSession>> CpuSession::Create(const CpuSessionOptions& options,
                                                               TrainableModel* model,
                                                               const OptimizerConfig& config) {
  if (model == nullptr) return absl::InvalidArgumentError("cpu session: needs a model");
  const bool sharded = options.sharding != Sharding::kNone;
  if (sharded && options.communicator == nullptr) {
    return absl::InvalidArgumentError("cpu session: sharding needs a communicator");
  }
  std::unique_ptr<CpuSession> session(new CpuSession(model, nullptr));
  session->communicator_ = options.communicator;
  session->broadcast_buffers_ = options.broadcast_buffers;
  session->find_unused_parameters_ = options.find_unused_parameters;
  std::vector<Parameter*> params = model->Parameters();
  if (options.sharding == Sharding::kGradients || options.sharding == Sharding::kShardGradOp ||
      options.sharding == Sharding::kFullShard) {
    AIDN_ASSIGN_OR_RETURN(session->fsdp_,
                          FsdpReducer::Create({.sharding = options.sharding}, model->Units(),
                                              model->Parameters(), options.communicator));
    params = session->fsdp_->ShardParameters();
    model->SetUnitHooks(session->fsdp_.get());
  } else if (options.communicator != nullptr) {
    AIDN_ASSIGN_OR_RETURN(
        session->reducer_,
        DdpReducer::Create({.bucket_mb = options.bucket_mb,
                            .shard_optimizer = options.sharding == Sharding::kOptimizer,
                            .powersgd = options.powersgd,
                            .half = options.half,
                            .find_unused_parameters = options.find_unused_parameters},
                           model->Parameters(), options.communicator));
    params = session->reducer_->ShardParameters();
    DdpReducer* r = session->reducer_.get();
    model->SetGradReadyCallback([r](Parameter* p) { r->OnGradReady(p); });
  }
  AIDN_ASSIGN_OR_RETURN(session->owned_optimizer_, Optimizer::Create(config, params));
  session->optimizer_ = session->owned_optimizer_.get();
  if (sharded && options.communicator->world_size() > 1) {
    session->optimizer_->SetSumOfSquaresReduction(SumOfSquaresOver(options.communicator));
  }
  return session;
}

absl::StatusOr<std::unique_ptr<CpuSession>> CpuSession::Create(const CpuSessionOptions& options,
                                                               TrainableModel* model,
                                                               Optimizer* optimizer) {
  if (options.sharding != Sharding::kNone) {
    return absl::InvalidArgumentError(
        "cpu session: sharding needs the session to make its optimizer");
  }
  if (model == nullptr || optimizer == nullptr) {
    return absl::InvalidArgumentError("cpu session: needs a model and an optimizer");
  }
  std::unique_ptr<CpuSession> session(new CpuSession(model, optimizer));
  session->communicator_ = options.communicator;
  session->broadcast_buffers_ = options.broadcast_buffers;
  session->find_unused_parameters_ = options.find_unused_parameters;
  if (options.communicator != nullptr) {
    // After the optimizer, as the trainer has always made them: with more
    // than one rank the reducer turns every gradient into a view of its
    // bucket.
    absl::StatusOr<std::unique_ptr<DdpReducer>> reducer =
        DdpReducer::Create({.bucket_mb = options.bucket_mb,
                            .powersgd = options.powersgd,
                            .half = options.half,
                            .find_unused_parameters = options.find_unused_parameters},
                           model->Parameters(), options.communicator);
    if (!reducer.ok()) return reducer.status();
    session->reducer_ = *std::move(reducer);
    DdpReducer* r = session->reducer_.get();
    model->SetGradReadyCallback([r](Parameter* p) { r->OnGradReady(p); });
  }
  return session;
}

CpuSession::Memory CpuSession::memory() const {
  Memory m;
  for (const Optimizer::StateEntry& e : optimizer_->State())
    m.optimizer_state += 4 * e.second->numel();
  if (fsdp_ != nullptr) {
    const FsdpReducer::Memory f = fsdp_->memory();
    m.parameters = f.weights;
    m.gradients = f.gradients;
    m.buffers = f.buffers;
    return m;
  }
  int64_t weights = 0;
  for (const Parameter* p : model_->Parameters()) weights += 4 * p->value.numel();
  const DdpReducer::Memory r = reducer_ != nullptr ? reducer_->memory() : DdpReducer::Memory{};
  m.parameters = r.weight_buffers > 0 ? r.weight_buffers : weights;
  m.gradients = r.gradient_buckets > 0 ? r.gradient_buckets : weights;
  return m;
}

const ShardMap* CpuSession::shard_map() const {
  if (fsdp_ != nullptr) return &fsdp_->map();
  return reducer_ != nullptr ? reducer_->shard_map() : nullptr;
}

absl::Status CpuSession::GatherFullParameters() {
  return fsdp_ != nullptr ? fsdp_->GatherFullParameters() : absl::OkStatus();
}

void CpuSession::ReleaseFullParameters() {
  if (fsdp_ != nullptr) fsdp_->ReleaseFullParameters();
}

std::vector<CpuSession::Piece> CpuSession::WeightPieces() const {
  if (const ShardMap* map = shard_map(); map != nullptr) return map->WeightPieces();
  std::vector<Piece> pieces;
  for (const Parameter* p : model_->Parameters()) {
    pieces.push_back(
        {p->name, p->name, p->value.shape(), 0, static_cast<size_t>(p->value.numel()), &p->value});
  }
  return pieces;
}

absl::StatusOr<std::vector<CpuSession::Piece>> CpuSession::StatePieces() const {
  const std::vector<Optimizer::StateEntry> state = optimizer_->State();
  if (const ShardMap* map = shard_map(); map != nullptr) return map->StatePieces(state);
  std::vector<Piece> pieces;
  for (const auto& [name, tensor] : state) {
    pieces.push_back(
        {name, name, tensor->shape(), 0, static_cast<size_t>(tensor->numel()), tensor});
  }
  return pieces;
}

CpuSession::~CpuSession() {
  if (reducer_ != nullptr) model_->SetGradReadyCallback(nullptr);
  if (fsdp_ != nullptr) model_->SetUnitHooks(nullptr);
}

absl::Status CpuSession::BroadcastBuffers() {
  if (!broadcast_buffers_ || communicator_ == nullptr || communicator_->world_size() == 1) {
    return absl::OkStatus();
  }
  const std::vector<Parameter*> buffers = model_->Buffers();
  if (buffers.empty()) return absl::OkStatus();
  return Annotate(DdpReducer::BroadcastParameters(buffers, communicator_), "broadcast_buffers");
}

absl::StatusOr<double> CpuSession::Step(const std::vector<MicroBatch>& micro, double lr) {
  if (micro.empty()) return absl::InvalidArgumentError("cpu session: a step needs a micro-batch");
  allreduce_seconds_ = 0.0;
  wait_seconds_ = 0.0;
  const int64_t accum = static_cast<int64_t>(micro.size());
  double loss = 0;
  // ZeRO-2 and FSDP: the hooks gather the units' weights and reduce-scatter
  // their gradients (into the zeroed shards) as forward and backward reach
  // them; the model's own gradients have no storage to zero.
  if (fsdp_ != nullptr) {
    fsdp_->BeginStep();
  } else {
    model_->ZeroGrad();
  }
  // find_unused_parameters: whether any forward of the step used each
  // parameter, and what the last one left unused.
  // A single rank (no reducer, no sharding) does the same on its own: what
  // no forward of the step used is not updated, torch's "grad is None".
  const bool alone = reducer_ == nullptr && fsdp_ == nullptr;
  const bool track = find_unused_parameters_ || alone;
  std::vector<bool> used;
  std::vector<Parameter*> unused;
  if (track) used.assign(model_->Parameters().size(), false);
  for (int64_t m = 0; m < accum; ++m) {
    const MicroBatch& batch = micro[static_cast<size_t>(m)];
    if (batch.seed.has_value()) model_->SetSeed(*batch.seed);
    if (m == 0) {
      if (absl::Status s = BroadcastBuffers(); !s.ok()) return s;
    }
    const double micro_loss = model_->ForwardLoss(batch, 1.0 / static_cast<double>(accum));
    loss += micro_loss / static_cast<double>(accum);
    if (track) {
      unused = model_->UnusedParameters();
      const std::vector<Parameter*>& params = model_->Parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        if (std::find(unused.begin(), unused.end(), params[i]) == unused.end()) used[i] = true;
      }
    }
    // DDP: only the last micro-batch's backward communicates; the mean loss
    // rides in its last bucket.
    const bool last = m == accum - 1;
    if (reducer_ != nullptr) {
      reducer_->BeginBackward(last, last ? static_cast<float>(loss) : 0.0f, used, unused);
    }
    model_->BackwardLoss();
    // SyncBatchNorm's collectives: the step is void after one failed.
    if (absl::Status s = model_->TakeCollectiveStatus(); !s.ok()) {
      if (reducer_ != nullptr) (void)reducer_->Finish(nullptr, nullptr);
      return s;
    }
  }
  if (fsdp_ != nullptr) {
    if (absl::Status s = fsdp_->Finish(&wait_seconds_, &allreduce_seconds_); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("sharded step: ", s.message()));
    }
    float mean = static_cast<float>(loss);
    if (absl::Status s = communicator_->AllReduce(&mean, 1, ReduceOp::kAvg); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("the step's loss: ", s.message()));
    }
    loss = mean;
    if (track) {
      // What no rank used is not stepped, as under DDP.
      std::vector<float> flags(used.size());
      for (size_t i = 0; i < used.size(); ++i) flags[i] = used[i] ? 1.0f : 0.0f;
      if (absl::Status s = communicator_->AllReduce(flags.data(), flags.size(), ReduceOp::kSum);
          !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("the used flags: ", s.message()));
      }
      const std::vector<Parameter*>& params = model_->Parameters();
      for (size_t i = 0; i < params.size(); ++i) params[i]->no_grad = flags[i] == 0.0f;
      fsdp_->CopyNoGradToShards();
    }
  } else if (reducer_ != nullptr) {
    if (absl::Status s = reducer_->Finish(&wait_seconds_, &allreduce_seconds_); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("gradient allreduce: ", s.message()));
    }
    loss = reducer_->averaged_extra();
  }
  if (alone) {
    const std::vector<Parameter*>& params = model_->Parameters();
    for (size_t i = 0; i < params.size(); ++i) params[i]->no_grad = !used[i];
  }
  if (absl::Status s = optimizer_->Step(lr); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("optimizer: ", s.message()));
  }
  if (fsdp_ != nullptr) {
    // The next forward gathers the updated weights, one unit ahead.
    fsdp_->AfterUpdate();
  } else if (reducer_ != nullptr) {
    const auto start = std::chrono::steady_clock::now();
    if (absl::Status s = reducer_->GatherParameters(); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("weights all-gather: ", s.message()));
    }
    // Nothing hides it: the step waits for all of it.
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    allreduce_seconds_ += took;
    wait_seconds_ += took;
  }
  return loss;
}

}  // namespace aidn::engine
