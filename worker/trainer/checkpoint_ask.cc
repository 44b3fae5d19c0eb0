#include "worker/trainer/checkpoint_ask.h"

#include "common/log.h"

namespace aidn::trainer {

void CheckpointAskFollower::Answer(int64_t step, int64_t completed) {
  if (step == answered_) return;
  answered_ = step;
  const bool missed = completed > step;
  if (missed) {
    AIDN_LOG(INFO) << "already past the checkpoint step asked for" << Kv("step", step)
                   << Kv("completed", completed);
  }
  reporter_->AnswerCheckpointAsk(step, missed);
}

bool CheckpointAskFollower::Due(int64_t completed) {
  Reporter::CheckpointAsk ask = reporter_->checkpoint_ask();
  if (ask.step == 0) return false;
  Answer(ask.step, completed);
  if (completed != ask.step) return false;
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
  // Another step (a rank had passed this one) or the generation's end.
  if (ask.step != 0) Answer(ask.step, completed);
  return false;
}

}  // namespace aidn::trainer
