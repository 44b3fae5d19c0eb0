#include "worker/trainer/parallel_rank.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/engine/tensor_parallel.h"
#include "worker/trainer/engine_config.h"

namespace aidn::trainer {
absl::StatusOr<std::unique_ptr<ParallelRank>> ParallelRank::Create(
    const v1::JobSpec& spec, const engine::CpuCommunicatorOptions& options,
    engine::KeyValueStore* store, TrainingTask* task) {
  const v1::ParallelSpec& p = spec.parallel();
  const int world = options.gloo.world_size;
  const int stages = std::max(1, p.pipeline());
  const int tensor = std::max(1, p.tensor());
  const int micro = stages > 1 ? p.micro_batches() : 1;
  if (world % (stages * tensor) != 0 || micro < 1 || spec.batch_size() % micro != 0 ||
      (tensor > 1 && task->gpt() == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel: ", tensor, " tensor ranks x ", stages, " stages (", micro,
                     " micro-batches of batch_size ", spec.batch_size(), ") over ", world,
                     " ranks of model ", spec.model().name()));
  }
  AIDN_ASSIGN_OR_RETURN(
      engine::ProcessGrid grid,
      engine::ProcessGrid::Create(world, {world / (stages * tensor), tensor, stages}));
  std::unique_ptr<ParallelRank> r(new ParallelRank(std::move(grid)));
  r->coords_ = r->grid_.CoordsOf(options.gloo.rank);
  r->micro_batches_ = micro;
  r->task_ = task;
  engine::CpuCommunicatorOptions grid_options = options;
  grid_options.gloo.prefix = absl::StrCat(options.gloo.prefix, "/grid");
  AIDN_ASSIGN_OR_RETURN(r->comms_, engine::CreateGridCommunicators(grid_options, r->grid_, store));
  // device: gpu: the stage on the GPU, made from the whole decoder before
  // the CPU copy is cut.
  engine::Gpt* gpt = task->gpt();
  if (spec.device() == v1::JobSpec::GPU) {
    if (gpt == nullptr || tensor > 1 || stages < 2 || r->replicas() > 1) {
      return absl::InvalidArgumentError(
          "parallel: on device: gpu, a GPT's pipeline of one replica (world_size = "
          "parallel.pipeline, no parallel.tensor) for now");
    }
    engine::GpuSessionOptions o = GpuSessionOptionsOf(spec, options.gloo.rank, world);
    o.store = store;
    AIDN_ASSIGN_OR_RETURN(r->gpu_, engine::GpuSession::CreateForGptStage(
                                       o, *gpt, stages, p.schedule() == v1::ParallelSpec::GPIPE,
                                       OptimizerConfigOf(spec)));
    AIDN_LOG(INFO) << "training on the GPU" << Kv("device", r->gpu_->Describe());
  }
  // Split first (from the whole weights), then cut into the stage.
  if (gpt != nullptr) AIDN_RETURN_IF_ERROR(gpt->SetTensorParallel(r->comms_.tensor.get()));
  if (stages > 1) {
    if (gpt != nullptr) {
      AIDN_ASSIGN_OR_RETURN(r->stage_, engine::MakeLanguageModelStage(gpt, stages, r->stage()));
    } else if (engine::Sequential* model = task->mutable_sequential(); model != nullptr) {
      const engine::ModelConfig m = ModelConfigOf(spec);
      AIDN_ASSIGN_OR_RETURN(
          r->stage_, engine::MakeClassifierStage(model, {m.in_channels, m.height, m.width}, stages,
                                                 r->stage()));
    } else {
      return absl::InvalidArgumentError("parallel.pipeline: the model has no stages");
    }
  }
  AIDN_LOG(INFO) << "model-parallel rank ready" << Kv("replica", r->replica())
                 << Kv("tensor_rank", r->tensor_rank()) << Kv("stage", r->stage())
                 << Kv("micro_batches", r->micro_batches());
  // Clipping's norm within a tensor group: slices summed, these whole ones
  // once.
  std::vector<const engine::Parameter*> whole;
  if (tensor > 1) {
    for (const engine::Parameter* q : r->Mine()) {
      if (!gpt->SplitOf(*q).has_value()) whole.push_back(q);
    }
  }
  if (stages > 1) {
    const engine::PipelineSchedule schedule = p.schedule() == v1::ParallelSpec::GPIPE
                                                  ? engine::PipelineSchedule::kGPipe
                                                  : engine::PipelineSchedule::k1F1B;
    engine::PipelineSessionOptions o = r->comms_.SessionOptions(schedule, BucketMbOf(spec));
    // ZeRO-1 over the stage's replicas (with one replica there is nothing
    // to shard: DDP's step).
    o.shard_optimizer = spec.strategy() == v1::JobSpec::ZERO1 && r->replicas() > 1;
    o.tensor = r->comms_.tensor.get();
    o.tensor_whole = whole;
    o.broadcast_buffers = !spec.ddp().has_broadcast_buffers() || spec.ddp().broadcast_buffers();
    AIDN_ASSIGN_OR_RETURN(
        r->pipeline_, engine::PipelineSession::Create(o, r->stage_.get(), OptimizerConfigOf(spec)));
    r->LogSharding();
    return r;
  }
  engine::CpuSessionOptions o;
  o.communicator = r->replicas() > 1 ? r->comms_.data.get() : nullptr;
  o.bucket_mb = BucketMbOf(spec);
  o.broadcast_buffers = !spec.ddp().has_broadcast_buffers() || spec.ddp().broadcast_buffers();
  // ZeRO-1 over the tensor groups' replicas.
  const bool shard = spec.strategy() == v1::JobSpec::ZERO1 && r->replicas() > 1;
  if (shard) o.sharding = engine::Sharding::kOptimizer;
  AIDN_ASSIGN_OR_RETURN(r->cpu_,
                        engine::CpuSession::Create(o, &task->model(), OptimizerConfigOf(spec)));
  if (shard) {
    r->cpu_->optimizer().SetSumOfSquaresReduction(
        engine::ShardedSumOfSquares(*r->cpu_->shard_map(), whole, nullptr, false,
                                    r->comms_.data.get(), r->comms_.tensor.get(), nullptr));
    r->LogSharding();
  } else if (tensor > 1) {
    r->cpu_->optimizer().SetSumOfSquaresReduction(
        engine::TensorParallelSumOfSquares(r->comms_.tensor.get(), whole));
  }
  return r;
}

const std::vector<engine::Parameter*>& ParallelRank::Mine() const {
  return stage_ != nullptr ? stage_->Parameters() : task_->Parameters();
}

std::vector<engine::Parameter*> ParallelRank::MyBuffers() const {
  return stage_ != nullptr ? stage_->Buffers() : task_->model().Buffers();
}

bool ParallelRank::counts_samples() const {
  return coords_.tensor == 0 && coords_.pipeline == grid_.shape().pipeline - 1;
}

absl::StatusOr<double> ParallelRank::Step(const std::vector<engine::MicroBatch>& micro, double lr) {
  if (gpu_ != nullptr) return gpu_->Step(micro, lr);
  absl::StatusOr<double> loss =
      pipeline_ != nullptr ? pipeline_->Step(micro, lr) : cpu_->Step(micro, lr);
  // A tensor group's collective that failed inside the model.
  if (engine::Gpt* gpt = task_->gpt(); gpt != nullptr) {
    AIDN_RETURN_IF_ERROR(Annotate(gpt->TakeCollectiveStatus(), "tensor-parallel collective"));
  }
  return loss;
}

absl::Status ParallelRank::SyncFromGpu(bool optimizer_state) {
  if (gpu_ == nullptr) return absl::OkStatus();
  // The parameters the stage does not hold are left alone.
  AIDN_RETURN_IF_ERROR(gpu_->CopyParametersTo(task_->Parameters()));
  if (!optimizer_state) return absl::OkStatus();
  AIDN_ASSIGN_OR_RETURN(const auto state, gpu_->OptimizerState());
  std::vector<engine::Optimizer::StateEntry> entries;
  for (const auto& [name, tensor] : state) entries.emplace_back(name, &tensor);
  return optimizer().LoadState(entries, gpu_->optimizer_steps());
}

double ParallelRank::allreduce_seconds() const {
  return pipeline_ != nullptr ? pipeline_->last_stats().allreduce_seconds
                              : cpu_->last_allreduce_seconds();
}

double ParallelRank::wait_seconds() const {
  if (pipeline_ == nullptr) return cpu_->last_allreduce_wait_seconds();
  // Waiting for the neighbours (the bubble) is not compute either.
  const engine::PipelineSession::Stats& s = pipeline_->last_stats();
  return s.allreduce_seconds + s.transfer_seconds;
}

engine::Optimizer& ParallelRank::optimizer() {
  return pipeline_ != nullptr ? pipeline_->optimizer() : cpu_->optimizer();
}

engine::CpuSession::Memory ParallelRank::memory() const {
  engine::CpuSession::Memory m;
  for (const engine::Parameter* p : Mine()) m.parameters += 4 * p->value.numel();
  // DDP's buckets hold the gradients, as many floats (and some padding).
  m.gradients = m.parameters;
  const engine::Optimizer& o = pipeline_ != nullptr ? pipeline_->optimizer() : cpu_->optimizer();
  for (const auto& [name, tensor] : o.State()) m.optimizer_state += 4 * tensor->numel();
  return m;
}

absl::Status ParallelRank::GatherWholeModel() {
  if (stage_ == nullptr) return absl::OkStatus();
  stage_->Widen();
  // Every stage's weights and buffers, zeros where it holds none, summed
  // over the pipeline: each tensor's owner's values (the tied parameter
  // the first stage's). One collective.
  std::vector<engine::Parameter*> all = task_->Parameters();
  std::vector<engine::Parameter*> mine = stage_->Parameters();
  for (engine::Parameter* b : task_->model().Buffers()) all.push_back(b);
  for (engine::Parameter* b : stage_->Buffers()) mine.push_back(b);
  engine::Parameter* tied = stage_->first() ? nullptr : stage_->tied();
  int64_t total = 0;
  for (const engine::Parameter* p : all) total += p->value.numel();
  std::vector<float> packed(static_cast<size_t>(total), 0.0f);
  int64_t offset = 0;
  for (const engine::Parameter* p : all) {
    if (p != tied && std::find(mine.begin(), mine.end(), p) != mine.end()) {
      std::memcpy(packed.data() + offset, p->value.data(), sizeof(float) * p->value.numel());
    }
    offset += p->value.numel();
  }
  AIDN_RETURN_IF_ERROR(
      comms_.pipeline->AllReduce(packed.data(), packed.size(), engine::ReduceOp::kSum));
  offset = 0;
  for (engine::Parameter* p : all) {
    std::memcpy(p->value.data(), packed.data() + offset, sizeof(float) * p->value.numel());
    offset += p->value.numel();
  }
  return absl::OkStatus();
}

void ParallelRank::ReleaseWholeModel() {
  if (stage_ != nullptr) stage_->Narrow();
}

int ParallelRank::eval_rank() const {
  return grid_.RankOf({coords_.data, 0, coords_.pipeline}) / grid_.shape().tensor;
}

int ParallelRank::eval_world() const { return grid_.world_size() / grid_.shape().tensor; }

std::optional<engine::Gpt::Split> ParallelRank::SplitOf(const engine::Parameter& p) const {
  const engine::Gpt* gpt = task_->gpt();
  return gpt != nullptr ? gpt->SplitOf(p) : std::nullopt;
}

bool ParallelRank::Writes(const engine::Parameter& p) const {
  if (stage_ != nullptr && !stage_->first() && stage_->tied() == &p) return false;
  return coords_.tensor == 0 || SplitOf(p).has_value();
}

const engine::ShardMap* ParallelRank::shard_map() const {
  if (pipeline_ != nullptr) return pipeline_->shard_map();
  return cpu_ != nullptr ? cpu_->shard_map() : nullptr;
}

bool ParallelRank::sharded() const { return shard_map() != nullptr; }

void ParallelRank::LogSharding() const {
  if (const engine::ShardMap* map = shard_map(); map != nullptr) {
    AIDN_LOG(INFO) << "optimizer state sharded over the replicas" << Kv("strategy", "ZERO1")
                   << Kv("replicas", replicas()) << Kv("groups", map->num_groups())
                   << Kv("shards", map->shards().size());
  }
}

std::vector<int> ParallelRank::writer_ranks() const {
  std::vector<int> ranks;
  if (sharded()) {
    for (int r = 0; r < grid_.world_size(); ++r) ranks.push_back(r);
    return ranks;
  }
  for (int p = 0; p < grid_.shape().pipeline; ++p) {
    for (int t = 0; t < grid_.shape().tensor; ++t) ranks.push_back(grid_.RankOf({0, t, p}));
  }
  return ranks;
}

std::vector<ParallelRank::Run> ParallelRank::RunsOf(const engine::Parameter& p) const {
  const std::optional<engine::Gpt::Split> split = SplitOf(p);
  if (!split.has_value()) return {{0, 0, p.value.numel()}};
  std::vector<Run> runs;
  const std::vector<int64_t>& shape = split->whole_shape;
  if (shape.size() == 1 || split->dim == 0) {
    // Runs of whole rows: contiguous in the whole tensor.
    const int64_t row = shape.size() == 1 ? 1 : shape[1];
    int64_t at = 0;
    for (const auto& [b, e] : split->ranges) {
      runs.push_back({at * row, b * row, (e - b) * row});
      at += e - b;
    }
    return runs;
  }
  // Columns: a run per row and range.
  const int64_t width = p.value.dim(1);
  for (int64_t r = 0; r < shape[0]; ++r) {
    int64_t at = 0;
    for (const auto& [b, e] : split->ranges) {
      runs.push_back({r * width + at, r * shape[1] + b, e - b});
      at += e - b;
    }
  }
  return runs;
}

void ParallelRank::AddPieces(const std::string& whole, const engine::Parameter& p,
                             const float* data, int64_t begin, int64_t end,
                             std::vector<engine::ShardMap::Piece>* out) {
  const std::optional<engine::Gpt::Split> split = SplitOf(p);
  const std::vector<int64_t> shape = split.has_value() ? split->whole_shape : p.value.shape();
  for (const Run& run : RunsOf(p)) {
    const int64_t lo = std::max(begin, run.local);
    const int64_t hi = std::min(end, run.local + run.length);
    if (lo >= hi) continue;
    const int64_t b = run.whole + (lo - run.local);
    const int64_t e = run.whole + (hi - run.local);
    views_.push_back(engine::Tensor::View(const_cast<float*>(data) + (lo - begin), {hi - lo}));
    // A whole tensor keeps its own name; a part is named by its range.
    int64_t numel = 1;
    for (const int64_t d : shape) numel *= d;
    const bool all = b == 0 && e == numel;
    out->push_back({all ? whole : absl::StrCat(whole, "[", b, ":", e, "]"), whole, shape,
                    static_cast<size_t>(b), static_cast<size_t>(e), &views_.back()});
  }
}

void ParallelRank::AddPieces(const std::string& whole, const engine::Parameter& p,
                             const engine::Tensor& tensor,
                             std::vector<engine::ShardMap::Piece>* out) {
  if (!SplitOf(p).has_value()) {
    out->push_back({whole, whole, tensor.shape(), 0, static_cast<size_t>(tensor.numel()), &tensor});
    return;
  }
  AddPieces(whole, p, tensor.data(), 0, tensor.numel(), out);
}

absl::StatusOr<ParallelRank::Pieces> ParallelRank::CheckpointPieces() {
  views_.clear();
  Pieces pieces;
  if (sharded()) {
    // ZeRO-1: every replica writes its shards' state; the first replica the
    // weights, the buffers and the tied parameter's state, as without.
    AIDN_ASSIGN_OR_RETURN(pieces.state, ShardedStatePieces(optimizer().State(), false));
    if (coords_.data != 0) return pieces;
  }
  std::map<std::string, const engine::Parameter*> by_name;
  for (const engine::Parameter* p : Mine()) {
    by_name[p->name] = p;
    if (Writes(*p)) AddPieces(p->name, *p, p->value, &pieces.weights);
  }
  // Buffers are whole on every tensor rank: tensor rank 0 writes its
  // stage's.
  if (coords_.tensor == 0) {
    for (const engine::Parameter* b : MyBuffers()) {
      pieces.weights.push_back({b->name, b->name, b->value.shape(), 0,
                                static_cast<size_t>(b->value.numel()), &b->value});
    }
  }
  // "<parameter>.<buffer>".
  for (const auto& [name, tensor] : optimizer().State()) {
    const auto it = by_name.find(name.substr(0, name.rfind('.')));
    if (it != by_name.end() && Writes(*it->second)) {
      AddPieces(name, *it->second, *tensor, &pieces.state);
    }
  }
  return pieces;
}

absl::StatusOr<std::vector<engine::ShardMap::Piece>> ParallelRank::ShardedStatePieces(
    const std::vector<engine::Optimizer::StateEntry>& state, bool reading) {
  // The shards' entries ("<parameter>[b:e].<buffer>"), not the whole tied
  // parameter's.
  std::vector<engine::Optimizer::StateEntry> shards;
  for (const engine::Optimizer::StateEntry& e : state) {
    if (e.first.find('[') != std::string::npos) shards.push_back(e);
  }
  AIDN_ASSIGN_OR_RETURN(std::vector<engine::ShardMap::Piece> local,
                        shard_map()->StatePieces(shards));
  std::map<std::string, const engine::Parameter*> by_name;
  for (const engine::Parameter* p : Mine()) by_name[p->name] = p;
  // Each as elements of the whole tensor: a shard of a tensor-parallel
  // slice is one piece per run of the slice it covers; a parameter every
  // tensor rank holds whole is written by tensor rank 0.
  std::vector<engine::ShardMap::Piece> pieces;
  for (const engine::ShardMap::Piece& piece : local) {
    const auto it = by_name.find(piece.whole.substr(0, piece.whole.rfind('.')));
    if (it == by_name.end()) {
      return absl::InternalError(absl::StrCat("optimizer state ", piece.name, " of no parameter"));
    }
    if (!SplitOf(*it->second).has_value()) {
      if (reading || coords_.tensor == 0) pieces.push_back(piece);
      continue;
    }
    AddPieces(piece.whole, *it->second, piece.tensor->data(), static_cast<int64_t>(piece.begin),
              static_cast<int64_t>(piece.end), &pieces);
  }
  return pieces;
}

absl::Status ParallelRank::LoadShardedOptimizerState(CheckpointLoader* loader,
                                                     int64_t optimizer_steps) {
  views_.clear();
  const std::vector<engine::Optimizer::StateEntry> state = optimizer().State();
  // Fresh tensors of the entries' shapes, which the pieces read into: the
  // shards' pieces of the whole entries, and the tied parameter's entries
  // whole (then this rank's slice of them).
  std::deque<engine::Tensor> fresh;
  std::vector<engine::Optimizer::StateEntry> shards;
  for (const auto& [name, tensor] : state) {
    if (name.find('[') == std::string::npos) continue;
    fresh.emplace_back(tensor->shape());
    shards.emplace_back(name, &fresh.back());
  }
  AIDN_ASSIGN_OR_RETURN(std::vector<engine::ShardMap::Piece> pieces,
                        ShardedStatePieces(shards, /*reading=*/true));
  const size_t shard_pieces = pieces.size();
  std::deque<engine::Tensor> wholes;
  std::vector<const engine::Parameter*> tied_of;
  std::vector<std::string> tied_names;
  for (const auto& [name, tensor] : state) {
    if (name.find('[') != std::string::npos) continue;
    const engine::Parameter* tied = stage_ != nullptr ? stage_->tied() : nullptr;
    if (tied == nullptr || name.substr(0, name.rfind('.')) != tied->name) {
      return absl::InternalError(absl::StrCat("optimizer state ", name, " is of no shard"));
    }
    const std::optional<engine::Gpt::Split> split = SplitOf(*tied);
    wholes.emplace_back(split.has_value() ? split->whole_shape : tensor->shape());
    pieces.push_back({name, name, wholes.back().shape(), 0,
                      static_cast<size_t>(wholes.back().numel()), &wholes.back()});
    tied_of.push_back(tied);
    tied_names.push_back(name);
  }
  AIDN_ASSIGN_OR_RETURN(std::vector<engine::Tensor> read, loader->ReadOptimizerState(pieces));
  for (size_t i = 0; i < shard_pieces; ++i) {
    std::memcpy(const_cast<float*>(pieces[i].tensor->data()), read[i].data(),
                sizeof(float) * static_cast<size_t>(read[i].numel()));
  }
  std::vector<engine::Optimizer::StateEntry> entries = shards;
  for (size_t i = shard_pieces; i < pieces.size(); ++i) {
    const std::optional<engine::Gpt::Split> split = SplitOf(*tied_of[i - shard_pieces]);
    fresh.push_back(split.has_value() ? engine::SliceOfSplit(read[i], *split) : std::move(read[i]));
    entries.emplace_back(tied_names[i - shard_pieces], &fresh.back());
  }
  return optimizer().LoadState(entries, optimizer_steps);
}

absl::Status ParallelRank::LoadOptimizerState(CheckpointLoader* loader, int64_t optimizer_steps) {
  if (sharded()) return LoadShardedOptimizerState(loader, optimizer_steps);
  std::map<std::string, const engine::Parameter*> by_name;
  for (const engine::Parameter* p : Mine()) by_name[p->name] = p;
  // Every entry whole, then this rank's part of it.
  const std::vector<engine::Optimizer::StateEntry> state = optimizer().State();
  std::deque<engine::Tensor> wholes;
  std::vector<engine::ShardMap::Piece> pieces;
  std::vector<std::optional<engine::Gpt::Split>> splits;
  for (const auto& [name, tensor] : state) {
    const auto it = by_name.find(name.substr(0, name.rfind('.')));
    splits.push_back(it != by_name.end() ? SplitOf(*it->second) : std::nullopt);
    wholes.emplace_back(splits.back().has_value() ? splits.back()->whole_shape : tensor->shape());
    pieces.push_back({name, name, wholes.back().shape(), 0,
                      static_cast<size_t>(wholes.back().numel()), &wholes.back()});
  }
  AIDN_ASSIGN_OR_RETURN(std::vector<engine::Tensor> read, loader->ReadOptimizerState(pieces));
  std::vector<engine::Tensor> parts;
  std::vector<engine::Optimizer::StateEntry> entries;
  parts.reserve(read.size());
  for (size_t i = 0; i < read.size(); ++i) {
    parts.push_back(splits[i].has_value() ? engine::SliceOfSplit(read[i], *splits[i])
                                          : std::move(read[i]));
    entries.emplace_back(state[i].first, &parts.back());
  }
  AIDN_RETURN_IF_ERROR(optimizer().LoadState(entries, optimizer_steps));
  if (gpu_ == nullptr) return absl::OkStatus();
  // The GPU's optimizer continues from the same state.
  std::vector<std::pair<std::string, const engine::Tensor*>> resumed;
  for (const engine::Optimizer::StateEntry& e : optimizer().State()) resumed.push_back(e);
  return gpu_->LoadOptimizerState(resumed, optimizer_steps);
}

}  // namespace aidn::trainer
