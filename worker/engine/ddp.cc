#include "worker/engine/ddp.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/clock.h"
#include "common/status.h"

namespace aidn::engine {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

absl::StatusOr<BucketPlan> PlanBuckets(const std::vector<int64_t>& numels, double bucket_mb,
                                       size_t extra_floats) {
  if (!(bucket_mb > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("bucket_mb: must be > 0, got ", bucket_mb));
  }
  const size_t cap = std::max<size_t>(1, static_cast<size_t>(bucket_mb * 1e6 / 4));
  auto padded = [](size_t n) { return (n + 15) / 16 * 16; };
  BucketPlan plan;
  plan.slots.resize(numels.size());
  for (int k = static_cast<int>(numels.size()) - 1; k >= 0; --k) {
    if (numels[static_cast<size_t>(k)] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", k, " has ", numels[static_cast<size_t>(k)], " elements"));
    }
    if (plan.buckets.empty() || plan.floats.back() >= cap) {
      plan.buckets.emplace_back();
      plan.floats.push_back(0);
    }
    plan.slots[static_cast<size_t>(k)] = {static_cast<int>(plan.buckets.size()) - 1,
                                          plan.floats.back()};
    plan.buckets.back().push_back(k);
    plan.floats.back() += padded(static_cast<size_t>(numels[static_cast<size_t>(k)]));
  }
  if (plan.buckets.empty()) {
    plan.buckets.emplace_back();
    plan.floats.push_back(0);
  }
  plan.floats.back() += extra_floats;
  return plan;
}

absl::Status CheckDdpOptions(const DdpOptions& options) {
  if (options.powersgd.has_value() && options.shard_optimizer) {
    return absl::InvalidArgumentError(
        "ddp: PowerSGD compresses allreduced buckets, not ZeRO-1's reduce-scatter");
  }
  if (options.half.has_value() && options.shard_optimizer) {
    return absl::InvalidArgumentError(
        absl::StrCat("ddp: ", HalfFormatName(*options.half),
                     " compression casts allreduced buckets, not ZeRO-1's reduce-scatter"));
  }
  if (options.half.has_value() && options.powersgd.has_value()) {
    return absl::InvalidArgumentError("ddp: PowerSGD and fp16/bf16 compression are exclusive");
  }
  if (options.powersgd.has_value() && options.powersgd->rank < 1) {
    return absl::InvalidArgumentError("ddp: PowerSGD's rank must be >= 1");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ShardMap::Group>> ShardedBucketGroups(
    const std::vector<Parameter*>& parameters, BucketPlan* plan, int world_size) {
  const size_t unit = size_t{16} * static_cast<size_t>(world_size);
  for (size_t& f : plan->floats) f = (f + unit - 1) / unit * unit;
  std::vector<ShardMap::Group> groups(plan->buckets.size());
  for (size_t b = 0; b < plan->buckets.size(); ++b) {
    groups[b].floats = plan->floats[b];
    for (int k : plan->buckets[b]) {
      groups[b].parameters.push_back(parameters[static_cast<size_t>(k)]);
      groups[b].offsets.push_back(plan->slots[static_cast<size_t>(k)].offset);
    }
  }
  AIDN_RETURN_IF_ERROR(ShardMap::CheckEveryRankOwnsSome(groups, world_size));
  return groups;
}

absl::StatusOr<std::unique_ptr<DdpReducer>> DdpReducer::Create(
    const DdpOptions& options, const std::vector<Parameter*>& parameters,
    Communicator* communicator) {
  if (communicator == nullptr) return absl::InvalidArgumentError("ddp: no communicator");
  AIDN_RETURN_IF_ERROR(CheckDdpOptions(options));
  std::vector<int64_t> numels;
  for (const Parameter* p : parameters) numels.push_back(p->value.numel());
  // The extra value rides at the end of the last bucket to be launched.
  // find_unused_parameters: each parameter's used flag before it, where
  // the bucket is summed exactly (a float allreduce).
  const bool flags_in_bucket = options.find_unused_parameters && !options.shard_optimizer &&
                               !options.half.has_value() && !options.powersgd.has_value();
  const size_t extras = 1 + (flags_in_bucket ? parameters.size() : 0);
  AIDN_ASSIGN_OR_RETURN(BucketPlan plan, PlanBuckets(numels, options.bucket_mb, extras));
  const int world = communicator->world_size();
  if (options.shard_optimizer && world > 1) {
    AIDN_RETURN_IF_ERROR(ShardedBucketGroups(parameters, &plan, world).status());
  }
  std::unique_ptr<DdpReducer> reducer(new DdpReducer(communicator));
  reducer->parameters_ = parameters;
  reducer->find_unused_ = options.find_unused_parameters;
  reducer->flags_in_bucket_ = flags_in_bucket;
  reducer->ready_.assign(parameters.size(), false);
  for (size_t i = 0; i < parameters.size(); ++i) reducer->index_[parameters[i]] = i;
  reducer->single_ = world == 1;
  reducer->shard_ = options.shard_optimizer && world > 1;
  if (options.half.has_value() && world > 1) {
    reducer->half_ = options.half;
    reducer->half_staging_.resize(plan.buckets.size());
  }
  if (options.powersgd.has_value() && world > 1) {
    reducer->powersgd_ = std::make_unique<PowerSgd>(*options.powersgd);
  }
  reducer->buckets_.resize(plan.buckets.size());
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    for (int k : plan.buckets[b]) {
      Parameter* p = parameters[static_cast<size_t>(k)];
      reducer->slots_[p] = plan.slots[static_cast<size_t>(k)];
      reducer->buckets_[b].parameters.push_back(p);
    }
  }
  reducer->extra_bucket_ = static_cast<int>(reducer->buckets_.size()) - 1;
  for (size_t i = 0; i < plan.floats.size(); ++i) {
    Bucket& bucket = reducer->buckets_[i];
    // One rank: the gradients stay where they are, no bucket is needed.
    if (reducer->single_) continue;
    bucket.buffer = Tensor({static_cast<int64_t>(plan.floats[i])});
    for (Parameter* p : bucket.parameters) {
      float* at = bucket.buffer.data() + reducer->slots_[p].offset;
      // (A gradient without storage yet is zero, as the bucket is.)
      if (p->grad.data() != nullptr) {
        std::memcpy(at, p->grad.data(), sizeof(float) * static_cast<size_t>(p->grad.numel()));
      }
      p->grad = Tensor::View(at, p->grad.shape());
    }
  }
  if (reducer->shard_) {
    reducer->ShardBuckets(plan);
  } else {
    reducer->shard_view_ = parameters;
  }
  reducer->thread_ = std::thread([r = reducer.get()]() { r->CommLoop(); });
  return reducer;
}

void DdpReducer::ShardBuckets(const BucketPlan& plan) {
  const int world = communicator_->world_size();
  const size_t rank = static_cast<size_t>(communicator_->rank());
  std::vector<ShardMap::Group> groups;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    const size_t floats = plan.floats[b];
    const size_t chunk = floats / static_cast<size_t>(world);
    bucket.weights = Tensor({static_cast<int64_t>(floats)});
    // The reduce-scatter runs in place: the rank's averaged slice lands in
    // its own slice of the bucket.
    bucket.shard_grad =
        Tensor::View(bucket.buffer.data() + rank * chunk, {static_cast<int64_t>(chunk)});
    ShardMap::Group& group = groups.emplace_back();
    group.floats = floats;
    // In bucket order (reverse registration), as the plan laid them out.
    for (Parameter* p : bucket.parameters) {
      const size_t offset = slots_[p].offset;
      float* at = bucket.weights.data() + offset;
      std::memcpy(at, p->value.data(), sizeof(float) * static_cast<size_t>(p->value.numel()));
      p->value = Tensor::View(at, p->value.shape());
      group.parameters.push_back(p);
      group.offsets.push_back(offset);
    }
  }
  map_ = std::make_unique<ShardMap>(std::move(groups), parameters_, static_cast<int>(rank), world);
  map_->MakeShards(
      [&](int b) {
        Bucket& bucket = buckets_[static_cast<size_t>(b)];
        return bucket.weights.data() + rank * static_cast<size_t>(bucket.shard_grad.numel());
      },
      [&](int b) { return buckets_[static_cast<size_t>(b)].shard_grad.data(); });
  shard_view_ = map_->shards();
}

DdpReducer::Memory DdpReducer::memory() const {
  Memory m;
  for (const Bucket& b : buckets_) {
    m.gradient_buckets += 4 * b.buffer.numel();
    m.weight_buffers += 4 * b.weights.numel();
  }
  return m;
}

absl::Status DdpReducer::GatherParameters() {
  if (!shard_) return absl::OkStatus();
  const size_t world = static_cast<size_t>(communicator_->world_size());
  const size_t rank = static_cast<size_t>(communicator_->rank());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Tensor& weights = buckets_[b].weights;
    const size_t chunk = static_cast<size_t>(weights.numel()) / world;
    // In place: the rank's slice is already where the output wants it.
    if (absl::Status s =
            communicator_->AllGather(weights.data() + rank * chunk, chunk, weights.data());
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("zero bucket ", b, " weights: ", s.message()));
    }
  }
  return absl::OkStatus();
}

DdpReducer::~DdpReducer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // The buckets go; the gradients (and, sharded, the weights) keep their
  // values in storage of their own.
  for (Bucket& b : buckets_) {
    for (Parameter* p : b.parameters) {
      if (p->grad.is_view()) p->grad = p->grad.Clone();
      if (shard_ && p->value.is_view()) p->value = p->value.Clone();
    }
  }
}

std::vector<std::vector<std::string>> DdpReducer::BucketLayout() const {
  std::vector<std::vector<std::string>> layout;
  for (const Bucket& b : buckets_) {
    std::vector<std::string>& names = layout.emplace_back();
    for (const Parameter* p : b.parameters) names.push_back(p->name);
  }
  return layout;
}

void DdpReducer::BeginBackward(bool communicate, float extra, const std::vector<bool>& used,
                               const std::vector<Parameter*>& unused_now) {
  communicating_ = communicate;
  if (!communicate) return;
  extra_ = extra;
  std::fill(ready_.begin(), ready_.end(), false);
  if (single_) {
    single_pending_ = static_cast<int>(slots_.size());
    if (find_unused_) {
      used_ = used;
      used_.resize(parameters_.size(), true);
      for (Parameter* p : unused_now) OnGradReady(p);
    }
    return;
  }
  for (Bucket& b : buckets_) b.pending = static_cast<int>(b.parameters.size());
  Tensor& extra_bucket = buckets_[extra_bucket_].buffer;
  extra_bucket[extra_bucket.numel() - 1] = extra;
  if (find_unused_) {
    used_ = used;
    used_.resize(parameters_.size(), true);
  }
  if (flags_in_bucket_) {
    // The used flags just before the loss, averaged with the last bucket.
    float* flags =
        extra_bucket.data() + extra_bucket.numel() - 1 - static_cast<int64_t>(parameters_.size());
    for (size_t i = 0; i < parameters_.size(); ++i) {
      flags[i] = i < used.size() && !used[i] ? 0.0f : 1.0f;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    allreduce_seconds_ = 0.0;
    bytes_sent_ = 0;
    bytes_uncompressed_ = 0;
    next_launch_ = 0;
  }
  // A bucket with no parameters (a model without any) goes at once.
  LaunchReadyBuckets();
  // What the last forward did not use is ready now: its gradient is what
  // earlier micro-batches left (zero if none).
  if (find_unused_) {
    for (Parameter* p : unused_now) OnGradReady(p);
  }
}

void DdpReducer::OnGradReady(Parameter* parameter) {
  if (!communicating_) return;
  if (const auto at = index_.find(parameter); at != index_.end()) {
    if (ready_[at->second]) return;  // reported twice: counted once
    ready_[at->second] = true;
  }
  if (single_) {
    if (slots_.contains(parameter)) --single_pending_;
    return;
  }
  auto it = slots_.find(parameter);
  if (it == slots_.end()) return;
  // The gradient is already in the bucket (a view).
  Bucket& bucket = buckets_[it->second.bucket];
  if (--bucket.pending == 0) LaunchReadyBuckets();
}

void DdpReducer::LaunchReadyBuckets() {
  bool launched = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (next_launch_ < static_cast<int>(buckets_.size()) &&
           buckets_[static_cast<size_t>(next_launch_)].pending == 0) {
      queue_.push_back(next_launch_++);
      ++in_flight_;
      launched = true;
    }
  }
  if (launched) cv_.notify_all();
}

void DdpReducer::CommLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const int index = queue_.front();
    queue_.pop_front();
    const bool skip = !error_.ok();
    lock.unlock();
    absl::Status status;
    int64_t sent = 0;
    int64_t uncompressed = 0;
    const Clock::time_point start = Clock::now();
    if (!skip) {
      Bucket& bucket = buckets_[index];
      Tensor& buffer = bucket.buffer;
      sent = buffer.numel() * static_cast<int64_t>(sizeof(float));
      uncompressed = sent;
      if (half_.has_value()) {
        status = ReduceHalf(index, &sent);
      } else if (powersgd_ != nullptr && powersgd_->active()) {
        // The gradients one by one (the padding between them stays 0), and
        // the extra slot as a gradient of one element.
        std::vector<PowerSgd::Gradient> grads;
        for (Parameter* p : bucket.parameters) grads.push_back({p->grad.data(), p->grad.shape()});
        if (index == extra_bucket_) grads.push_back({buffer.data() + buffer.numel() - 1, {1}});
        status = powersgd_->Reduce(index, grads, communicator_);
        sent = powersgd_->last_floats_sent() * static_cast<int64_t>(sizeof(float));
      } else if (shard_) {
        status = communicator_->ReduceScatter(buffer.data(),
                                              static_cast<size_t>(bucket.shard_grad.numel()),
                                              bucket.shard_grad.data(), ReduceOp::kAvg);
      } else {
        status = communicator_->AllReduce(buffer.data(), static_cast<size_t>(buffer.numel()),
                                          ReduceOp::kAvg);
      }
    }
    const double took = SecondsSince(start);
    lock.lock();
    allreduce_seconds_ += took;
    bytes_sent_ += sent;
    bytes_uncompressed_ += uncompressed;
    if (!status.ok() && error_.ok()) {
      error_ =
          absl::Status(status.code(), absl::StrCat("ddp bucket ", index, ": ", status.message()));
    }
    --in_flight_;
    cv_.notify_all();
  }
}

absl::Status DdpReducer::ReduceHalf(int index, int64_t* sent) {
  Tensor& buffer = buckets_[index].buffer;
  const size_t count = static_cast<size_t>(buffer.numel()) - (index == extra_bucket_ ? 1 : 0);
  std::vector<uint16_t>& staging = half_staging_[static_cast<size_t>(index)];
  staging.resize(count);
  ToHalf(buffer.data(), count, 1.0f / static_cast<float>(communicator_->world_size()), *half_,
         staging.data());
  *sent = static_cast<int64_t>(count * sizeof(uint16_t));
  AIDN_RETURN_IF_ERROR(communicator_->AllReduceHalf(staging.data(), count, *half_));
  FromHalf(staging.data(), count, *half_, buffer.data());
  return absl::OkStatus();
}

absl::Status DdpReducer::Finish(double* wait_seconds, double* allreduce_seconds) {
  if (wait_seconds != nullptr) *wait_seconds = 0.0;
  if (allreduce_seconds != nullptr) *allreduce_seconds = 0.0;
  if (!communicating_) return absl::OkStatus();
  communicating_ = false;
  if (single_) {
    if (single_pending_ != 0) return MissingGradients();
    averaged_extra_ = extra_;
    for (size_t i = 0; find_unused_ && i < parameters_.size(); ++i) {
      parameters_[i]->no_grad = !used_[i];
    }
    return absl::OkStatus();
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (buckets_[i].pending != 0) return MissingGradients();
  }
  const Clock::time_point start = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return in_flight_ == 0; });
  if (wait_seconds != nullptr) *wait_seconds = SecondsSince(start);
  if (allreduce_seconds != nullptr) *allreduce_seconds = allreduce_seconds_;
  // Every bucket of this step went through it.
  if (powersgd_ != nullptr) powersgd_->EndStep();
  if (!error_.ok()) return error_;
  lock.unlock();
  if (find_unused_ && !flags_in_bucket_) {
    // Compression would touch the used flags (PowerSGD's error feedback
    // adds last step's residue to everything in a bucket), and a
    // reduce-scatter leaves each with one rank: they go alone, summed
    // exactly.
    std::vector<float> flags(parameters_.size());
    for (size_t i = 0; i < flags.size(); ++i) flags[i] = used_[i] ? 1.0f : 0.0f;
    if (absl::Status s = communicator_->AllReduce(flags.data(), flags.size(), ReduceOp::kSum);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("ddp: the used flags: ", s.message()));
    }
    for (size_t i = 0; i < flags.size(); ++i) parameters_[i]->no_grad = flags[i] == 0.0f;
    if (map_ != nullptr) map_->CopyNoGradToShards();
  }
  if (shard_ || half_.has_value()) {
    // A reduce-scatter leaves the extra slot with one rank, and 16 bits
    // would round the loss: average it alone.
    float extra = extra_;
    if (absl::Status s = communicator_->AllReduce(&extra, 1, ReduceOp::kAvg); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat(shard_ ? "zero" : "ddp", ": the step's loss: ", s.message()));
    }
    averaged_extra_ = extra;
    return absl::OkStatus();
  }
  const Tensor& extra_bucket = buckets_[extra_bucket_].buffer;
  averaged_extra_ = extra_bucket[extra_bucket.numel() - 1];
  if (flags_in_bucket_) {
    const float* flags =
        extra_bucket.data() + extra_bucket.numel() - 1 - static_cast<int64_t>(parameters_.size());
    for (size_t i = 0; i < parameters_.size(); ++i) parameters_[i]->no_grad = flags[i] == 0.0f;
  }
  return absl::OkStatus();
}

absl::Status DdpReducer::MissingGradients() const {
  std::vector<std::string> names;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (!ready_[i]) names.push_back(parameters_[i]->name);
  }
  return NoGradientError(names);
}

absl::Status NoGradientError(const std::vector<std::string>& names) {
  const size_t shown = std::min<size_t>(names.size(), 5);
  return absl::InvalidArgumentError(absl::StrCat(
      "ddp: ", names.size(), names.size() == 1 ? " parameter" : " parameters",
      " got no gradient this step (",
      absl::StrJoin(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
      names.size() > shown ? ", ..." : "",
      "): the forward did not use them; set ddp.find_unused_parameters: true for a model that "
      "skips parts of itself"));
}

absl::Status DdpReducer::BroadcastParameters(const std::vector<Parameter*>& parameters,
                                             Communicator* communicator, int root) {
  if (communicator->world_size() == 1) return absl::OkStatus();
  size_t total = 0;
  for (const Parameter* p : parameters) total += static_cast<size_t>(p->value.numel());
  std::vector<float> packed(total);
  size_t offset = 0;
  for (const Parameter* p : parameters) {
    const size_t n = static_cast<size_t>(p->value.numel());
    std::memcpy(packed.data() + offset, p->value.data(), sizeof(float) * n);
    offset += n;
  }
  absl::Status s = communicator->Broadcast(packed.data(), packed.size(), root);
  if (!s.ok())
    return absl::Status(s.code(), absl::StrCat("broadcast of initial weights: ", s.message()));
  offset = 0;
  for (Parameter* p : parameters) {
    const size_t n = static_cast<size_t>(p->value.numel());
    std::memcpy(p->value.data(), packed.data() + offset, sizeof(float) * n);
    offset += n;
  }
  return absl::OkStatus();
}

}  // namespace aidn::engine
