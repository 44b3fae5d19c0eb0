#include "worker/engine/pipeline_session.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/status.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/tensor_parallel.h"

namespace aidn::engine {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

absl::StatusOr<std::unique_ptr<PipelineSession>> PipelineSession::Create(
    const PipelineSessionOptions& options, PipelineStageModel* model,
    const OptimizerConfig& config) {
  if (model == nullptr) return absl::InvalidArgumentError("pipeline session: needs a stage model");
  const int stages = model->stages();
  if ((!model->first() && options.prev == nullptr) || (!model->last() && options.next == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline stage ", model->stage(), " of ",
                                                   stages, ": needs a link to each neighbour"));
  }
  if (stages > 1 && (options.pipeline == nullptr || options.pipeline->world_size() != stages)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline session: needs a communicator of the ", stages, " stages"));
  }
  if (model->tied() != nullptr && (options.tied == nullptr || options.tied->world_size() != 2)) {
    return absl::InvalidArgumentError(
        "pipeline session: the first and last stages share a parameter and need a "
        "communicator of the two");
  }
  std::unique_ptr<PipelineSession> session(new PipelineSession(options, model));
  const bool shard =
      options.shard_optimizer && options.data != nullptr && options.data->world_size() > 1;
  // ZeRO-1: the tied parameter stays out of the buckets (Finish averages
  // it), since the two ends' buckets would slice it differently.
  Parameter* const unbucketed = shard ? model->tied() : nullptr;
  std::vector<Parameter*> optimized = model->Parameters();
  if (options.data != nullptr && options.data->world_size() > 1) {
    std::vector<Parameter*> bucketed = model->Parameters();
    std::erase(bucketed, unbucketed);
    AIDN_ASSIGN_OR_RETURN(session->reducer_, DdpReducer::Create({.bucket_mb = options.bucket_mb,
                                                                 .shard_optimizer = shard},
                                                                bucketed, options.data));
    DdpReducer* r = session->reducer_.get();
    model->SetGradReadyCallback([r, unbucketed](Parameter* p) {
      if (p != unbucketed) r->OnGradReady(p);
    });
    if (shard) {
      optimized = r->ShardParameters();
      if (unbucketed != nullptr) optimized.insert(optimized.begin(), unbucketed);
    }
  }
  AIDN_ASSIGN_OR_RETURN(session->optimizer_, Optimizer::Create(config, optimized));
  if (shard) {
    // Each replica holds its slices of the stage's gradient; the tied
    // parameter, whole on every replica, counts on the first stage.
    session->optimizer_->SetSumOfSquaresReduction(ShardedSumOfSquares(
        *session->shard_map(), options.tensor_whole, model->tied(), model->first(), options.data,
        options.tensor, stages > 1 ? options.pipeline : nullptr));
    return session;
  }
  // The stage's sum within its tensor group: split parameters summed, whole
  // ones once.
  Optimizer::SumOfSquaresReduction stage;
  if (options.tensor != nullptr && options.tensor->world_size() > 1) {
    stage = TensorParallelSumOfSquares(options.tensor, options.tensor_whole);
  }
  if (stages > 1) {
    // The norm of the whole model's gradient: every stage's sum, the tied
    // parameter's once (the first stage's copy).
    Optimizer::SumOfSquaresReduction over = SumOfSquaresOver(options.pipeline);
    Parameter* duplicate = model->first() ? nullptr : model->tied();
    session->optimizer_->SetSumOfSquaresReduction(
        [over, stage, duplicate](double local) -> absl::StatusOr<double> {
          double mine = duplicate == nullptr ? local : local - SumOfSquares(duplicate->grad);
          if (stage) {
            AIDN_ASSIGN_OR_RETURN(mine, stage(mine));
          }
          return over(mine);
        });
  } else if (stage) {
    session->optimizer_->SetSumOfSquaresReduction(stage);
  }
  return session;
}

PipelineSession::~PipelineSession() {
  if (reducer_ != nullptr) model_->SetGradReadyCallback(nullptr);
}

absl::StatusOr<double> PipelineSession::Step(const std::vector<MicroBatch>& micro, double lr) {
  if (micro.empty()) {
    return absl::InvalidArgumentError("pipeline session: a step needs a micro-batch");
  }
  const Clock::time_point start = Clock::now();
  stats_ = Stats();
  model_->ZeroGrad();
  double loss = 0;
  AIDN_RETURN_IF_ERROR(RunSchedule(micro, &loss));
  AIDN_RETURN_IF_ERROR(Finish(&loss));
  AIDN_RETURN_IF_ERROR(Annotate(optimizer_->Step(lr), "optimizer"));
  if (reducer_ != nullptr) {
    // ZeRO-1: every replica's updated slices to every replica.
    AIDN_RETURN_IF_ERROR(Annotate(reducer_->GatherParameters(), "weights all-gather"));
  }
  stats_.step_seconds = SecondsSince(start);
  return loss;
}

absl::Status PipelineSession::RunSchedule(const std::vector<MicroBatch>& micro, double* loss) {
  const int m = static_cast<int>(micro.size());
  AIDN_ASSIGN_OR_RETURN(std::vector<PipelineAction> actions,
                        StageActions(options_.schedule, model_->stages(), model_->stage(), m));
  const double scale = 1.0 / static_cast<double>(m);
  inputs_.resize(static_cast<size_t>(m));
  kept_.assign(static_cast<size_t>(m), false);
  resident_ = -1;
  int backwards = 0;
  int in_flight = 0;
  // Bytes of the inputs held (received, not yet consumed).
  int64_t input_bytes = 0;
  auto peak = [&] {
    stats_.peak_kept_bytes = std::max(stats_.peak_kept_bytes, input_bytes + model_->kept_bytes());
  };
  auto receive = [&](int mb) -> Tensor* {
    Tensor* t = &inputs_[static_cast<size_t>(mb)];
    t->Resize(model_->InputShape(micro[static_cast<size_t>(mb)]));
    input_bytes += 4 * t->numel();
    peak();
    return t;
  };
  auto release = [&](int mb) {
    Tensor& t = inputs_[static_cast<size_t>(mb)];
    input_bytes -= 4 * t.numel();
    t = Tensor();
  };
  const std::vector<Parameter*> buffers = model_->Buffers();
  const bool broadcast = options_.broadcast_buffers && !buffers.empty() &&
                         options_.data != nullptr && options_.data->world_size() > 1;
  // `again`: the forward run a second time before its backward.
  auto forward = [&](int mb, bool again) -> absl::StatusOr<double> {
    const MicroBatch& batch = micro[static_cast<size_t>(mb)];
    if (batch.seed.has_value()) model_->SetSeed(*batch.seed);
    if (broadcast && !again && mb == 0) {
      // Every stage runs micro-batch 0's forward first, before DDP's
      // buckets (the step's last backward) use the data communicator.
      AIDN_RETURN_IF_ERROR(
          Annotate(DdpReducer::BroadcastParameters(buffers, options_.data), "broadcast_buffers"));
    }
    if (again) model_->FreezeRunningStatistics(true);
    const double l = model_->Forward(batch, inputs_[static_cast<size_t>(mb)], scale, &output_);
    if (again) model_->FreezeRunningStatistics(false);
    resident_ = mb;
    return l;
  };
  // Time in transfers: waiting for the neighbours is the bubble.
  auto transfer = [&](absl::Status s, Clock::time_point t0, const char* what, int mb) {
    stats_.transfer_seconds += SecondsSince(t0);
    return Annotate(s, absl::StrCat(what, " of micro-batch ", mb));
  };
  for (const PipelineAction& a : actions) {
    const int mb = a.micro_batch;
    const MicroBatch& batch = micro[static_cast<size_t>(mb)];
    const Clock::time_point t0 = Clock::now();
    switch (a.kind) {
      case PipelineAction::kRecvActivation: {
        Tensor* in = receive(mb);
        AIDN_RETURN_IF_ERROR(transfer(options_.prev->Recv(in->data(), in->numel()), t0,
                                      "receiving the activation", mb));
        break;
      }
      case PipelineAction::kForward: {
        AIDN_ASSIGN_OR_RETURN(const double l, forward(mb, /*again=*/false));
        *loss += l * scale;
        stats_.peak_in_flight = std::max(stats_.peak_in_flight, ++in_flight);
        if (model_->Keep(mb)) {
          // The activations hold what backward needs; the input is spent.
          kept_[static_cast<size_t>(mb)] = true;
          resident_ = -1;
          if (!model_->first()) release(mb);
        }
        peak();
        stats_.compute_seconds += SecondsSince(t0);
        break;
      }
      case PipelineAction::kSendActivation:
        AIDN_RETURN_IF_ERROR(transfer(
            options_.next->Send(output_.data(), static_cast<size_t>(model_->OutputFloats(batch))),
            t0, "sending the activation", mb));
        break;
      case PipelineAction::kRecvGradient:
        grad_output_.Resize(model_->OutputShape(batch));
        AIDN_RETURN_IF_ERROR(
            transfer(options_.next->Recv(grad_output_.data(), grad_output_.numel()), t0,
                     "receiving the gradient", mb));
        break;
      case PipelineAction::kBackward: {
        if (kept_[static_cast<size_t>(mb)]) {
          model_->Restore(mb);
        } else if (resident_ != mb) {
          AIDN_RETURN_IF_ERROR(forward(mb, /*again=*/true).status());
          ++stats_.recomputed;
        }
        const bool final = ++backwards == static_cast<int>(micro.size());
        // DDP: the last backward's gradients are final; the mean loss
        // (the last stage's) rides in its last bucket.
        if (reducer_ != nullptr) {
          reducer_->BeginBackward(final, final && model_->last() ? static_cast<float>(*loss) : 0);
        }
        model_->Backward(grad_output_, &grad_input_);
        resident_ = -1;
        --in_flight;
        stats_.compute_seconds += SecondsSince(t0);
        if (!model_->first() && !kept_[static_cast<size_t>(mb)]) release(mb);
        break;
      }
      case PipelineAction::kSendGradient:
        AIDN_RETURN_IF_ERROR(
            transfer(options_.prev->Send(grad_input_.data(),
                                         static_cast<size_t>(model_->InputFloats(batch))),
                     t0, "sending the gradient", mb));
        break;
      case PipelineAction::kSendActivationRecvGradient: {
        const MicroBatch& other = micro[static_cast<size_t>(a.other)];
        grad_output_.Resize(model_->OutputShape(other));
        AIDN_RETURN_IF_ERROR(
            transfer(options_.next->Exchange(output_.data(),
                                             static_cast<size_t>(model_->OutputFloats(batch)),
                                             grad_output_.data(), grad_output_.numel()),
                     t0, "sending the activation and receiving a gradient", mb));
        break;
      }
      case PipelineAction::kSendGradientRecvActivation: {
        Tensor* in = receive(a.other);
        AIDN_RETURN_IF_ERROR(
            transfer(options_.prev->Exchange(grad_input_.data(),
                                             static_cast<size_t>(model_->InputFloats(batch)),
                                             in->data(), in->numel()),
                     t0, "sending the gradient and receiving an activation", mb));
        break;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status PipelineSession::Finish(double* loss) {
  const Clock::time_point start = Clock::now();
  if (reducer_ != nullptr) {
    AIDN_RETURN_IF_ERROR(Annotate(reducer_->Finish(nullptr, nullptr), "gradient allreduce"));
    if (model_->last()) *loss = reducer_->averaged_extra();
  }
  Parameter* tied = model_->tied();
  if (tied != nullptr && shard_map() != nullptr) {
    // ZeRO-1 left it out of the buckets: averaged over the replicas here.
    AIDN_RETURN_IF_ERROR(
        Annotate(options_.data->AllReduce(tied->grad.data(),
                                          static_cast<size_t>(tied->grad.numel()), ReduceOp::kAvg),
                 absl::StrCat("the tied ", tied->name, "'s gradient over the replicas")));
  }
  if (tied != nullptr) {
    // Each end's part of the gradient (the embedding's, the LM head's).
    AIDN_RETURN_IF_ERROR(
        Annotate(options_.tied->AllReduce(tied->grad.data(),
                                          static_cast<size_t>(tied->grad.numel()), ReduceOp::kSum),
                 absl::StrCat("the tied ", tied->name, "'s gradient")));
  }
  stats_.allreduce_seconds = SecondsSince(start);
  if (model_->stages() > 1) {
    // The loss is the last stage's; the others learn it here.
    float mean = model_->last() ? static_cast<float>(*loss) : 0.0f;
    AIDN_RETURN_IF_ERROR(
        Annotate(options_.pipeline->AllReduce(&mean, 1, ReduceOp::kSum), "the step's loss"));
    *loss = mean;
  }
  return absl::OkStatus();
}

}  // namespace aidn::engine
