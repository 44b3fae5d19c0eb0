#ifndef AIDN_WORKER_ENGINE_CUDA_STREAM_COLLECTIVES_H_
#define AIDN_WORKER_ENGINE_CUDA_STREAM_COLLECTIVES_H_

// Collectives over device buffers in a stream's order, with no host wait:
// what a layer needs from the ranks in the middle of forward or backward
// (SyncBatchNorm's statistics), and what a pipeline stage exchanges with
// its neighbours. The GPU engine declares it; the NCCL
// communicator (comm/nccl_communicator.h) implements it, so that layers
// need no NCCL header. An error stays with the communicator too: the step's
// end-of-step wait reports it.

#include <cuda_runtime.h>

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

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
  // The same in doubles (a clipping norm's squares, summed over pipeline
  // stages or ZeRO's shards).
  virtual absl::Status AllReduceDoubleSumOn(cudaStream_t stream, double* data, size_t count) = 0;
  // The host's wait for `event` (recorded after work that depends on this
  // group's collectives), bounded: a dead peer fails it, naming `what`,
  // instead of leaving the event pending forever.
  virtual absl::Status WaitForEvent(cudaEvent_t event, absl::string_view what) = 0;
};

// Point to point with one neighbour (a pipeline's previous or next stage)
// over device buffers: `send_count` floats of `send` go to the peer and
// `recv_count` floats of the peer's come into `recv`, ordered after what
// `stream` has queued so far and before what it queues next; either count
// may be zero. The peer makes the matching call with the counts the other
// way round (the schedules of pipeline_schedule.h pair them).
class DeviceLink {
 public:
  virtual ~DeviceLink() = default;
  virtual absl::Status ExchangeOn(cudaStream_t stream, const float* send, size_t send_count,
                                  float* recv, size_t recv_count) = 0;
};

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_STREAM_COLLECTIVES_H_
