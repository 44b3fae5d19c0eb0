#include "worker/trainer/training_state.h"

#include <bit>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace aidn::trainer {
namespace {

using Lines = std::map<std::string, std::string>;

const std::string* Find(const Lines& lines, const char* key) {
  auto it = lines.find(key);
  return it == lines.end() ? nullptr : &it->second;
}

// A key a resume needs.
template <typename Int>
absl::Status Required(const Lines& lines, const char* key, Int* out) {
  const std::string* value = Find(lines, key);
  if (value == nullptr) {
    return absl::DataLossError(absl::StrCat("checkpoint state.txt lacks the key ", key));
  }
  if (!absl::SimpleAtoi(*value, out)) {
    return absl::DataLossError(
        absl::StrCat("checkpoint state.txt: ", key, " \"", *value, "\" is not a number"));
  }
  return absl::OkStatus();
}

// A key only for people: read where present and well formed.
template <typename Int>
void Optional(const Lines& lines, const char* key, Int* out) {
  if (const std::string* value = Find(lines, key); value != nullptr) {
    Int parsed = 0;
    if (absl::SimpleAtoi(*value, &parsed)) *out = parsed;
  }
}

void Optional(const Lines& lines, const char* key, std::string* out) {
  if (const std::string* value = Find(lines, key); value != nullptr) *out = *value;
}

}  // namespace

TrainingState TrainingState::At(int64_t step, int64_t steps_per_epoch, int64_t samples_per_step) {
  TrainingState state;
  state.step = step;
  state.steps_per_epoch = steps_per_epoch;
  state.epoch = step / steps_per_epoch;
  state.sampler_epoch = step / steps_per_epoch;
  state.sampler_offset = (step % steps_per_epoch) * samples_per_step;
  return state;
}

Lines TrainingState::Encode() const {
  Lines lines = {
      {"step", absl::StrCat(step)},
      {"epoch", absl::StrCat(epoch)},
      {"total_steps", absl::StrCat(total_steps)},
      {"steps_per_epoch", absl::StrCat(steps_per_epoch)},
      {"sampler_epoch", absl::StrCat(sampler_epoch)},
      {"sampler_offset", absl::StrCat(sampler_offset)},
      {"seed", absl::StrCat(seed)},
      {"rng", rng},
      {"world_size", absl::StrCat(world_size)},
      {"optimizer", optimizer},
      {"optimizer_steps", absl::StrCat(optimizer_steps)},
      {"model", model},
      {"job", job},
      {"generation", absl::StrCat(generation)},
  };
  if (loss_scale.has_value()) {
    // All 17 digits: the scale read back is the same double.
    lines["loss_scale"] = absl::StrFormat("%.17g", loss_scale->scale);
    lines["loss_scale_growth_tracker"] = absl::StrCat(loss_scale->growth_tracker);
  }
  return lines;
}

absl::StatusOr<TrainingState> TrainingState::Decode(const Lines& lines) {
  TrainingState state;
  state.rng.clear();
  for (absl::Status s : {Required(lines, "step", &state.step),
                         Required(lines, "optimizer_steps", &state.optimizer_steps),
                         Required(lines, "steps_per_epoch", &state.steps_per_epoch),
                         Required(lines, "world_size", &state.world_size)}) {
    if (!s.ok()) return s;
  }
  Optional(lines, "epoch", &state.epoch);
  Optional(lines, "total_steps", &state.total_steps);
  Optional(lines, "sampler_epoch", &state.sampler_epoch);
  Optional(lines, "sampler_offset", &state.sampler_offset);
  Optional(lines, "seed", &state.seed);
  Optional(lines, "generation", &state.generation);
  Optional(lines, "rng", &state.rng);
  Optional(lines, "optimizer", &state.optimizer);
  Optional(lines, "model", &state.model);
  Optional(lines, "job", &state.job);
  if (const std::string* scale_text = Find(lines, "loss_scale"); scale_text != nullptr) {
    double scale = 0;
    int64_t tracker = 0;
    const std::string* tracker_text = Find(lines, "loss_scale_growth_tracker");
    if (!absl::SimpleAtod(*scale_text, &scale) || !(scale > 0) || tracker_text == nullptr ||
        !absl::SimpleAtoi(*tracker_text, &tracker)) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint state.txt: loss_scale \"", *scale_text,
          "\" is not a number > 0, or loss_scale_growth_tracker is missing or not a number"));
    }
    state.loss_scale = engine::LossScaleState{scale, static_cast<int>(tracker)};
  }
  return state;
}

TrainingState::Broadcast TrainingState::EncodeBroadcast() const {
  Broadcast values = {step, optimizer_steps, steps_per_epoch, world_size, 0, 0};
  if (loss_scale.has_value()) {
    values[4] = std::bit_cast<int64_t>(loss_scale->scale);
    values[5] = loss_scale->growth_tracker;
  }
  return values;
}

std::optional<TrainingState> TrainingState::DecodeBroadcast(const Broadcast& values) {
  if (values[0] == 0) return std::nullopt;
  TrainingState state;
  state.step = values[0];
  state.optimizer_steps = values[1];
  state.steps_per_epoch = values[2];
  state.world_size = values[3];
  if (values[4] != 0) {
    state.loss_scale =
        engine::LossScaleState{std::bit_cast<double>(values[4]), static_cast<int>(values[5])};
  }
  return state;
}

}  // namespace aidn::trainer
