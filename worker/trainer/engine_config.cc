#include "worker/trainer/engine_config.h"

#include <algorithm>
#include <filesystem>

#include "absl/status/statusor.h"

namespace aidn::trainer {

using std::chrono::milliseconds;

engine::ModelConfig ModelConfigOf(const v1::JobSpec& spec) {
  engine::ModelConfig config;
  config.name = spec.model().name();
  config.hidden_sizes.assign(spec.model().hidden_sizes().begin(),
                             spec.model().hidden_sizes().end());
  config.dropout = spec.model().dropout();
  config.stochastic_depth = spec.model().stochastic_depth();
  return config;
}

engine::GptConfig GptConfigOf(const v1::JobSpec& spec) {
  const v1::ModelSpec& m = spec.model();
  engine::GptConfig config;
  config.n_layer = m.n_layer();
  config.n_head = m.n_head();
  config.n_embd = m.n_embd();
  config.block_size = m.block_size();
  config.vocab_size = m.vocab_size();
  config.dropout = m.dropout();
  config.stochastic_depth = m.stochastic_depth();
  config.bias = !m.has_bias() || m.bias();
  return config;
}

engine::OptimizerConfig OptimizerConfigOf(const v1::JobSpec& spec) {
  const v1::OptimizerSpec& o = spec.optimizer();
  engine::OptimizerConfig config;
  config.name = o.name();
  config.lr = o.lr();
  config.momentum = o.momentum();
  config.nesterov = o.nesterov();
  config.weight_decay = o.weight_decay();
  config.beta1 = o.beta1();
  config.beta2 = o.beta2();
  config.eps = o.eps();
  config.grad_clip_norm = o.grad_clip_norm();
  return config;
}

engine::LrScheduleConfig ScheduleOf(const v1::JobSpec& spec) {
  const v1::LrScheduleSpec& s = spec.lr_schedule();
  engine::LrScheduleConfig config;
  switch (s.kind()) {
    case v1::LrScheduleSpec::STEP:
      config.kind = engine::LrScheduleConfig::Kind::kStep;
      break;
    case v1::LrScheduleSpec::COSINE:
      config.kind = engine::LrScheduleConfig::Kind::kCosine;
      break;
    default:
      config.kind = engine::LrScheduleConfig::Kind::kConstant;
  }
  config.warmup_steps = s.warmup_steps();
  config.step_size = s.step_size();
  config.gamma = s.gamma();
  config.min_lr = s.min_lr();
  return config;
}

double BucketMbOf(const v1::JobSpec& spec) {
  return spec.has_bucket_mb() ? spec.bucket_mb() : 25.0;
}

std::optional<engine::PowerSgdOptions> PowerSgdOf(const v1::JobSpec& spec) {
  const v1::DdpSpec& d = spec.ddp();
  if (d.compression() != v1::DdpSpec::POWERSGD) return std::nullopt;
  engine::PowerSgdOptions o;
  o.rank = std::max(1, d.powersgd_rank());
  o.start_step = d.has_powersgd_start_step() ? d.powersgd_start_step() : 1000;
  o.error_feedback = !d.has_powersgd_error_feedback() || d.powersgd_error_feedback();
  o.warm_start = !d.has_powersgd_warm_start() || d.powersgd_warm_start();
  o.seed = spec.seed();
  return o;
}

std::optional<engine::HalfFormat> HalfCompressionOf(const v1::JobSpec& spec) {
  switch (spec.ddp().compression()) {
    case v1::DdpSpec::FP16:
      return engine::HalfFormat::kFp16;
    case v1::DdpSpec::BF16:
      return engine::HalfFormat::kBf16;
    default:
      return std::nullopt;
  }
}

engine::Sharding ShardingOf(const v1::JobSpec& spec) {
  switch (spec.strategy()) {
    case v1::JobSpec::ZERO1:
      return engine::Sharding::kOptimizer;
    case v1::JobSpec::ZERO2:
      return engine::Sharding::kGradients;
    case v1::JobSpec::FSDP:
      return spec.fsdp().sharding() == v1::FsdpSpec::SHARD_GRAD_OP ? engine::Sharding::kShardGradOp
                                                                   : engine::Sharding::kFullShard;
    default:
      return engine::Sharding::kNone;
  }
}

milliseconds PeerTimeoutOf(const v1::JobSpec& spec) {
  const google::protobuf::Duration& d = spec.timeouts().rendezvous();
  return std::max(milliseconds(30'000), milliseconds(d.seconds() * 1000 + d.nanos() / 1'000'000));
}

engine::CpuTransport CpuTransportOf(const v1::JobSpec& spec) {
  switch (spec.comm_backend()) {
    case v1::JobSpec::GLOO:
      return engine::CpuTransport::kGloo;
    case v1::JobSpec::SHM:
      return engine::CpuTransport::kShm;
    default:
      return engine::CpuTransport::kAuto;
  }
}

engine::GpuSessionOptions GpuSessionOptionsOf(const v1::JobSpec& spec, int rank, int world_size) {
  engine::GpuSessionOptions o;
  o.rank = rank;
  o.world_size = world_size;
  o.allow_tf32 = spec.allow_tf32();
  o.fast_convolutions = spec.fast_convolutions();
  o.timeout = PeerTimeoutOf(spec);
  o.bucket_mb = BucketMbOf(spec);
  o.cuda_graphs = spec.cuda_graphs();
  o.compression = HalfCompressionOf(spec);
  o.powersgd = PowerSgdOf(spec);
  o.broadcast_buffers = !spec.ddp().has_broadcast_buffers() || spec.ddp().broadcast_buffers();
  o.sync_batchnorm = spec.ddp().sync_batchnorm();
  o.find_unused_parameters = spec.ddp().find_unused_parameters();
  // ZeRO-2 and FSDP have no ddp: block: a model that skips blocks has its
  // unused parameters left alone as DDP's find_unused_parameters does.
  if (spec.strategy() == v1::JobSpec::ZERO2 || spec.strategy() == v1::JobSpec::FSDP) {
    o.find_unused_parameters = spec.model().stochastic_depth() > 0;
  }
  if (spec.strategy() == v1::JobSpec::FSDP) {
    if (spec.fsdp().param_dtype() == v1::JobSpec::BF16) {
      o.fsdp_param_half = engine::HalfFormat::kBf16;
    }
    if (spec.fsdp().reduce_dtype() == v1::JobSpec::BF16) {
      o.fsdp_reduce_half = engine::HalfFormat::kBf16;
    }
  }
  switch (spec.precision()) {
    case v1::JobSpec::BF16:
      o.precision = "bf16";
      break;
    case v1::JobSpec::FP16:
      o.precision = "fp16";
      break;
    default:
      o.precision = "fp32";
      break;
  }
  return o;
}

absl::Status LoadData(const v1::DatasetSpec& spec, const std::string& cache_dir,
                      engine::Dataset* train, engine::Dataset* test) {
  // Through the cache when there is one; an error is reported from the
  // files the spec names.
  auto load = [&cache_dir](const std::string& images, const std::string& labels) {
    if (!cache_dir.empty()) {
      absl::StatusOr<engine::Dataset> cached = engine::LoadIdx(
          engine::DecompressedPath(images, cache_dir), engine::DecompressedPath(labels, cache_dir),
          engine::kFashionMnistMean, engine::kFashionMnistStd);
      if (cached.ok()) return cached;
    }
    return engine::LoadIdx(images, labels, engine::kFashionMnistMean, engine::kFashionMnistStd);
  };
  absl::StatusOr<engine::Dataset> tr, te;
  if (spec.kind() == "idx") {
    tr = load(spec.train_images(), spec.train_labels());
    if (tr.ok()) te = load(spec.test_images(), spec.test_labels());
  } else {
    tr = engine::LoadFashionMnist(spec.dir(), /*train=*/true, cache_dir);
    if (tr.ok()) te = engine::LoadFashionMnist(spec.dir(), /*train=*/false, cache_dir);
  }
  if (!tr.ok()) return tr.status();
  if (!te.ok()) return te.status();
  *train = *std::move(tr);
  *test = *std::move(te);
  return absl::OkStatus();
}

std::string CheckpointDirOf(const v1::JobSpec& spec, const TrainerOptions& options) {
  const std::string& dir = spec.checkpoint().dir();
  if (dir.empty()) return "";
  std::filesystem::path path(dir);
  if (path.is_relative()) {
    path = std::filesystem::path(options.checkpoint_root.empty() ? options.work_dir
                                                                 : options.checkpoint_root) /
           path;
  }
  return (path / options.job_id).lexically_normal().string();
}

}  // namespace aidn::trainer
