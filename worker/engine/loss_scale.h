#ifndef AIDN_WORKER_ENGINE_LOSS_SCALE_H_
#define AIDN_WORKER_ENGINE_LOSS_SCALE_H_

// Dynamic loss scaling for fp16 training, with torch.cuda.amp.GradScaler's
// rule and defaults: the loss gradient is multiplied by scale() so that
// small gradients survive fp16's narrow range; after backward the gradients
// are divided by it again and checked. A step whose gradients hold an inf or
// a NaN is skipped (no update, the optimizer's step count unchanged) and the
// scale is multiplied by backoff_factor; after growth_interval steps in a
// row without one, the scale is multiplied by growth_factor.
//
// Host-side state only (the GPU trainer does the checking); not thread-safe.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aidn::engine {

struct LossScaleOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int growth_interval = 2000;
};

// What a checkpoint keeps of a scaler (the options come from the spec).
struct LossScaleState {
  double scale = 0;
  int growth_tracker = 0;
};

class DynamicLossScaler {
 public:
  // INVALID_ARGUMENT naming the field: init_scale not a finite number > 0,
  // growth_factor not finite and > 1, backoff_factor not in (0, 1),
  // growth_interval < 1.
  static absl::StatusOr<DynamicLossScaler> Create(const LossScaleOptions& options);

  double scale() const { return scale_; }
  // Records a step's check; returns whether its update is to be applied.
  bool Update(bool found_non_finite);
  int64_t skipped_steps() const { return skipped_; }
  // Successful steps since the last change of scale (torch's growth
  // tracker).
  int growth_tracker() const { return tracker_; }

  LossScaleState state() const { return {scale_, tracker_}; }
  // A resume: continues from a checkpoint's scale and growth tracker, so
  // that a job does not restart at init_scale and overflow its way down
  // again. INVALID_ARGUMENT naming the field: scale not a finite number
  // > 0, growth_tracker outside [0, growth_interval). Nothing changes then.
  absl::Status Restore(const LossScaleState& state);

 private:
  explicit DynamicLossScaler(const LossScaleOptions& options)
      : options_(options), scale_(options.init_scale) {}
  LossScaleOptions options_;
  double scale_;
  int tracker_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_LOSS_SCALE_H_
