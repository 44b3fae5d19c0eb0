#ifndef AIDN_WORKER_ENGINE_LR_SCHEDULE_H_
#define AIDN_WORKER_ENGINE_LR_SCHEDULE_H_

// Learning-rate schedules: constant, step decay and cosine, each with an
// optional linear warmup. A pure function of the optimizer step, so a
// restarted trainer recomputes the rate from its restored step count.
//
// Choices (torch has no single scheduler with warmup; these are the usual
// LinearLR + StepLR / CosineAnnealingLR compositions, evaluated per step):
// - Warmup: for step < warmup_steps, lr = base_lr * (step + 1) / warmup_steps.
//   The first step already trains (base_lr / warmup_steps, not 0) and the last
//   warmup step reaches base_lr.
// - After warmup the schedule sees t = step - warmup_steps, starting at 0:
//   kConstant  base_lr
//   kStep      base_lr * gamma^floor(t / step_size)  (torch.optim.lr_scheduler.StepLR,
//              counted in optimizer steps, not epochs)
//   kCosine    min_lr + (base_lr - min_lr) * (1 + cos(pi * t / T)) / 2 with
//              T = total_steps - warmup_steps (CosineAnnealingLR with T_max = T,
//              eta_min = min_lr); t is clamped to T, so steps past the end stay
//              at min_lr, and T <= 0 (all warmup) gives min_lr.
// - A negative step counts as step 0.

#include <cstdint>

#include "absl/status/status.h"

namespace aidn::engine {

struct LrScheduleConfig {
  enum class Kind { kConstant, kStep, kCosine };
  Kind kind = Kind::kConstant;
  // Steps of linear warmup before the schedule proper (0: none).
  int64_t warmup_steps = 0;
  // kStep: decay by `gamma` every `step_size` steps (must be > 0).
  int64_t step_size = 0;
  double gamma = 0.1;
  // kCosine: the rate at the end of training.
  double min_lr = 0.0;
};

// INVALID_ARGUMENT naming the field: negative warmup, kStep with
// step_size <= 0 or gamma outside [0, 1], kCosine with min_lr < 0.
absl::Status ValidateLrSchedule(const LrScheduleConfig& config);

// The rate for the 0-based optimizer step `step` of a run of `total_steps`
// steps. For an invalid config (see ValidateLrSchedule) kStep with
// step_size <= 0 does not decay.
double LearningRate(const LrScheduleConfig& config, double base_lr, int64_t step,
                    int64_t total_steps);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_LR_SCHEDULE_H_
