#include "worker/trainer/training_task.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "worker/engine/loss.h"
#include "worker/engine/text_data.h"
#include "worker/trainer/engine_config.h"

namespace aidn::trainer {
namespace {

absl::Status Prefixed(const char* field, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
}

class ImageTask final : public TrainingTask {
 public:
  // `eval_samples`: the test samples evaluated, the first ones (0: all).
  ImageTask(engine::Dataset train, engine::Dataset test, std::unique_ptr<engine::Sequential> model,
            int64_t eval_samples)
      : train_(std::move(train)),
        test_(std::move(test)),
        model_(std::move(model)),
        classifier_(model_.get()),
        eval_samples_(eval_samples > 0 ? std::min(eval_samples, test_.size) : test_.size) {}

  engine::TrainableModel& model() override { return classifier_; }
  const engine::Sequential* sequential() const override { return model_.get(); }
  engine::Sequential* mutable_sequential() override { return model_.get(); }
  int64_t train_items() const override { return train_.size; }
  int64_t tokens_per_item() const override { return 0; }

  engine::MicroBatch Gather(int64_t /*epoch*/, const std::vector<int64_t>& indices, size_t begin,
                            size_t count, size_t slot) override {
    if (slot >= images_.size()) {
      images_.resize(slot + 1);
      labels_.resize(slot + 1);
    }
    engine::GatherBatch(train_, indices, begin, count, &images_[slot], &labels_[slot]);
    return engine::MicroBatch{&images_[slot], &labels_[slot], std::nullopt};
  }

  absl::StatusOr<EvalSums> EvaluateWith(int rank, int world_size,
                                        const BatchEvaluator& evaluator) override {
    // Each rank takes every world_size-th test sample.
    std::vector<int64_t> mine;
    for (int64_t i = rank; i < eval_samples_; i += world_size) mine.push_back(i);
    engine::Tensor images, logits;
    std::vector<int32_t> labels;
    const BatchEvaluator on_cpu = [&](const engine::MicroBatch& b) -> absl::StatusOr<BatchResult> {
      model_->Forward(*b.images, &logits, /*training=*/false);
      return BatchResult{engine::SoftmaxCrossEntropy(logits, *b.labels, nullptr),
                         engine::CountCorrect(logits, *b.labels)};
    };
    const BatchEvaluator& run = evaluator ? evaluator : on_cpu;
    EvalSums sums;
    constexpr size_t kEvalBatch = 256;  // bounds the CNN's im2col buffers
    for (size_t begin = 0; begin < mine.size(); begin += kEvalBatch) {
      const size_t count = std::min(kEvalBatch, mine.size() - begin);
      engine::GatherBatch(test_, mine, begin, count, &images, &labels);
      AIDN_ASSIGN_OR_RETURN(const BatchResult r,
                            run(engine::MicroBatch{&images, &labels, std::nullopt}));
      sums.loss_sum += r.mean_loss * static_cast<double>(count);
      sums.correct += static_cast<double>(r.correct);
    }
    sums.count = static_cast<double>(mine.size());
    return sums;
  }

  std::string EvalLine(int32_t epoch, int64_t /*step*/, double loss,
                       double accuracy) const override {
    return absl::StrFormat("epoch %d | test loss %.4f | test accuracy %.4f", epoch, loss, accuracy);
  }

 private:
  const engine::Dataset train_, test_;
  std::unique_ptr<engine::Sequential> model_;
  engine::Classifier classifier_;
  const int64_t eval_samples_;
  // A deque: growing it keeps the earlier slots (which the step's earlier
  // micro-batches point into) where they are.
  std::deque<engine::Tensor> images_;
  std::deque<std::vector<int32_t>> labels_;
};

class TextTask final : public TrainingTask {
 public:
  TextTask(const v1::JobSpec& spec, engine::TextSplit text, std::unique_ptr<engine::Gpt> model)
      : seed_(spec.seed()),
        block_(model->config().block_size),
        eval_batch_(std::max(1, spec.batch_size())),
        eval_windows_(spec.dataset().eval_windows()),
        text_(std::move(text)),
        model_(std::move(model)),
        lm_(model_.get()) {}

  engine::TrainableModel& model() override { return lm_; }
  engine::Gpt* gpt() override { return model_.get(); }
  int64_t train_items() const override {
    return engine::TextWindowCount(text_.train.size(), block_);
  }
  int64_t tokens_per_item() const override { return block_; }

  engine::MicroBatch Gather(int64_t epoch, const std::vector<int64_t>& indices, size_t begin,
                            size_t count, size_t slot) override {
    if (slot >= x_.size()) {
      x_.resize(slot + 1);
      y_.resize(slot + 1);
    }
    const size_t n = count * static_cast<size_t>(block_);
    x_[slot].resize(n);
    y_[slot].resize(n);
    engine::GatherTextWindows(text_.train, engine::TextWindowShift(seed_, epoch, block_), block_,
                              indices, begin, count, x_[slot].data(), y_[slot].data());
    engine::MicroBatch batch;
    batch.tokens = &x_[slot];
    batch.labels = &y_[slot];
    batch.seq_len = block_;
    return batch;
  }

  absl::StatusOr<EvalSums> EvaluateWith(int rank, int world_size,
                                        const BatchEvaluator& evaluator) override {
    // eval_windows windows spread evenly over the validation text (cut at
    // 0), the same ones at every evaluation; rank r takes every
    // world_size-th of them.
    const int64_t windows = engine::TextWindowCount(text_.val.size(), block_);
    const int64_t chosen = std::min<int64_t>(eval_windows_, windows);
    std::vector<int64_t> mine;
    for (int64_t i = rank; i < chosen; i += world_size) mine.push_back(i * windows / chosen);
    std::vector<int32_t> x, y;
    const BatchEvaluator on_cpu = [&](const engine::MicroBatch& b) -> absl::StatusOr<BatchResult> {
      const double loss =
          model_->Forward(b.tokens->data(), b.labels->data(),
                          static_cast<int64_t>(b.tokens->size()) / b.seq_len, b.seq_len,
                          /*training=*/false);
      return BatchResult{loss, engine::CountCorrect(model_->WholeLogits(), *b.labels)};
    };
    const BatchEvaluator& run = evaluator ? evaluator : on_cpu;
    EvalSums sums;
    for (size_t begin = 0; begin < mine.size(); begin += static_cast<size_t>(eval_batch_)) {
      const size_t count = std::min(static_cast<size_t>(eval_batch_), mine.size() - begin);
      const int64_t tokens = static_cast<int64_t>(count) * block_;
      x.resize(static_cast<size_t>(tokens));
      y.resize(static_cast<size_t>(tokens));
      engine::GatherTextWindows(text_.val, /*shift=*/0, block_, mine, begin, count, x.data(),
                                y.data());
      engine::MicroBatch batch;
      batch.tokens = &x;
      batch.labels = &y;
      batch.seq_len = block_;
      AIDN_ASSIGN_OR_RETURN(const BatchResult r, run(batch));
      sums.loss_sum += r.mean_loss * static_cast<double>(tokens);
      sums.correct += static_cast<double>(r.correct);
      sums.count += static_cast<double>(tokens);
    }
    return sums;
  }

  std::string EvalLine(int32_t epoch, int64_t step, double loss, double accuracy) const override {
    return absl::StrFormat(
        "epoch %d step %d | val loss %.4f | perplexity %.3f | %.3f bits/byte | next-byte "
        "accuracy %.4f",
        epoch, step, loss, std::exp(loss), loss / std::numbers::ln2, accuracy);
  }

  std::vector<std::pair<std::string, std::string>> Metadata() const override {
    return {{"aidn.gpt", engine::FormatGptConfig(model_->config())}};
  }

 private:
  const uint64_t seed_;
  const int block_;
  const int eval_batch_;
  const int64_t eval_windows_;
  const engine::TextSplit text_;
  std::unique_ptr<engine::Gpt> model_;
  engine::LanguageModel lm_;
  // A deque, as ImageTask's.
  std::deque<std::vector<int32_t>> x_, y_;
};

absl::StatusOr<std::unique_ptr<TrainingTask>> CreateTextTask(const v1::JobSpec& spec) {
  const v1::DatasetSpec& d = spec.dataset();
  absl::StatusOr<std::string> text =
      engine::LoadText(std::vector<std::string>(d.files().begin(), d.files().end()));
  if (!text.ok()) return Prefixed("dataset.files", text.status());
  const int64_t bytes = static_cast<int64_t>(text->size());
  engine::TextSplit split = engine::SplitText(*std::move(text), d.val_fraction());
  const int block = spec.model().block_size();
  if (engine::TextWindowCount(split.val.size(), block) == 0) {
    return Prefixed("dataset.val_fraction",
                    absl::FailedPreconditionError(absl::StrCat(
                        "the validation text (", split.val.size(), " of ", bytes,
                        " bytes) is shorter than two windows of model.block_size + 1 (", block,
                        " + 1) bytes: give more text, a larger val_fraction or a smaller "
                        "block_size")));
  }
  if (engine::TextWindowCount(split.train.size(), block) == 0) {
    return Prefixed("dataset.files",
                    absl::FailedPreconditionError(absl::StrCat(
                        "the training text (", split.train.size(),
                        " bytes) is shorter than two windows of model.block_size + 1 (", block,
                        " + 1) bytes")));
  }
  absl::StatusOr<std::unique_ptr<engine::Gpt>> model =
      engine::Gpt::Create(GptConfigOf(spec), spec.seed());
  if (!model.ok()) return Prefixed("model", model.status());
  (*model)->SetActivationCheckpointing(spec.model().activation_checkpointing());
  return std::make_unique<TextTask>(spec, std::move(split), *std::move(model));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TrainingTask>> TrainingTask::Create(const v1::JobSpec& spec,
                                                                   const std::string& cache_dir) {
  if (spec.model().name() == "gpt") return CreateTextTask(spec);
  engine::Dataset train, test;
  if (absl::Status s = LoadData(spec.dataset(), cache_dir, &train, &test); !s.ok()) {
    return Prefixed("dataset", s);
  }
  absl::StatusOr<std::unique_ptr<engine::Sequential>> model =
      engine::BuildModel(ModelConfigOf(spec), spec.seed());
  if (!model.ok()) return model.status();
  return std::make_unique<ImageTask>(std::move(train), std::move(test), *std::move(model),
                                     spec.eval_max_samples());
}

}  // namespace aidn::trainer
