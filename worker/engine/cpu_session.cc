#include "worker/engine/cpu_session.h"

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

absl::StatusOr<std::unique_ptr<CpuSession>> CpuSession::Create(const CpuSessionOptions& options,
                                                               TrainableModel* model,
                                                               const OptimizerConfig& config) {
  if (model == nullptr) return absl::InvalidArgumentError("cpu session: needs a model");
  if (options.shard_optimizer && options.communicator == nullptr) {
    return absl::InvalidArgumentError("cpu session: shard_optimizer needs a communicator");
  }
  std::unique_ptr<CpuSession> session(new CpuSession(model, nullptr));
  std::vector<Parameter*> params = model->Parameters();
  if (options.communicator != nullptr) {
    AIDN_ASSIGN_OR_RETURN(session->reducer_,
                          DdpReducer::Create({.bucket_mb = options.bucket_mb,
                                              .shard_optimizer = options.shard_optimizer},
                                             model->Parameters(), options.communicator));
    params = session->reducer_->ShardParameters();
    DdpReducer* r = session->reducer_.get();
    model->SetGradReadyCallback([r](Parameter* p) { r->OnGradReady(p); });
  }
  AIDN_ASSIGN_OR_RETURN(session->owned_optimizer_, Optimizer::Create(config, params));
  session->optimizer_ = session->owned_optimizer_.get();
  if (options.shard_optimizer && options.communicator->world_size() > 1) {
    // The whole gradient's sum of squares: each rank's in two floats (high
    // and low part), gathered and added in double in rank order, so every
    // rank computes the same bits.
    Communicator* comm = options.communicator;
    session->optimizer_->SetSumOfSquaresReduction([comm](double local) -> absl::StatusOr<double> {
      const float hi = static_cast<float>(local);
      const float mine[2] = {hi, static_cast<float>(local - static_cast<double>(hi))};
      std::vector<float> all(2 * static_cast<size_t>(comm->world_size()));
      AIDN_RETURN_IF_ERROR(comm->AllGather(mine, 2, all.data()));
      double sum = 0;
      for (size_t i = 0; i < all.size(); i += 2) {
        sum += static_cast<double>(all[i]) + static_cast<double>(all[i + 1]);
      }
      return sum;
    });
  }
  return session;
}

absl::StatusOr<std::unique_ptr<CpuSession>> CpuSession::Create(const CpuSessionOptions& options,
                                                               TrainableModel* model,
                                                               Optimizer* optimizer) {
  if (options.shard_optimizer) {
    return absl::InvalidArgumentError(
        "cpu session: shard_optimizer needs the session to make its optimizer");
  }
  if (model == nullptr || optimizer == nullptr) {
    return absl::InvalidArgumentError("cpu session: needs a model and an optimizer");
  }
  std::unique_ptr<CpuSession> session(new CpuSession(model, optimizer));
  if (options.communicator != nullptr) {
    // After the optimizer, as the trainer has always made them: with more
    // than one rank the reducer turns every gradient into a view of its
    // bucket.
    absl::StatusOr<std::unique_ptr<DdpReducer>> reducer = DdpReducer::Create(
        {.bucket_mb = options.bucket_mb}, model->Parameters(), options.communicator);
    if (!reducer.ok()) return reducer.status();
    session->reducer_ = *std::move(reducer);
    DdpReducer* r = session->reducer_.get();
    model->SetGradReadyCallback([r](Parameter* p) { r->OnGradReady(p); });
  }
  return session;
}

CpuSession::Memory CpuSession::memory() const {
  Memory m;
  int64_t weights = 0;
  for (const Parameter* p : model_->Parameters()) weights += 4 * p->value.numel();
  const DdpReducer::Memory r = reducer_ != nullptr ? reducer_->memory() : DdpReducer::Memory{};
  m.parameters = r.weight_buffers > 0 ? r.weight_buffers : weights;
  m.gradients = r.gradient_buckets > 0 ? r.gradient_buckets : weights;
  for (const Optimizer::StateEntry& e : optimizer_->State())
    m.optimizer_state += 4 * e.second->numel();
  return m;
}

CpuSession::~CpuSession() {
  if (reducer_ != nullptr) model_->SetGradReadyCallback(nullptr);
}

absl::StatusOr<double> CpuSession::Step(const std::vector<MicroBatch>& micro, double lr) {
  if (micro.empty()) return absl::InvalidArgumentError("cpu session: a step needs a micro-batch");
  allreduce_seconds_ = 0.0;
  wait_seconds_ = 0.0;
  const int64_t accum = static_cast<int64_t>(micro.size());
  double loss = 0;
  model_->ZeroGrad();
  for (int64_t m = 0; m < accum; ++m) {
    const MicroBatch& batch = micro[static_cast<size_t>(m)];
    if (batch.seed.has_value()) model_->SetSeed(*batch.seed);
    const double micro_loss = model_->ForwardLoss(batch, 1.0 / static_cast<double>(accum));
    loss += micro_loss / static_cast<double>(accum);
    // Only the last micro-batch's backward communicates; the mean loss
    // rides in its last bucket.
    const bool last = m == accum - 1;
    if (reducer_ != nullptr) reducer_->BeginBackward(last, last ? static_cast<float>(loss) : 0.0f);
    model_->BackwardLoss();
  }
  if (reducer_ != nullptr) {
    if (absl::Status s = reducer_->Finish(&wait_seconds_, &allreduce_seconds_); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("gradient allreduce: ", s.message()));
    }
    loss = reducer_->averaged_extra();
  }
  if (absl::Status s = optimizer_->Step(lr); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("optimizer: ", s.message()));
  }
  if (reducer_ != nullptr) {
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
