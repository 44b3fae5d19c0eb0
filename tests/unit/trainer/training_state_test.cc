#include "worker/trainer/training_state.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"

namespace aidn::trainer {
namespace {

using ::testing::HasSubstr;
using Lines = std::map<std::string, std::string>;

TrainingState Sample() {
  TrainingState s = TrainingState::At(/*step=*/45, /*steps_per_epoch=*/20, /*samples=*/128);
  s.total_steps = 100;
  s.seed = 7;
  s.world_size = 2;
  s.optimizer = "adamw";
  s.optimizer_steps = 45;
  s.model = "mlp";
  s.job = "j-1";
  s.generation = 3;
  return s;
}

// state.txt as the trainer has always written it: existing checkpoints
// must keep resuming, and tools read these lines.
constexpr char kGoldenStateTxt[] =
    "epoch 2\n"
    "generation 3\n"
    "job j-1\n"
    "loss_scale 32768.5\n"
    "loss_scale_growth_tracker 7\n"
    "model mlp\n"
    "optimizer adamw\n"
    "optimizer_steps 45\n"
    "rng dropout seed = seed * 1000003 + (step * accum + micro) * world_size + rank\n"
    "sampler_epoch 2\n"
    "sampler_offset 640\n"
    "seed 7\n"
    "step 45\n"
    "steps_per_epoch 20\n"
    "total_steps 100\n"
    "world_size 2\n";

TEST(TrainingState, WritesStateTxtByteForByteAsBefore) {
  TrainingState s = Sample();
  s.loss_scale = engine::LossScaleState{32768.5, 7};
  const std::string dir = absl::StrCat(::testing::TempDir(), "/training-state-", getpid());
  std::filesystem::remove_all(dir);
  engine::ModelConfig config;
  config.hidden_sizes = {4};
  std::unique_ptr<engine::Sequential> model = *engine::BuildModel(config, 1);
  engine::CheckpointContents contents;
  for (const engine::Parameter* p : model->Parameters()) contents.model.push_back(p);
  contents.state = s.Encode();
  absl::StatusOr<engine::WrittenCheckpoint> written = engine::WriteCheckpoint(dir, 45, contents);
  ASSERT_TRUE(written.ok()) << written.status();
  std::ifstream in(written->path + "/" + engine::kStateFile);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), kGoldenStateTxt);

  // And it reads back as written.
  absl::StatusOr<engine::LoadedCheckpoint> loaded =
      engine::LoadCheckpoint(written->path, model->Parameters());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  absl::StatusOr<TrainingState> back = TrainingState::Decode(loaded->state);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->Encode(), s.Encode());
  std::filesystem::remove_all(dir);
}

TEST(TrainingState, RoundTripsThroughStateTxtLines) {
  for (bool fp16 : {false, true}) {
    TrainingState s = Sample();
    if (fp16) s.loss_scale = engine::LossScaleState{0.1 + 0.2, 3};  // not a short decimal
    const Lines lines = s.Encode();
    EXPECT_EQ(lines.contains("loss_scale"), fp16);
    absl::StatusOr<TrainingState> back = TrainingState::Decode(lines);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->step, 45);
    EXPECT_EQ(back->epoch, 2);
    EXPECT_EQ(back->sampler_epoch, 2);
    EXPECT_EQ(back->sampler_offset, 5 * 128);
    EXPECT_EQ(back->total_steps, 100);
    EXPECT_EQ(back->steps_per_epoch, 20);
    EXPECT_EQ(back->seed, 7u);
    EXPECT_EQ(back->rng, kDropoutSeedRule);
    EXPECT_EQ(back->world_size, 2);
    EXPECT_EQ(back->optimizer, "adamw");
    EXPECT_EQ(back->optimizer_steps, 45);
    EXPECT_EQ(back->model, "mlp");
    EXPECT_EQ(back->job, "j-1");
    EXPECT_EQ(back->generation, 3);
    ASSERT_EQ(back->loss_scale.has_value(), fp16);
    if (fp16) {
      EXPECT_EQ(back->loss_scale->scale, 0.1 + 0.2);  // bit for bit
      EXPECT_EQ(back->loss_scale->growth_tracker, 3);
    }
    EXPECT_EQ(back->Encode(), lines);
  }
}

TEST(TrainingState, RoundTripsThroughTheBroadcastArray) {
  TrainingState s = Sample();
  s.loss_scale = engine::LossScaleState{1.0 / 3.0, 11};
  std::optional<TrainingState> back = TrainingState::DecodeBroadcast(s.EncodeBroadcast());
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->step, s.step);
  EXPECT_EQ(back->optimizer_steps, s.optimizer_steps);
  EXPECT_EQ(back->steps_per_epoch, s.steps_per_epoch);
  EXPECT_EQ(back->world_size, s.world_size);
  ASSERT_TRUE(back->loss_scale.has_value());
  EXPECT_EQ(back->loss_scale->scale, 1.0 / 3.0);
  EXPECT_EQ(back->loss_scale->growth_tracker, 11);

  s.loss_scale.reset();
  back = TrainingState::DecodeBroadcast(s.EncodeBroadcast());
  ASSERT_TRUE(back.has_value());
  EXPECT_FALSE(back->loss_scale.has_value());

  EXPECT_FALSE(TrainingState::DecodeBroadcast(TrainingState::EncodeNone()).has_value());
}

TEST(TrainingState, AMissingKeyIsDataLossNamingIt) {
  for (const char* key : {"step", "optimizer_steps", "steps_per_epoch", "world_size"}) {
    Lines lines = Sample().Encode();
    lines.erase(key);
    absl::StatusOr<TrainingState> decoded = TrainingState::Decode(lines);
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << key;
    EXPECT_THAT(decoded.status().message(), HasSubstr(key));
  }
  // Keys only for people may be missing.
  Lines lines = Sample().Encode();
  for (const char* key : {"epoch", "total_steps", "sampler_epoch", "sampler_offset", "seed", "rng",
                          "optimizer", "model", "job", "generation"}) {
    lines.erase(key);
  }
  absl::StatusOr<TrainingState> decoded = TrainingState::Decode(lines);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->optimizer_steps, 45);
}

TEST(TrainingState, BadValuesAreDataLoss) {
  Lines lines = Sample().Encode();
  lines["world_size"] = "two";
  absl::Status s = TrainingState::Decode(lines).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("world_size \"two\""));

  for (const auto& [scale, tracker] : std::vector<std::pair<std::string, std::string>>{
           {"0", "1"}, {"-2", "1"}, {"nan", "1"}, {"big", "1"}, {"2", "x"}}) {
    lines = Sample().Encode();
    lines["loss_scale"] = scale;
    lines["loss_scale_growth_tracker"] = tracker;
    s = TrainingState::Decode(lines).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << scale << " " << tracker;
    EXPECT_THAT(s.message(), HasSubstr("loss_scale")) << scale;
  }
  lines = Sample().Encode();
  lines["loss_scale"] = "1024";
  s = TrainingState::Decode(lines).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("loss_scale_growth_tracker is missing"));
}

TEST(TrainingState, AtPlacesTheSampler) {
  TrainingState s = TrainingState::At(/*step=*/40, /*steps_per_epoch=*/20, /*samples=*/64);
  EXPECT_EQ(s.epoch, 2);
  EXPECT_EQ(s.sampler_epoch, 2);
  EXPECT_EQ(s.sampler_offset, 0);
  s = TrainingState::At(/*step=*/7, /*steps_per_epoch=*/20, /*samples=*/64);
  EXPECT_EQ(s.epoch, 0);
  EXPECT_EQ(s.sampler_offset, 7 * 64);
}

}  // namespace
}  // namespace aidn::trainer
