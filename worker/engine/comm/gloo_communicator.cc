#include "worker/engine/comm/gloo_communicator.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "gloo/types.h"

namespace aidn::engine {
namespace {

using Clock = std::chrono::steady_clock;

// Gloo's TCP pairs write to their sockets without MSG_NOSIGNAL, so a peer
// that closes its end while this rank sends raises SIGPIPE, whose default
// action kills the process before Gloo can report EPIPE. Ignore it (as
// gRPC, and Python under PyTorch, do), unless the process has its own
// handler. Once per process.
void IgnoreSigpipeUnlessHandled() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current = {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
  });
}

// AllReduce exchanges whole buffers directly while each rank sends at most
// this much ((world_size - 1) * buffer bytes); above, gloo::allreduce.
constexpr size_t kDirectAllreduceBytes = 256 * 1024;
// Cached gloo::allreduce options (one per buffer).
constexpr size_t kMaxCachedAllreduceOptions = 64;
// Slot prefixes of aidn's own exchanges; Gloo's collectives use 0x01..0x08
// (gloo/types.h).
constexpr uint8_t kReduceScatterSlotPrefix = 0x41;
constexpr uint8_t kFarewellSlotPrefix = 0x42;
constexpr uint8_t kDirectAllreduceSlotPrefix = 0x43;
// Longest a closing communicator waits for its peers' farewells.
constexpr std::chrono::milliseconds kFarewellTimeout{5'000};

// Gloo's reduction callback: c = a + b, c may alias a or b.
void SumFloats(void* c, const void* a, const void* b, size_t n) {
  float* out = static_cast<float*>(c);
  const float* x = static_cast<const float*>(a);
  const float* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

// The same for 16-bit floats: each sum in float, rounded to the format.
template <HalfFormat kFormat>
void SumHalfFloats(void* c, const void* a, const void* b, size_t n) {
  SumHalves(static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), n, kFormat,
            static_cast<uint16_t*>(c));
}

void AddInto(float* __restrict acc, const float* __restrict x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += x[i];
}

// Division rather than multiplication by 1/n: the result is the correctly
// rounded mean of the sum, as PyTorch's div_(world_size) gives.
void DivideBy(float* data, size_t n, int divisor) {
  const float d = static_cast<float>(divisor);
  for (size_t i = 0; i < n; ++i) data[i] /= d;
}

// Time left until `deadline`, at least 1 ms: Gloo reads -1 ms as "the
// context's timeout" and other negative values as an immediate timeout.
std::chrono::milliseconds GlooTimeLeft(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

bool MentionsTimeout(const char* what) {
  std::string lower(what);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower.find("timeout") != std::string::npos || lower.find("timed out") != std::string::npos;
}

// What the GlooStore below throws to carry a failed store call's status
// through Gloo (which only knows exceptions) back to Guarded. It is a
// gloo::IoException, so Gloo code that catches those treats it as any other
// I/O failure.
class StoreStatusError : public gloo::IoException {
 public:
  explicit StoreStatusError(absl::Status status)
      : gloo::IoException(status.ToString()), status_(std::move(status)) {}
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

// Gloo's view of the engine's KeyValueStore. A get or wait without a
// timeout of its own (or with a non-positive one) waits `timeout`.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  GlooStore(KeyValueStore& store, std::chrono::milliseconds timeout)
      : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_.Set(key, std::string(data.begin(), data.end())));
  }
  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> value = store_.Get(key, timeout_);
    Check(value.status());
    return std::vector<char>(value->begin(), value->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    const Clock::time_point deadline =
        Clock::now() + (timeout > std::chrono::milliseconds::zero() ? timeout : timeout_);
    for (const std::string& key : keys) {
      const auto left =
          std::max(std::chrono::milliseconds::zero(),
                   std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
      Check(store_.Get(key, left).status());
    }
  }

 private:
  static void Check(const absl::Status& status) {
    if (!status.ok()) throw StoreStatusError(status);
  }

  KeyValueStore& store_;
  const std::chrono::milliseconds timeout_;
};

// Runs `fn`, turning whatever it throws into a status prefixed with
// `context()` (built only on failure).
template <typename Fn, typename Context>
absl::Status Guarded(Fn&& fn, Context&& context) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const StoreStatusError& e) {
    return Annotate(e.status(), context());
  } catch (const gloo::Exception& e) {
    return absl::Status(MentionsTimeout(e.what()) ? absl::StatusCode::kDeadlineExceeded
                                                  : absl::StatusCode::kUnavailable,
                        absl::StrCat(context(), ": ", e.what()));
  } catch (const gloo::EnforceNotMet& e) {
    return absl::Status(MentionsTimeout(e.what()) ? absl::StatusCode::kDeadlineExceeded
                                                  : absl::StatusCode::kInternal,
                        absl::StrCat(context(), ": ", e.what()));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(context(), ": out of memory"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(context(), ": ", e.what()));
  }
}

class GlooCommunicator final : public Communicator {
 public:
  // `context` is null for world_size 1.
  GlooCommunicator(const GlooOptions& options, std::shared_ptr<gloo::Context> context)
      : rank_(options.rank),
        world_size_(options.world_size),
        timeout_(options.timeout),
        context_(std::move(context)) {}

  ~GlooCommunicator() override {
    if (context_ != nullptr && broken_.ok()) Farewell();
    // Gloo buffers refer to the context: drop them first.
    direct_buffer_.reset();
    allreduce_options_.clear();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  int64_t sequence() const override { return sequence_.load(std::memory_order_relaxed); }

  absl::Status AllReduce(float* data, size_t count, ReduceOp op) override {
    AIDN_RETURN_IF_ERROR(Check(data != nullptr || count == 0, "allreduce: null buffer"));
    if (count > 0 && world_size_ > 1) {
      absl::Status status = Guarded(
          [&] {
            if (count * sizeof(float) * (world_size_ - 1) <= kDirectAllreduceBytes) {
              DirectAllreduce(data, count);
            } else {
              SegmentedAllreduce(data, count);
            }
          },
          [&] { return absl::StrCat("gloo allreduce of ", count, " floats"); });
      AIDN_RETURN_IF_ERROR(Fail(status));
      if (op == ReduceOp::kAvg) DivideBy(data, count, world_size_);
    }
    return Done();
  }

  // Small buffers: the direct exchange of Communicator::AllReduceHalf (an
  // AllGather). Large ones: gloo::allreduce's ring over the halves.
  absl::Status AllReduceHalf(uint16_t* data, size_t count, HalfFormat format) override {
    AIDN_RETURN_IF_ERROR(Check(data != nullptr || count == 0, "allreduce of halves: null buffer"));
    if (world_size_ == 1 || count * sizeof(uint16_t) * (world_size_ - 1) <= kDirectAllreduceBytes) {
      return Communicator::AllReduceHalf(data, count, format);
    }
    AIDN_RETURN_IF_ERROR(Fail(Guarded(
        [&] {
          gloo::AllreduceOptions opts(context_);
          opts.setOutput<uint16_t>(data, count);
          opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
          opts.setReduceFunction(format == HalfFormat::kFp16 ? &SumHalfFloats<HalfFormat::kFp16>
                                                             : &SumHalfFloats<HalfFormat::kBf16>);
          opts.setTag(NextTag());
          opts.setTimeout(timeout_);
          gloo::allreduce(opts);
        },
        [&] {
          return absl::StrCat("gloo allreduce of ", count, " ", HalfFormatName(format), " values");
        })));
    return Done();
  }

  absl::Status Broadcast(float* data, size_t count, int root) override {
    AIDN_RETURN_IF_ERROR(Check(data != nullptr || count == 0, "broadcast: null buffer"));
    AIDN_RETURN_IF_ERROR(
        Check(root >= 0 && root < world_size_,
              absl::StrCat("broadcast: root ", root, " is not a rank of ", world_size_)));
    if (count > 0 && world_size_ > 1) {
      AIDN_RETURN_IF_ERROR(Fail(Guarded(
          [&] {
            gloo::BroadcastOptions opts(context_);
            opts.setOutput<float>(data, count);
            opts.setRoot(root);
            opts.setTag(NextTag());
            opts.setTimeout(timeout_);
            gloo::broadcast(opts);
          },
          [&] { return absl::StrCat("gloo broadcast of ", count, " floats from rank ", root); })));
    }
    return Done();
  }

  absl::Status AllGather(const float* in, size_t count, float* out) override {
    AIDN_RETURN_IF_ERROR(
        Check((in != nullptr && out != nullptr) || count == 0, "allgather: null buffer"));
    if (count == 0) return Done();
    float* mine = out + static_cast<size_t>(rank_) * count;
    if (world_size_ == 1) {
      if (in != mine) std::memmove(mine, in, count * sizeof(float));
      return Done();
    }
    AIDN_RETURN_IF_ERROR(Fail(Guarded(
        [&] {
          gloo::AllgatherOptions opts(context_);
          // Gloo copies the input into place; an input already there is
          // left out.
          if (in != mine) opts.setInput<float>(const_cast<float*>(in), count);
          opts.setOutput<float>(out, count * world_size_);
          opts.setTag(NextTag());
          opts.setTimeout(timeout_);
          gloo::allgather(opts);
        },
        [&] { return absl::StrCat("gloo allgather of ", count, " floats per rank"); })));
    return Done();
  }

  absl::Status ReduceScatter(const float* in, size_t count, float* out, ReduceOp op) override {
    AIDN_RETURN_IF_ERROR(
        Check((in != nullptr && out != nullptr) || count == 0, "reducescatter: null buffer"));
    if (count == 0) return Done();
    if (world_size_ == 1) {
      if (in != out) std::memmove(out, in, count * sizeof(float));
      return Done();
    }
    AIDN_RETURN_IF_ERROR(Fail(Guarded(
        [&] { RingReduceScatter(in, count, out); },
        [&] { return absl::StrCat("gloo reducescatter of ", count, " floats per rank"); })));
    if (op == ReduceOp::kAvg) DivideBy(out, count, world_size_);
    return Done();
  }

  absl::Status Barrier() override {
    AIDN_RETURN_IF_ERROR(Check(true, ""));
    if (world_size_ > 1) {
      AIDN_RETURN_IF_ERROR(Fail(Guarded(
          [&] {
            gloo::BarrierOptions opts(context_);
            opts.setTag(NextTag());
            opts.setTimeout(timeout_);
            gloo::barrier(opts);
          },
          [] { return std::string("gloo barrier"); })));
    }
    return Done();
  }

 private:
  // INVALID_ARGUMENT if `ok` is false; FAILED_PRECONDITION once broken.
  absl::Status Check(bool ok, absl::string_view message) const {
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("communicator unusable after an earlier error: ", broken_.message()));
    }
    if (!ok) return absl::InvalidArgumentError(message);
    return absl::OkStatus();
  }

  // Remembers the first error: the peers are out of step after it.
  absl::Status Fail(absl::Status status) {
    if (!status.ok() && broken_.ok()) broken_ = status;
    return status;
  }

  absl::Status Done() {
    sequence_.fetch_add(1, std::memory_order_relaxed);
    return absl::OkStatus();
  }

  uint32_t NextTag() { return tag_++; }

  // Every rank sends its whole buffer to every peer at once and sums all
  // contributions in rank order, so each rank computes the same bits: one
  // round of messages instead of the ring's 2(n-1) dependent ones, which is
  // what matters for small buffers. The staging area (world_size blocks)
  // and its Gloo buffer are kept while no larger count comes.
  void DirectAllreduce(float* data, size_t count) {
    const int n = world_size_;
    const size_t bytes = count * sizeof(float);
    if (direct_staging_.size() < count * n) {
      direct_buffer_.reset();
      direct_staging_.assign(count * n, 0.0f);
      direct_buffer_ = context_->createUnboundBuffer(direct_staging_.data(),
                                                     direct_staging_.size() * sizeof(float));
    }
    float* staging = direct_staging_.data();
    std::memcpy(staging + static_cast<size_t>(rank_) * count, data, bytes);
    const uint64_t slot = gloo::Slot::build(kDirectAllreduceSlotPrefix, NextTag());
    for (int peer = 0; peer < n; ++peer) {
      if (peer == rank_) continue;
      direct_buffer_->recv(peer, slot, static_cast<size_t>(peer) * bytes, bytes);
      direct_buffer_->send(peer, slot, static_cast<size_t>(rank_) * bytes, bytes);
    }
    const Clock::time_point deadline = Clock::now() + timeout_;
    for (int i = 0; i < n - 1; ++i) {
      if (!direct_buffer_->waitRecv(GlooTimeLeft(deadline)))
        throw gloo::IoException("receive aborted");
    }
    for (int i = 0; i < n - 1; ++i) {
      if (!direct_buffer_->waitSend(GlooTimeLeft(deadline)))
        throw gloo::IoException("send aborted");
    }
    std::memcpy(data, staging, bytes);
    for (int r = 1; r < n; ++r) AddInto(data, staging + static_cast<size_t>(r) * count, count);
  }

  // gloo::allreduce works on unbound buffers, which carry no state shared
  // with the peers: caching its options per buffer is rank-local and safe.
  void SegmentedAllreduce(float* data, size_t count) {
    const std::pair<float*, size_t> key{data, count};
    auto it = allreduce_options_.find(key);
    if (it == allreduce_options_.end()) {
      if (allreduce_options_.size() >= kMaxCachedAllreduceOptions) allreduce_options_.clear();
      auto opts = std::make_unique<gloo::AllreduceOptions>(context_);
      opts->setOutput<float>(data, count);
      opts->setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts->setReduceFunction(&SumFloats);
      opts->setTimeout(timeout_);
      it = allreduce_options_.emplace(key, std::move(opts)).first;
    }
    it->second->setTag(NextTag());
    gloo::allreduce(*it->second);
  }

  // Ring reduce-scatter: in step s a rank sends its partial sum of block
  // (rank - s - 1) to the right and adds the left's partial sum of block
  // (rank - s - 2) to its own; after world_size - 1 steps block `rank` holds
  // every rank's contribution. Each rank sends (n-1)/n of the data, half of
  // what an allreduce would.
  void RingReduceScatter(const float* in, size_t count, float* out) {
    const int n = world_size_;
    const size_t block_bytes = count * sizeof(float);
    scratch_.assign(in, in + count * n);
    recv_.resize(count);
    auto scratch_buffer = context_->createUnboundBuffer(scratch_.data(), block_bytes * n);
    auto recv_buffer = context_->createUnboundBuffer(recv_.data(), block_bytes);
    const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, NextTag());
    const int left = (rank_ + n - 1) % n;
    const int right = (rank_ + 1) % n;
    const Clock::time_point deadline = Clock::now() + timeout_;
    for (int step = 0; step < n - 1; ++step) {
      const size_t send_block = static_cast<size_t>((rank_ - step - 1 + 2 * n) % n);
      const size_t recv_block = static_cast<size_t>((rank_ - step - 2 + 2 * n) % n);
      recv_buffer->recv(left, slot, 0, block_bytes);
      scratch_buffer->send(right, slot, send_block * block_bytes, block_bytes);
      if (!recv_buffer->waitRecv(GlooTimeLeft(deadline)))
        throw gloo::IoException("receive aborted");
      if (!scratch_buffer->waitSend(GlooTimeLeft(deadline)))
        throw gloo::IoException("send aborted");
      AddInto(scratch_.data() + recv_block * count, recv_.data(), count);
    }
    std::memcpy(out, scratch_.data() + static_cast<size_t>(rank_) * count, block_bytes);
  }

  // Closing a connection while a peer still finishes the last collective
  // (its final message arrived but the waiting thread has not woken yet)
  // fails that peer with "connection closed by peer". So a healthy
  // communicator says goodbye to every peer and waits (bounded) for theirs
  // before closing: once every farewell arrived, every peer is past its
  // last collective. Errors here are ignored: a peer may be gone already.
  void Farewell() noexcept {
    const uint64_t slot = gloo::Slot::build(kFarewellSlotPrefix, 0);
    const Clock::time_point deadline = Clock::now() + std::min(timeout_, kFarewellTimeout);
    std::vector<char> sent(world_size_, 1);
    std::vector<char> received(world_size_, 0);
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> buffers;
    try {
      for (int peer = 0; peer < world_size_; ++peer) {
        if (peer == rank_) continue;
        buffers.push_back(context_->createUnboundBuffer(&received[peer], 1));
        buffers.back()->recv(peer, slot);
        buffers.push_back(context_->createUnboundBuffer(&sent[peer], 1));
        buffers.back()->send(peer, slot);
      }
    } catch (const std::exception&) {
      // A peer already left; wait for the others all the same.
    }
    for (size_t i = 0; i < buffers.size(); ++i) {
      try {
        if (i % 2 == 0) {
          buffers[i]->waitRecv(GlooTimeLeft(deadline));
        } else {
          buffers[i]->waitSend(GlooTimeLeft(deadline));
        }
      } catch (const std::exception&) {
        // That peer left first or is stuck elsewhere; close anyway.
      }
    }
  }

  const int rank_;
  const int world_size_;
  const std::chrono::milliseconds timeout_;
  // Declared before the caches that hold buffers on it.
  std::shared_ptr<gloo::Context> context_;

  std::atomic<int64_t> sequence_{0};
  absl::Status broken_;
  uint32_t tag_ = 0;

  std::vector<float> direct_staging_;
  std::unique_ptr<gloo::transport::UnboundBuffer> direct_buffer_;
  std::map<std::pair<float*, size_t>, std::unique_ptr<gloo::AllreduceOptions>> allreduce_options_;
  std::vector<float> scratch_;
  std::vector<float> recv_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(const GlooOptions& options,
                                                                     KeyValueStore* store) {
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: must be at least 1, got ", options.world_size));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: must be in [0, ", options.world_size, "), got ", options.rank));
  }
  if (options.timeout <= std::chrono::milliseconds::zero()) {
    return absl::InvalidArgumentError("timeout: must be positive");
  }
  IgnoreSigpipeUnlessHandled();
  if (options.world_size == 1) {
    return std::unique_ptr<Communicator>(std::make_unique<GlooCommunicator>(options, nullptr));
  }
  if (store == nullptr) {
    return absl::InvalidArgumentError("store: required when world_size > 1");
  }
  if (options.host.empty()) return absl::InvalidArgumentError("host: must not be empty");

  std::shared_ptr<gloo::rendezvous::Context> context;
  AIDN_RETURN_IF_ERROR(Guarded(
      [&] {
        gloo::transport::tcp::attr attr;
        attr.hostname = options.host;
        std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
        context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.world_size);
        context->setTimeout(options.timeout);
        GlooStore gloo_store(*store, options.timeout);
        if (options.prefix.empty()) {
          context->connectFullMesh(gloo_store, device);
        } else {
          gloo::rendezvous::PrefixStore prefixed(options.prefix, gloo_store);
          context->connectFullMesh(prefixed, device);
        }
      },
      [&] {
        return absl::StrCat("gloo rendezvous of rank ", options.rank, " of ", options.world_size,
                            " on ", options.host);
      }));
  return std::unique_ptr<Communicator>(
      std::make_unique<GlooCommunicator>(options, std::move(context)));
}

}  // namespace aidn::engine
