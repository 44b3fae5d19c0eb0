#ifndef AIDN_WORKER_ENGINE_PIPELINE_STAGE_H_
#define AIDN_WORKER_ENGINE_PIPELINE_STAGE_H_

// One pipeline stage's part of a model: a contiguous run of its units (a
// GPT's blocks, a Sequential's layers with parameters), as the pipeline
// session (pipeline_session.h) drives it, one micro-batch at a time:
//
//   first stage   the batch's input (images, tokens) -> its units -> activation
//   middle stage  activation -> its units -> activation
//   last stage    activation -> its units -> the loss against the labels
//
// Backward goes the other way: the last stage from its loss, the others
// from the gradient of their output, each writing the gradient of its input
// (but the first). Every rank builds the whole model from the job's seed,
// so the stages start from exactly the weights a one-rank run has; a GPT
// stage then releases the weights of the blocks it does not run. A GPT's
// first and last stages both hold wte (the embedding and the tied LM head):
// tied() names it, and the session sums its gradient over the two.
//
// Dropout: a Sequential's layers are seeded by their index in the whole
// model (LayerSeed), so every stage draws the masks a one-rank run draws; a
// GPT stage draws from one stream of its own per micro-batch seed, not the
// whole model's (the masks differ from a one-rank run's, the run stays
// deterministic and resumable).
//
// Not thread-safe; one per training thread. Borrows the model, which must
// outlive it.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/engine/data.h"
#include "worker/engine/gpt.h"
#include "worker/engine/model.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

// `units` split into `stages` contiguous runs [first, end), as even as
// possible, the earlier stages taking one more where they do not divide.
// INVALID_ARGUMENT when there are fewer units than stages (or sizes < 1).
absl::StatusOr<std::vector<std::pair<int, int>>> SplitStages(int units, int stages);

class PipelineStageModel {
 public:
  using GradReadyCallback = std::function<void(Parameter*)>;

  virtual ~PipelineStageModel() = default;
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }
  int stage() const { return stage_; }
  int stages() const { return stages_; }

  // The parameters this stage holds, in the model's registration order.
  virtual const std::vector<Parameter*>& Parameters() const = 0;
  // The buffers this stage holds (BatchNorm's running statistics), in the
  // model's registration order.
  virtual std::vector<Parameter*> Buffers() const { return {}; }
  // Layer::FreezeRunningStatistics on the stage's layers.
  virtual void FreezeRunningStatistics(bool /*frozen*/) {}
  // The parameter the first and last stages both hold (a GPT's wte); null
  // for a model without one or a stage at neither end.
  virtual Parameter* tied() { return nullptr; }
  // The shape of the activation entering this stage (empty on the first)
  // and leaving it (empty on the last) for `batch`, and their floats.
  virtual std::vector<int64_t> InputShape(const MicroBatch& batch) const = 0;
  virtual std::vector<int64_t> OutputShape(const MicroBatch& batch) const = 0;
  int64_t InputFloats(const MicroBatch& batch) const { return Floats(InputShape(batch)); }
  int64_t OutputFloats(const MicroBatch& batch) const { return Floats(OutputShape(batch)); }
  virtual void SetGradReadyCallback(GradReadyCallback callback) = 0;
  virtual void ZeroGrad() = 0;
  virtual void SetSeed(uint64_t seed) = 0;
  // The training forward of `batch` (dropout on): from its input on the
  // first stage, from `input` (InputFloats of it) on the others, which
  // must stay unchanged until the matching Backward. The last stage returns
  // the loss (its gradient scaled by `grad_scale`) and leaves `output`
  // alone; the others return 0 and write their activation into `output`.
  virtual double Forward(const MicroBatch& batch, const Tensor& input, double grad_scale,
                         Tensor* output) = 0;
  // Accumulates (+=) the gradients of the last Forward, from its loss (the
  // last stage) or from `grad_output` (the others), and writes the
  // gradient of that Forward's input into `grad_input` (not the first).
  virtual void Backward(const Tensor& grad_output, Tensor* grad_input) = 0;

  // Several micro-batches in flight: Keep(mb), right after mb's Forward,
  // sets its activations aside (the model then holds none); Restore(mb),
  // right before its Backward, brings them back. False from Keep: the model
  // cannot (a Sequential's layers hold their own state), and the session
  // runs the forward again before the backward instead.
  virtual bool Keep(int /*micro_batch*/) { return false; }
  virtual void Restore(int /*micro_batch*/) {}
  // Bytes of the activations kept now.
  virtual int64_t kept_bytes() const { return 0; }

  // The whole model on this rank for a while (evaluation): Widen gives
  // every parameter storage (a GPT stage's released ones: their values are
  // then the caller's to fill) and makes the model run all its layers;
  // Narrow goes back to the stage, releasing what Widen gave. No training
  // step in between.
  virtual void Widen() {}
  virtual void Narrow() {}

 protected:
  PipelineStageModel(int stages, int stage) : stages_(stages), stage_(stage) {}

 private:
  static int64_t Floats(const std::vector<int64_t>& shape) {
    int64_t n = shape.empty() ? 0 : 1;
    for (const int64_t d : shape) n *= d;
    return n;
  }

  const int stages_;
  const int stage_;
};

// Stage `stage` of `stages` of an image classifier (a Sequential with
// softmax cross-entropy on the last stage). `sample_shape` is one input's
// ([C, H, W]); the activations' shapes come from a forward of one zero
// sample at creation. Stages start at layers with parameters (a layer
// without, such as a ReLU, goes with the one before it). INVALID_ARGUMENT
// for fewer layers with parameters than stages.
absl::StatusOr<std::unique_ptr<PipelineStageModel>> MakeClassifierStage(
    Sequential* model, std::vector<int64_t> sample_shape, int stages, int stage);

// Stage `stage` of `stages` of a GPT (Gpt::SetStage), releasing the
// weights of the blocks other stages run. INVALID_ARGUMENT unless stages
// divides n_layer.
absl::StatusOr<std::unique_ptr<PipelineStageModel>> MakeLanguageModelStage(Gpt* model, int stages,
                                                                           int stage);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_PIPELINE_STAGE_H_
