#ifndef AIDN_WORKER_TRAINER_TRAINING_TASK_H_
#define AIDN_WORKER_TRAINER_TRAINING_TASK_H_

// What a built-in trainer's job trains: its model and its data, and how a
// step's micro-batches and an evaluation come from them. Two kinds:
//
//   images  model mlp or cnn (a Sequential) on fashion-mnist / idx: items
//           are images, evaluation is the test set's loss and accuracy.
//   text    model gpt on text: items are windows of block_size + 1 bytes
//           cut at the epoch's shift (text_data.h), evaluation is the
//           validation text's loss per token (perplexity = e^loss) and
//           next-token accuracy over eval_windows evenly spaced windows.
//
// Either way the DistributedSampler deals out item indices, so the sampler's
// seed + epoch semantics, the ranks' shards and a resumed run's position
// are the same for both.
//
// Not thread-safe: one per trainer, on its main thread.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "aidn/v1/job.pb.h"
#include "worker/engine/data.h"
#include "worker/engine/gpt.h"
#include "worker/engine/model.h"
#include "worker/engine/trainable.h"

namespace aidn::trainer {

class TrainingTask {
 public:
  // Loads the data the spec names (images through the worker's cache of
  // inflated files, `cache_dir`; empty: none) and builds the model from
  // spec.seed. Every error is permanent (a missing file, a corpus too
  // short for one window), prefixed with the spec field at fault.
  static absl::StatusOr<std::unique_ptr<TrainingTask>> Create(const v1::JobSpec& spec,
                                                              const std::string& cache_dir);
  virtual ~TrainingTask() = default;

  virtual engine::TrainableModel& model() = 0;
  const std::vector<engine::Parameter*>& Parameters() { return model().Parameters(); }
  // The parameters, then the buffers: what checkpoints save and restore.
  std::vector<engine::Parameter*> ModelState() {
    std::vector<engine::Parameter*> state = model().Parameters();
    for (engine::Parameter* b : model().Buffers()) state.push_back(b);
    return state;
  }
  // The model the GPU engine mirrors; null for a model it does not have.
  virtual const engine::Sequential* sequential() const { return nullptr; }
  // The model itself, for a pipeline stage to be cut from: the Sequential
  // of an image task or the Gpt of a text task (the other null).
  virtual engine::Sequential* mutable_sequential() { return nullptr; }
  virtual engine::Gpt* gpt() { return nullptr; }

  // Training items per epoch (images, or text windows).
  virtual int64_t train_items() const = 0;
  // Tokens per item: block_size for text, 0 for images.
  virtual int64_t tokens_per_item() const = 0;

  // Micro-batch `slot` of a step: items indices[begin, begin + count) of
  // `epoch`, in buffers of the slot's own that stay valid until the next
  // Gather into it. The seed is left for the caller.
  virtual engine::MicroBatch Gather(int64_t epoch, const std::vector<int64_t>& indices,
                                    size_t begin, size_t count, size_t slot) = 0;

  // This rank's share of an evaluation (the ranks' sums add up to the
  // whole): summed loss, correct predictions, and what they count (images
  // or tokens).
  struct EvalSums {
    double loss_sum = 0;
    double correct = 0;
    double count = 0;
  };
  EvalSums Evaluate(int rank, int world_size) {
    // The task's own CPU model never fails.
    return *EvaluateWith(rank, world_size, nullptr);
  }
  // One evaluation batch elsewhere than on the task's CPU model (the GPU
  // session's Evaluate, on the device's weights): its mean loss and right
  // predictions.
  struct BatchResult {
    double mean_loss = 0;
    int64_t correct = 0;
  };
  using BatchEvaluator = std::function<absl::StatusOr<BatchResult>(const engine::MicroBatch&)>;
  // Evaluate with the same batches (images and labels; or tokens, targets
  // and seq_len) going through `evaluator` (null: the CPU model); its
  // first error comes back.
  virtual absl::StatusOr<EvalSums> EvaluateWith(int rank, int world_size,
                                                const BatchEvaluator& evaluator) = 0;
  // The log line of an evaluation whose means are `loss` and `accuracy`.
  virtual std::string EvalLine(int32_t epoch, int64_t step, double loss, double accuracy) const = 0;

  // Safetensors metadata beside the weights (aidn.gpt: the sizes that
  // rebuild the model from an export alone).
  virtual std::vector<std::pair<std::string, std::string>> Metadata() const { return {}; }
};

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_TRAINING_TASK_H_
