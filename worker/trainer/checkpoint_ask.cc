#include "worker/trainer/checkpoint_ask.h"

#include "common/log.h"

namespace aidn::trainer {

bool CheckpointAskFollower::Due(int64_t completed) {
  // Answers an ask not yet answered (the reporter answers those that
  // arrive after the first boundary itself).
  Reporter::CheckpointAsk ask = reporter_->AtStepBoundary(completed);
  if (ask.step == 0 || completed != ask.step) return false;
  if (ask.go) return true;
  AIDN_LOG(INFO) << "waiting at the checkpoint step asked for until every rank is there"
                 << Kv("step", ask.step);
  ask = reporter_->AwaitCheckpointGo(ask.step, wait_);
  if (ask.step == completed && ask.go) return true;
  if (ask.step == completed) {
    // No word in time: the coordinator is to propose another step.
    AIDN_LOG(WARNING) << "no agreement on the checkpoint step asked for; training on"
                      << Kv("step", ask.step);
    reporter_->AnswerCheckpointAsk(ask.step, /*missed=*/true);
    return false;
  }
  // Another step (a rank had passed this one; the reporter acked it) or the
  // generation's end.
  return false;
}

}  // namespace aidn::trainer
