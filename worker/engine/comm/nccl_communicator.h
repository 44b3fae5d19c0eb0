#ifndef AIDN_WORKER_ENGINE_COMM_NCCL_COMMUNICATOR_H_
#define AIDN_WORKER_ENGINE_COMM_NCCL_COMMUNICATOR_H_

// The GPU Communicator: NCCL (2.28, /usr/local/cuda), built only with CUDA.
//
// Rendezvous: rank 0 calls ncclGetUniqueId and sets "<prefix>/id" in the
// generation's KeyValueStore (the coordinator's job KV, fenced by
// generation); the other ranks wait on the key. The store lives in the
// coordinator, never in rank 0's process.
//
// Nothing hangs forever. The communicator is created non-blocking
// (ncclConfig_t.blocking = 0) and every wait, for the initialisation and for
// each collective, polls ncclCommGetAsyncError and the stream against a
// deadline (`timeout`). On an error or at the deadline the communicator is
// aborted (ncclCommAbort), the call returns DEADLINE_EXCEEDED ("nccl
// allreduce of 1024 floats did not complete within 300000 ms; communicator
// aborted") or the error, and every later call FAILED_PRECONDITION: the
// trainer exits non-zero and the coordinator fails the generation.
//
// Buffers are device memory. The Communicator calls enqueue on stream() and
// wait for completion; Enqueue* and Wait let DDP overlap the allreduce of a
// bucket with the rest of backward (the caller orders the communication
// stream after the compute stream with an event).
//
// Thread safety: as the Communicator contract (one collective at a time);
// rank(), world_size() and sequence() may be called from any thread.

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/comm/kv_store.h"
#include "worker/engine/cuda/stream_collectives.h"

namespace aidn::engine {

struct NcclOptions {
  // This process' rank, 0 <= rank < world_size.
  int rank = 0;
  int world_size = 1;
  // CUDA device of this rank (the worker sets CUDA_VISIBLE_DEVICES, so 0).
  int device = 0;
  // Key prefix in the store.
  std::string prefix = "nccl";
  // Bounds the id exchange, the initialisation and each collective.
  std::chrono::milliseconds timeout{300'000};
};

// OK for ncclSuccess, else "<context>: <ncclGetErrorString> (<last error>)";
// UNAVAILABLE for a remote or system error (a peer gone), INVALID_ARGUMENT
// for invalid arguments or usage, INTERNAL otherwise.
absl::Status NcclError(absl::string_view context, ncclResult_t result);

// The unique id of the generation's communicator: rank 0 creates and
// publishes it, every other rank waits for it (DEADLINE_EXCEEDED naming the
// key after options.timeout). Needs no GPU.
absl::StatusOr<ncclUniqueId> ExchangeNcclUniqueId(const NcclOptions& options, KeyValueStore* store);

class NcclCommunicator final : public Communicator, public cuda::StreamCollectives {
 public:
  // Exchanges the id, then initialises (non-blocking) on options.device
  // with a stream of its own.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(const NcclOptions& options,
                                                                  KeyValueStore* store);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  int64_t sequence() const override { return sequence_.load(); }

  absl::Status AllReduce(float* data, size_t count, ReduceOp op) override;
  absl::Status Broadcast(float* data, size_t count, int root) override;
  absl::Status AllGather(const float* in, size_t count, float* out) override;
  absl::Status AllReduceHalf(uint16_t* data, size_t count, HalfFormat format) override;
  absl::Status ReduceScatter(const float* in, size_t count, float* out, ReduceOp op) override;
  absl::Status Barrier() override;

  // Queues an in-place allreduce on stream() without waiting; Wait() or
  // WaitForEvent() (or any later synchronous call) reports its outcome and
  // counts it in sequence().
  absl::Status EnqueueAllReduce(float* data, size_t count, ReduceOp op);
  // Queues an in-place broadcast from `root` on stream(), as EnqueueAllReduce.
  absl::Status EnqueueBroadcast(float* data, size_t count, int root);
  // Broadcasts of several buffers from `root` in one NCCL group (one launch,
  // not one per buffer: BatchNorm's running statistics), counted as one
  // collective.
  absl::Status EnqueueBroadcasts(const std::vector<std::pair<float*, size_t>>& buffers, int root);
  // Point to point (a pipeline's neighbouring stages): `send_count`
  // floats of `send` to rank `peer` and `recv_count` floats from it into
  // `recv`, in one NCCL group so that neither side waits for the other's
  // order (1F1B's steady state sends an activation forward while the next
  // stage sends a gradient back); a count of zero leaves that direction
  // out. Queued on stream(), counted as one collective; `peer` may be this
  // rank (a copy). The peer makes the matching call with the counts the
  // other way round. INVALID_ARGUMENT for a peer outside the world or a
  // null buffer with a count.
  absl::Status EnqueueExchange(int peer, const float* send, size_t send_count, float* recv,
                               size_t recv_count);
  // EnqueueExchange, then Wait: PeerLink's Send, Recv and Exchange on
  // device memory.
  absl::Status Exchange(int peer, const float* send, size_t send_count, float* recv,
                        size_t recv_count);
  // Queues ReduceScatter's reduce-scatter on stream() without waiting
  // (in place when `out` is `in` + rank x count).
  absl::Status EnqueueReduceScatter(const float* in, size_t count, float* out, ReduceOp op);
  // The same in 16 bits (FSDP's mixed precision): `count` values of
  // `format` each way; the reduce-scatter sums.
  absl::Status EnqueueAllGatherHalf(const uint16_t* in, size_t count, uint16_t* out,
                                    HalfFormat format);
  absl::Status EnqueueReduceScatterHalf(const uint16_t* in, size_t count, uint16_t* out,
                                        HalfFormat format);
  // `data` summed over the ranks in place in doubles, ordered between
  // `stream`'s work before and after as AllReduceSumOn (ZeRO's gradient
  // norm from the ranks' shards).
  absl::Status AllReduceDoubleSumOn(cudaStream_t stream, double* data, size_t count) override;
  // The largest of every rank's `data` in place (int32), ordered likewise
  // (loss scaling's overflow flag over ZeRO-1's shards).
  absl::Status AllReduceIntMaxOn(cudaStream_t stream, int32_t* data, size_t count);
  // Queues AllGather's all-gather on stream() without waiting (in place
  // when `in` is `out` + rank x count).
  absl::Status EnqueueAllGather(const float* in, size_t count, float* out);
  // cuda::StreamCollectives: WaitFor(stream), the Enqueue* call,
  // Before(stream). The layer's stream then waits for everything queued on
  // stream() before too (the gradient buckets' allreduces: torch's
  // SyncBatchNorm shares DDP's NCCL stream likewise).
  absl::Status AllGatherOn(cudaStream_t stream, const float* in, size_t count, float* out) override;
  absl::Status AllReduceSumOn(cudaStream_t stream, float* data, size_t count) override;
  // Orders stream() after what `other` has queued so far, and `other`
  // after what stream() has: a collective enqueued between the two on
  // another stream's data (SyncBatchNorm's statistics on the compute
  // stream), with no host wait.
  absl::Status WaitFor(cudaStream_t other) { return Order(other, stream_); }
  absl::Status Before(cudaStream_t other) { return Order(stream_, other); }
  // The same for an in-place sum of 16-bit floats (AllReduceHalf's).
  absl::Status EnqueueAllReduceHalf(uint16_t* data, size_t count, HalfFormat format);
  // Waits until everything queued on stream() has completed, polling for
  // asynchronous errors; aborts at an error or at the deadline.
  absl::Status Wait(absl::string_view what);
  // As Wait, but for `event` (on any stream), which the caller recorded
  // after work that waits for everything queued on stream() so far (DDP:
  // the step's last kernel on the compute stream, which waited for the
  // buckets' allreduces). A dead peer leaves the collective, and so the
  // event, pending forever: this is how the compute stream's host wait is
  // bounded.
  absl::Status WaitForEvent(cudaEvent_t event, absl::string_view what) override;

  // A communicator of the ranks that pass the same `color` (>= 0), ranked
  // by `key` (ncclCommSplit), with a stream of its own: a process grid's
  // tensor, pipeline or data group. Collective over this communicator:
  // every rank calls it, in the same order. Waits (bounded by the timeout)
  // until the new communicator is ready; a failure fails this one too (its
  // peers are in the middle of the split). INVALID_ARGUMENT for a
  // negative color.
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> Split(int color, int key);

  // Aborts the communicator now (a failure elsewhere in the generation);
  // later calls answer FAILED_PRECONDITION. Call it from the thread that
  // makes the collectives, never while one of them waits: it frees the NCCL
  // communicator that a waiting call polls.
  void Abort(absl::string_view why);

  cudaStream_t stream() const { return stream_; }

 private:
  explicit NcclCommunicator(const NcclOptions& options) : options_(options) {}
  // Common prologue: refuses after a failure.
  absl::Status Usable() const;
  // After queuing `what` (counted in queued_): ncclInProgress is fine
  // (non-blocking), anything else fails the communicator.
  absl::Status Queued(absl::string_view what, ncclResult_t result);
  // Polls ncclCommGetAsyncError until the communicator leaves
  // ncclInProgress (and, with a `done` query, until it answers cudaSuccess:
  // stream() drained, an event reached); aborts on an error or past the
  // timeout ("<what> <not_done> within N ms<hint>").
  absl::Status Poll(absl::string_view what, const std::function<cudaError_t()>& done,
                    absl::string_view not_done, absl::string_view hint);
  // Wait(), then counts the collectives queued so far as completed.
  absl::Status Complete(absl::string_view what);
  absl::Status Fail(absl::Status status);
  // An in-place allreduce of `count` values of `type` ordered between
  // `stream`'s work before and after (the *On collectives).
  absl::Status AllReduceOn(cudaStream_t stream, void* data, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, absl::string_view what);
  // `then` waits for what `first` has queued so far.
  absl::Status Order(cudaStream_t first, cudaStream_t then);

  // Const but for Split, which sets a new communicator's rank and size.
  NcclOptions options_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  // WaitFor / Before's event (made at first use).
  cudaEvent_t order_ = nullptr;
  // A one-float device buffer for Barrier.
  float* barrier_ = nullptr;
  absl::Status failed_;
  std::atomic<int64_t> sequence_{0};
  // Collectives queued (sequence_ catches up with it at each completed wait).
  int64_t queued_ = 0;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_COMM_NCCL_COMMUNICATOR_H_
