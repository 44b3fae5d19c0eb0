#ifndef AIDN_WORKER_ENGINE_CUDA_STREAM_COLLECTIVES_H_
#define AIDN_WORKER_ENGINE_CUDA_STREAM_COLLECTIVES_H_

// Collectives over device buffers in a stream's order, with no host wait:
// what a layer needs from the ranks in the middle of forward or backward
// (SyncBatchNorm's statistics). The GPU engine declares it; the NCCL
// communicator (comm/nccl_communicator.h) implements it, so that layers
// need no NCCL header. An error stays with the communicator too: the step's
// end-of-step wait reports it.

#include <cuda_runtime.h>

#include <cstddef>

#include "absl/status/status.h"

namespace aidn::engine::cuda {

class StreamCollectives {
 public:
  virtual ~StreamCollectives() = default;
  virtual int world_size() const = 0;
  // out [world_size x count] = every rank's `in` [count], in rank order,
  // ordered after what `stream` has queued so far and before what it
  // queues next.
  virtual absl::Status AllGatherOn(cudaStream_t stream, const float* in, size_t count,
                                   float* out) = 0;
  // `data` summed over the ranks in place, ordered likewise.
  virtual absl::Status AllReduceSumOn(cudaStream_t stream, float* data, size_t count) = 0;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_STREAM_COLLECTIVES_H_
