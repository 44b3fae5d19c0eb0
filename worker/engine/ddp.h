#ifndef AIDN_WORKER_ENGINE_DDP_H_
#define AIDN_WORKER_ENGINE_DDP_H_

// Data-parallel gradient averaging, as torch's DistributedDataParallel does
// it: parameters are grouped into buckets of about bucket_mb in reverse
// registration order (the order backward produces their gradients), and each
// bucket's allreduce starts on a communication thread as soon as its last
// gradient is ready, so communication overlaps the rest of backward.
//
// Call order per optimizer step, on the training thread:
//   BeginBackward(communicate, extra) ; model.Backward(...) (which calls
//   OnGradReady for every parameter) ; Finish(...)
// With gradient accumulation, only the last micro-step communicates.
//
// `extra` rides in a spare slot of the last bucket, so the step's loss is
// averaged across ranks without a collective of its own.
//
// With more than one rank, each parameter's gradient becomes a view into its
// bucket (torch's gradient_as_bucket_view): backward writes the gradients
// where the allreduce reads them and the averages land where the optimizer
// reads them, with no copies either way. The reducer gives the gradients
// storage of their own again when it is destroyed, so the parameters must
// outlive it.
//
// Not thread-safe apart from the internal hand-off to the communication
// thread. The communicator must not be used by anyone else between
// BeginBackward and Finish.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/powersgd.h"
#include "worker/engine/shard_map.h"
#include "worker/engine/tensor.h"

namespace aidn::engine {

struct DdpOptions {
  // Target bucket size in MB (10^6 bytes, as torch's bucket_cap_mb).
  double bucket_mb = 25.0;
  // ZeRO-1: each bucket is reduce-scattered (averaged) instead of
  // allreduced, so that every rank gets the averaged gradients of its
  // shard, a 1/world_size slice of every bucket (ShardParameters). The
  // optimizer steps the shards only (its state is 1/world_size of DDP's),
  // and GatherParameters all-gathers the updated weights. The parameters'
  // values become views into per-bucket buffers of the gradients' layout,
  // each bucket padded to a multiple of 16 * world_size floats.
  bool shard_optimizer = false;
  // PowerSGD compression of every bucket (powersgd.h: the semantics of
  // torch's powerSGD_hook, a plain allreduce before its start_step); not
  // with shard_optimizer.
  std::optional<PowerSgdOptions> powersgd;
  // Each bucket cast to 16 bits for the allreduce and back after (torch's
  // fp16_compress_hook and bf16_compress_hook), divided by the world size
  // before the cast so that the fp16 sum cannot overflow; the step's loss
  // goes apart, in float. Not with shard_optimizer or powersgd.
  std::optional<HalfFormat> half;
  // torch's find_unused_parameters: a step may leave parameters without a
  // gradient (a forward that skipped them). BeginBackward marks those the
  // last forward did not use ready at once (their buckets still finish),
  // and one float per parameter says whether the rank used it in any
  // forward of the step: in the last bucket's allreduce, or (compressed or
  // shard_optimizer, where the bucket's values are not summed exactly
  // everywhere) in an exact allreduce of their own. A parameter no rank
  // used is marked no_grad for the optimizer (torch's "grad is None"), and
  // with shard_optimizer so are its shards (torch's
  // ZeroRedundancyOptimizer skips it likewise). Without the option such a
  // step fails, naming the parameters.
  bool find_unused_parameters = false;
};

// INVALID_ARGUMENT for options that do not combine (compression with
// shard_optimizer, PowerSGD with fp16/bf16) or a PowerSGD rank below 1:
// the CPU and GPU reducers' common checks.
absl::Status CheckDdpOptions(const DdpOptions& options);

// INVALID_ARGUMENT naming (the first five of) the parameters that got no
// gradient in a step and the option that allows it: both reducers' error
// for a forward that skipped parts of the model without
// find_unused_parameters.
absl::Status NoGradientError(const std::vector<std::string>& names);

// Where each gradient lives in the flat bucket buffers, for the CPU reducer
// below and the GPU one (cuda/gpu_ddp.h) alike: parameters in reverse
// registration order (the order backward produces their gradients), a new
// bucket once the current one holds at least the cap, each gradient at a
// multiple of 16 floats (64 bytes, a cache line and more than any GPU
// alignment a vectorised kernel needs). `extra_floats` spare floats end
// the last bucket (the CPU reducer's loss slot).
struct BucketPlan {
  struct Slot {
    int bucket = 0;
    size_t offset = 0;  // in floats, into the bucket's buffer
  };
  // Parameter indices (registration order) per bucket, in launch order.
  std::vector<std::vector<int>> buckets;
  // Per parameter, by registration index.
  std::vector<Slot> slots;
  // Floats per bucket buffer (padding and extras included).
  std::vector<size_t> floats;
};
// INVALID_ARGUMENT for bucket_mb <= 0 (or NaN) or a negative size. With no
// parameters, one bucket holding only the extras.
absl::StatusOr<BucketPlan> PlanBuckets(const std::vector<int64_t>& numels, double bucket_mb,
                                       size_t extra_floats);

// ZeRO-1's groups (shard_map.h): the plan's buckets of `parameters`
// (registration order), each padded to a multiple of 16 x world_size floats
// (in `plan` too), so that every rank's slice starts at a 64-byte boundary;
// the parameters in bucket order at their plan offsets. INVALID_ARGUMENT
// when some rank would own only padding (CheckEveryRankOwnsSome).
absl::StatusOr<std::vector<ShardMap::Group>> ShardedBucketGroups(
    const std::vector<Parameter*>& parameters, BucketPlan* plan, int world_size);

class DdpReducer {
 public:
  // `parameters` in registration order; the communicator is not owned.
  static absl::StatusOr<std::unique_ptr<DdpReducer>> Create(
      const DdpOptions& options, const std::vector<Parameter*>& parameters,
      Communicator* communicator);
  ~DdpReducer();

  // Starts a backward pass. With communicate false, OnGradReady does nothing
  // (an accumulation micro-step). find_unused_parameters: `used` holds, in
  // registration order, whether any forward of the step used the parameter
  // on this rank, and `unused_now` the parameters the last forward did not
  // use (marked ready here); both are ignored otherwise.
  void BeginBackward(bool communicate, float extra, const std::vector<bool>& used = {},
                     const std::vector<Parameter*>& unused_now = {});
  // The model's grad-ready callback.
  void OnGradReady(Parameter* parameter);
  // Waits for every bucket and writes the averaged gradients back
  // (find_unused_parameters: and sets each parameter's no_grad).
  // INVALID_ARGUMENT naming the parameters that got no gradient. The time
  // the training thread waited goes into *wait_seconds and the time the
  // collectives took into *allreduce_seconds (either may be null).
  absl::Status Finish(double* wait_seconds, double* allreduce_seconds);
  // `extra` averaged over the ranks (valid after a communicating Finish).
  float averaged_extra() const { return averaged_extra_; }
  // Bytes the last communicating pass handed the collectives per rank (the
  // allreduced payloads: with PowerSGD its P and Q and the uncompressed
  // gradients, with fp16/bf16 two bytes a value), and what plain float
  // allreduces would have taken.
  int64_t last_bytes_sent() const { return bytes_sent_; }
  int64_t last_bytes_uncompressed() const { return bytes_uncompressed_; }

  // shard_optimizer: this rank's shards, for the optimizer: one flat piece
  // per parameter that its slice of a bucket covers, named
  // "<parameter>[begin:end]" (flat element range), its value a view into
  // the bucket's weights and its gradient a view into the averaged slice
  // (valid after a communicating Finish, until the next backward writes
  // the bucket); whole_shape is the parameter's.
  // Without sharding, or with one rank: the parameters themselves.
  const std::vector<Parameter*>& ShardParameters() const { return shard_view_; }
  // shard_optimizer: after the optimizer stepped the shards, every rank's
  // shards into every rank's weights (an all-gather per bucket). OK at once
  // without sharding or with one rank.
  absl::Status GatherParameters();
  // Bytes the reducer holds: the gradient buckets (none with one rank) and
  // the weights' buffers (shard_optimizer: the parameters' storage). The
  // reduce-scatter and the all-gather run in place and hold nothing more
  // (the Gloo communicator stages a bucket of its own; see its header).
  struct Memory {
    int64_t gradient_buckets = 0;
    int64_t weight_buffers = 0;
  };
  Memory memory() const;

  // shard_optimizer with more than one rank: where this rank's shards lie
  // (shard_map.h; the groups are the buckets); null otherwise.
  const ShardMap* shard_map() const { return map_.get(); }

  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // Parameter names per bucket, for logs and tests.
  std::vector<std::vector<std::string>> BucketLayout() const;

  // Copies rank `root`'s parameter values to every rank (identical initial
  // weights), in one collective over a packed buffer.
  static absl::Status BroadcastParameters(const std::vector<Parameter*>& parameters,
                                          Communicator* communicator, int root = 0);

 private:
  using Slot = BucketPlan::Slot;
  struct Bucket {
    std::vector<Parameter*> parameters;
    Tensor buffer;    // the gradients' storage (+ the extra slot in the last)
    int pending = 0;  // gradients still to arrive this pass
    // shard_optimizer: the weights' storage, laid out as `buffer`, and this
    // rank's slice of the averaged gradients (a view into `buffer`).
    Tensor weights;
    Tensor shard_grad;
  };
  // DdpOptions::half: bucket `index` averaged through 16 bits (the extra
  // slot left out). Its payload bytes go into *sent.
  absl::Status ReduceHalf(int index, int64_t* sent);
  // Queues the ready buckets from next_launch_ on, in index order.
  void LaunchReadyBuckets();
  // INVALID_ARGUMENT naming the parameters not reported ready.
  absl::Status MissingGradients() const;
  // shard_optimizer: lays out the weights and this rank's shards.
  void ShardBuckets(const BucketPlan& plan);

  DdpReducer(Communicator* communicator) : communicator_(communicator) {}
  void CommLoop();

  Communicator* communicator_;
  std::vector<Bucket> buckets_;
  std::unordered_map<Parameter*, Slot> slots_;
  int extra_bucket_ = 0;
  bool communicating_ = false;
  float averaged_extra_ = 0.0f;
  // One rank: the average of one gradient is itself, so the gradients stay
  // where they are and nothing is copied or handed to the comm thread.
  bool single_ = false;
  float extra_ = 0.0f;
  // One rank: gradients of this backward not yet reported ready.
  int single_pending_ = 0;
  // Registration index per parameter, and which reported ready this pass.
  std::unordered_map<Parameter*, size_t> index_;
  std::vector<bool> ready_;
  bool find_unused_ = false;
  // find_unused_parameters: whether the used flags ride in the last bucket
  // (an exact float allreduce), or go alone.
  bool flags_in_bucket_ = false;
  // find_unused_parameters: this step's used flags.
  std::vector<bool> used_;
  bool shard_ = false;
  // shard_optimizer: the buckets' shards (shard_map.h).
  std::unique_ptr<ShardMap> map_;
  // The parameters in registration order.
  std::vector<Parameter*> parameters_;
  // The shards, or (not sharded) the parameters.
  std::vector<Parameter*> shard_view_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> queue_;  // buckets ready to reduce
  // The next bucket to queue: buckets go in index order only, so that every
  // rank's collectives come in the same order whatever order its gradients
  // (or, with find_unused_parameters, its unused parameters) were ready
  // in, as torch's reducer launches them.
  int next_launch_ = 0;
  int in_flight_ = 0;  // queued or being reduced
  bool stop_ = false;
  absl::Status error_;
  double allreduce_seconds_ = 0.0;
  int64_t bytes_sent_ = 0;
  int64_t bytes_uncompressed_ = 0;
  // DdpOptions::half, and each bucket's 16-bit staging (the comm thread's).
  std::optional<HalfFormat> half_;
  std::vector<std::vector<uint16_t>> half_staging_;
  // DdpOptions::powersgd; used by the comm thread, stepped by Finish.
  std::unique_ptr<PowerSgd> powersgd_;
  std::thread thread_;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_DDP_H_
