#ifndef AIDN_WORKER_ENGINE_POWERSGD_H_
#define AIDN_WORKER_ENGINE_POWERSGD_H_

// PowerSGD gradient compression (Vogels et al., 2019) with the semantics of
// PyTorch's powerSGD_hook (torch.distributed.algorithms.ddp_comm_hooks.
// powerSGD_hook), one DDP bucket at a time:
//
//   - before start_step steps: a plain allreduce (averaged);
//   - then, with error feedback, the bucket first gets the error the last
//     compression of it left (input += error);
//   - each gradient viewed as a matrix [shape[0], rest] of n x m is
//     compressed when that pays: (n + m) r x min_compression_rate < n m,
//     with r = min(n, m, rank); the others are allreduced as they are;
//   - per compressed matrix M: P = M Q, all P allreduced (summed) and each
//     orthogonalised (Gram-Schmidt), Q = M^T P, all Q allreduced and divided
//     by the world size, M = P Q^T (orthogonalisation: OrthogonalizeColumns).
//     Q starts random (the same on every rank)
//     and orthogonalised; with warm start the next step starts from this
//     step's Q (orthogonalised again), else from a new random one;
//   - with error feedback, error = input - output for the next step.
//
// With r = min(n, m) every matrix comes back exactly averaged (to
// rounding): P spans M's whole column space. The random Q is aidn's own
// generator (deterministic from the seed and the step, the same on every
// rank), not torch's.
//
// Not thread-safe: one per DDP reducer, used from its communication thread.
// Every rank calls Reduce for the same buckets in the same order with the
// same shapes (the communicator's contract).

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

struct PowerSgdOptions {
  // The approximation's rank r (torch's matrix_approximation_rank).
  int rank = 1;
  // Plain allreduce for this many steps first (torch's
  // start_powerSGD_iter).
  int64_t start_step = 1000;
  // A matrix is compressed when (n + m) r x this < n m.
  double min_compression_rate = 2.0;
  bool error_feedback = true;
  bool warm_start = true;
  // Seeds the random Q (every rank the same).
  uint64_t seed = 0;
};

class PowerSgd {
 public:
  explicit PowerSgd(const PowerSgdOptions& options) : options_(options) {}

  // One gradient of a bucket: where it lies and its shape.
  struct Gradient {
    float* data;
    std::vector<int64_t> shape;
  };
  // Averages bucket `bucket`'s gradients over `comm`, in place (the error
  // kept follows their order). The collectives' errors come back; the
  // bucket is then not averaged.
  absl::Status Reduce(int bucket, const std::vector<Gradient>& grads, Communicator* comm);
  // The same for gradients back to back in `buffer`, of `shapes`.
  absl::Status Reduce(int bucket, float* buffer, const std::vector<std::vector<int64_t>>& shapes,
                      Communicator* comm);
  // Whether Reduce compresses now (start_step reached).
  bool active() const { return step_ >= options_.start_step; }
  // Counts a step (after every bucket of it was reduced).
  void EndStep() { ++step_; }
  int64_t step() const { return step_; }

  // The error a bucket's last compression left (null before one).
  const std::vector<float>* error(int bucket) const;
  // Floats the last Reduce sent per rank (the allreduced counts), and what
  // a plain allreduce would have sent.
  int64_t last_floats_sent() const { return last_sent_; }
  int64_t last_floats_uncompressed() const { return last_uncompressed_; }

 private:
  struct BucketState {
    std::vector<float> error;
    // The compressed matrices' P and Q, back to back.
    std::vector<float> p, q;
    bool has_q = false;
  };

  const PowerSgdOptions options_;
  int64_t step_ = 0;
  std::map<int, BucketState> buckets_;
  int64_t last_sent_ = 0;
  int64_t last_uncompressed_ = 0;
};

// How a bucket's gradients go (the same on every device): each viewed as
// a matrix [n, m] (shape[0], the rest folded) compressed at rank r, or,
// where that does not pay (r == 0 here), allreduced as it is.
struct PowerSgdPlan {
  struct Matrix {
    int64_t numel = 0;
    int64_t n = 0, m = 0, r = 0;
  };
  std::vector<Matrix> grads;  // in the bucket's order
  int64_t total_floats = 0;   // every gradient's values
  int64_t plain_floats = 0;   // the uncompressed ones'
  int64_t p_floats = 0;       // sum of n r over the compressed
  int64_t q_floats = 0;       // sum of m r over the compressed
  // Floats one compressed pass allreduces: plain, P and Q.
  int64_t floats_sent() const { return plain_floats + p_floats + q_floats; }
};
PowerSgdPlan PlanPowerSgd(const std::vector<std::vector<int64_t>>& shapes,
                          const PowerSgdOptions& options);

// A bucket's fresh Q before orthogonalisation: `count` standard normal
// values from aidn's generator, seeded by the options' seed, the step and
// the bucket (every rank the same).
void RandomPowerSgdQ(const PowerSgdOptions& options, int64_t step, int bucket, float* q,
                     int64_t count);

// Orthonormalises the columns of `matrix` [rows, cols] (row-major; cols <=
// rows) in place by Gram-Schmidt with a second pass, so that the columns
// come out orthonormal also when the matrix has lower rank (torch takes a
// QR factorisation for rank > 2 for the same reason); a zero column stays
// zero, as torch's with epsilon 0.
void OrthogonalizeColumns(float* matrix, int64_t rows, int64_t cols);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_POWERSGD_H_
