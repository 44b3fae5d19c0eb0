#ifndef AIDN_WORKER_ENGINE_TRAINABLE_H_
#define AIDN_WORKER_ENGINE_TRAINABLE_H_

// A model as a training step drives it (CpuSession): forward of a
// micro-batch to its loss, backward from that loss, parameters and their
// readiness for DDP. Two models implement it: an image classifier (a
// Sequential whose logits meet softmax cross-entropy against the labels)
// and a language model (Gpt, whose loss is the next token's
// cross-entropy).
//
// Not thread-safe: one per training thread, like the models it wraps.

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "worker/engine/data.h"
#include "worker/engine/gpt.h"
#include "worker/engine/model.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

class TrainableModel {
 public:
  // As Sequential's and Gpt's: a parameter's gradient is final for this
  // backward (DDP starts bucket allreduces from here).
  using GradReadyCallback = std::function<void(Parameter*)>;

  virtual ~TrainableModel() = default;
  // In registration order (checkpoints, the optimizer, DDP buckets).
  virtual const std::vector<Parameter*>& Parameters() const = 0;
  // State saved with the weights but not trained (BatchNorm's running
  // statistics); none by default.
  virtual std::vector<Parameter*> Buffers() const { return {}; }
  // The parameters the last ForwardLoss did not use (stochastic depth);
  // BackwardLoss reports no gradient of theirs ready.
  virtual std::vector<Parameter*> UnusedParameters() const { return {}; }
  // The first error of a collective inside the model (SyncBatchNorm) since
  // the last call; OK by default.
  virtual absl::Status TakeCollectiveStatus() { return absl::OkStatus(); }
  virtual void SetGradReadyCallback(GradReadyCallback callback) = 0;
  // units.h: the groups fully sharded strategies gather and free together,
  // and the hooks the model calls around them (not owned; null: none).
  virtual std::vector<std::vector<Parameter*>> Units() = 0;
  virtual void SetUnitHooks(UnitHooks* hooks) = 0;
  virtual void ZeroGrad() = 0;
  // Reseeds dropout for the next forward.
  virtual void SetSeed(uint64_t seed) = 0;
  // The training forward of `batch` (dropout on) and its mean loss; keeps
  // what BackwardLoss needs, whose gradients it scales by `grad_scale` (1/k
  // with k micro-batches a step). Programmer errors (abort): a batch of the
  // other kind (images for a language model, tokens for a classifier).
  virtual double ForwardLoss(const MicroBatch& batch, double grad_scale) = 0;
  // Accumulates (+=) the gradients of the last ForwardLoss's loss, scaled.
  virtual void BackwardLoss() = 0;
};

// A Sequential over images [N, C, H, W] with softmax cross-entropy against
// the labels [N]. Borrows the model, which must outlive it.
class Classifier final : public TrainableModel {
 public:
  explicit Classifier(Sequential* model) : model_(model) {}
  const std::vector<Parameter*>& Parameters() const override { return model_->Parameters(); }
  std::vector<Parameter*> Buffers() const override { return model_->Buffers(); }
  std::vector<Parameter*> UnusedParameters() const override { return model_->UnusedParameters(); }
  absl::Status TakeCollectiveStatus() override { return model_->TakeCollectiveStatus(); }
  void SetGradReadyCallback(GradReadyCallback callback) override {
    model_->SetGradReadyCallback(std::move(callback));
  }
  std::vector<std::vector<Parameter*>> Units() override { return model_->Units(); }
  void SetUnitHooks(UnitHooks* hooks) override { model_->SetUnitHooks(hooks); }
  void ZeroGrad() override { model_->ZeroGrad(); }
  void SetSeed(uint64_t seed) override { model_->SetSeed(seed); }
  double ForwardLoss(const MicroBatch& batch, double grad_scale) override;
  void BackwardLoss() override;

 private:
  Sequential* model_;
  bool forward_done_ = false;
  // Reused from step to step.
  Tensor logits_;
  Tensor grad_logits_;
};

// A Gpt over tokens and targets [N, seq_len]. Borrows the model, which must
// outlive it.
class LanguageModel final : public TrainableModel {
 public:
  explicit LanguageModel(Gpt* model) : model_(model) {}
  const std::vector<Parameter*>& Parameters() const override { return model_->Parameters(); }
  std::vector<Parameter*> UnusedParameters() const override { return model_->UnusedParameters(); }
  void SetGradReadyCallback(GradReadyCallback callback) override {
    model_->SetGradReadyCallback(std::move(callback));
  }
  std::vector<std::vector<Parameter*>> Units() override { return model_->Units(); }
  void SetUnitHooks(UnitHooks* hooks) override { model_->SetUnitHooks(hooks); }
  void ZeroGrad() override { model_->ZeroGrad(); }
  void SetSeed(uint64_t seed) override { model_->SetSeed(seed); }
  double ForwardLoss(const MicroBatch& batch, double grad_scale) override;
  void BackwardLoss() override { model_->Backward(grad_scale_); }

 private:
  Gpt* model_;
  double grad_scale_ = 1.0;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_TRAINABLE_H_
