#ifndef AIDN_WORKER_ENGINE_BATCHNORM_H_
#define AIDN_WORKER_ENGINE_BATCHNORM_H_

// Batch normalisation of images, torch's BatchNorm2d(C) with its defaults
// (eps 1e-5, momentum 0.1, affine, running statistics tracked):
//
//   training  y = (x - mean) / sqrt(var + eps) * weight + bias, with the
//             batch's per-channel mean and biased variance over N, H and
//             W; running_mean and running_var move by momentum towards the
//             batch's mean and unbiased variance;
//   eval      the same with running_mean and running_var.
//
// SyncBatchNorm (SetBatchNormSync): in training the statistics are every
// rank's batch's, as torch's SyncBatchNorm computes them: each rank's
// per-channel mean, sum of squared deviations and count all-gathered and
// combined in rank order (Chan et al.'s parallel variance), so every rank
// normalises with the same numbers; backward sums sum(dy) and
// sum(dy * xhat) over the ranks for the input gradient (the weight and bias
// gradients stay the rank's own, for DDP to average). Every rank must run
// the same BatchNorm layers in the same order.
//
// weight starts at 1 and bias at 0 (parameters); running_mean at 0 and
// running_var at 1 (buffers, Layer::Buffers). Sums run in double, so the
// statistics do not depend on the order of a channel's elements to float
// rounding. torch's num_batches_tracked is not kept (momentum is set, so
// torch never reads it).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "worker/engine/model.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

class BatchNorm2d final : public Layer {
 public:
  explicit BatchNorm2d(int64_t channels, double eps = 1e-5, double momentum = 0.1);
  std::string Describe() const override;
  void Forward(const Tensor& input, Tensor* output, bool training) override;
  void Backward(const Tensor& grad_output, Tensor* grad_input) override;
  std::vector<Parameter*> Parameters() override { return {&weight_, &bias_}; }
  std::vector<Parameter*> Buffers() override { return {&running_mean_, &running_var_}; }
  void SetBatchNormSync(Communicator* comm) override { sync_ = comm; }
  void FreezeRunningStatistics(bool frozen) override { frozen_ = frozen; }
  absl::Status TakeCollectiveStatus() override {
    return std::exchange(sync_status_, absl::OkStatus());
  }

  int64_t channels() const { return channels_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }
  Parameter& running_mean() { return running_mean_; }
  Parameter& running_var() { return running_var_; }

 private:
  int64_t channels_;
  double eps_;
  double momentum_;
  Parameter weight_;
  Parameter bias_;
  Parameter running_mean_;
  Parameter running_var_;
  // The last Forward: its input, mode, and per channel the mean and
  // 1/sqrt(var + eps) it normalised with.
  const Tensor* input_ = nullptr;
  bool training_ = false;
  // Layer::FreezeRunningStatistics.
  bool frozen_ = false;
  std::vector<float> mean_;
  std::vector<float> invstd_;
  // SyncBatchNorm: the communicator, the last training forward's count over
  // every rank, staging for the collectives, and the first error.
  Communicator* sync_ = nullptr;
  double global_count_ = 0;
  std::vector<float> exchange_;
  absl::Status sync_status_;
  // Per channel: the mean and the sum of squared deviations of this rank's
  // values, combined with the other ranks' when synced.
  void Statistics(const Tensor& input, std::vector<double>* mean, std::vector<double>* m2,
                  double* count);
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_BATCHNORM_H_
