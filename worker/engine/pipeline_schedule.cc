#include "worker/engine/pipeline_schedule.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace aidn::engine {
namespace {

using A = PipelineAction;

class Builder {
 public:
  Builder(int stages, int stage) : first_(stage == 0), last_(stage == stages - 1) {}

  void RecvForward(int mb) {
    if (!first_) Add(A::kRecvActivation, mb);
  }
  void SendForward(int mb) {
    if (!last_) Add(A::kSendActivation, mb);
  }
  void RecvBackward(int mb) {
    if (!last_) Add(A::kRecvGradient, mb);
  }
  void SendBackward(int mb) {
    if (!first_) Add(A::kSendGradient, mb);
  }
  // Send the activation of `mb` forward, receive the gradient of `grad_mb`.
  void SendForwardRecvBackward(int mb, int grad_mb) {
    if (!last_) Add(A::kSendActivationRecvGradient, mb, grad_mb);
  }
  // Send the gradient of `mb` back, receive the activation of `next_mb`.
  void SendBackwardRecvForward(int mb, int next_mb) {
    if (!first_) Add(A::kSendGradientRecvActivation, mb, next_mb);
  }
  void Forward(int mb) { Add(A::kForward, mb); }
  void Backward(int mb) { Add(A::kBackward, mb); }

  std::vector<PipelineAction> Take() { return std::move(actions_); }

 private:
  void Add(A::Kind kind, int mb, int other = -1) { actions_.push_back({kind, mb, other}); }

  const bool first_;
  const bool last_;
  std::vector<PipelineAction> actions_;
};

}  // namespace

absl::StatusOr<std::vector<PipelineAction>> StageActions(PipelineSchedule schedule, int stages,
                                                         int stage, int micro_batches) {
  if (stages < 1 || micro_batches < 1 || stage < 0 || stage >= stages) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline of ", stages, " stages, stage ", stage,
                                                   ", ", micro_batches,
                                                   " micro-batches: need stages >= 1, "
                                                   "0 <= stage < stages, micro-batches >= 1"));
  }
  Builder b(stages, stage);
  const int m = micro_batches;
  if (schedule == PipelineSchedule::kGPipe) {
    for (int mb = 0; mb < m; ++mb) {
      b.RecvForward(mb);
      b.Forward(mb);
      b.SendForward(mb);
    }
    for (int mb = 0; mb < m; ++mb) {
      b.RecvBackward(mb);
      b.Backward(mb);
      b.SendBackward(mb);
    }
    return b.Take();
  }
  // 1F1B.
  const int warmup = std::min(stages - stage - 1, m);
  const int steady = m - warmup;
  for (int mb = 0; mb < warmup; ++mb) {
    b.RecvForward(mb);
    b.Forward(mb);
    b.SendForward(mb);
  }
  if (steady > 0) b.RecvForward(warmup);
  for (int i = 0; i < steady; ++i) {
    const int fwd = warmup + i;  // the forward of this round
    const int bwd = i;           // the backward of this round
    b.Forward(fwd);
    b.SendForwardRecvBackward(fwd, bwd);
    b.Backward(bwd);
    if (i == steady - 1) {
      b.SendBackward(bwd);
    } else {
      b.SendBackwardRecvForward(bwd, fwd + 1);
    }
  }
  for (int bwd = steady; bwd < m; ++bwd) {
    b.RecvBackward(bwd);
    b.Backward(bwd);
    b.SendBackward(bwd);
  }
  return b.Take();
}

int PeakInFlight(const std::vector<PipelineAction>& actions) {
  int now = 0, peak = 0;
  for (const PipelineAction& a : actions) {
    if (a.kind == PipelineAction::kForward) peak = std::max(peak, ++now);
    if (a.kind == PipelineAction::kBackward) --now;
  }
  return peak;
}

double IdealBubble(int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

std::string ActionName(const PipelineAction& a) {
  switch (a.kind) {
    case PipelineAction::kRecvActivation:
      return absl::StrCat("recv-act ", a.micro_batch);
    case PipelineAction::kForward:
      return absl::StrCat("F", a.micro_batch);
    case PipelineAction::kSendActivation:
      return absl::StrCat("send-act ", a.micro_batch);
    case PipelineAction::kRecvGradient:
      return absl::StrCat("recv-grad ", a.micro_batch);
    case PipelineAction::kBackward:
      return absl::StrCat("B", a.micro_batch);
    case PipelineAction::kSendGradient:
      return absl::StrCat("send-grad ", a.micro_batch);
    case PipelineAction::kSendActivationRecvGradient:
      return absl::StrCat("send-act ", a.micro_batch, "+recv-grad ", a.other);
    case PipelineAction::kSendGradientRecvActivation:
      return absl::StrCat("send-grad ", a.micro_batch, "+recv-act ", a.other);
  }
  return "?";
}

}  // namespace aidn::engine
