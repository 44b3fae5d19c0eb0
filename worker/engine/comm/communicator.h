#ifndef AIDN_WORKER_ENGINE_COMM_COMMUNICATOR_H_
#define AIDN_WORKER_ENGINE_COMM_COMMUNICATOR_H_

// Collectives among the ranks of one generation of a job. Implementations:
// shared memory among ranks on one host (shm_communicator.h), Gloo over TCP
// (gloo_communicator.h: CPU, any hosts), NCCL (nccl_communicator.h: GPU);
// cpu_communicator.h picks between the CPU ones. All meet their peers
// through a KeyValueStore (kv_store.h), and all pass one conformance suite
// (tests/unit/engine/communicator_conformance.h).
//
// Call-order contract: every rank calls the same collectives, with the same
// counts, in the same order. One collective at a time per communicator (use
// one communicator per thread that communicates). Errors (a peer gone, a
// timeout) come back as absl::Status; after one, the communicator is
// unusable and the generation must end.

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "worker/engine/half.h"

namespace aidn::engine {

enum class ReduceOp { kSum, kAvg };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // In place: every rank ends with the elementwise reduction.
  virtual absl::Status AllReduce(float* data, size_t count, ReduceOp op) = 0;
  // In place: every rank ends with root's data.
  virtual absl::Status Broadcast(float* data, size_t count, int root) = 0;
  // `out` holds world_size * count: rank r's `in` at [r * count, (r+1) * count).
  // In place when `in` is out + rank * count.
  virtual absl::Status AllGather(const float* in, size_t count, float* out) = 0;
  // `in` holds world_size * count; rank r gets the reduction of block r. In
  // place when `out` is in + rank * count (the rest of `in` is then left
  // unspecified); otherwise `in` is left as it was.
  virtual absl::Status ReduceScatter(const float* in, size_t count, float* out, ReduceOp op) = 0;
  // In place over 16-bit floats (half.h): every rank ends with the same
  // sum, each within the format's rounding of the exact sum (the default:
  // an AllGather of the halves, summed in rank order in float and rounded
  // once; the Gloo communicator runs a ring for large buffers, rounding
  // each partial sum, as NCCL's ncclHalf and ncclBfloat16 sums do).
  // Host memory (device memory for NCCL), like every other call.
  virtual absl::Status AllReduceHalf(uint16_t* data, size_t count, HalfFormat format);
  virtual absl::Status Barrier() = 0;
  // Collectives completed so far (the progress beat's collective_seq).
  virtual int64_t sequence() const = 0;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_COMM_COMMUNICATOR_H_
