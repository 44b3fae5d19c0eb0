#include "coordinator/gpt_spec.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/gpt_shapes.h"
#include "common/status.h"
#include "coordinator/spec.h"
#include "coordinator/spec_checks.h"

namespace aidn::coordinator {
namespace {

constexpr int kMaxLayers = 1024;
constexpr int kMaxHeads = 1024;
constexpr int kMaxWidth = 65536;
constexpr int kMaxBlockSize = 65536;
constexpr int kMaxVocab = 1 << 24;
constexpr int kByteVocab = 256;
constexpr int kMaxTextFiles = 1024;
constexpr int kMaxEvalWindows = 1'000'000;
constexpr double kDefaultValFraction = 0.1;
constexpr int kDefaultEvalWindows = 64;

bool HasGptFields(const v1::ModelSpec& m) {
  return !m.config().empty() || m.n_layer() != 0 || m.n_head() != 0 || m.n_embd() != 0 ||
         m.block_size() != 0 || m.vocab_size() != 0 || m.has_bias() || m.activation_checkpointing();
}

// The first gpt field set, for the message.
const char* FirstGptField(const v1::ModelSpec& m) {
  if (!m.config().empty()) return "model.config";
  if (m.n_layer() != 0) return "model.n_layer";
  if (m.n_head() != 0) return "model.n_head";
  if (m.n_embd() != 0) return "model.n_embd";
  if (m.block_size() != 0) return "model.block_size";
  if (m.vocab_size() != 0) return "model.vocab_size";
  if (m.has_bias()) return "model.bias";
  return "model.activation_checkpointing";
}

}  // namespace

void ApplyGptDefaults(v1::JobSpec* spec) {
  v1::ModelSpec* model = spec->mutable_model();
  if (model->name() == kGptModel) {
    if (model->config().empty()) model->set_config("gpt-char");
    if (const GptShape* shape = FindGptShape(model->config()); shape != nullptr) {
      if (model->n_layer() == 0) model->set_n_layer(shape->n_layer);
      if (model->n_head() == 0) model->set_n_head(shape->n_head);
      if (model->n_embd() == 0) model->set_n_embd(shape->n_embd);
      if (model->block_size() == 0) model->set_block_size(shape->block_size);
      if (model->vocab_size() == 0) model->set_vocab_size(shape->vocab_size);
    }
    if (!model->has_bias()) model->set_bias(true);
    if (spec->dataset().kind().empty()) spec->mutable_dataset()->set_kind(kTextDataset);
  }
  v1::DatasetSpec* dataset = spec->mutable_dataset();
  if (dataset->kind() == kTextDataset) {
    if (dataset->files_size() == 0) dataset->add_files(kDefaultTextCorpus);
    if (!dataset->has_val_fraction()) dataset->set_val_fraction(kDefaultValFraction);
    if (dataset->eval_windows() == 0) dataset->set_eval_windows(kDefaultEvalWindows);
  }
}

absl::Status ValidateGptModel(const v1::JobSpec& spec) {
  const v1::ModelSpec& m = spec.model();
  if (m.name() != kGptModel) {
    if (HasGptFields(m)) return Invalid(FirstGptField(m), "only applies to model gpt");
    return absl::OkStatus();
  }
  if (m.hidden_sizes_size() != 0) {
    return Invalid("model.hidden_sizes", "only applies to mlp (gpt's widths are n_embd)");
  }
  if (FindGptShape(m.config()) == nullptr) {
    return Invalid("model.config", absl::StrCat("unknown gpt configuration ", Quote(m.config()),
                                                " (known: ", kGptShapeNames, ")"));
  }
  AIDN_RETURN_IF_ERROR(CheckIntRange("model.n_layer", m.n_layer(), 1, kMaxLayers));
  AIDN_RETURN_IF_ERROR(CheckIntRange("model.n_head", m.n_head(), 1, kMaxHeads));
  AIDN_RETURN_IF_ERROR(CheckIntRange("model.n_embd", m.n_embd(), 1, kMaxWidth));
  AIDN_RETURN_IF_ERROR(CheckIntRange("model.block_size", m.block_size(), 1, kMaxBlockSize));
  AIDN_RETURN_IF_ERROR(CheckIntRange("model.vocab_size", m.vocab_size(), 1, kMaxVocab));
  if (m.n_embd() % m.n_head() != 0) {
    return Invalid("model.n_embd", absl::StrCat("must be a multiple of model.n_head (", m.n_head(),
                                                "), got ", m.n_embd()));
  }
  // The engine keeps each tensor's index in 32 bits.
  const int64_t widest = std::max<int64_t>(m.vocab_size(), int64_t{4} * m.n_embd());
  if (widest * m.n_embd() > (int64_t{1} << 31)) {
    return Invalid("model.n_embd",
                   absl::StrCat("max(vocab_size, 4 n_embd) x n_embd must be at most 2^31, got ",
                                widest * m.n_embd()));
  }
  if (spec.dataset().kind() != kTextDataset) {
    return Invalid("dataset.kind", absl::StrCat("model gpt trains on dataset.kind \"text\", got ",
                                                Quote(spec.dataset().kind())));
  }
  if (m.vocab_size() < kByteVocab) {
    return Invalid("model.vocab_size",
                   absl::StrCat("must be at least 256 for byte-level text, got ", m.vocab_size()));
  }
  if (spec.device() == v1::JobSpec::GPU) {
    // What the GPU decoder does not have yet (parallel_spec.cc says what
    // GPU pipelines take).
    if (m.activation_checkpointing()) {
      return Invalid("model.activation_checkpointing", "runs on device: cpu for now");
    }
    if (spec.cuda_graphs()) {
      return Invalid("cuda_graphs",
                     "not for model gpt yet (mlp, cnn and resnet steps are captured)");
    }
  }
  return CheckRealRange("model.dropout", m.dropout(), 0, 1, /*hi_inclusive=*/false);
}

absl::Status ValidateTextDataset(const v1::JobSpec& spec) {
  const v1::DatasetSpec& d = spec.dataset();
  if (d.kind() != kTextDataset) {
    if (d.files_size() != 0) return Invalid("dataset.files", "only applies to dataset.kind text");
    if (d.has_val_fraction()) {
      return Invalid("dataset.val_fraction", "only applies to dataset.kind text");
    }
    if (d.eval_windows() != 0) {
      return Invalid("dataset.eval_windows", "only applies to dataset.kind text");
    }
    return absl::OkStatus();
  }
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string&>{"dataset.dir", d.dir()},
        {"dataset.train_images", d.train_images()},
        {"dataset.train_labels", d.train_labels()},
        {"dataset.test_images", d.test_images()},
        {"dataset.test_labels", d.test_labels()}}) {
    if (!value.empty()) return Invalid(field, "does not apply to dataset.kind text (use files)");
  }
  if (d.files_size() == 0) return Invalid("dataset.files", "required for dataset.kind text");
  if (d.files_size() > kMaxTextFiles) {
    return Invalid("dataset.files",
                   absl::StrCat("at most ", kMaxTextFiles, " paths, got ", d.files_size()));
  }
  for (int i = 0; i < d.files_size(); ++i) {
    const std::string field = absl::StrCat("dataset.files[", i, "]");
    AIDN_RETURN_IF_ERROR(ValidateSpecPath(field.c_str(), d.files(i)));
  }
  if (!d.has_val_fraction()) {
    return Invalid("dataset.val_fraction", "not set (defaults were not applied)");
  }
  const double f = d.val_fraction();
  if (!(f > 0 && f <= 0.5)) {
    return Invalid("dataset.val_fraction", absl::StrCat("must be in (0, 0.5], got ", f));
  }
  AIDN_RETURN_IF_ERROR(CheckIntRange("dataset.eval_windows", d.eval_windows(), 1, kMaxEvalWindows));
  if (spec.model().name() != kGptModel) {
    return Invalid("model.name", absl::StrCat("dataset.kind text trains model gpt, got ",
                                              Quote(spec.model().name())));
  }
  return absl::OkStatus();
}

}  // namespace aidn::coordinator
