#include "worker/engine/fsdp.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/engine/cpu_kernels.h"

namespace aidn::engine {
namespace {

using Clock = std::chrono::steady_clock;

// Free buffers a pool keeps for reuse: a gathered unit, the one prefetched
// and the root.
constexpr size_t kPoolKeeps = 3;

}  // namespace

absl::StatusOr<std::vector<ShardMap::Group>> UnitGroups(std::vector<std::vector<Parameter*>> units,
                                                        const std::vector<Parameter*>& parameters,
                                                        int world_size) {
  if (units.empty()) units.emplace_back();  // the root, empty
  std::unordered_map<const Parameter*, int> seen;
  for (const auto& unit : units) {
    for (const Parameter* p : unit) ++seen[p];
  }
  for (const Parameter* p : parameters) {
    auto it = seen.find(p);
    const int count = it == seen.end() ? 0 : it->second;
    if (count != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("fsdp: parameter ", p->name, " is in ", count, " units, want 1"));
    }
  }
  if (seen.size() != parameters.size()) {
    return absl::InvalidArgumentError("fsdp: a unit holds a parameter the model does not list");
  }
  std::vector<ShardMap::Group> groups;
  for (const auto& unit : units) groups.push_back(ShardMap::Lay(unit, world_size));
  AIDN_RETURN_IF_ERROR(ShardMap::CheckEveryRankOwnsSome(groups, world_size));
  return groups;
}

Tensor FsdpReducer::Pool::Take(size_t floats) {
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (static_cast<size_t>(it->numel()) < floats) continue;
    if (best == free_.end() || it->numel() < best->numel()) best = it;
  }
  if (best != free_.end()) {
    Tensor t = std::move(*best);
    free_.erase(best);
    return t;
  }
  bytes_ += 4 * static_cast<int64_t>(floats);
  peak_ = std::max(peak_, bytes_);
  return Tensor({static_cast<int64_t>(floats)});
}

void FsdpReducer::Pool::Give(Tensor buffer) {
  free_.push_back(std::move(buffer));
  if (free_.size() <= kPoolKeeps) return;
  // Beyond what reuse needs, the smallest goes back to the system.
  auto smallest =
      std::min_element(free_.begin(), free_.end(),
                       [](const Tensor& a, const Tensor& b) { return a.numel() < b.numel(); });
  bytes_ -= 4 * smallest->numel();
  free_.erase(smallest);
}

absl::StatusOr<std::unique_ptr<FsdpReducer>> FsdpReducer::Create(
    const FsdpOptions& options, std::vector<std::vector<Parameter*>> units,
    const std::vector<Parameter*>& parameters, Communicator* communicator) {
  if (communicator == nullptr) return absl::InvalidArgumentError("fsdp: no communicator");
  if (options.sharding != Sharding::kGradients && options.sharding != Sharding::kShardGradOp &&
      options.sharding != Sharding::kFullShard) {
    return absl::InvalidArgumentError("fsdp: sharding must be zero2, shard_grad_op or full_shard");
  }
  if (options.max_pending_gradients < 1) {
    return absl::InvalidArgumentError(absl::StrCat("fsdp: max_pending_gradients must be >= 1, got ",
                                                   options.max_pending_gradients));
  }
  const int world = communicator->world_size();
  const size_t rank = static_cast<size_t>(communicator->rank());
  AIDN_ASSIGN_OR_RETURN(std::vector<ShardMap::Group> groups,
                        UnitGroups(std::move(units), parameters, world));
  std::unique_ptr<FsdpReducer> r(new FsdpReducer(options, communicator));
  const int num_units = static_cast<int>(groups.size());
  r->map_ =
      std::make_unique<ShardMap>(std::move(groups), parameters, static_cast<int>(rank), world);
  r->units_.resize(static_cast<size_t>(num_units));
  for (int u = 0; u < num_units; ++u) {
    Unit& unit = r->units_[static_cast<size_t>(u)];
    const ShardMap::Group& group = r->map_->group(u);
    const size_t chunk = r->map_->chunk(u);
    Tensor whole({static_cast<int64_t>(group.floats)});
    for (size_t i = 0; i < group.parameters.size(); ++i) {
      const Parameter* p = group.parameters[i];
      std::memcpy(whole.data() + group.offsets[i], p->value.data(),
                  sizeof(float) * static_cast<size_t>(p->value.numel()));
    }
    unit.shard_grad = Tensor({static_cast<int64_t>(chunk)});
    if (r->sharded_weights()) {
      unit.shard = Tensor({static_cast<int64_t>(chunk)});
      if (chunk > 0) {
        std::memcpy(unit.shard.data(), whole.data() + rank * chunk, sizeof(float) * chunk);
      }
      r->PointValues(u, nullptr);
    } else {
      unit.weights = std::move(whole);
      r->PointValues(u, unit.weights.data());
      unit.state = Weights::kGathered;
      unit.gathered = true;
    }
    // The gradients live in a buffer during the unit's backward only.
    r->PointGrads(u, nullptr);
  }
  r->map_->MakeShards(
      [&](int u) {
        Unit& unit = r->units_[static_cast<size_t>(u)];
        return r->sharded_weights() ? unit.shard.data()
                                    : unit.weights.data() + rank * r->map_->chunk(u);
      },
      [&](int u) { return r->units_[static_cast<size_t>(u)].shard_grad.data(); });
  r->thread_ = std::thread([p = r.get()] { p->CommLoop(); });
  return r;
}

FsdpReducer::~FsdpReducer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (map_ == nullptr) return;
  // Storage of their own: the weights where they are whole and current,
  // zeros elsewhere; zeroed gradients.
  for (int u = 0; u < map_->num_groups(); ++u) {
    const bool current = units_[static_cast<size_t>(u)].state == Weights::kGathered;
    for (Parameter* p : map_->group(u).parameters) {
      p->value = current ? p->value.Clone() : Tensor(p->value.shape());
      p->grad = Tensor(p->grad.shape());
    }
  }
}

void FsdpReducer::PointValues(int unit, float* base) {
  const ShardMap::Group& group = map_->group(unit);
  for (size_t i = 0; i < group.parameters.size(); ++i) {
    Parameter* p = group.parameters[i];
    p->value = Tensor::View(base == nullptr ? nullptr : base + group.offsets[i], p->value.shape());
  }
}

void FsdpReducer::PointGrads(int unit, float* base) {
  const ShardMap::Group& group = map_->group(unit);
  for (size_t i = 0; i < group.parameters.size(); ++i) {
    Parameter* p = group.parameters[i];
    p->grad = Tensor::View(base == nullptr ? nullptr : base + group.offsets[i], p->grad.shape());
  }
}

void FsdpReducer::Enqueue(Op op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(op));
    ++in_flight_;
  }
  cv_.notify_all();
}

void FsdpReducer::Gather(int u) {
  Unit& unit = units_[static_cast<size_t>(u)];
  if (unit.state != Weights::kStale) return;
  if (floats(u) == 0) {
    unit.state = Weights::kGathered;
    return;
  }
  if (sharded_weights()) {
    unit.weights = weight_pool_.Take(floats(u));
    PointValues(u, unit.weights.data());
  }
  unit.state = Weights::kGathering;
  {
    std::lock_guard<std::mutex> lock(mu_);
    unit.gathered = false;
  }
  Enqueue({.gather = true, .unit = u, .out = unit.weights.data(), .buffer = Tensor()});
}

void FsdpReducer::WaitGathered(int u) {
  Unit& unit = units_[static_cast<size_t>(u)];
  if (unit.state == Weights::kGathered) return;
  AIDN_CHECK(unit.state == Weights::kGathering) << "fsdp: unit " << u << " was never gathered";
  const Clock::time_point start = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return unit.gathered; });
  wait_seconds_ += SecondsSince(start);
  unit.state = Weights::kGathered;
}

void FsdpReducer::FreeWeights(int u) {
  if (!sharded_weights() || floats(u) == 0) return;
  Unit& unit = units_[static_cast<size_t>(u)];
  if (unit.state == Weights::kStale) return;
  WaitGathered(u);
  weight_pool_.Give(std::move(unit.weights));
  unit.weights = Tensor();
  PointValues(u, nullptr);
  unit.state = Weights::kStale;
}

void FsdpReducer::BeforeForward(int u) {
  if (summoned_) return;
  Gather(u);
  // The next unit's weights come while this one computes.
  if (u + 1 < map_->num_groups()) Gather(u + 1);
  WaitGathered(u);
}

void FsdpReducer::AfterForward(int u) {
  if (summoned_) return;
  if (options_.sharding == Sharding::kFullShard && u != 0) FreeWeights(u);
}

void FsdpReducer::BeforeBackward(int u) {
  AIDN_CHECK(!summoned_) << "fsdp: backward between GatherFullParameters and its release";
  Gather(u);
  // Backward runs the units in reverse after the root.
  const int next = u == 0 ? map_->num_groups() - 1 : u - 1;
  if (next >= 1 && next != u) Gather(next);
  WaitGathered(u);
  const size_t n = floats(u);
  if (n == 0) return;
  Unit& unit = units_[static_cast<size_t>(u)];
  {
    const Clock::time_point start = Clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    if (u != 0) {
      cv_.wait(lock, [&] { return pending_grads_ < options_.max_pending_gradients; });
      ++pending_grads_;
    } else {
      // The last micro-batch's root buffer, back from its reduce-scatter,
      // is the one to reuse.
      cv_.wait(lock, [&] { return !root_pending_; });
      root_pending_ = true;
    }
    unit.grad = grad_pool_.Take(n);
    wait_seconds_ += SecondsSince(start);
  }
  std::memset(unit.grad.data(), 0, sizeof(float) * n);
  PointGrads(u, unit.grad.data());
}

void FsdpReducer::AfterBackward(int u) {
  if (floats(u) > 0) {
    Unit& unit = units_[static_cast<size_t>(u)];
    PointGrads(u, nullptr);
    float* data = unit.grad.data();
    Enqueue({.gather = false, .unit = u, .out = data, .buffer = std::move(unit.grad)});
    unit.grad = Tensor();
  }
  FreeWeights(u);
}

void FsdpReducer::BeginStep() {
  AIDN_CHECK(!summoned_) << "fsdp: a step between GatherFullParameters and its release";
  for (Unit& unit : units_) unit.shard_grad.Zero();
  wait_seconds_ = 0.0;
  std::lock_guard<std::mutex> lock(mu_);
  comm_seconds_ = 0.0;
}

absl::Status FsdpReducer::Finish(double* wait_seconds, double* comm_seconds) {
  const Clock::time_point start = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return in_flight_ == 0; });
  wait_seconds_ += SecondsSince(start);
  if (wait_seconds != nullptr) *wait_seconds = wait_seconds_;
  if (comm_seconds != nullptr) *comm_seconds = comm_seconds_;
  return error_;
}

void FsdpReducer::AfterUpdate() {
  // ZeRO-2 keeps the weights; other ranks' slices in them are old now.
  // FSDP freed every unit after its backward.
  for (int u = 0; u < map_->num_groups(); ++u) {
    if (floats(u) > 0) units_[static_cast<size_t>(u)].state = Weights::kStale;
  }
}

absl::Status FsdpReducer::GatherFullParameters() {
  AIDN_CHECK(!summoned_) << "fsdp: GatherFullParameters twice";
  for (int u = 0; u < map_->num_groups(); ++u) Gather(u);
  for (int u = 0; u < map_->num_groups(); ++u) WaitGathered(u);
  summoned_ = true;
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void FsdpReducer::ReleaseFullParameters() {
  if (!summoned_) return;
  summoned_ = false;
  for (int u = 0; u < map_->num_groups(); ++u) FreeWeights(u);
}

FsdpReducer::Memory FsdpReducer::memory() const {
  Memory m;
  for (int u = 0; u < map_->num_groups(); ++u) {
    const int64_t chunk = static_cast<int64_t>(map_->chunk(u));
    m.weights += 4 * (sharded_weights() ? chunk : static_cast<int64_t>(floats(u)));
    m.gradients += 4 * chunk;
  }
  std::lock_guard<std::mutex> lock(mu_);
  m.buffers = weight_pool_.peak_bytes() + grad_pool_.peak_bytes();
  return m;
}

absl::Status FsdpReducer::RunOp(Op& op) {
  const size_t chunk = map_->chunk(op.unit);
  const size_t rank = static_cast<size_t>(communicator_->rank());
  Unit& unit = units_[static_cast<size_t>(op.unit)];
  if (op.gather) {
    // ZeRO-2: in place, the rank's slice is where the output wants it.
    const float* in = sharded_weights() ? unit.shard.data() : op.out + rank * chunk;
    absl::Status s = communicator_->AllGather(in, chunk, op.out);
    if (!s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("fsdp unit ", op.unit, " weights all-gather: ", s.message()));
    }
    return absl::OkStatus();
  }
  float* mine = op.out + rank * chunk;
  absl::Status s = communicator_->ReduceScatter(op.out, chunk, mine, ReduceOp::kAvg);
  if (!s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("fsdp unit ", op.unit, " gradients reduce-scatter: ", s.message()));
  }
  cpu::AccumulateKernel(mine, unit.shard_grad.data(), static_cast<int64_t>(chunk));
  return absl::OkStatus();
}

void FsdpReducer::CommLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    Op op = std::move(queue_.front());
    queue_.pop_front();
    const bool skip = !error_.ok();
    lock.unlock();
    const Clock::time_point start = Clock::now();
    absl::Status status = skip ? absl::OkStatus() : RunOp(op);
    const double took = SecondsSince(start);
    lock.lock();
    comm_seconds_ += took;
    if (!status.ok() && error_.ok()) error_ = status;
    if (op.gather) {
      units_[static_cast<size_t>(op.unit)].gathered = true;
    } else {
      grad_pool_.Give(std::move(op.buffer));
      if (op.unit != 0) {
        --pending_grads_;
      } else {
        root_pending_ = false;
      }
    }
    --in_flight_;
    cv_.notify_all();
  }
}

}  // namespace aidn::engine
