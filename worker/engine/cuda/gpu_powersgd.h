#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_POWERSGD_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_POWERSGD_H_

// PowerSGD on GPUs: powersgd.h's PowerSgd (torch's powerSGD_hook), one DDP
// bucket at a time, all of it queued on the NCCL communicator's stream so
// that it overlaps backward as a plain bucket allreduce does:
//
//   - the same plan (PlanPowerSgd: which gradients are compressed, at what
//     rank), the same random start of Q (RandomPowerSgdQ, generated on the
//     host and uploaded), the same warm start and error feedback;
//   - P = M Q, Q = M^T P and M = P Q^T in fp32 through cuBLAS (a handle of
//     its own, bound to the NCCL stream; never TF32), whatever the
//     context's precision, as torch computes them in the gradients' dtype;
//   - the orthogonalisation on the device (LaunchOrthogonalizeColumns),
//     dot products in double as on the CPU;
//   - the error kept over the bucket's whole buffer: the padding between
//     gradients is zero in and zero out, so its error stays zero.
//
// Results match the CPU's to rounding: the sums run in another order.
//
// Not thread-safe: the trainer's thread, as GpuDdpReducer. Device memory
// (per bucket: the error, the input, P, Q and the uncompressed gradients
// packed) comes from the context's allocator at a bucket's first
// compressed pass and is freed with the object, after both streams are
// drained (allocator.h's one-stream rule, as the reducer's buckets).

#include <cublas_v2.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/nccl_communicator.h"
#include "worker/engine/cuda/allocator.h"
#include "worker/engine/cuda/gpu_context.h"
#include "worker/engine/powersgd.h"

namespace aidn::engine::cuda {

class GpuPowerSgd {
 public:
  // INVALID_ARGUMENT for a rank below 1.
  static absl::StatusOr<std::unique_ptr<GpuPowerSgd>> Create(GpuContext* ctx,
                                                             NcclCommunicator* nccl,
                                                             const PowerSgdOptions& options);
  ~GpuPowerSgd();
  GpuPowerSgd(const GpuPowerSgd&) = delete;
  GpuPowerSgd& operator=(const GpuPowerSgd&) = delete;

  // One gradient of a bucket: where it lies (device) and its shape.
  struct Gradient {
    float* data;
    std::vector<int64_t> shape;
  };
  // Queues the averaging of bucket `bucket`'s gradients over the ranks, in
  // place, on the communicator's stream (the caller orders that stream
  // after the gradients, and the optimizer after it). `buffer` [floats] is
  // the bucket, holding `grads` and zeros between them. Every rank calls it
  // for the same buckets in the same order with the same shapes.
  absl::Status Reduce(int bucket, float* buffer, size_t floats, const std::vector<Gradient>& grads);
  // Whether Reduce compresses now (start_step reached).
  bool active() const { return step_ >= options_.start_step; }
  // Counts a step (after every bucket of it was reduced).
  void EndStep() { ++step_; }
  int64_t step() const { return step_; }
  // Floats the last Reduce allreduced per rank, and what a plain allreduce
  // would have.
  int64_t last_floats_sent() const { return last_sent_; }
  int64_t last_floats_uncompressed() const { return last_uncompressed_; }
  // The error a bucket's last compression left, over its whole buffer
  // (empty before one); waits for the communicator's stream.
  absl::StatusOr<std::vector<float>> Error(int bucket) const;

 private:
  struct BucketState {
    PowerSgdPlan plan;
    DeviceBuffer error, input, p, q, packed;
    size_t floats = 0;
    // A fresh Q, generated on the host: pinned, so that its upload does not
    // wait for the stream (it is rewritten only after the step's host wait).
    float* q_host = nullptr;
    bool has_q = false;
  };

  GpuPowerSgd(GpuContext* ctx, NcclCommunicator* nccl, const PowerSgdOptions& options)
      : ctx_(ctx), nccl_(nccl), options_(options) {}
  // The state of `bucket` for these gradients (allocated the first time).
  absl::StatusOr<BucketState*> State(int bucket, size_t floats, const std::vector<Gradient>& grads);
  // C = op(A) op(B), all row-major, on the NCCL stream (gemm.h's Sgemm).
  absl::Status Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                    int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc);

  GpuContext* ctx_;
  NcclCommunicator* nccl_;
  const PowerSgdOptions options_;
  cublasHandle_t cublas_ = nullptr;
  std::map<int, BucketState> buckets_;
  int64_t step_ = 0;
  int64_t last_sent_ = 0;
  int64_t last_uncompressed_ = 0;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_POWERSGD_H_
