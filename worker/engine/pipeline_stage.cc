#include "worker/engine/pipeline_stage.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/engine/layers.h"
#include "worker/engine/loss.h"

namespace aidn::engine {

absl::StatusOr<std::vector<std::pair<int, int>>> SplitStages(int units, int stages) {
  if (stages < 1 || units < stages) {
    return absl::InvalidArgumentError(absl::StrCat("cannot split ", units, " units into ", stages,
                                                   " pipeline stages: need at least one each"));
  }
  std::vector<std::pair<int, int>> ranges;
  int first = 0;
  for (int s = 0; s < stages; ++s) {
    const int size = units / stages + (s < units % stages ? 1 : 0);
    ranges.emplace_back(first, first + size);
    first += size;
  }
  return ranges;
}

namespace {

// Layers [begin_, end_) of a Sequential; softmax cross-entropy after the
// last stage's.
class ClassifierStage final : public PipelineStageModel {
 public:
  ClassifierStage(Sequential* model, int stages, int stage, size_t begin, size_t end,
                  std::vector<int64_t> in_sample, std::vector<int64_t> out_sample)
      : PipelineStageModel(stages, stage),
        model_(model),
        begin_(begin),
        end_(end),
        in_sample_(std::move(in_sample)),
        out_sample_(std::move(out_sample)),
        parameters_(model->ParametersOf(begin, end)),
        buffers_(model->BuffersOf(begin, end)) {}

  const std::vector<Parameter*>& Parameters() const override { return parameters_; }
  std::vector<Parameter*> Buffers() const override { return buffers_; }
  void FreezeRunningStatistics(bool frozen) override { model_->FreezeRunningStatistics(frozen); }
  std::vector<int64_t> InputShape(const MicroBatch& batch) const override {
    return first() ? std::vector<int64_t>{} : Batched(batch, in_sample_);
  }
  std::vector<int64_t> OutputShape(const MicroBatch& batch) const override {
    return last() ? std::vector<int64_t>{} : Batched(batch, out_sample_);
  }
  void SetGradReadyCallback(GradReadyCallback callback) override {
    model_->SetGradReadyCallback(std::move(callback));
  }
  void ZeroGrad() override {
    for (Parameter* p : parameters_) p->grad.Zero();
  }
  void SetSeed(uint64_t seed) override { model_->SetSeed(seed); }

  double Forward(const MicroBatch& batch, const Tensor& input, double grad_scale,
                 Tensor* output) override {
    AIDN_CHECK(batch.labels != nullptr && (!first() || batch.images != nullptr))
        << "a classifier stage's micro-batch needs labels (and images on the first stage)";
    const Tensor& x = first() ? *batch.images : input;
    if (!last()) {
      model_->ForwardRange(begin_, end_, x, output, /*training=*/true);
      return 0.0;
    }
    model_->ForwardRange(begin_, end_, x, &logits_, /*training=*/true);
    return SoftmaxCrossEntropy(logits_, *batch.labels, &grad_logits_, grad_scale);
  }

  void Backward(const Tensor& grad_output, Tensor* grad_input) override {
    model_->BackwardRange(begin_, end_, last() ? grad_logits_ : grad_output,
                          first() ? nullptr : grad_input);
  }

 private:
  // [rows of the batch, sample...].
  static std::vector<int64_t> Batched(const MicroBatch& batch, const std::vector<int64_t>& sample) {
    AIDN_CHECK(batch.labels != nullptr) << "a classifier stage's micro-batch needs labels";
    std::vector<int64_t> shape = {static_cast<int64_t>(batch.labels->size())};
    shape.insert(shape.end(), sample.begin(), sample.end());
    return shape;
  }

  Sequential* model_;
  const size_t begin_, end_;
  // One sample's activation entering and leaving the stage.
  const std::vector<int64_t> in_sample_, out_sample_;
  std::vector<Parameter*> parameters_;
  std::vector<Parameter*> buffers_;
  Tensor logits_;
  Tensor grad_logits_;
};

// Blocks of a Gpt (Gpt::SetStage).
class LanguageModelStage final : public PipelineStageModel {
 public:
  LanguageModelStage(Gpt* model, int stages, int stage, int first, int end)
      : PipelineStageModel(stages, stage), model_(model), first_(first), end_(end) {
    model_->SetStage(first_, end_);
    Release();
  }

  void Widen() override {
    for (Parameter* p : model_->Parameters()) {
      if (p->value.data() == nullptr) p->value = Tensor(p->value.shape());
    }
    model_->SetStage(0, model_->config().n_layer);
  }
  void Narrow() override {
    model_->SetStage(first_, end_);
    Release();
  }

  const std::vector<Parameter*>& Parameters() const override { return model_->StageParameters(); }
  Parameter* tied() override {
    if (stages() == 1 || (!first() && !last())) return nullptr;
    // wte comes first in the model's registration order, on both ends.
    return model_->StageParameters().front();
  }
  std::vector<int64_t> InputShape(const MicroBatch& batch) const override {
    if (first()) return {};
    return {Positions(batch), model_->config().n_embd};
  }
  std::vector<int64_t> OutputShape(const MicroBatch& batch) const override {
    if (last()) return {};
    return {Positions(batch), model_->config().n_embd};
  }
  void SetGradReadyCallback(GradReadyCallback callback) override {
    model_->SetGradReadyCallback(std::move(callback));
  }
  void ZeroGrad() override { model_->ZeroGrad(); }
  void SetSeed(uint64_t seed) override { model_->SetSeed(seed); }

  double Forward(const MicroBatch& batch, const Tensor& input, double grad_scale,
                 Tensor* output) override {
    AIDN_CHECK(batch.tokens != nullptr && batch.labels != nullptr && batch.seq_len > 0)
        << "a language model stage's micro-batch needs tokens, targets and a sequence length";
    const int64_t n = Positions(batch);
    grad_scale_ = grad_scale;
    const double loss =
        model_->ForwardStage(batch.tokens->data(), first() ? nullptr : &input, batch.labels->data(),
                             n / batch.seq_len, batch.seq_len, true);
    if (!last()) {
      const Tensor& out = model_->stage_output();
      EnsureShape(output, out.shape());
      std::copy(out.data(), out.data() + out.numel(), output->data());
    }
    return loss;
  }

  void Backward(const Tensor& grad_output, Tensor* grad_input) override {
    model_->BackwardStage(last() ? nullptr : &grad_output, first() ? nullptr : grad_input,
                          grad_scale_);
  }

  bool Keep(int micro_batch) override {
    Gpt::Stash stash;
    if (!spare_.empty()) {
      stash = std::move(spare_.back());
      spare_.pop_back();
    }
    model_->SwapActivations(&stash);
    kept_[micro_batch] = std::move(stash);
    return true;
  }
  void Restore(int micro_batch) override {
    auto it = kept_.find(micro_batch);
    AIDN_CHECK(it != kept_.end()) << "gpt stage: micro-batch " << micro_batch << " was not kept";
    model_->SwapActivations(&it->second);
    // The buffers the model held, for the next Keep.
    spare_.push_back(std::move(it->second));
    kept_.erase(it);
  }
  int64_t kept_bytes() const override {
    int64_t bytes = 0;
    for (const auto& [mb, stash] : kept_) bytes += stash.bytes();
    return bytes;
  }

 private:
  static int64_t Positions(const MicroBatch& batch) {
    AIDN_CHECK(batch.tokens != nullptr) << "a language model stage's micro-batch needs tokens";
    return static_cast<int64_t>(batch.tokens->size());
  }

  // The weights (and gradients) of other stages' parameters: no storage.
  void Release() {
    const std::vector<Parameter*>& mine = model_->StageParameters();
    for (Parameter* p : model_->Parameters()) {
      if (std::find(mine.begin(), mine.end(), p) != mine.end()) continue;
      p->value = Tensor::View(nullptr, p->value.shape());
      p->grad = Tensor::View(nullptr, p->grad.shape());
    }
  }

  Gpt* model_;
  const int first_, end_;
  double grad_scale_ = 1.0;
  // Micro-batches between their forward and backward, and buffers to reuse.
  std::map<int, Gpt::Stash> kept_;
  std::vector<Gpt::Stash> spare_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PipelineStageModel>> MakeClassifierStage(
    Sequential* model, std::vector<int64_t> sample_shape, int stages, int stage) {
  if (model == nullptr || stage < 0 || stage >= stages) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline stage ", stage, " of ", stages, ": out of range"));
  }
  // The layers each unit starts at.
  std::vector<size_t> unit_layers;
  for (size_t i = 0; i < model->size(); ++i) {
    if (model->HasParameters(i)) unit_layers.push_back(i);
  }
  absl::StatusOr<std::vector<std::pair<int, int>>> ranges =
      SplitStages(static_cast<int>(unit_layers.size()), stages);
  if (!ranges.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("the model has ", unit_layers.size(),
                                                   " layers with parameters, fewer than ", stages,
                                                   " pipeline stages"));
  }
  const auto [first_unit, end_unit] = (*ranges)[static_cast<size_t>(stage)];
  const size_t begin = stage == 0 ? 0 : unit_layers[static_cast<size_t>(first_unit)];
  const size_t end =
      stage == stages - 1 ? model->size() : unit_layers[static_cast<size_t>(end_unit)];
  // The activations' shapes, from one zero sample through the layers before
  // and through this stage's.
  std::vector<int64_t> shape = {1};
  shape.insert(shape.end(), sample_shape.begin(), sample_shape.end());
  Tensor x(shape), in, out;
  std::vector<int64_t> in_sample, out_sample;
  if (begin > 0) {
    model->ForwardRange(0, begin, x, &in, /*training=*/false);
    in_sample.assign(in.shape().begin() + 1, in.shape().end());
  }
  if (stage < stages - 1) {
    model->ForwardRange(begin, end, begin > 0 ? in : x, &out, /*training=*/false);
    out_sample.assign(out.shape().begin() + 1, out.shape().end());
  }
  return std::unique_ptr<PipelineStageModel>(new ClassifierStage(
      model, stages, stage, begin, end, std::move(in_sample), std::move(out_sample)));
}

absl::StatusOr<std::unique_ptr<PipelineStageModel>> MakeLanguageModelStage(Gpt* model, int stages,
                                                                           int stage) {
  if (model == nullptr || stage < 0 || stage >= stages) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline stage ", stage, " of ", stages, ": out of range"));
  }
  const int layers = model->config().n_layer;
  if (layers % stages != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_layer ", layers, " does not divide into ", stages, " pipeline stages"));
  }
  AIDN_ASSIGN_OR_RETURN(auto ranges, SplitStages(layers, stages));
  const auto [first, end] = ranges[static_cast<size_t>(stage)];
  return std::unique_ptr<PipelineStageModel>(
      new LanguageModelStage(model, stages, stage, first, end));
}

}  // namespace aidn::engine
