#include "worker/trainer/training_task.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "worker/engine/cpu.h"
#include "worker/engine/loss.h"

namespace aidn::trainer {
namespace {

// A text task over a corpus of `bytes` bytes written to a temporary file.
class TextTaskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (std::filesystem::temp_directory_path() /
             absl::StrCat("aidn_text_task_", ::getpid(), ".txt"))
                .string();
    engine::ConfigureCpu(1);
  }
  void TearDown() override { std::filesystem::remove(path_); }

  v1::JobSpec Spec(size_t bytes) {
    std::string text;
    for (size_t i = 0; text.size() < bytes; ++i)
      text += absl::StrCat("line ", i % 97, " of text\n");
    text.resize(bytes);
    std::ofstream(path_) << text;
    v1::JobSpec spec;
    spec.set_seed(4);
    spec.set_batch_size(3);
    v1::ModelSpec* m = spec.mutable_model();
    m->set_name("gpt");
    m->set_n_layer(1);
    m->set_n_head(2);
    m->set_n_embd(16);
    m->set_block_size(16);
    m->set_vocab_size(256);
    spec.mutable_dataset()->set_kind("text");
    spec.mutable_dataset()->add_files(path_);
    spec.mutable_dataset()->set_val_fraction(0.2);
    spec.mutable_dataset()->set_eval_windows(10);
    return spec;
  }

  std::string path_;
};

TEST_F(TextTaskTest, ItemsAreWindowsOfTheTrainingText) {
  auto task = TrainingTask::Create(Spec(8000), "");
  ASSERT_TRUE(task.ok()) << task.status();
  // 6400 training bytes: (6400 - 16) / 16 windows of 17.
  EXPECT_EQ((*task)->train_items(), 399);
  EXPECT_EQ((*task)->tokens_per_item(), 16);
  EXPECT_EQ((*task)->sequential(), nullptr);
  EXPECT_EQ((*task)->Metadata().at(0).second,
            "n_layer=1,n_head=2,n_embd=16,block_size=16,vocab_size=256,bias=1");
  const std::vector<int64_t> indices = {5, 7, 398, 0};
  const engine::MicroBatch batch = (*task)->Gather(/*epoch=*/2, indices, 1, 3, 0);
  ASSERT_NE(batch.tokens, nullptr);
  EXPECT_EQ(batch.images, nullptr);
  EXPECT_EQ(batch.seq_len, 16);
  ASSERT_EQ(batch.tokens->size(), 48u);
  // Targets are the inputs one byte later.
  for (size_t r = 0; r < 3; ++r) {
    for (size_t t = 0; t + 1 < 16; ++t) {
      EXPECT_EQ((*batch.labels)[r * 16 + t], (*batch.tokens)[r * 16 + t + 1]);
    }
  }
  // A language model's step runs on it.
  engine::TrainableModel& model = (*task)->model();
  model.ZeroGrad();
  const double loss = model.ForwardLoss(batch, 1.0);
  EXPECT_NEAR(loss, std::log(256.0), 0.5);
}

// A step's micro-batches (gradient accumulation) are gathered one slot
// after the other; each stays valid while the later ones are gathered.
TEST_F(TextTaskTest, EarlierSlotsOfAStepStayValid) {
  auto task = TrainingTask::Create(Spec(8000), "");
  ASSERT_TRUE(task.ok()) << task.status();
  const std::vector<int64_t> indices = {1, 2, 3, 4, 5, 6, 7, 8};
  const engine::MicroBatch first = (*task)->Gather(0, indices, 0, 2, 0);
  const std::vector<int32_t> copy = *first.tokens;
  for (size_t slot = 1; slot < 8; ++slot) (*task)->Gather(0, indices, slot, 1, slot);
  EXPECT_EQ(*first.tokens, copy);
  EXPECT_EQ(first.tokens->size(), 32u);
}

TEST_F(TextTaskTest, TheRanksEvaluateDisjointSharesOfTheSameWindows) {
  auto task = TrainingTask::Create(Spec(8000), "");
  ASSERT_TRUE(task.ok()) << task.status();
  const TrainingTask::EvalSums whole = (*task)->Evaluate(0, 1);
  // eval_windows 10 windows of 16 tokens.
  EXPECT_EQ(whole.count, 160);
  EXPECT_GT(whole.loss_sum, 0);
  TrainingTask::EvalSums sum;
  for (int rank = 0; rank < 3; ++rank) {
    const TrainingTask::EvalSums share = (*task)->Evaluate(rank, 3);
    sum.loss_sum += share.loss_sum;
    sum.correct += share.correct;
    sum.count += share.count;
  }
  EXPECT_EQ(sum.count, whole.count);
  EXPECT_EQ(sum.correct, whole.correct);
  EXPECT_NEAR(sum.loss_sum, whole.loss_sum, 1e-4 * whole.loss_sum);
  // The same windows every time.
  EXPECT_EQ((*task)->Evaluate(0, 1).loss_sum, whole.loss_sum);
  const std::string line = (*task)->EvalLine(1, 10, std::log(8.0), 0.25);
  EXPECT_TRUE(absl::StrContains(line, "perplexity 8.000 | 3.000 bits/byte")) << line;
}

// An evaluation elsewhere (the GPU session's) gets the same batches: a
// second copy of the model (the same seed) evaluating them gives the CPU's
// sums exactly; its error comes back.
TEST_F(TextTaskTest, AnotherEvaluatorGetsTheSameBatches) {
  auto task = TrainingTask::Create(Spec(8000), "");
  auto twin = TrainingTask::Create(Spec(8000), "");
  ASSERT_TRUE(task.ok() && twin.ok());
  const TrainingTask::EvalSums want = (*task)->Evaluate(1, 2);
  int batches = 0;
  absl::StatusOr<TrainingTask::EvalSums> got = (*task)->EvaluateWith(
      1, 2, [&](const engine::MicroBatch& b) -> absl::StatusOr<TrainingTask::BatchResult> {
        ++batches;
        EXPECT_EQ(b.seq_len, 16);
        EXPECT_EQ(b.tokens->size(), b.labels->size());
        engine::Gpt* model = (*twin)->gpt();
        const double loss =
            model->Forward(b.tokens->data(), b.labels->data(),
                           static_cast<int64_t>(b.tokens->size()) / b.seq_len, b.seq_len, false);
        return TrainingTask::BatchResult{loss,
                                         engine::CountCorrect(model->WholeLogits(), *b.labels)};
      });
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GT(batches, 0);
  EXPECT_EQ(got->loss_sum, want.loss_sum);
  EXPECT_EQ(got->correct, want.correct);
  EXPECT_EQ(got->count, want.count);
  absl::StatusOr<TrainingTask::EvalSums> failed = (*task)->EvaluateWith(
      0, 1, [](const engine::MicroBatch&) -> absl::StatusOr<TrainingTask::BatchResult> {
        return absl::UnavailableError("device lost");
      });
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(TextTaskTest, ACorpusTooShortForTheValidationWindowsIsNamed) {
  auto task = TrainingTask::Create(Spec(100), "");
  ASSERT_FALSE(task.ok());
  EXPECT_EQ(task.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(
      absl::StartsWith(task.status().message(), "dataset.val_fraction: the validation text"))
      << task.status();
}

TEST_F(TextTaskTest, AMissingFileIsNamed) {
  v1::JobSpec spec = Spec(8000);
  spec.mutable_dataset()->add_files("/nonexistent/corpus.txt");
  auto task = TrainingTask::Create(spec, "");
  ASSERT_FALSE(task.ok());
  EXPECT_EQ(task.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(task.status().message(), "/nonexistent/corpus.txt"))
      << task.status();
}

}  // namespace
}  // namespace aidn::trainer
