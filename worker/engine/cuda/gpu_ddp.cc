#include "worker/engine/cuda/gpu_ddp.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {

absl::StatusOr<std::unique_ptr<GpuDdpReducer>> GpuDdpReducer::Create(
    GpuContext* ctx, const std::vector<GpuParameter*>& parameters, NcclCommunicator* nccl,
    const DdpOptions& options, const ShardMap* shards) {
  if (ctx == nullptr || nccl == nullptr) {
    return absl::InvalidArgumentError("gpu ddp: no context or no communicator");
  }
  std::vector<int64_t> numels;
  for (size_t k = 0; k < parameters.size(); ++k) {
    if (parameters[k] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("gpu ddp: parameter ", k, " is null"));
    }
    numels.push_back(parameters[k]->grad.numel());
  }
  AIDN_RETURN_IF_ERROR(CheckDdpOptions(options));
  AIDN_ASSIGN_OR_RETURN(BucketPlan plan, PlanBuckets(numels, options.bucket_mb, 0));
  if (options.shard_optimizer) {
    AIDN_RETURN_IF_ERROR(CheckShardLayout(parameters, shards, nccl->world_size(), &plan));
  }
  std::unique_ptr<GpuDdpReducer> r(new GpuDdpReducer(ctx, nccl));
  r->half_ = options.half;
  r->parameters_ = parameters;
  r->find_unused_ = options.find_unused_parameters;
  if (r->find_unused_) {
    AIDN_ASSIGN_OR_RETURN(r->used_, UsedFlags::Create(ctx, parameters.size()));
  }
  if (options.powersgd.has_value()) {
    AIDN_ASSIGN_OR_RETURN(r->powersgd_, GpuPowerSgd::Create(ctx, nccl, *options.powersgd));
  }
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    Bucket& bucket = r->buckets_.emplace_back();
    bucket.floats = plan.floats[b];
    for (int k : plan.buckets[b]) {
      GpuParameter* p = parameters[static_cast<size_t>(k)];
      if (!r->bucket_of_.emplace(p, static_cast<int>(b)).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("gpu ddp: parameter ", p->name, " is listed twice"));
      }
      bucket.parameters.push_back(p);
    }
  }
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&r->ready_, cudaEventDisableTiming));
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreate(&r->start_));
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreate(&r->end_));
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreate(&r->backward_end_));
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&r->buffers_done_, cudaEventDisableTiming));
  // The gradients move into the buckets (stream order keeps their values:
  // the copies are queued before anything that writes them again).
  cudaStream_t stream = ctx->stream();
  for (size_t b = 0; b < r->buckets_.size(); ++b) {
    Bucket& bucket = r->buckets_[b];
    if (bucket.floats == 0) continue;
    // From the compute stream's allocator although NCCL's stream uses them
    // too (allocator.h's one-stream rule): they are freed only in the
    // destructor, after both streams are synchronised.
    AIDN_ASSIGN_OR_RETURN(bucket.buffer, ctx->allocator().Allocate(sizeof(float) * bucket.floats));
    if (r->half_.has_value()) {
      AIDN_ASSIGN_OR_RETURN(bucket.half,
                            ctx->allocator().Allocate(sizeof(uint16_t) * bucket.floats));
    }
    float* base = static_cast<float*>(bucket.buffer.data());
    // The padding between gradients is reduced too: zeros, not garbage.
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(base, 0, sizeof(float) * bucket.floats, stream));
  }
  for (size_t k = 0; k < parameters.size(); ++k) {
    GpuParameter* p = parameters[k];
    const BucketPlan::Slot slot = plan.slots[k];
    float* at = static_cast<float*>(r->buckets_[static_cast<size_t>(slot.bucket)].buffer.data()) +
                slot.offset;
    if (p->grad.numel() > 0) {
      AIDN_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(at, p->grad.data(), sizeof(float) * static_cast<size_t>(p->grad.numel()),
                          cudaMemcpyDeviceToDevice, stream));
    }
    std::vector<int64_t> shape = p->grad.shape();
    p->grad = GpuTensor::View(at, std::move(shape));
  }
  for (Bucket& bucket : r->buckets_) bucket.pending = static_cast<int>(bucket.parameters.size());
  if (options.shard_optimizer) {
    r->sharded_ = true;
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreate(&r->gathered_));
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreate(&r->gather_start_));
    AIDN_RETURN_IF_ERROR(r->ShardBuckets(*shards, plan));
  }
  return r;
}

absl::Status GpuDdpReducer::CheckShardLayout(const std::vector<GpuParameter*>& parameters,
                                             const ShardMap* shards, int world_size,
                                             BucketPlan* plan) {
  if (shards == nullptr) {
    return absl::InvalidArgumentError("gpu ddp: ZeRO-1 needs the shards' layout");
  }
  // The buckets padded as ShardedBucketGroups pads them; the layout must
  // be that plan's, parameter for parameter.
  const size_t unit = size_t{16} * static_cast<size_t>(world_size);
  for (size_t& f : plan->floats) f = (f + unit - 1) / unit * unit;
  bool same = shards->num_groups() == static_cast<int>(plan->buckets.size()) &&
              shards->parameters().size() == parameters.size();
  for (size_t b = 0; same && b < plan->buckets.size(); ++b) {
    const ShardMap::Group& g = shards->group(static_cast<int>(b));
    same = g.floats == plan->floats[b] && g.parameters.size() == plan->buckets[b].size();
    for (size_t i = 0; same && i < g.parameters.size(); ++i) {
      const size_t k = static_cast<size_t>(plan->buckets[b][i]);
      same = g.parameters[i]->name == parameters[k]->name && g.offsets[i] == plan->slots[k].offset;
    }
  }
  if (!same) {
    return absl::InvalidArgumentError(
        "gpu ddp: the shards' layout is not this model's bucket plan (another bucket_mb or world "
        "size?)");
  }
  return absl::OkStatus();
}

absl::Status GpuDdpReducer::ShardBuckets(const ShardMap& shards, const BucketPlan& plan) {
  cudaStream_t stream = ctx_->stream();
  rank_ = static_cast<size_t>(nccl_->rank());
  // The weights move into per-bucket buffers of the gradients' layout, where
  // the all-gather after each update writes.
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    bucket.chunk = bucket.floats / static_cast<size_t>(nccl_->world_size());
    if (bucket.floats == 0) continue;
    AIDN_ASSIGN_OR_RETURN(bucket.values, ctx_->allocator().Allocate(sizeof(float) * bucket.floats));
    float* base = static_cast<float*>(bucket.values.data());
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(base, 0, sizeof(float) * bucket.floats, stream));
    for (size_t i = 0; i < bucket.parameters.size(); ++i) {
      GpuParameter* p = bucket.parameters[i];
      const size_t k = static_cast<size_t>(plan.buckets[b][i]);
      float* at = base + plan.slots[k].offset;
      if (p->value.numel() > 0) {
        AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
            at, p->value.data(), sizeof(float) * static_cast<size_t>(p->value.numel()),
            cudaMemcpyDeviceToDevice, stream));
      }
      std::vector<int64_t> shape = p->value.shape();
      p->value = GpuTensor::View(at, std::move(shape));
    }
  }
  // This rank's shards, named and ordered as the layout's: values in the
  // rank's slice of the weights, gradients in its slice of the bucket
  // (where the reduce-scatter leaves the averages, in place).
  for (size_t k = 0; k < shards.shards().size(); ++k) {
    const ShardMap::ShardPlace at = shards.place(k);
    Bucket& bucket = buckets_[static_cast<size_t>(at.group)];
    auto piece = std::make_unique<GpuParameter>();
    piece->name = shards.shards()[k]->name;
    const int64_t n = static_cast<int64_t>(at.hi - at.lo);
    piece->value = GpuTensor::View(static_cast<float*>(bucket.values.data()) + at.lo, {n});
    piece->grad = GpuTensor::View(static_cast<float*>(bucket.buffer.data()) + at.lo, {n});
    piece->whole_shape = parameters_[at.parameter]->value.shape();
    shard_view_.push_back(piece.get());
    shards_.push_back(std::move(piece));
    shard_whole_.push_back(at.parameter);
  }
  return absl::OkStatus();
}

GpuDdpReducer::~GpuDdpReducer() {
  // Nothing may still read or write the buckets when they go.
  SettleAtTeardown(ctx_, nccl_, launched_ > 0 || !reported_.empty(), "gradient buckets");
  for (Bucket& bucket : buckets_) {
    for (GpuParameter* p : bucket.parameters) {
      for (GpuTensor* t : {&p->grad, &p->value}) {
        if (!t->is_view()) continue;
        absl::StatusOr<GpuTensor> own = GpuTensor::Empty(ctx_, t->shape());
        if (!own.ok() || !own->CopyFrom(ctx_, *t).ok()) continue;
        *t = *std::move(own);
      }
    }
  }
  cudaStreamSynchronize(ctx_->stream());
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (start_ != nullptr) cudaEventDestroy(start_);
  if (end_ != nullptr) cudaEventDestroy(end_);
  if (backward_end_ != nullptr) cudaEventDestroy(backward_end_);
  if (buffers_done_ != nullptr) cudaEventDestroy(buffers_done_);
  if (gathered_ != nullptr) cudaEventDestroy(gathered_);
  if (gather_start_ != nullptr) cudaEventDestroy(gather_start_);
}

std::vector<std::vector<std::string>> GpuDdpReducer::BucketLayout() const {
  std::vector<std::vector<std::string>> layout;
  for (const Bucket& b : buckets_) {
    std::vector<std::string>& names = layout.emplace_back();
    for (const GpuParameter* p : b.parameters) names.push_back(p->name);
  }
  return layout;
}

absl::Status GpuDdpReducer::Launch(int index) {
  Bucket& bucket = buckets_[static_cast<size_t>(index)];
  cudaStream_t comm = nccl_->stream();
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(ready_, ctx_->stream()));
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(comm, ready_, 0));
  if (launched_ == 0) {
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(start_, comm));
    bytes_sent_ = 0;
    bytes_uncompressed_ = 0;
    launch_order_.clear();
  }
  launch_order_.push_back(index);
  ++launched_;
  const int64_t bytes = static_cast<int64_t>(sizeof(float) * bucket.floats);
  bytes_uncompressed_ += bytes;
  float* data = static_cast<float*>(bucket.buffer.data());
  absl::Status s;
  if (half_.has_value()) {
    s = LaunchHalf(bucket);
    bytes_sent_ += bytes / 2;
  } else if (sharded_) {
    // In place: the rank's slice of the bucket gets its averages.
    s = nccl_->EnqueueReduceScatter(data, bucket.chunk, data + rank_ * bucket.chunk,
                                    ReduceOp::kAvg);
    bytes_sent_ += bytes;
  } else if (powersgd_ != nullptr && powersgd_->active()) {
    std::vector<GpuPowerSgd::Gradient> grads;
    for (GpuParameter* p : bucket.parameters) grads.push_back({p->grad.data(), p->grad.shape()});
    s = powersgd_->Reduce(index, data, bucket.floats, grads);
    bytes_sent_ += powersgd_->last_floats_sent() * static_cast<int64_t>(sizeof(float));
  } else {
    s = nccl_->EnqueueAllReduce(data, bucket.floats, ReduceOp::kAvg);
    bytes_sent_ += bytes;
  }
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("ddp bucket ", index, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status GpuDdpReducer::LaunchHalf(Bucket& bucket) {
  if (bucket.floats == 0) return absl::OkStatus();
  cudaStream_t comm = nccl_->stream();
  float* data = static_cast<float*>(bucket.buffer.data());
  const int64_t n = static_cast<int64_t>(bucket.floats);
  const HalfType type = *half_ == HalfFormat::kFp16 ? HalfType::kFp16 : HalfType::kBf16;
  AIDN_RETURN_IF_ERROR(LaunchScale(comm, data, n, 1.0f / static_cast<float>(nccl_->world_size())));
  AIDN_RETURN_IF_ERROR(LaunchToHalf(comm, data, bucket.half.data(), n, type));
  AIDN_RETURN_IF_ERROR(nccl_->EnqueueAllReduceHalf(static_cast<uint16_t*>(bucket.half.data()),
                                                   bucket.floats, *half_));
  return LaunchFromHalf(comm, bucket.half.data(), data, n, type, /*accumulate=*/false);
}

absl::Status GpuDdpReducer::BroadcastBuffers(const std::vector<GpuParameter*>& buffers) {
  return BroadcastBuffersFromRankZero(ctx_, nccl_, buffers, ready_, buffers_done_);
}

absl::Status GpuDdpReducer::OnGradReady(const std::vector<GpuParameter*>& parameters) {
  // Last parameter first, as the plan orders them (a layer's bias before
  // its weight), so that buckets complete in plan order when no block was
  // skipped.
  for (auto p_it = parameters.rbegin(); p_it != parameters.rend(); ++p_it) {
    GpuParameter* p = *p_it;
    auto it = bucket_of_.find(p);
    if (it == bucket_of_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gpu ddp: gradient of ", p == nullptr ? "null" : p->name, " is not in any bucket"));
    }
    if (!reported_.emplace(p, true).second) {
      return absl::FailedPreconditionError(
          absl::StrCat("gpu ddp: gradient of ", p->name, " reported twice in one backward"));
    }
    --buckets_[static_cast<size_t>(it->second)].pending;
  }
  // Every rank launches the buckets in plan order, each once all before it
  // went: a bucket that filled early (one of parameters a skipped block
  // left unused, reported before backward) waits for its turn, so that the
  // ranks' NCCL calls pair up whatever each rank skipped.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    AIDN_RETURN_IF_ERROR(Launch(static_cast<int>(next_launch_++)));
  }
  return absl::OkStatus();
}

absl::Status GpuDdpReducer::BeginBackward(const std::vector<bool>& used,
                                          const std::vector<GpuParameter*>& unused_now) {
  if (!find_unused_) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(used_->Set(used, "gpu ddp"));
  // Their gradients stay zero (ZeroGrad): ready now, so the buckets finish.
  return unused_now.empty() ? absl::OkStatus() : OnGradReady(unused_now);
}

absl::Status GpuDdpReducer::MissingGradients() const {
  std::vector<std::string> names;
  for (GpuParameter* p : parameters_) {
    if (reported_.count(p) == 0) names.push_back(p->name);
  }
  return NoGradientError(names);
}

absl::Status GpuDdpReducer::ExchangeUsedFlags() {
  return used_->MarkUnused(nccl_, parameters_, shard_view_, shard_whole_);
}

absl::Status GpuDdpReducer::AfterBackward() {
  absl::Status missing;
  // The buckets not launched yet, in plan order: all of them came only if
  // every gradient did; one still pending is launched anyway (so the
  // ranks' NCCL calls still match) and the step fails, naming what did not
  // come.
  for (; next_launch_ < buckets_.size(); ++next_launch_) {
    if (buckets_[next_launch_].pending != 0 && missing.ok()) missing = MissingGradients();
    AIDN_RETURN_IF_ERROR(Launch(static_cast<int>(next_launch_)));
  }
  next_launch_ = 0;
  for (Bucket& bucket : buckets_) bucket.pending = static_cast<int>(bucket.parameters.size());
  reported_.clear();
  timed_ = launched_ > 0;
  launched_ = 0;
  if (!timed_) {
    // Nothing went out this step (no buckets): no figures from the last.
    bytes_sent_ = 0;
    bytes_uncompressed_ = 0;
  }
  if (timed_ && powersgd_ != nullptr) powersgd_->EndStep();
  if (timed_) {
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(backward_end_, ctx_->stream()));
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(end_, nccl_->stream()));
    // The optimizer (queued next on the compute stream) reads the averages.
    AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(ctx_->stream(), end_, 0));
  }
  // Every rank exchanges its flags, also when this one failed (its peers'
  // allreduce would wait for it).
  if (find_unused_) missing.Update(ExchangeUsedFlags());
  return missing;
}

absl::Status GpuDdpReducer::Wait(cudaEvent_t done) {
  // The deadline is for the collectives, not for this rank's own compute
  // (many micro-batches can take long): first backward's end, which does not
  // depend on any peer, without one.
  if (timed_) AIDN_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(backward_end_));
  const bool gather = sharded_ && timed_;
  if (gather) {
    // ZeRO-1: every bucket's updated slices to every rank, in place, after
    // the update; the next step's forward waits for them.
    cudaStream_t comm = nccl_->stream();
    AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(comm, done, 0));
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(gather_start_, comm));
    for (size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& bucket = buckets_[b];
      if (bucket.floats == 0) continue;
      float* values = static_cast<float*>(bucket.values.data());
      absl::Status s = nccl_->EnqueueAllGather(values + rank_ * bucket.chunk, bucket.chunk, values);
      if (!s.ok()) return Annotate(s, absl::StrCat("zero-1 weights of bucket ", b));
    }
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(gathered_, comm));
    AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(ctx_->stream(), gathered_, 0));
  }
  AIDN_RETURN_IF_ERROR(nccl_->WaitForEvent(
      gather ? gathered_ : done,
      gather ? "gradient reduce-scatter and weight all-gather" : "gradient allreduce"));
  allreduce_seconds_ = 0;
  exposed_seconds_ = 0;
  if (timed_) {
    float ms = 0;
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms, start_, end_));
    allreduce_seconds_ = static_cast<double>(ms) / 1e3;
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms, backward_end_, end_));
    exposed_seconds_ = std::max(0.0, static_cast<double>(ms) / 1e3);
    if (gather) {
      // Not overlapped: all of it is waited for.
      AIDN_RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms, gather_start_, gathered_));
      allreduce_seconds_ += static_cast<double>(ms) / 1e3;
      exposed_seconds_ += static_cast<double>(ms) / 1e3;
    }
  }
  return absl::OkStatus();
}

}  // namespace aidn::engine::cuda
