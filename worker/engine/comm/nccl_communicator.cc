#include "worker/engine/comm/nccl_communicator.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine {
namespace {

using SteadyClock = std::chrono::steady_clock;
using std::chrono::milliseconds;

absl::StatusCode CodeForNccl(ncclResult_t result) {
  switch (result) {
    case ncclSystemError:
    case ncclRemoteError:
      return absl::StatusCode::kUnavailable;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

ncclRedOp_t ToNccl(ReduceOp op) { return op == ReduceOp::kAvg ? ncclAvg : ncclSum; }

// Polls without burning a core for long: yields first (a small collective
// completes in microseconds), then sleeps 50 us between looks.
void Pause(int* spins) {
  if (++*spins < 200) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace

absl::Status NcclError(absl::string_view context, ncclResult_t result) {
  if (result == ncclSuccess) return absl::OkStatus();
  std::string message = absl::StrCat(context, ": ", ncclGetErrorString(result));
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&message, " (", last, ")");
  return absl::Status(CodeForNccl(result), message);
}

absl::StatusOr<ncclUniqueId> ExchangeNcclUniqueId(const NcclOptions& options,
                                                  KeyValueStore* store) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl: rank ", options.rank, " is not in a world of size ", options.world_size));
  }
  const std::string key = options.prefix + "/id";
  ncclUniqueId id;
  if (options.rank == 0) {
    AIDN_RETURN_IF_ERROR(NcclError("ncclGetUniqueId", ncclGetUniqueId(&id)));
    AIDN_RETURN_IF_ERROR(store->Set(key, std::string(id.internal, sizeof(id.internal))));
    return id;
  }
  absl::StatusOr<std::string> value = store->Get(key, options.timeout);
  if (!value.ok()) {
    return absl::Status(value.status().code(), absl::StrCat("nccl: rank ", options.rank,
                                                            " waiting for rank 0's unique id: ",
                                                            value.status().message()));
  }
  if (value->size() != sizeof(id.internal)) {
    return absl::DataLossError(absl::StrCat("nccl: unique id under \"", key, "\" has ",
                                            value->size(), " bytes, not ", sizeof(id.internal)));
  }
  std::memcpy(id.internal, value->data(), sizeof(id.internal));
  return id;
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const NcclOptions& options, KeyValueStore* store) {
  AIDN_ASSIGN_OR_RETURN(ncclUniqueId id, ExchangeNcclUniqueId(options, store));
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(options));
  AIDN_RETURN_IF_CUDA_ERROR(cudaSetDevice(options.device));
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking));
  AIDN_RETURN_IF_CUDA_ERROR(cudaMalloc(&c->barrier_, sizeof(float)));
  AIDN_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(c->barrier_, 0, sizeof(float), c->stream_));

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that a missing peer cannot hang us: we poll
  const ncclResult_t started =
      ncclCommInitRankConfig(&c->comm_, options.world_size, id, options.rank, &config);
  const std::string what =
      absl::StrCat("nccl init of rank ", options.rank, " of ", options.world_size);
  if (started != ncclSuccess && started != ncclInProgress) {
    return c->Fail(NcclError(what, started));
  }
  // Init completes in the background; a peer that never comes leaves it in
  // progress until we give up.
  AIDN_RETURN_IF_ERROR(c->Poll(what, nullptr, "did not complete", " (is every rank up?)"));
  return c;
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Split(int color, int key) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (color < 0) {
    return absl::InvalidArgumentError(absl::StrCat("nccl split: color ", color, " is negative"));
  }
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(options_));
  c->options_.prefix = absl::StrCat(options_.prefix, "/split-", color);
  AIDN_RETURN_IF_CUDA_ERROR(cudaSetDevice(options_.device));
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking));
  AIDN_RETURN_IF_CUDA_ERROR(cudaMalloc(&c->barrier_, sizeof(float)));
  AIDN_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(c->barrier_, 0, sizeof(float), c->stream_));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const std::string what =
      absl::StrCat("nccl split of rank ", options_.rank, " (color ", color, ", key ", key, ")");
  const ncclResult_t started = ncclCommSplit(comm_, color, key, &c->comm_, &config);
  if (started != ncclSuccess && started != ncclInProgress) return Fail(NcclError(what, started));
  // Both ends of a non-blocking split may still be in progress.
  AIDN_RETURN_IF_ERROR(Poll(what, nullptr, "did not complete", " (does every rank split?)"));
  if (c->comm_ == nullptr) {
    return Fail(absl::InternalError(absl::StrCat(what, ": no communicator came back")));
  }
  AIDN_RETURN_IF_ERROR(c->Poll(what, nullptr, "did not complete", " (does every rank split?)"));
  int rank = 0;
  int count = 0;
  if (ncclResult_t r = ncclCommUserRank(c->comm_, &rank); r != ncclSuccess) {
    return c->Fail(NcclError(what, r));
  }
  if (ncclResult_t r = ncclCommCount(c->comm_, &count); r != ncclSuccess) {
    return c->Fail(NcclError(what, r));
  }
  c->options_.rank = rank;
  c->options_.world_size = count;
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) {
    if (failed_.ok()) {
      // Flush what is queued, then free; bounded like everything else.
      ncclResult_t r = ncclCommFinalize(comm_);
      const SteadyClock::time_point deadline =
          SteadyClock::now() + std::min(options_.timeout, milliseconds(5'000));
      int spins = 0;
      while (r == ncclSuccess || r == ncclInProgress) {
        ncclResult_t state = ncclSuccess;
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) {
          r = ncclInternalError;  // abort rather than destroy a comm in an unknown state
          break;
        }
        if (state != ncclInProgress) {
          r = state;
          break;
        }
        if (SteadyClock::now() > deadline) {
          r = ncclInternalError;
          break;
        }
        Pause(&spins);
      }
      if (r == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    } else {
      ncclCommAbort(comm_);
    }
  }
  if (barrier_ != nullptr) cudaFree(barrier_);
  if (order_ != nullptr) cudaEventDestroy(order_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status NcclCommunicator::Usable() const {
  if (!failed_.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "nccl communicator is unusable after an earlier failure: ", failed_.message()));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Fail(absl::Status status) {
  failed_ = absl::Status(status.code(), absl::StrCat(status.message(), "; communicator aborted"));
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  return failed_;
}

void NcclCommunicator::Abort(absl::string_view why) {
  if (!failed_.ok()) return;
  Fail(absl::AbortedError(absl::StrCat("nccl communicator aborted: ", why))).IgnoreError();
}

absl::Status NcclCommunicator::Queued(absl::string_view what, ncclResult_t result) {
  ++queued_;
  if (result == ncclSuccess) return absl::OkStatus();
  if (result != ncclInProgress) return Fail(NcclError(what, result));
  // A non-blocking communicator may still be enqueuing: until it says
  // ncclSuccess, no other NCCL call and no CUDA work on stream() may follow
  // (an event recorded now could land before the collective's kernel).
  return Poll(what, nullptr, "was not enqueued", "");
}

absl::Status NcclCommunicator::Wait(absl::string_view what) {
  AIDN_RETURN_IF_ERROR(Usable());
  const int64_t queued = queued_;
  AIDN_RETURN_IF_ERROR(Poll(
      what, [this] { return cudaStreamQuery(stream_); }, "did not complete", ""));
  sequence_.store(queued);
  return absl::OkStatus();
}

absl::Status NcclCommunicator::WaitForEvent(cudaEvent_t event, absl::string_view what) {
  AIDN_RETURN_IF_ERROR(Usable());
  const int64_t queued = queued_;
  AIDN_RETURN_IF_ERROR(Poll(
      what, [event] { return cudaEventQuery(event); }, "did not complete", ""));
  sequence_.store(queued);
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Poll(absl::string_view what,
                                    const std::function<cudaError_t()>& done,
                                    absl::string_view not_done, absl::string_view hint) {
  const SteadyClock::time_point deadline = SteadyClock::now() + options_.timeout;
  int spins = 0;
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) return Fail(NcclError("ncclCommGetAsyncError", r));
    if (state != ncclSuccess && state != ncclInProgress) return Fail(NcclError(what, state));
    if (state == ncclSuccess) {
      if (!done) return absl::OkStatus();
      const cudaError_t q = done();
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) {
        return Fail(cuda::CudaError(absl::StrCat(what, ": waiting for the GPU"), q));
      }
    }
    if (SteadyClock::now() > deadline) {
      return Fail(absl::DeadlineExceededError(
          absl::StrCat(what, " ", not_done, " within ", options_.timeout.count(), " ms", hint)));
    }
    Pause(&spins);
  }
}

absl::Status NcclCommunicator::Complete(absl::string_view what) { return Wait(what); }

absl::Status NcclCommunicator::EnqueueAllReduce(float* data, size_t count, ReduceOp op) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (count == 0) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("nccl allreduce: null buffer");
  return Queued(absl::StrCat("nccl allreduce of ", count, " floats"),
                ncclAllReduce(data, data, count, ncclFloat, ToNccl(op), comm_, stream_));
}

absl::Status NcclCommunicator::AllReduce(float* data, size_t count, ReduceOp op) {
  const std::string what = absl::StrCat("nccl allreduce of ", count, " floats");
  AIDN_RETURN_IF_ERROR(EnqueueAllReduce(data, count, op));
  if (count == 0) {
    ++queued_;
    sequence_.fetch_add(1);
    return absl::OkStatus();
  }
  return Complete(what);
}

absl::Status NcclCommunicator::EnqueueAllReduceHalf(uint16_t* data, size_t count,
                                                    HalfFormat format) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (count == 0) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("nccl allreduce of halves: null buffer");
  return Queued(
      absl::StrCat("nccl allreduce of ", count, " ", HalfFormatName(format), " values"),
      ncclAllReduce(data, data, count, format == HalfFormat::kFp16 ? ncclFloat16 : ncclBfloat16,
                    ncclSum, comm_, stream_));
}

absl::Status NcclCommunicator::AllReduceHalf(uint16_t* data, size_t count, HalfFormat format) {
  const std::string what =
      absl::StrCat("nccl allreduce of ", count, " ", HalfFormatName(format), " values");
  AIDN_RETURN_IF_ERROR(EnqueueAllReduceHalf(data, count, format));
  if (count == 0) {
    ++queued_;
    sequence_.fetch_add(1);
    return absl::OkStatus();
  }
  return Complete(what);
}

absl::Status NcclCommunicator::EnqueueBroadcast(float* data, size_t count, int root) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (root < 0 || root >= options_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl broadcast: root ", root, " is not in a world of size ", options_.world_size));
  }
  if (count == 0) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("nccl broadcast: null buffer");
  return Queued(absl::StrCat("nccl broadcast of ", count, " floats from ", root),
                ncclBroadcast(data, data, count, ncclFloat, root, comm_, stream_));
}

absl::Status NcclCommunicator::EnqueueBroadcasts(
    const std::vector<std::pair<float*, size_t>>& buffers, int root) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (root < 0 || root >= options_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl broadcast: root ", root, " is not in a world of size ", options_.world_size));
  }
  size_t floats = 0;
  for (const auto& [data, count] : buffers) {
    if (count > 0 && data == nullptr) {
      return absl::InvalidArgumentError("nccl broadcast: null buffer");
    }
    floats += count;
  }
  if (floats == 0) return absl::OkStatus();
  const std::string what = absl::StrCat("nccl broadcast of ", buffers.size(), " buffers (", floats,
                                        " floats) from ", root);
  ncclResult_t result = ncclGroupStart();
  if (result != ncclSuccess) return Fail(NcclError(what, result));
  for (const auto& [data, count] : buffers) {
    if (count == 0) continue;
    result = ncclBroadcast(data, data, count, ncclFloat, root, comm_, stream_);
    if (result != ncclSuccess && result != ncclInProgress) {
      ncclGroupEnd();
      return Fail(NcclError(what, result));
    }
  }
  return Queued(what, ncclGroupEnd());
}

absl::Status NcclCommunicator::EnqueueExchange(int peer, const float* send, size_t send_count,
                                               float* recv, size_t recv_count) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (peer < 0 || peer >= options_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl send/recv: peer ", peer, " is not in a world of size ", options_.world_size));
  }
  if ((send_count > 0 && send == nullptr) || (recv_count > 0 && recv == nullptr)) {
    return absl::InvalidArgumentError("nccl send/recv: null buffer");
  }
  if (send_count == 0 && recv_count == 0) return absl::OkStatus();
  const std::string what = absl::StrCat("nccl send of ", send_count, " floats to and receive of ",
                                        recv_count, " from rank ", peer);
  ncclResult_t result = ncclGroupStart();
  if (result != ncclSuccess) return Fail(NcclError(what, result));
  if (send_count > 0) result = ncclSend(send, send_count, ncclFloat, peer, comm_, stream_);
  if ((result == ncclSuccess || result == ncclInProgress) && recv_count > 0) {
    result = ncclRecv(recv, recv_count, ncclFloat, peer, comm_, stream_);
  }
  if (result != ncclSuccess && result != ncclInProgress) {
    ncclGroupEnd();
    return Fail(NcclError(what, result));
  }
  return Queued(what, ncclGroupEnd());
}

absl::Status NcclCommunicator::Exchange(int peer, const float* send, size_t send_count, float* recv,
                                        size_t recv_count) {
  AIDN_RETURN_IF_ERROR(EnqueueExchange(peer, send, send_count, recv, recv_count));
  if (send_count == 0 && recv_count == 0) {
    ++queued_;
    sequence_.fetch_add(1);
    return absl::OkStatus();
  }
  return Complete(absl::StrCat("nccl send/recv with rank ", peer));
}

absl::Status NcclCommunicator::Broadcast(float* data, size_t count, int root) {
  AIDN_RETURN_IF_ERROR(EnqueueBroadcast(data, count, root));
  if (count == 0) {
    ++queued_;
    sequence_.fetch_add(1);
    return absl::OkStatus();
  }
  return Complete(absl::StrCat("nccl broadcast of ", count, " floats from ", root));
}

absl::Status NcclCommunicator::EnqueueAllGather(const float* in, size_t count, float* out) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (count == 0) return absl::OkStatus();
  if (in == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("nccl allgather: null buffer");
  }
  return Queued(absl::StrCat("nccl allgather of ", count, " floats"),
                ncclAllGather(in, out, count, ncclFloat, comm_, stream_));
}

absl::Status NcclCommunicator::EnqueueAllGatherHalf(const uint16_t* in, size_t count, uint16_t* out,
                                                    HalfFormat format) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (count == 0) return absl::OkStatus();
  if (in == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("nccl allgather of halves: null buffer");
  }
  return Queued(
      absl::StrCat("nccl allgather of ", count, " ", HalfFormatName(format), " values"),
      ncclAllGather(in, out, count, format == HalfFormat::kFp16 ? ncclFloat16 : ncclBfloat16, comm_,
                    stream_));
}

absl::Status NcclCommunicator::EnqueueReduceScatterHalf(const uint16_t* in, size_t count,
                                                        uint16_t* out, HalfFormat format) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (count == 0) return absl::OkStatus();
  if (in == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("nccl reduce-scatter of halves: null buffer");
  }
  return Queued(
      absl::StrCat("nccl reduce-scatter of ", count, " ", HalfFormatName(format), " values"),
      ncclReduceScatter(in, out, count, format == HalfFormat::kFp16 ? ncclFloat16 : ncclBfloat16,
                        ncclSum, comm_, stream_));
}

absl::Status NcclCommunicator::AllGather(const float* in, size_t count, float* out) {
  AIDN_RETURN_IF_ERROR(EnqueueAllGather(in, count, out));
  if (count == 0) {
    ++queued_;
    sequence_.fetch_add(1);
    return absl::OkStatus();
  }
  return Complete(absl::StrCat("nccl allgather of ", count, " floats"));
}

absl::Status NcclCommunicator::AllGatherOn(cudaStream_t stream, const float* in, size_t count,
                                           float* out) {
  AIDN_RETURN_IF_ERROR(WaitFor(stream));
  AIDN_RETURN_IF_ERROR(EnqueueAllGather(in, count, out));
  return Before(stream);
}

absl::Status NcclCommunicator::AllReduceSumOn(cudaStream_t stream, float* data, size_t count) {
  return AllReduceOn(stream, data, count, ncclFloat, ncclSum, "floats");
}

absl::Status NcclCommunicator::Order(cudaStream_t first, cudaStream_t then) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (order_ == nullptr) {
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&order_, cudaEventDisableTiming));
  }
  // One event serves every ordering: a wait binds to the record before it.
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(order_, first));
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(then, order_, 0));
  return absl::OkStatus();
}

absl::Status NcclCommunicator::EnqueueReduceScatter(const float* in, size_t count, float* out,
                                                    ReduceOp op) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (count == 0) return absl::OkStatus();
  if (in == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("nccl reduce-scatter: null buffer");
  }
  return Queued(absl::StrCat("nccl reduce-scatter of ", count, " floats"),
                ncclReduceScatter(in, out, count, ncclFloat, ToNccl(op), comm_, stream_));
}

absl::Status NcclCommunicator::ReduceScatter(const float* in, size_t count, float* out,
                                             ReduceOp op) {
  AIDN_RETURN_IF_ERROR(EnqueueReduceScatter(in, count, out, op));
  if (count == 0) {
    ++queued_;
    sequence_.fetch_add(1);
    return absl::OkStatus();
  }
  return Complete(absl::StrCat("nccl reduce-scatter of ", count, " floats"));
}

absl::Status NcclCommunicator::AllReduceOn(cudaStream_t stream, void* data, size_t count,
                                           ncclDataType_t type, ncclRedOp_t op,
                                           absl::string_view what) {
  AIDN_RETURN_IF_ERROR(Usable());
  if (count == 0) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("nccl allreduce: null buffer");
  AIDN_RETURN_IF_ERROR(WaitFor(stream));
  AIDN_RETURN_IF_ERROR(Queued(absl::StrCat("nccl allreduce of ", count, " ", what),
                              ncclAllReduce(data, data, count, type, op, comm_, stream_)));
  return Before(stream);
}

absl::Status NcclCommunicator::AllReduceIntMaxOn(cudaStream_t stream, int32_t* data, size_t count) {
  return AllReduceOn(stream, data, count, ncclInt32, ncclMax, "ints (max)");
}

absl::Status NcclCommunicator::AllReduceDoubleSumOn(cudaStream_t stream, double* data,
                                                    size_t count) {
  return AllReduceOn(stream, data, count, ncclDouble, ncclSum, "doubles");
}

absl::Status NcclCommunicator::Barrier() {
  AIDN_RETURN_IF_ERROR(Usable());
  const std::string what = "nccl barrier";
  AIDN_RETURN_IF_ERROR(
      Queued(what, ncclAllReduce(barrier_, barrier_, 1, ncclFloat, ncclSum, comm_, stream_)));
  return Complete(what);
}

}  // namespace aidn::engine
