#include "worker/engine/loss_scale.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace aidn::engine {

absl::StatusOr<DynamicLossScaler> DynamicLossScaler::Create(const LossScaleOptions& options) {
  if (!std::isfinite(options.init_scale) || options.init_scale <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scale init_scale: must be a finite number > 0, got ", options.init_scale));
  }
  if (!std::isfinite(options.growth_factor) || options.growth_factor <= 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scale growth_factor: must be a finite number > 1, got ", options.growth_factor));
  }
  if (!(options.backoff_factor > 0 && options.backoff_factor < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss scale backoff_factor: must be in (0, 1), got ", options.backoff_factor));
  }
  if (options.growth_interval < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss scale growth_interval: must be >= 1, got ", options.growth_interval));
  }
  return DynamicLossScaler(options);
}

absl::Status DynamicLossScaler::Restore(const LossScaleState& state) {
  if (!std::isfinite(state.scale) || state.scale <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss scale: must be a finite number > 0, got ", state.scale));
  }
  if (state.growth_tracker < 0 || state.growth_tracker >= options_.growth_interval) {
    return absl::InvalidArgumentError(absl::StrCat("loss scale growth_tracker: must be in [0, ",
                                                   options_.growth_interval, "), got ",
                                                   state.growth_tracker));
  }
  scale_ = state.scale;
  tracker_ = state.growth_tracker;
  return absl::OkStatus();
}

bool DynamicLossScaler::Update(bool found_non_finite) {
  if (found_non_finite) {
    scale_ *= options_.backoff_factor;
    tracker_ = 0;
    ++skipped_;
    return false;
  }
  if (++tracker_ == options_.growth_interval) {
    // As torch: the scale only grows while it stays finite.
    const double grown = scale_ * options_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;
    tracker_ = 0;
  }
  return true;
}

}  // namespace aidn::engine
