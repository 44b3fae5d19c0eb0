#ifndef AIDN_WORKER_TRAINER_TRAINING_STATE_H_
#define AIDN_WORKER_TRAINER_TRAINING_STATE_H_

// The training state a checkpoint keeps beside its tensors, in one typed
// struct: what state.txt holds, and what rank 0 broadcasts to the other
// ranks when a generation resumes.
//
// state.txt is "key value" lines (engine::WriteCheckpoint writes the map
// Encode returns, sorted by key):
//
//   epoch 1                     step / steps_per_epoch (also sampler_epoch)
//   generation 3                the generation that wrote it
//   job j-1                     the job's id
//   loss_scale 32768            fp16 only: the scale the next step uses
//   loss_scale_growth_tracker 7 fp16 only: good steps since the last change
//   model mlp                   the spec's model name
//   optimizer adamw             the spec's optimizer name
//   optimizer_steps 40          the optimizer's step count (torch's 'step')
//   rng dropout seed = ...      the dropout seed rule (engine::DropoutSeed)
//   sampler_epoch 1             DistributedSampler position: the epoch ...
//   sampler_offset 1280         ... and the samples this rank has used of it
//   seed 7                      the spec's seed
//   step 40                     optimizer steps done
//   steps_per_epoch 32          whole optimizer steps per epoch
//   total_steps 100             the job's length in steps
//   world_size 2                ranks that trained
//
// A resume needs step, steps_per_epoch, world_size and optimizer_steps (and
// the loss scale pair where there is one); the other keys are for people
// and tools and are not read back.

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "worker/engine/loss_scale.h"

namespace aidn::trainer {

// The dropout seed rule as state.txt's "rng" line states it.
inline constexpr char kDropoutSeedRule[] =
    "dropout seed = seed * 1000003 + (step * accum + micro) * world_size + rank";

struct TrainingState {
  // Optimizer steps done (the checkpoint's step).
  int64_t step = 0;
  // step / steps_per_epoch.
  int64_t epoch = 0;
  int64_t total_steps = 0;
  int64_t steps_per_epoch = 0;
  // DistributedSampler position: the epoch's permutation comes from seed +
  // epoch; this rank has used sampler_offset of its samples.
  int64_t sampler_epoch = 0;
  int64_t sampler_offset = 0;
  uint64_t seed = 0;
  // Dropout's generator is reseeded every micro-step by this rule, so the
  // step number is its whole state.
  std::string rng = kDropoutSeedRule;
  int64_t world_size = 0;
  std::string optimizer;
  int64_t optimizer_steps = 0;
  std::string model;
  std::string job;
  int64_t generation = 0;
  // fp16: the dynamic loss scaler's state; none in fp32 / bf16 (and in
  // checkpoints older than fp16 training, whose resume starts the scale
  // again at its initial value).
  std::optional<engine::LossScaleState> loss_scale;

  // The position after `step` steps of `steps_per_epoch`, each using
  // `samples_per_step` samples of one rank: step, epoch and the sampler's.
  static TrainingState At(int64_t step, int64_t steps_per_epoch, int64_t samples_per_step);

  // state.txt's lines, key to value.
  std::map<std::string, std::string> Encode() const;
  // From state.txt's lines. DATA_LOSS naming the key when one a resume
  // needs is missing or not a number, or when loss_scale is not a number
  // > 0 or comes without loss_scale_growth_tracker. The keys only for
  // people are read where present (a number that does not parse is left
  // at its default: a resume does not use them).
  static absl::StatusOr<TrainingState> Decode(const std::map<std::string, std::string>& lines);

  // What every rank needs to resume, as rank 0 broadcasts it: [step,
  // optimizer steps, steps per epoch, world size, the loss scale's bits
  // (0: none), its growth tracker]. The int64s travel through a float
  // collective bit for bit (a broadcast copies, it never adds).
  using Broadcast = std::array<int64_t, 6>;
  // Nothing to resume from: step 0.
  static Broadcast EncodeNone() { return Broadcast{}; }
  Broadcast EncodeBroadcast() const;
  // nullopt for EncodeNone()'s array; otherwise a state with the broadcast
  // fields set and the rest at their defaults.
  static std::optional<TrainingState> DecodeBroadcast(const Broadcast& values);
};

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_TRAINING_STATE_H_
