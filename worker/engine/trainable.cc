#include "worker/engine/trainable.h"

#include "common/log.h"
#include "worker/engine/loss.h"

namespace aidn::engine {

double Classifier::ForwardLoss(const MicroBatch& batch, double grad_scale) {
  AIDN_CHECK(batch.images != nullptr && batch.labels != nullptr)
      << "a classifier's micro-batch needs images and labels";
  model_->Forward(*batch.images, &logits_, /*training=*/true);
  forward_done_ = true;
  return SoftmaxCrossEntropy(logits_, *batch.labels, &grad_logits_, grad_scale);
}

void Classifier::BackwardLoss() {
  AIDN_CHECK(forward_done_) << "BackwardLoss before ForwardLoss";
  model_->Backward(grad_logits_);
}

double LanguageModel::ForwardLoss(const MicroBatch& batch, double grad_scale) {
  AIDN_CHECK(batch.tokens != nullptr && batch.labels != nullptr && batch.seq_len > 0)
      << "a language model's micro-batch needs tokens, targets and a sequence length";
  const int64_t n = static_cast<int64_t>(batch.tokens->size());
  AIDN_CHECK(n % batch.seq_len == 0 && batch.labels->size() == batch.tokens->size())
      << "tokens and targets must both be [N, seq_len]";
  grad_scale_ = grad_scale;
  return model_->Forward(batch.tokens->data(), batch.labels->data(), n / batch.seq_len,
                         batch.seq_len, /*training=*/true);
}

}  // namespace aidn::engine
