#include "worker/trainer/pipeline_rank.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/trainer/engine_config.h"

namespace aidn::trainer {

absl::StatusOr<std::unique_ptr<PipelineRank>> PipelineRank::Create(
    const v1::JobSpec& spec, const engine::CpuCommunicatorOptions& options,
    engine::KeyValueStore* store, TrainingTask* task) {
  const v1::ParallelSpec& p = spec.parallel();
  const int world = options.gloo.world_size;
  const int stages = std::max(1, p.pipeline());
  const int tensor = std::max(1, p.tensor());
  if (tensor != 1 || stages < 2 || world % stages != 0 || p.micro_batches() < 1 ||
      spec.batch_size() % p.micro_batches() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parallel: a pipeline of ", stages, " stages (tensor ", tensor, ", ", p.micro_batches(),
        " micro-batches of batch_size ", spec.batch_size(), ") over ", world, " ranks"));
  }
  AIDN_ASSIGN_OR_RETURN(engine::ProcessGrid grid,
                        engine::ProcessGrid::Create(world, {world / stages, 1, stages}));
  std::unique_ptr<PipelineRank> r(new PipelineRank(std::move(grid)));
  r->coords_ = r->grid_.CoordsOf(options.gloo.rank);
  r->micro_batches_ = p.micro_batches();
  r->task_ = task;
  if (engine::Gpt* gpt = task->gpt(); gpt != nullptr) {
    AIDN_ASSIGN_OR_RETURN(r->stage_, engine::MakeLanguageModelStage(gpt, stages, r->stage()));
  } else if (engine::Sequential* model = task->mutable_sequential(); model != nullptr) {
    const engine::ModelConfig m = ModelConfigOf(spec);
    AIDN_ASSIGN_OR_RETURN(r->stage_, engine::MakeClassifierStage(
                                         model, {m.in_channels, m.height, m.width}, stages,
                                         r->stage()));
  } else {
    return absl::InvalidArgumentError("parallel.pipeline: the model has no stages");
  }
  engine::CpuCommunicatorOptions grid_options = options;
  grid_options.gloo.prefix = absl::StrCat(options.gloo.prefix, "/grid");
  AIDN_ASSIGN_OR_RETURN(r->comms_, engine::CreateGridCommunicators(grid_options, r->grid_, store));
  const engine::PipelineSchedule schedule = p.schedule() == v1::ParallelSpec::GPIPE
                                                ? engine::PipelineSchedule::kGPipe
                                                : engine::PipelineSchedule::k1F1B;
  AIDN_ASSIGN_OR_RETURN(
      r->session_,
      engine::PipelineSession::Create(r->comms_.SessionOptions(schedule, BucketMbOf(spec)),
                                      r->stage_.get(), OptimizerConfigOf(spec)));
  return r;
}

engine::CpuSession::Memory PipelineRank::memory() const {
  engine::CpuSession::Memory m;
  for (const engine::Parameter* p : stage_->Parameters()) m.parameters += 4 * p->value.numel();
  // DDP's buckets hold the gradients, as many floats (and some padding).
  m.gradients = m.parameters;
  for (const auto& [name, tensor] : session_->optimizer().State()) {
    m.optimizer_state += 4 * tensor->numel();
  }
  return m;
}

absl::Status PipelineRank::GatherWholeModel() {
  stage_->Widen();
  // Every stage's weights, zeros where it holds none, summed over the
  // pipeline: each parameter's owner's values (the tied one the first
  // stage's). One collective.
  const std::vector<engine::Parameter*>& all = task_->Parameters();
  const std::vector<engine::Parameter*>& mine = stage_->Parameters();
  int64_t total = 0;
  for (const engine::Parameter* p : all) total += p->value.numel();
  std::vector<float> packed(static_cast<size_t>(total), 0.0f);
  int64_t offset = 0;
  for (const engine::Parameter* p : all) {
    if (std::find(mine.begin(), mine.end(), p) != mine.end() && Owns(p->name)) {
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

bool PipelineRank::Owns(const std::string& name) const {
  engine::Parameter* tied = stage_->tied();
  return stage_->first() || tied == nullptr || tied->name != name;
}

std::vector<int> PipelineRank::writer_ranks() const {
  return grid_.Group(grid_.RankOf({0, 0, 0}), engine::GridDim::kPipeline);
}

std::vector<engine::ShardMap::Piece> PipelineRank::WeightPieces() const {
  std::vector<engine::ShardMap::Piece> pieces;
  for (const engine::Parameter* p : stage_->Parameters()) {
    if (!Owns(p->name)) continue;
    pieces.push_back(
        {p->name, p->name, p->value.shape(), 0, static_cast<size_t>(p->value.numel()), &p->value});
  }
  return pieces;
}

std::vector<engine::ShardMap::Piece> PipelineRank::AllStatePieces() const {
  std::vector<engine::ShardMap::Piece> pieces;
  for (const auto& [name, tensor] : session_->optimizer().State()) {
    pieces.push_back({name, name, tensor->shape(), 0, static_cast<size_t>(tensor->numel()), tensor});
  }
  return pieces;
}

std::vector<engine::ShardMap::Piece> PipelineRank::StatePieces() const {
  std::vector<engine::ShardMap::Piece> pieces = AllStatePieces();
  engine::Parameter* tied = stage_->tied();
  if (stage_->first() || tied == nullptr) return pieces;
  // "<parameter>.<buffer>": the first stage writes the tied parameter's.
  const std::string prefix = tied->name + ".";
  std::erase_if(pieces, [&](const engine::ShardMap::Piece& p) { return p.name.starts_with(prefix); });
  return pieces;
}

}  // namespace aidn::trainer
