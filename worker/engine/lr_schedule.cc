#include "worker/engine/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"

namespace aidn::engine {

absl::Status ValidateLrSchedule(const LrScheduleConfig& config) {
  if (config.warmup_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr_schedule.warmup_steps = ", config.warmup_steps, ": must be >= 0"));
  }
  switch (config.kind) {
    case LrScheduleConfig::Kind::kConstant:
      break;
    case LrScheduleConfig::Kind::kStep:
      if (config.step_size <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("lr_schedule.step_size = ", config.step_size, ": must be > 0"));
      }
      if (!(config.gamma >= 0 && config.gamma <= 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("lr_schedule.gamma = ", config.gamma, ": must be in [0, 1]"));
      }
      break;
    case LrScheduleConfig::Kind::kCosine:
      if (!(config.min_lr >= 0) || !std::isfinite(config.min_lr)) {
        return absl::InvalidArgumentError(
            absl::StrCat("lr_schedule.min_lr = ", config.min_lr, ": must be finite and >= 0"));
      }
      break;
  }
  return absl::OkStatus();
}

double LearningRate(const LrScheduleConfig& config, double base_lr, int64_t step,
                    int64_t total_steps) {
  step = std::max<int64_t>(step, 0);
  const int64_t warmup = std::max<int64_t>(config.warmup_steps, 0);
  if (step < warmup) {
    return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  }
  const int64_t t = step - warmup;
  switch (config.kind) {
    case LrScheduleConfig::Kind::kConstant:
      return base_lr;
    case LrScheduleConfig::Kind::kStep:
      if (config.step_size <= 0) return base_lr;
      return base_lr * std::pow(config.gamma, static_cast<double>(t / config.step_size));
    case LrScheduleConfig::Kind::kCosine: {
      const int64_t period = total_steps - warmup;
      if (period <= 0 || t >= period) return config.min_lr;
      const double phase = std::numbers::pi * static_cast<double>(t) / static_cast<double>(period);
      return config.min_lr + (base_lr - config.min_lr) * (1.0 + std::cos(phase)) / 2.0;
    }
  }
  return base_lr;
}

}  // namespace aidn::engine
