#ifndef AIDN_WORKER_TRAINER_CHECKPOINT_ASK_H_
#define AIDN_WORKER_TRAINER_CHECKPOINT_ASK_H_

// A rank's side of a checkpoint the coordinator asks for outside the
// spec's schedule (a pause; coordinator/checkpoint_agreement.h): at every
// step boundary, the rank answers a new ask (it will wait at the step, or
// it is already past it; asks that arrive later the reporter answers), and
// at the step itself waits for go, so that every rank checkpoints at the
// same step or none does.
//
// Not thread-safe: the training thread's.

#include <chrono>
#include <cstdint>

#include "worker/trainer/reporter.h"

namespace aidn::trainer {

class CheckpointAskFollower {
 public:
  // `reporter` is not owned. A rank waits at most `wait` for the others to
  // agree; then it says it missed the step and trains on. (A generation
  // whose ranks all wait that long has long failed its progress timeout.)
  explicit CheckpointAskFollower(Reporter* reporter,
                                 std::chrono::milliseconds wait = std::chrono::minutes(10))
      : reporter_(reporter), wait_(wait) {}

  // After `completed` steps: true when the rank is to checkpoint now.
  bool Due(int64_t completed);

 private:
  Reporter* reporter_;
  const std::chrono::milliseconds wait_;
};

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_CHECKPOINT_ASK_H_
