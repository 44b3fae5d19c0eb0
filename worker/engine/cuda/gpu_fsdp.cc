#include "worker/engine/cuda/gpu_fsdp.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {

// ---------------------------------------------------------------- Pool

GpuFsdpReducer::Pool::~Pool() {
  for (Slot& s : slots_) {
    if (s.event != nullptr) cudaEventDestroy(s.event);
  }
}

absl::StatusOr<int> GpuFsdpReducer::Pool::Take(GpuContext* ctx, size_t floats) {
  // A buffer serves a request of at least half its size: a block's request
  // never ties up the root's or the embedding layer's buffer.
  const auto fits = [floats](size_t f) { return f >= floats && f <= 2 * floats; };
  const size_t fitting = static_cast<size_t>(std::count_if(
      slots_.begin(), slots_.end(), [&](const Slot& s) { return s.live && fits(s.floats); }));
  if (fitting >= keep_) {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      const size_t f = at(*it).floats;
      if (fits(f) && (best == free_.end() || f < at(*best).floats)) best = it;
    }
    if (best != free_.end()) {
      const int slot = *best;
      free_.erase(best);
      return slot;
    }
  }
  // A new buffer, in a slot a Trim emptied if there is one.
  auto dead = std::find_if(slots_.begin(), slots_.end(), [](const Slot& s) { return !s.live; });
  const size_t index =
      dead != slots_.end() ? static_cast<size_t>(dead - slots_.begin()) : slots_.size();
  Slot s;
  s.floats = floats;
  AIDN_ASSIGN_OR_RETURN(s.buffer, ctx->allocator().Allocate(sizeof(float) * floats));
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming));
  bytes_ += static_cast<int64_t>(s.buffer.bytes());
  peak_ = std::max(peak_, bytes_);
  if (index == slots_.size()) {
    slots_.push_back(std::move(s));
  } else {
    slots_[index] = std::move(s);
  }
  return static_cast<int>(index);
}

void GpuFsdpReducer::Pool::Trim() {
  while (free_.size() > keep_) {
    Slot& s = slots_[static_cast<size_t>(free_.back())];
    free_.pop_back();
    bytes_ -= static_cast<int64_t>(s.buffer.bytes());
    // Back to the compute stream's allocator: the caller makes sure the
    // buffer's last users come before what that stream queues next.
    s.buffer.Release();
    if (s.event != nullptr) cudaEventDestroy(s.event);
    s.event = nullptr;
    s.recorded = false;
    s.live = false;
  }
}

// ---------------------------------------------------------------- Create

absl::StatusOr<std::unique_ptr<GpuFsdpReducer>> GpuFsdpReducer::Create(
    GpuContext* ctx, NcclCommunicator* nccl, const ShardMap& layout,
    const std::vector<GpuParameter*>& parameters, const GpuFsdpOptions& options) {
  if (ctx == nullptr || nccl == nullptr) {
    return absl::InvalidArgumentError("gpu fsdp: no context or no communicator");
  }
  if (options.sharding != Sharding::kGradients && options.sharding != Sharding::kShardGradOp &&
      options.sharding != Sharding::kFullShard) {
    return absl::InvalidArgumentError(
        "gpu fsdp: sharding must be zero2, shard_grad_op or full_shard");
  }
  if (options.param_half.has_value() && options.sharding == Sharding::kGradients) {
    return absl::InvalidArgumentError(
        "gpu fsdp: ZeRO-2 keeps whole fp32 weights; 16-bit gathers are FSDP's");
  }
  if (options.max_pending_gradients < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu fsdp: max_pending_gradients must be >= 1, got ", options.max_pending_gradients));
  }
  const size_t world = static_cast<size_t>(nccl->world_size());
  const size_t rank = static_cast<size_t>(nccl->rank());
  // The layout must be these parameters', for this world and rank.
  const std::vector<Parameter*>& names = layout.parameters();
  if (names.size() != parameters.size()) {
    return absl::InvalidArgumentError(absl::StrCat("gpu fsdp: the layout has ", names.size(),
                                                   " parameters, the model ", parameters.size()));
  }
  std::unordered_map<const Parameter*, size_t> index;
  for (size_t k = 0; k < parameters.size(); ++k) {
    if (parameters[k] == nullptr || parameters[k]->name != names[k]->name ||
        parameters[k]->value.numel() != names[k]->value.numel()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpu fsdp: parameter ", k, " is ", names[k]->name, " in the layout and ",
                       parameters[k] == nullptr ? "null" : parameters[k]->name, " on the device"));
    }
    index[names[k]] = k;
  }
  // Every check before anything moves.
  for (int u = 0; u < layout.num_groups(); ++u) {
    if (layout.chunk(u) * world != layout.group(u).floats) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpu fsdp: unit ", u, "'s layout is not for ", world, " ranks"));
    }
  }
  for (size_t k = 0; k < layout.shards().size(); ++k) {
    const ShardMap::ShardPlace at = layout.place(k);
    const size_t mine = rank * layout.chunk(at.group);
    if (at.lo < mine || at.hi > mine + layout.chunk(at.group)) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpu fsdp: the layout's shards are not rank ", rank, "'s"));
    }
  }
  std::unique_ptr<GpuFsdpReducer> r(new GpuFsdpReducer(ctx, nccl, options));
  r->rank_ = rank;
  r->parameters_ = parameters;
  cudaStream_t stream = ctx->stream();
  size_t largest = 0;  // floats of the largest unit
  r->units_.resize(static_cast<size_t>(layout.num_groups()));
  for (int u = 0; u < layout.num_groups(); ++u) {
    const ShardMap::Group& g = layout.group(u);
    Unit& unit = r->units_[static_cast<size_t>(u)];
    unit.floats = g.floats;
    unit.chunk = layout.chunk(u);
    unit.offsets = g.offsets;
    for (const Parameter* p : g.parameters) {
      unit.parameters.push_back(parameters[index.at(p)]);
    }
    largest = std::max(largest, g.floats);
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&unit.gathered, cudaEventDisableTiming));
    if (g.floats == 0) {
      unit.state = Weights::kGathered;
      continue;
    }
    // The whole unit from the parameters' values (padding zero), then this
    // rank's slice of it; ZeRO-2 keeps the whole. The parameters keep
    // their own storage until everything is allocated (below).
    AIDN_ASSIGN_OR_RETURN(DeviceBuffer whole, ctx->allocator().Allocate(sizeof(float) * g.floats));
    float* base = static_cast<float*>(whole.data());
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(base, 0, sizeof(float) * g.floats, stream));
    for (size_t i = 0; i < unit.parameters.size(); ++i) {
      const GpuParameter* p = unit.parameters[i];
      if (p->value.numel() == 0) continue;
      AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
          base + unit.offsets[i], p->value.data(),
          sizeof(float) * static_cast<size_t>(p->value.numel()), cudaMemcpyDeviceToDevice, stream));
    }
    AIDN_ASSIGN_OR_RETURN(unit.shard_grad, ctx->allocator().Allocate(sizeof(float) * unit.chunk));
    AIDN_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(unit.shard_grad.data(), 0, sizeof(float) * unit.chunk, stream));
    if (r->sharded_weights()) {
      AIDN_ASSIGN_OR_RETURN(unit.shard, ctx->allocator().Allocate(sizeof(float) * unit.chunk));
      AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(unit.shard.data(), base + rank * unit.chunk,
                                                sizeof(float) * unit.chunk,
                                                cudaMemcpyDeviceToDevice, stream));
      // The whole goes back to the allocator after the copies queued from
      // it (the compute stream's order).
    } else {
      unit.whole = std::move(whole);
      unit.state = Weights::kGathered;
    }
  }
  // Mixed precision's staging, for the largest unit.
  const size_t most = largest;
  if (options.param_half.has_value()) {
    AIDN_ASSIGN_OR_RETURN(r->send_half_,
                          ctx->allocator().Allocate(sizeof(uint16_t) * (most / world)));
    AIDN_ASSIGN_OR_RETURN(r->gather_half_, ctx->allocator().Allocate(sizeof(uint16_t) * most));
  }
  if (options.reduce_half.has_value()) {
    AIDN_ASSIGN_OR_RETURN(r->reduce_half_, ctx->allocator().Allocate(sizeof(uint16_t) * most));
  }
  r->weights_.set_keep(1);
  r->grads_.set_keep(static_cast<size_t>(options.max_pending_gradients));
  // This rank's shards, named and ordered as the layout's.
  for (size_t k = 0; k < layout.shards().size(); ++k) {
    const ShardMap::ShardPlace at = layout.place(k);
    Unit& unit = r->units_[static_cast<size_t>(at.group)];
    const size_t mine = rank * unit.chunk;
    auto piece = std::make_unique<GpuParameter>();
    piece->name = layout.shards()[k]->name;
    const int64_t n = static_cast<int64_t>(at.hi - at.lo);
    float* value = r->sharded_weights() ? static_cast<float*>(unit.shard.data()) + (at.lo - mine)
                                        : static_cast<float*>(unit.whole.data()) + at.lo;
    piece->value = GpuTensor::View(value, {n});
    piece->grad =
        GpuTensor::View(static_cast<float*>(unit.shard_grad.data()) + (at.lo - mine), {n});
    piece->whole_shape = parameters[at.parameter]->value.shape();
    r->shard_view_.push_back(piece.get());
    r->shards_.push_back(std::move(piece));
    r->shard_whole_.push_back(at.parameter);
  }
  if (options.find_unused_parameters) {
    AIDN_ASSIGN_OR_RETURN(r->used_, UsedFlags::Create(ctx, parameters.size()));
  }
  for (cudaEvent_t* e : {&r->mark_, &r->buffers_done_}) {
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  for (cudaEvent_t* e : {&r->start_, &r->end_, &r->backward_end_}) {
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreate(e));
  }
  // Nothing can fail now: the values move into the units (their own
  // storage goes back to the allocator after the copies queued from it),
  // and the gradients live in a pool buffer during the unit's backward
  // only.
  for (int u = 0; u < r->num_units(); ++u) {
    Unit& unit = r->units_[static_cast<size_t>(u)];
    if (unit.floats == 0) continue;
    r->PointValues(u, r->sharded_weights() ? nullptr : static_cast<float*>(unit.whole.data()));
    r->PointGrads(u, nullptr);
  }
  r->moved_ = true;
  return r;
}

GpuFsdpReducer::~GpuFsdpReducer() {
  SettleAtTeardown(ctx_, nccl_, in_step_, "sharded collectives");
  // Storage of their own: the weights where they are whole and current
  // (gathered in fp32), zeros elsewhere; zeroed gradients.
  for (Unit& unit : units_) {
    const bool current = unit.state == Weights::kGathered && !unit.rounded;
    for (GpuParameter* p : unit.parameters) {
      if (!moved_) break;
      absl::StatusOr<GpuTensor> value = GpuTensor::Empty(ctx_, p->value.shape());
      absl::StatusOr<GpuTensor> grad = GpuTensor::Empty(ctx_, p->grad.shape());
      if (!value.ok() || !grad.ok()) continue;
      if (current && p->value.data() != nullptr) {
        (void)value->CopyFrom(ctx_, p->value);
      } else {
        (void)value->Zero(ctx_);
      }
      (void)grad->Zero(ctx_);
      p->value = *std::move(value);
      p->grad = *std::move(grad);
    }
    if (unit.gathered != nullptr) cudaEventDestroy(unit.gathered);
  }
  cudaStreamSynchronize(ctx_->stream());
  for (cudaEvent_t e : {mark_, buffers_done_, start_, end_, backward_end_}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
}

// ---------------------------------------------------------------- helpers

void GpuFsdpReducer::PointValues(int u, float* base) {
  Unit& unit = units_[static_cast<size_t>(u)];
  for (size_t i = 0; i < unit.parameters.size(); ++i) {
    GpuParameter* p = unit.parameters[i];
    std::vector<int64_t> shape = p->value.shape();
    p->value =
        GpuTensor::View(base == nullptr ? nullptr : base + unit.offsets[i], std::move(shape));
  }
}

void GpuFsdpReducer::PointGrads(int u, float* base) {
  Unit& unit = units_[static_cast<size_t>(u)];
  for (size_t i = 0; i < unit.parameters.size(); ++i) {
    GpuParameter* p = unit.parameters[i];
    std::vector<int64_t> shape = p->grad.shape();
    p->grad = GpuTensor::View(base == nullptr ? nullptr : base + unit.offsets[i], std::move(shape));
  }
}

absl::Status GpuFsdpReducer::NcclAfterCompute() {
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(mark_, ctx_->stream()));
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(nccl_->stream(), mark_, 0));
  return absl::OkStatus();
}

absl::Status GpuFsdpReducer::StartTiming() {
  if (timing_ || !in_step_) return absl::OkStatus();
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(start_, nccl_->stream()));
  timing_ = true;
  return absl::OkStatus();
}

namespace {

HalfType TypeOf(HalfFormat format) {
  return format == HalfFormat::kFp16 ? HalfType::kFp16 : HalfType::kBf16;
}

}  // namespace

absl::Status GpuFsdpReducer::Gather(int u, bool full_precision) {
  Unit& unit = units_[static_cast<size_t>(u)];
  if (unit.state != Weights::kStale) return absl::OkStatus();
  if (unit.floats == 0) {
    unit.state = Weights::kGathered;
    return absl::OkStatus();
  }
  float* out = nullptr;
  const float* in = nullptr;
  if (sharded_weights()) {
    Pool& pool = weight_pool(u);
    AIDN_ASSIGN_OR_RETURN(unit.weight_slot, pool.Take(ctx_, unit.floats));
    out = pool.data(unit.weight_slot);
    in = static_cast<const float*>(unit.shard.data());
    PointValues(u, out);
  } else {
    // ZeRO-2: in place, the rank's slice is where the output wants it.
    out = static_cast<float*>(unit.whole.data());
    in = out + rank_ * unit.chunk;
  }
  // After the update that wrote the slices, and after whatever read the
  // pool buffer before (both queued on the compute stream by now).
  AIDN_RETURN_IF_ERROR(NcclAfterCompute());
  AIDN_RETURN_IF_ERROR(StartTiming());
  cudaStream_t comm = nccl_->stream();
  const std::string what = absl::StrCat("fsdp unit ", u, " weights all-gather");
  const int64_t floats = static_cast<int64_t>(unit.floats);
  if (options_.param_half.has_value() && !full_precision) {
    // The slice rounded, gathered in 16 bits, widened into the unit.
    const HalfFormat format = *options_.param_half;
    uint16_t* send = static_cast<uint16_t*>(send_half_.data());
    uint16_t* gathered = static_cast<uint16_t*>(gather_half_.data());
    AIDN_RETURN_IF_ERROR(
        LaunchToHalf(comm, in, send, static_cast<int64_t>(unit.chunk), TypeOf(format)));
    AIDN_RETURN_IF_ERROR(
        Annotate(nccl_->EnqueueAllGatherHalf(send, unit.chunk, gathered, format), what));
    AIDN_RETURN_IF_ERROR(LaunchFromHalf(comm, gathered, out, floats, TypeOf(format), false));
    bytes_step_ += static_cast<int64_t>(sizeof(uint16_t)) * floats;
    unit.rounded = true;
  } else {
    unit.rounded = false;
    AIDN_RETURN_IF_ERROR(Annotate(nccl_->EnqueueAllGather(in, unit.chunk, out), what));
    bytes_step_ += static_cast<int64_t>(sizeof(float)) * floats;
  }
  fp32_step_ += static_cast<int64_t>(sizeof(float)) * floats;
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(unit.gathered, comm));
  unit.state = Weights::kGathering;
  return absl::OkStatus();
}

absl::Status GpuFsdpReducer::WaitGathered(int u) {
  Unit& unit = units_[static_cast<size_t>(u)];
  if (unit.state == Weights::kGathered) return absl::OkStatus();
  if (unit.state != Weights::kGathering) {
    return absl::FailedPreconditionError(absl::StrCat("gpu fsdp: unit ", u, " was never gathered"));
  }
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(ctx_->stream(), unit.gathered, 0));
  unit.state = Weights::kGathered;
  return absl::OkStatus();
}

absl::Status GpuFsdpReducer::FreeWeights(int u) {
  Unit& unit = units_[static_cast<size_t>(u)];
  if (!sharded_weights() || unit.floats == 0 || unit.state == Weights::kStale) {
    return absl::OkStatus();
  }
  // A gather still on its way: the buffer's next user (on either stream)
  // comes after it.
  AIDN_RETURN_IF_ERROR(WaitGathered(u));
  // Its next user's gather waits for the compute stream's work queued up
  // to then (NcclAfterCompute), this unit's reads included.
  weight_pool(u).Give(unit.weight_slot);
  unit.weight_slot = -1;
  PointValues(u, nullptr);
  unit.state = Weights::kStale;
  return absl::OkStatus();
}

// ---------------------------------------------------------------- hooks

absl::Status GpuFsdpReducer::BeforeForward(int u) {
  if (summoned_) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(Gather(u));
  // The next unit's weights come while this one computes.
  if (u + 1 < num_units()) AIDN_RETURN_IF_ERROR(Gather(u + 1));
  return WaitGathered(u);
}

absl::Status GpuFsdpReducer::AfterForward(int u) {
  if (summoned_) return absl::OkStatus();
  if (options_.sharding == Sharding::kFullShard && u != 0) return FreeWeights(u);
  return absl::OkStatus();
}

absl::Status GpuFsdpReducer::BeforeBackward(int u) {
  if (summoned_) {
    return absl::FailedPreconditionError(
        "gpu fsdp: backward between GatherFullParameters and its release");
  }
  AIDN_RETURN_IF_ERROR(Gather(u));
  // Backward runs the units in reverse after the root.
  const int next = u == 0 ? num_units() - 1 : u - 1;
  if (next >= 1 && next != u) AIDN_RETURN_IF_ERROR(Gather(next));
  AIDN_RETURN_IF_ERROR(WaitGathered(u));
  Unit& unit = units_[static_cast<size_t>(u)];
  if (unit.floats == 0) return absl::OkStatus();
  Pool& pool = grad_pool(u);
  AIDN_ASSIGN_OR_RETURN(unit.grad_slot, pool.Take(ctx_, unit.floats));
  cudaStream_t stream = ctx_->stream();
  // After the buffer's last reduce-scatter.
  if (pool.recorded(unit.grad_slot)) {
    AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream, pool.event(unit.grad_slot), 0));
  }
  float* grads = pool.data(unit.grad_slot);
  AIDN_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(grads, 0, sizeof(float) * unit.floats, stream));
  PointGrads(u, grads);
  return absl::OkStatus();
}

absl::Status GpuFsdpReducer::AfterBackward(int u) {
  Unit& unit = units_[static_cast<size_t>(u)];
  if (unit.grad_slot >= 0) {
    PointGrads(u, nullptr);
    Pool& pool = grad_pool(u);
    const int slot = unit.grad_slot;
    unit.grad_slot = -1;
    AIDN_RETURN_IF_ERROR(NcclAfterCompute());
    AIDN_RETURN_IF_ERROR(StartTiming());
    AIDN_RETURN_IF_ERROR(ReduceScatter(u, pool.data(slot)));
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(pool.event(slot), nccl_->stream()));
    pool.set_recorded(slot);
    pool.Give(slot);
  }
  return FreeWeights(u);
}

absl::Status GpuFsdpReducer::ReduceScatter(int u, float* grads) {
  Unit& unit = units_[static_cast<size_t>(u)];
  cudaStream_t comm = nccl_->stream();
  float* shard = static_cast<float*>(unit.shard_grad.data());
  const int64_t chunk = static_cast<int64_t>(unit.chunk);
  const int64_t floats = static_cast<int64_t>(unit.floats);
  const std::string what = absl::StrCat("fsdp unit ", u, " gradients reduce-scatter");
  fp32_step_ += static_cast<int64_t>(sizeof(float)) * floats;
  if (options_.reduce_half.has_value()) {
    // Divided by the world size before the rounding, so that the 16-bit
    // sum cannot overflow (DDP's compression hooks do the same).
    const HalfFormat format = *options_.reduce_half;
    uint16_t* half = static_cast<uint16_t*>(reduce_half_.data());
    uint16_t* mine = half + rank_ * unit.chunk;
    if (nccl_->world_size() > 1) {
      AIDN_RETURN_IF_ERROR(
          LaunchScale(comm, grads, floats, 1.0f / static_cast<float>(nccl_->world_size())));
    }
    AIDN_RETURN_IF_ERROR(LaunchToHalf(comm, grads, half, floats, TypeOf(format)));
    AIDN_RETURN_IF_ERROR(
        Annotate(nccl_->EnqueueReduceScatterHalf(half, unit.chunk, mine, format), what));
    // The micro-batches' averages summed into the shard.
    bytes_step_ += static_cast<int64_t>(sizeof(uint16_t)) * floats;
    return LaunchFromHalf(comm, mine, shard, chunk, TypeOf(format), /*accumulate=*/true);
  }
  float* mine = grads + rank_ * unit.chunk;
  AIDN_RETURN_IF_ERROR(
      Annotate(nccl_->EnqueueReduceScatter(grads, unit.chunk, mine, ReduceOp::kAvg), what));
  bytes_step_ += static_cast<int64_t>(sizeof(float)) * floats;
  // The micro-batches' averages summed into the shard, on the NCCL stream.
  return LaunchAdd(comm, shard, mine, shard, chunk);
}

// ---------------------------------------------------------------- the step

absl::Status GpuFsdpReducer::BeginStep() {
  if (summoned_) {
    return absl::FailedPreconditionError(
        "gpu fsdp: a step between GatherFullParameters and its release");
  }
  // The last step's optimizer read the shards on the compute stream, after
  // their reduce-scatters: zeroing them there is ordered after both.
  for (Unit& unit : units_) {
    if (unit.chunk == 0) continue;
    AIDN_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(unit.shard_grad.data(), 0, sizeof(float) * unit.chunk, ctx_->stream()));
  }
  in_step_ = true;
  timing_ = false;
  bytes_step_ = 0;
  fp32_step_ = 0;
  // The buffers' figure is a step's (not an evaluation's full gather).
  for (Pool* p : {&weights_, &root_weights_, &grads_, &root_grads_}) p->ResetPeak();
  return absl::OkStatus();
}

absl::Status GpuFsdpReducer::BeginBackward(const std::vector<bool>& used) {
  if (used_ == nullptr) return absl::OkStatus();
  return used_->Set(used, "gpu fsdp");
}

absl::Status GpuFsdpReducer::AfterBackward() {
  cudaStream_t stream = ctx_->stream();
  timed_ = timing_;
  if (timing_) {
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(backward_end_, stream));
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(end_, nccl_->stream()));
    // The optimizer reads the shards after the last reduce-scatter.
    AIDN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream, end_, 0));
  }
  if (used_ == nullptr) return absl::OkStatus();
  return used_->MarkUnused(nccl_, parameters_, shard_view_, shard_whole_);
}

absl::Status GpuFsdpReducer::Wait(cudaEvent_t done) {
  // The update wrote the shards: ZeRO-2's whole units are stale until
  // their slices are gathered again (FSDP freed every unit in backward).
  for (int u = 0; u < num_units(); ++u) {
    Unit& unit = units_[static_cast<size_t>(u)];
    if (unit.floats == 0) continue;
    AIDN_RETURN_IF_ERROR(FreeWeights(u));
    unit.state = Weights::kStale;
  }
  AIDN_RETURN_IF_ERROR(nccl_->WaitForEvent(done, "gradient reduce-scatters and the update"));
  in_step_ = false;
  // Every user of the pools' buffers is done (the host waited for the step,
  // which waited for the last reduce-scatter): what a step of units of many
  // sizes left beyond each pool's `keep` goes back to the allocator, whose
  // cache serves the next step.
  for (Pool* p : {&weights_, &root_weights_, &grads_, &root_grads_}) p->Trim();
  bytes_sent_ = bytes_step_;
  bytes_fp32_ = fp32_step_;
  comm_seconds_ = 0;
  exposed_seconds_ = 0;
  if (timed_) {
    float ms = 0;
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms, start_, end_));
    comm_seconds_ = static_cast<double>(ms) / 1e3;
    AIDN_RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms, backward_end_, end_));
    exposed_seconds_ = std::max(0.0, static_cast<double>(ms) / 1e3);
  }
  return absl::OkStatus();
}

absl::Status GpuFsdpReducer::BroadcastBuffers(const std::vector<GpuParameter*>& buffers) {
  return BroadcastBuffersFromRankZero(ctx_, nccl_, buffers, mark_, buffers_done_);
}

absl::Status GpuFsdpReducer::GatherFullParameters() {
  if (summoned_) return absl::FailedPreconditionError("gpu fsdp: GatherFullParameters twice");
  if (in_step_) {
    return absl::FailedPreconditionError("gpu fsdp: GatherFullParameters during a step");
  }
  // In fp32 whatever the step gathers in: the master weights themselves (a
  // unit a forward left gathered in 16 bits is gathered again).
  for (int u = 0; u < num_units(); ++u) {
    if (units_[static_cast<size_t>(u)].rounded) AIDN_RETURN_IF_ERROR(FreeWeights(u));
    AIDN_RETURN_IF_ERROR(Gather(u, /*full_precision=*/true));
  }
  for (int u = 0; u < num_units(); ++u) AIDN_RETURN_IF_ERROR(WaitGathered(u));
  summoned_ = true;
  return absl::OkStatus();
}

void GpuFsdpReducer::ReleaseFullParameters() {
  if (!summoned_) return;
  summoned_ = false;
  for (int u = 0; u < num_units(); ++u) FreeWeights(u).IgnoreError();
  // Every unit was gathered at once: the pool keeps a step's worth.
  weights_.Trim();
}

GpuFsdpReducer::Memory GpuFsdpReducer::memory() const {
  Memory m;
  for (const Unit& unit : units_) {
    const int64_t chunk = static_cast<int64_t>(sizeof(float) * unit.chunk);
    m.weights += sharded_weights() ? chunk : static_cast<int64_t>(sizeof(float) * unit.floats);
    m.gradients += chunk;
  }
  for (const Pool* p : {&weights_, &root_weights_, &grads_, &root_grads_}) {
    m.buffers += p->peak_bytes();
  }
  for (const DeviceBuffer* b : {&send_half_, &gather_half_, &reduce_half_}) {
    m.buffers += static_cast<int64_t>(b->bytes());
  }
  return m;
}

}  // namespace aidn::engine::cuda
