#include "coordinator/spec.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/job_spec_limits.h"
#include "common/status.h"
#include "coordinator/command_spec.h"
#include "coordinator/gpt_spec.h"
#include "coordinator/parallel_spec.h"
#include "coordinator/spec_checks.h"

namespace aidn::coordinator {
namespace {

constexpr char kFashionMnist[] = "fashion-mnist";
constexpr char kIdx[] = "idx";
constexpr char kDefaultFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";
constexpr char kSgd[] = "sgd";
constexpr char kAdamW[] = "adamw";
constexpr char kMlp[] = "mlp";
constexpr char kCnn[] = "cnn";

bool IsResNet(const std::string& name) { return name == "resnet18" || name == "resnet50"; }

// Sizes aidnctl checks too, before it sends a spec.
using job_spec_limits::kMaxLabelKeyBytes;
using job_spec_limits::kMaxLabels;
using job_spec_limits::kMaxLabelValueBytes;
using job_spec_limits::kMaxNameBytes;
using job_spec_limits::kMaxPathBytes;
constexpr int32_t kMaxThreadsPerRank = 256;
constexpr int kMaxHiddenLayers = 16;
constexpr int32_t kMaxHiddenSize = 65536;
constexpr double kMaxLr = 10.0;
constexpr int64_t kMaxWarmupSteps = 1'000'000'000;
constexpr int32_t kMaxBatchSize = 65536;
constexpr int32_t kMaxEpochs = 100'000;
constexpr int64_t kMaxSteps = 1'000'000'000'000;
constexpr double kMaxBucketMb = 1024.0;
constexpr int32_t kMaxGradAccumSteps = 1024;
constexpr int32_t kMaxKeepLast = 1000;
constexpr int32_t kMaxRestarts = 100;
constexpr int32_t kMaxPriority = 1000;
constexpr int64_t kMaxTimeoutSeconds = 24 * 60 * 60;
// A longer wait between restarts only hides a job that cannot run.
constexpr int64_t kMaxRestartBackoffSeconds = 5 * 60;
constexpr std::chrono::milliseconds kDefaultRestartBackoff{1000};

google::protobuf::Duration ToDuration(std::chrono::milliseconds ms) {
  google::protobuf::Duration d;
  d.set_seconds(ms.count() / 1000);
  d.set_nanos(static_cast<int32_t>((ms.count() % 1000) * 1'000'000));
  return d;
}

absl::Status CheckNonNegativeReal(absl::string_view field, double v) {
  if (!std::isfinite(v) || v < 0) {
    return Invalid(field, absl::StrCat("must be a finite number >= 0, got ", v));
  }
  return absl::OkStatus();
}

// Decodes one UTF-8 code point at s[*i], advancing *i; false on malformed
// input (overlong forms, surrogates and values past U+10FFFF included).
bool NextCodePoint(absl::string_view s, size_t* i, uint32_t* cp) {
  auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char b0 = byte(*i);
  int extra;
  uint32_t min;
  if (b0 < 0x80) {
    *cp = b0;
    *i += 1;
    return true;
  } else if ((b0 & 0xE0) == 0xC0) {
    extra = 1, *cp = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    extra = 2, *cp = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    extra = 3, *cp = b0 & 0x07, min = 0x10000;
  } else {
    return false;
  }
  if (*i + extra >= s.size()) return false;
  for (int k = 1; k <= extra; ++k) {
    unsigned char b = byte(*i + k);
    if ((b & 0xC0) != 0x80) return false;
    *cp = (*cp << 6) | (b & 0x3F);
  }
  if (*cp < min || *cp > 0x10FFFF || (*cp >= 0xD800 && *cp <= 0xDFFF)) return false;
  *i += extra + 1;
  return true;
}

// Well-formed UTF-8 without C0, DEL or C1 control characters.
absl::Status CheckText(absl::string_view field, absl::string_view s, size_t max_bytes) {
  if (s.size() > max_bytes) {
    return Invalid(field, absl::StrCat("must be at most ", max_bytes, " bytes, got ", s.size()));
  }
  size_t i = 0;
  while (i < s.size()) {
    uint32_t cp = 0;
    if (!NextCodePoint(s, &i, &cp)) return Invalid(field, "must be valid UTF-8");
    if (cp < 0x20 || (cp >= 0x7F && cp <= 0x9F)) {
      return Invalid(field, absl::StrCat("must not contain control characters, got ", Quote(s)));
    }
  }
  return absl::OkStatus();
}

// The name of an enum value for messages, or its number when it has none.
template <typename NameFn>
std::string EnumName(NameFn name_fn, int value) {
  std::string name = name_fn(value);
  return name.empty() ? absl::StrCat(value) : name;
}

absl::Status ValidateModel(const v1::ModelSpec& model) {
  if (model.stochastic_depth() != 0) {
    if (!IsResNet(model.name()) && model.name() != kGptModel) {
      return Invalid("model.stochastic_depth", "applies to resnet18, resnet50 and gpt only");
    }
    AIDN_RETURN_IF_ERROR(CheckRealRange("model.stochastic_depth", model.stochastic_depth(), 0, 1,
                                        /*hi_inclusive=*/false));
  }
  if (model.name().empty()) {
    return Invalid("model.name", "required (known: mlp, cnn, resnet18, resnet50, gpt)");
  }
  if (model.name() == kGptModel) return absl::OkStatus();  // ValidateGptModel
  if (model.name() == kMlp) {
    int n = model.hidden_sizes_size();
    if (n < 1 || n > kMaxHiddenLayers) {
      return Invalid("model.hidden_sizes",
                     absl::StrCat("mlp needs 1 to ", kMaxHiddenLayers, " hidden layers, got ", n));
    }
    for (int i = 0; i < n; ++i) {
      AIDN_RETURN_IF_ERROR(CheckIntRange(absl::StrCat("model.hidden_sizes[", i, "]"),
                                         model.hidden_sizes(i), 1, kMaxHiddenSize));
    }
  } else if (model.name() == kCnn || IsResNet(model.name())) {
    if (model.hidden_sizes_size() != 0) {
      return Invalid("model.hidden_sizes",
                     absl::StrCat("must be empty for ", model.name(), " (its layers are fixed)"));
    }
    if (IsResNet(model.name()) && model.dropout() != 0) {
      return Invalid("model.dropout", absl::StrCat(model.name(), " has no dropout"));
    }
  } else {
    return Invalid("model.name", absl::StrCat("unknown model ", Quote(model.name()),
                                              " (known: mlp, cnn, resnet18, resnet50, gpt)"));
  }
  return CheckRealRange("model.dropout", model.dropout(), 0, 1, /*hi_inclusive=*/false);
}

absl::Status ValidateDataset(const v1::DatasetSpec& dataset) {
  struct PathField {
    const char* field;
    const std::string& value;
  };
  const PathField idx_files[] = {
      {"dataset.train_images", dataset.train_images()},
      {"dataset.train_labels", dataset.train_labels()},
      {"dataset.test_images", dataset.test_images()},
      {"dataset.test_labels", dataset.test_labels()},
  };
  if (dataset.kind() == kFashionMnist) {
    AIDN_RETURN_IF_ERROR(ValidateSpecPath("dataset.dir", dataset.dir()));
    // Files named one by one would be silently ignored: refuse them.
    for (const PathField& f : idx_files) {
      if (!f.value.empty()) return Invalid(f.field, "only applies to dataset.kind \"idx\"");
    }
  } else if (dataset.kind() == kIdx) {
    if (!dataset.dir().empty()) {
      return Invalid("dataset.dir",
                     "only applies to dataset.kind \"fashion-mnist\" (idx names each file)");
    }
    for (const PathField& f : idx_files) {
      if (f.value.empty()) return Invalid(f.field, "required when dataset.kind is \"idx\"");
      AIDN_RETURN_IF_ERROR(ValidateSpecPath(f.field, f.value));
    }
  } else if (dataset.kind() == kTextDataset) {
    return absl::OkStatus();  // ValidateTextDataset
  } else if (dataset.kind().empty()) {
    return Invalid("dataset.kind", "required (known: fashion-mnist, idx, text)");
  } else {
    return Invalid("dataset.kind", absl::StrCat("unknown dataset kind ", Quote(dataset.kind()),
                                                " (known: fashion-mnist, idx, text)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptimizer(const v1::OptimizerSpec& opt) {
  bool sgd = opt.name() == kSgd;
  bool adamw = opt.name() == kAdamW;
  if (!sgd && !adamw) {
    if (opt.name().empty()) return Invalid("optimizer.name", "required (known: sgd, adamw)");
    return Invalid("optimizer.name",
                   absl::StrCat("unknown optimizer ", Quote(opt.name()), " (known: sgd, adamw)"));
  }
  if (!opt.has_lr()) return Invalid("optimizer.lr", "not set (defaults were not applied)");
  if (!std::isfinite(opt.lr()) || opt.lr() <= 0) {
    return Invalid("optimizer.lr", absl::StrCat("must be a finite number > 0, got ", opt.lr()));
  }
  if (opt.lr() > kMaxLr) {
    return Invalid("optimizer.lr", absl::StrCat("must be at most ", kMaxLr, ", got ", opt.lr()));
  }
  if (!opt.has_weight_decay()) {
    return Invalid("optimizer.weight_decay", "not set (defaults were not applied)");
  }
  AIDN_RETURN_IF_ERROR(
      CheckRealRange("optimizer.weight_decay", opt.weight_decay(), 0, 1, /*hi_inclusive=*/true));
  AIDN_RETURN_IF_ERROR(CheckNonNegativeReal("optimizer.grad_clip_norm", opt.grad_clip_norm()));
  if (sgd) {
    AIDN_RETURN_IF_ERROR(
        CheckRealRange("optimizer.momentum", opt.momentum(), 0, 1, /*hi_inclusive=*/false));
    // PyTorch's rule: Nesterov momentum needs momentum > 0 (and dampening 0,
    // which aidn always uses).
    if (opt.nesterov() && opt.momentum() <= 0) {
      return Invalid("optimizer.nesterov", "requires optimizer.momentum > 0");
    }
    // AdamW's knobs on an SGD spec are almost certainly a mistake.
    if (opt.beta1() != 0) return Invalid("optimizer.beta1", "only applies to adamw");
    if (opt.beta2() != 0) return Invalid("optimizer.beta2", "only applies to adamw");
    if (opt.eps() != 0) return Invalid("optimizer.eps", "only applies to adamw");
  } else {
    if (opt.momentum() != 0) {
      return Invalid("optimizer.momentum", "only applies to sgd (adamw uses beta1)");
    }
    if (opt.nesterov()) return Invalid("optimizer.nesterov", "only applies to sgd");
    AIDN_RETURN_IF_ERROR(
        CheckRealRange("optimizer.beta1", opt.beta1(), 0, 1, /*hi_inclusive=*/false));
    AIDN_RETURN_IF_ERROR(
        CheckRealRange("optimizer.beta2", opt.beta2(), 0, 1, /*hi_inclusive=*/false));
    if (!std::isfinite(opt.eps()) || opt.eps() <= 0) {
      return Invalid("optimizer.eps", absl::StrCat("must be a finite number > 0, got ", opt.eps()));
    }
  }
  return absl::OkStatus();
}

// Runs after ValidateOptimizer, so lr is known to be valid.
absl::Status ValidateLrSchedule(const v1::LrScheduleSpec& s, double lr) {
  using Spec = v1::LrScheduleSpec;
  AIDN_RETURN_IF_ERROR(
      CheckIntRange("lr_schedule.warmup_steps", s.warmup_steps(), 0, kMaxWarmupSteps));
  switch (s.kind()) {
    case Spec::CONSTANT:
      break;
    case Spec::STEP:
      if (s.step_size() <= 0) {
        return Invalid("lr_schedule.step_size",
                       absl::StrCat("must be > 0 for kind step, got ", s.step_size()));
      }
      if (!std::isfinite(s.gamma()) || s.gamma() <= 0 || s.gamma() > 1) {
        return Invalid("lr_schedule.gamma",
                       absl::StrCat("must be a finite number in (0, 1], got ", s.gamma()));
      }
      break;
    case Spec::COSINE:
      if (!std::isfinite(s.min_lr()) || s.min_lr() < 0 || s.min_lr() > lr) {
        return Invalid("lr_schedule.min_lr",
                       absl::StrCat("must be a finite number in [0, optimizer.lr = ", lr, "], got ",
                                    s.min_lr()));
      }
      break;
    case Spec::KIND_UNSPECIFIED:
      return Invalid("lr_schedule.kind", "not set (defaults were not applied)");
    default:
      return Invalid("lr_schedule.kind", absl::StrCat("unknown value ", static_cast<int>(s.kind()),
                                                      " (known: constant, step, cosine)"));
  }
  // Knobs of another kind would be silently ignored: refuse them.
  if (s.kind() != Spec::STEP) {
    if (s.step_size() != 0) return Invalid("lr_schedule.step_size", "only applies to kind step");
    if (s.gamma() != 0) return Invalid("lr_schedule.gamma", "only applies to kind step");
  }
  if (s.kind() != Spec::COSINE && s.min_lr() != 0) {
    return Invalid("lr_schedule.min_lr", "only applies to kind cosine");
  }
  return absl::OkStatus();
}

absl::Status ValidateCheckpoint(const v1::CheckpointSpec& c) {
  if (!c.dir().empty()) AIDN_RETURN_IF_ERROR(ValidateSpecPath("checkpoint.dir", c.dir()));
  if (c.every_steps() < 0) {
    return Invalid("checkpoint.every_steps", absl::StrCat("must be >= 0, got ", c.every_steps()));
  }
  if (c.every_steps() > 0 && c.dir().empty()) {
    return Invalid("checkpoint.every_steps", "needs checkpoint.dir (empty: no checkpoints)");
  }
  if (c.has_resume_from()) {
    if (c.resume_from().job().empty()) {
      return Invalid("checkpoint.resume_from.job",
                     "must name the job whose checkpoint to start from");
    }
    AIDN_RETURN_IF_ERROR(
        CheckText("checkpoint.resume_from.job", c.resume_from().job(), kMaxNameBytes));
    if (c.resume_from().step() < 0) {
      return Invalid("checkpoint.resume_from.step",
                     absl::StrCat("must be >= 0 (0: the newest), got ", c.resume_from().step()));
    }
  }
  return CheckIntRange("checkpoint.keep_last", c.keep_last(), 1, kMaxKeepLast);
}

// "90s", "0.000000001s", "-5s".
std::string FormatDuration(const google::protobuf::Duration& d) {
  if (d.nanos() == 0) return absl::StrCat(d.seconds(), "s");
  return absl::StrFormat("%d.%09ds", d.seconds(), d.nanos());
}

absl::Status ValidateTimeout(absl::string_view field, const google::protobuf::Duration& d) {
  if (d.nanos() < 0 || d.nanos() > 999'999'999) {
    return Invalid(field, absl::StrCat("nanos must be in [0, 999999999], got ", d.nanos()));
  }
  if (d.seconds() < 0 || (d.seconds() == 0 && d.nanos() == 0)) {
    return Invalid(field, absl::StrCat("must be > 0, got ", FormatDuration(d)));
  }
  if (d.seconds() > kMaxTimeoutSeconds || (d.seconds() == kMaxTimeoutSeconds && d.nanos() > 0)) {
    return Invalid(field, absl::StrCat("must be at most 24h (86400s), got ", FormatDuration(d)));
  }
  return absl::OkStatus();
}

absl::Status ValidateTimeouts(const v1::TimeoutsSpec& t) {
  if (!t.has_rendezvous()) {
    return Invalid("timeouts.rendezvous", "not set (defaults were not applied)");
  }
  AIDN_RETURN_IF_ERROR(ValidateTimeout("timeouts.rendezvous", t.rendezvous()));
  if (!t.has_worker()) return Invalid("timeouts.worker", "not set (defaults were not applied)");
  AIDN_RETURN_IF_ERROR(ValidateTimeout("timeouts.worker", t.worker()));
  // progress left unset means "automatic".
  if (t.has_progress()) AIDN_RETURN_IF_ERROR(ValidateTimeout("timeouts.progress", t.progress()));
  if (!t.has_restart_backoff()) {
    return Invalid("timeouts.restart_backoff", "not set (defaults were not applied)");
  }
  const google::protobuf::Duration& b = t.restart_backoff();
  if (b.seconds() > kMaxRestartBackoffSeconds ||
      (b.seconds() == kMaxRestartBackoffSeconds && b.nanos() > 0)) {
    return Invalid("timeouts.restart_backoff",
                   absl::StrCat("must be at most 5m (300s), got ", FormatDuration(b)));
  }
  return ValidateTimeout("timeouts.restart_backoff", b);
}

bool IsLabelKeyChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '/' || c == '-';
}

absl::Status ValidateLabels(const google::protobuf::Map<std::string, std::string>& labels) {
  if (labels.size() > kMaxLabels) {
    return Invalid("labels", absl::StrCat("at most ", kMaxLabels, " labels, got ", labels.size()));
  }
  // Map order is unspecified; sort so the same spec always reports the same
  // label.
  std::vector<std::pair<std::string, std::string>> sorted(labels.begin(), labels.end());
  std::sort(sorted.begin(), sorted.end());
  for (const auto& [key, value] : sorted) {
    if (key.empty() || key.size() > kMaxLabelKeyBytes ||
        !std::all_of(key.begin(), key.end(), IsLabelKeyChar)) {
      return Invalid("labels",
                     absl::StrCat("key ", Quote(key), " must match [a-zA-Z0-9._/-]{1,63}"));
    }
    absl::Status s = CheckText("value", value, kMaxLabelValueBytes);
    if (!s.ok()) return Invalid("labels", absl::StrCat("key ", Quote(key), ": ", s.message()));
  }
  return absl::OkStatus();
}

// world_size, device and threads_per_rank: where and on what the ranks run.
absl::Status ValidatePlacement(const SpecLimits& limits, const v1::JobSpec& spec) {
  using v1::JobSpec;
  AIDN_RETURN_IF_ERROR(CheckIntRange("world_size", spec.world_size(), 1, limits.max_world_size));
  switch (spec.device()) {
    case JobSpec::CPU:
    case JobSpec::GPU:
      break;
    case JobSpec::DEVICE_UNSPECIFIED:
      return Invalid("device", "not set (defaults were not applied)");
    default:
      return Invalid("device", absl::StrCat("unknown value ", static_cast<int>(spec.device()),
                                            " (known: cpu, gpu)"));
  }
  return CheckIntRange("threads_per_rank", spec.threads_per_rank(), 1, kMaxThreadsPerRank);
}

// batch_size, epochs and max_steps: how much training there is.
absl::Status ValidateLength(const v1::JobSpec& spec) {
  AIDN_RETURN_IF_ERROR(CheckIntRange("batch_size", spec.batch_size(), 1, kMaxBatchSize));
  AIDN_RETURN_IF_ERROR(CheckIntRange("epochs", spec.epochs(), 0, kMaxEpochs));
  AIDN_RETURN_IF_ERROR(CheckIntRange("max_steps", spec.max_steps(), 0, kMaxSteps));
  AIDN_RETURN_IF_ERROR(CheckIntRange("eval_every_steps", spec.eval_every_steps(), 0, kMaxSteps));
  AIDN_RETURN_IF_ERROR(
      CheckIntRange("eval_max_samples", spec.eval_max_samples(), 0, int64_t{1} << 40));
  AIDN_RETURN_IF_ERROR(CheckText("scaling_baseline", spec.scaling_baseline(), 64));
  if (spec.eval_max_samples() != 0 && spec.model().name() == kGptModel) {
    return Invalid("eval_max_samples", "applies to image models (gpt: dataset.eval_windows)");
  }
  if (spec.epochs() == 0 && spec.max_steps() == 0) {
    return Invalid("epochs", "one of epochs and max_steps must be > 0");
  }
  return absl::OkStatus();
}

// strategy, bucket_mb and grad_accum_steps: how gradients are combined.
absl::Status ValidateParallelism(const v1::JobSpec& spec) {
  using v1::JobSpec;
  switch (spec.strategy()) {
    case JobSpec::DDP:
      break;
    case JobSpec::ZERO1:
      break;
    case JobSpec::ZERO2:
    case JobSpec::FSDP:
      break;
    case JobSpec::STRATEGY_UNSPECIFIED:
      return Invalid("strategy", "not set (defaults were not applied)");
    default:
      return Invalid("strategy", absl::StrCat("unknown value ", static_cast<int>(spec.strategy()),
                                              " (known: ddp, zero1, zero2, fsdp)"));
  }
  if (spec.has_fsdp() && spec.strategy() != JobSpec::FSDP) {
    return Invalid("fsdp", absl::StrCat("applies to strategy: fsdp only (this job's is ",
                                        JobSpec::Strategy_Name(spec.strategy()), ")"));
  }
  if (spec.strategy() == JobSpec::FSDP) {
    const v1::FsdpSpec::Sharding sharding = spec.fsdp().sharding();
    if (sharding != v1::FsdpSpec::FULL_SHARD && sharding != v1::FsdpSpec::SHARD_GRAD_OP) {
      return Invalid("fsdp.sharding", absl::StrCat("unknown value ", static_cast<int>(sharding),
                                                   " (known: full_shard, shard_grad_op)"));
    }
    for (const auto& [field, dtype] :
         {std::pair{"fsdp.param_dtype", spec.fsdp().param_dtype()},
          std::pair{"fsdp.reduce_dtype", spec.fsdp().reduce_dtype()}}) {
      if (dtype == JobSpec::PRECISION_UNSPECIFIED || dtype == JobSpec::FP32) continue;
      if (dtype != JobSpec::BF16) {
        return Invalid(field, absl::StrCat(JobSpec::Precision_Name(dtype),
                                           " is not offered (known: fp32, bf16)"));
      }
      if (spec.device() != JobSpec::GPU) {
        return Invalid(field, "BF16 is for device: gpu (CPU jobs gather and reduce in fp32)");
      }
    }
  }
  if (!spec.has_bucket_mb()) return Invalid("bucket_mb", "not set (defaults were not applied)");
  if (!std::isfinite(spec.bucket_mb()) || spec.bucket_mb() <= 0 ||
      spec.bucket_mb() > kMaxBucketMb) {
    return Invalid("bucket_mb",
                   absl::StrCat("must be a finite number in (0, 1024], got ", spec.bucket_mb()));
  }
  return CheckIntRange("grad_accum_steps", spec.grad_accum_steps(), 1, kMaxGradAccumSteps);
}

// ddp: gradient compression.
absl::Status ValidateDdp(const v1::JobSpec& spec) {
  using v1::DdpSpec;
  if (!spec.has_ddp()) return absl::OkStatus();
  const DdpSpec& d = spec.ddp();
  // ZeRO-1 is DDP with a sharded optimizer (torch: DDP with
  // ZeroRedundancyOptimizer): buffers and unused parameters work alike.
  const bool zero1 = spec.strategy() == v1::JobSpec::ZERO1;
  if (spec.strategy() != v1::JobSpec::DDP && !zero1) {
    return Invalid("ddp", absl::StrCat("applies to strategies ddp and zero1 only (this job's is ",
                                       v1::JobSpec::Strategy_Name(spec.strategy()), ")"));
  }
  switch (d.compression()) {
    case DdpSpec::NONE:
      if (d.powersgd_rank() != 0 || d.has_powersgd_start_step() ||
          d.has_powersgd_error_feedback() || d.has_powersgd_warm_start()) {
        return Invalid("ddp", "the powersgd_ fields apply to compression: powersgd only");
      }
      return absl::OkStatus();
    case DdpSpec::POWERSGD:
    case DdpSpec::FP16:
    case DdpSpec::BF16:
      break;
    case DdpSpec::COMPRESSION_UNSPECIFIED:
      return Invalid("ddp.compression", "not set (defaults were not applied)");
    default:
      return Invalid("ddp.compression",
                     absl::StrCat("unknown value ", static_cast<int>(d.compression()),
                                  " (known: none, powersgd, fp16, bf16)"));
  }
  const std::string name = absl::AsciiStrToLower(DdpSpec::Compression_Name(d.compression()));
  if (zero1) {
    return Invalid("ddp.compression",
                   absl::StrCat(name,
                                " compresses allreduced buckets; strategy "
                                "zero1 reduce-scatters them (use strategy: ddp)"));
  }
  if (d.compression() == DdpSpec::POWERSGD && spec.precision() == v1::JobSpec::FP16) {
    // The loss-scaled gradients of a step that overflowed would leave the
    // error feedback non-finite for good.
    return Invalid("ddp.compression",
                   "powersgd does not go with precision: fp16 (use bf16 or fp32); an overflowed "
                   "step would poison its error feedback");
  }
  if (spec.parallel().tensor() > 1 || spec.parallel().pipeline() > 1) {
    return Invalid("ddp.compression", absl::StrCat(name, " does not combine with parallel: yet"));
  }
  if (d.compression() != DdpSpec::POWERSGD) {
    if (d.powersgd_rank() != 0 || d.has_powersgd_start_step() || d.has_powersgd_error_feedback() ||
        d.has_powersgd_warm_start()) {
      return Invalid("ddp", "the powersgd_ fields apply to compression: powersgd only");
    }
    return absl::OkStatus();
  }
  AIDN_RETURN_IF_ERROR(CheckIntRange("ddp.powersgd_rank", d.powersgd_rank(), 1, 1024));
  return CheckIntRange("ddp.powersgd_start_step", d.powersgd_start_step(), 0, kMaxSteps);
}

// Skipped blocks leave parameters without gradients: DDP's and ZeRO-1's
// find_unused_parameters cope, ZeRO-2 and FSDP reduce-scatter zeros for
// them; the model-parallel schedules do not yet.
absl::Status ValidateStochasticDepth(const v1::JobSpec& spec) {
  if (spec.model().stochastic_depth() <= 0) return absl::OkStatus();
  if (spec.parallel().tensor() > 1 || spec.parallel().pipeline() > 1) {
    return Invalid("model.stochastic_depth", "does not combine with parallel: yet");
  }
  return absl::OkStatus();
}

// A ResNet's BatchNorm running statistics go into DDP's checkpoints (rank
// 0 writes the whole model), as rank 0's whole tensors into ZeRO's and
// FSDP's sharded ones, and a pipeline stage writes its own; the GPU engine
// has BatchNorm, SyncBatchNorm and stochastic depth too.
absl::Status ValidateResNet(const v1::JobSpec& spec) {
  const std::string& name = spec.model().name();
  if (spec.ddp().sync_batchnorm()) {
    if (!IsResNet(name)) {
      return Invalid("ddp.sync_batchnorm", "applies to models with BatchNorm (resnet18, resnet50)");
    }
    if (spec.model().stochastic_depth() > 0) {
      // Each rank skips its own blocks: their BatchNorms' collectives
      // would not line up.
      return Invalid("ddp.sync_batchnorm", "does not go with model.stochastic_depth");
    }
    if (spec.parallel().pipeline() > 1) {
      // A stage's statistics would have to meet its replicas' only.
      return Invalid("ddp.sync_batchnorm", "does not combine with parallel.pipeline yet");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePrecision(const v1::JobSpec& spec) {
  using v1::JobSpec;
  switch (spec.precision()) {
    case JobSpec::FP32:
      return absl::OkStatus();
    case JobSpec::BF16:
    case JobSpec::FP16:
      if (spec.device() != JobSpec::GPU) {
        return Invalid("precision", absl::StrCat(JobSpec::Precision_Name(spec.precision()),
                                                 " is for device: gpu (CPU jobs compute in fp32)"));
      }
      return absl::OkStatus();
    case JobSpec::PRECISION_UNSPECIFIED:
      return Invalid("precision", "not set (defaults were not applied)");
    default:
      return Invalid("precision", absl::StrCat("unknown value ", static_cast<int>(spec.precision()),
                                               " (known: fp32, bf16, fp16)"));
  }
}

absl::Status ValidateCommBackend(const v1::JobSpec& spec) {
  using v1::JobSpec;
  switch (spec.comm_backend()) {
    case JobSpec::AUTO:
      return absl::OkStatus();
    case JobSpec::GLOO:
    case JobSpec::SHM:
      if (spec.device() == JobSpec::GPU) {
        return Invalid("comm_backend", absl::StrCat(JobSpec::CommBackend_Name(spec.comm_backend()),
                                                    " is for CPU jobs (GPU jobs use NCCL): "
                                                    "leave it unset or auto"));
      }
      return absl::OkStatus();
    case JobSpec::COMM_BACKEND_UNSPECIFIED:
      return Invalid("comm_backend", "not set (defaults were not applied)");
    default:
      return Invalid("comm_backend",
                     absl::StrCat("unknown value ", static_cast<int>(spec.comm_backend()),
                                  " (known: auto, gloo, shm)"));
  }
}

// allow_tf32, cuda_graphs and fast_convolutions mean something on a GPU only.
absl::Status ValidateGpuOnlySwitches(const v1::JobSpec& spec) {
  using v1::JobSpec;
  if (spec.allow_tf32() && spec.device() != JobSpec::GPU) {
    return Invalid("allow_tf32", "is for device: gpu (CPU jobs compute in fp32)");
  }
  if (spec.cuda_graphs() && spec.device() != JobSpec::GPU) {
    return Invalid("cuda_graphs", "is for device: gpu (CPU steps launch no kernels)");
  }
  if (spec.fast_convolutions() && spec.device() != JobSpec::GPU) {
    return Invalid("fast_convolutions", "is for device: gpu (cuDNN's convolution algorithms)");
  }
  return absl::OkStatus();
}

absl::Status ValidateMaxRestarts(const v1::JobSpec& spec) {
  if (!spec.has_max_restarts()) {
    return Invalid("max_restarts", "not set (defaults were not applied)");
  }
  return CheckIntRange("max_restarts", spec.max_restarts(), 0, kMaxRestarts);
}

// The built-in trainer's fields (all but those every job has).
absl::Status ValidateTrainerFields(const v1::JobSpec& spec) {
  AIDN_RETURN_IF_ERROR(ValidateModel(spec.model()));
  AIDN_RETURN_IF_ERROR(ValidateDataset(spec.dataset()));
  AIDN_RETURN_IF_ERROR(ValidateGptModel(spec));
  AIDN_RETURN_IF_ERROR(ValidateTextDataset(spec));
  AIDN_RETURN_IF_ERROR(ValidateOptimizer(spec.optimizer()));
  AIDN_RETURN_IF_ERROR(ValidateLrSchedule(spec.lr_schedule(), spec.optimizer().lr()));
  AIDN_RETURN_IF_ERROR(ValidateLength(spec));
  AIDN_RETURN_IF_ERROR(ValidateParallelism(spec));
  AIDN_RETURN_IF_ERROR(ValidateParallel(spec));
  AIDN_RETURN_IF_ERROR(ValidateDdp(spec));
  AIDN_RETURN_IF_ERROR(ValidateResNet(spec));
  AIDN_RETURN_IF_ERROR(ValidateStochasticDepth(spec));
  AIDN_RETURN_IF_ERROR(ValidatePrecision(spec));
  AIDN_RETURN_IF_ERROR(ValidateCommBackend(spec));
  return ValidateGpuOnlySwitches(spec);
}

void ApplyTrainerDefaults(v1::JobSpec* spec) {
  using v1::JobSpec;
  ApplyGptDefaults(spec);
  ApplyParallelDefaults(spec);
  v1::ModelSpec* model = spec->mutable_model();
  if (model->name() == kMlp && model->hidden_sizes_size() == 0) {
    model->add_hidden_sizes(256);
    model->add_hidden_sizes(256);
  }

  v1::DatasetSpec* dataset = spec->mutable_dataset();
  if (dataset->kind().empty()) dataset->set_kind(kFashionMnist);
  if (dataset->kind() == kFashionMnist && dataset->dir().empty()) {
    dataset->set_dir(kDefaultFashionMnistDir);
  }
  if (!dataset->has_shuffle()) dataset->set_shuffle(true);

  v1::OptimizerSpec* opt = spec->mutable_optimizer();
  if (opt->name().empty()) opt->set_name(kSgd);
  // An unknown optimizer gets no defaults: validation names it.
  if (opt->name() == kSgd) {
    if (!opt->has_lr()) opt->set_lr(0.01);
    if (!opt->has_weight_decay()) opt->set_weight_decay(0.0);
  } else if (opt->name() == kAdamW) {
    if (!opt->has_lr()) opt->set_lr(0.001);
    if (!opt->has_weight_decay()) opt->set_weight_decay(0.01);
    if (opt->beta1() == 0) opt->set_beta1(0.9);
    if (opt->beta2() == 0) opt->set_beta2(0.999);
    if (opt->eps() == 0) opt->set_eps(1e-8);
  }

  v1::LrScheduleSpec* schedule = spec->mutable_lr_schedule();
  if (schedule->kind() == v1::LrScheduleSpec::KIND_UNSPECIFIED) {
    schedule->set_kind(v1::LrScheduleSpec::CONSTANT);
  }
  if (schedule->kind() == v1::LrScheduleSpec::STEP && schedule->gamma() == 0) {
    schedule->set_gamma(0.1);
  }

  if (spec->batch_size() == 0) spec->set_batch_size(64);
  if (spec->epochs() == 0 && spec->max_steps() == 0) spec->set_epochs(1);
  if (spec->strategy() == JobSpec::STRATEGY_UNSPECIFIED) spec->set_strategy(JobSpec::DDP);
  if (spec->strategy() == JobSpec::FSDP &&
      spec->fsdp().sharding() == v1::FsdpSpec::SHARDING_UNSPECIFIED) {
    spec->mutable_fsdp()->set_sharding(v1::FsdpSpec::FULL_SHARD);
  }
  if (!spec->has_bucket_mb()) spec->set_bucket_mb(25.0);
  if (spec->has_ddp()) {
    v1::DdpSpec* d = spec->mutable_ddp();
    if (d->compression() == v1::DdpSpec::COMPRESSION_UNSPECIFIED) {
      d->set_compression(v1::DdpSpec::NONE);
    }
    if (!d->has_broadcast_buffers()) d->set_broadcast_buffers(true);
    if (d->compression() == v1::DdpSpec::POWERSGD) {
      if (d->powersgd_rank() == 0) d->set_powersgd_rank(1);
      if (!d->has_powersgd_start_step()) d->set_powersgd_start_step(1000);
      if (!d->has_powersgd_error_feedback()) d->set_powersgd_error_feedback(true);
      if (!d->has_powersgd_warm_start()) d->set_powersgd_warm_start(true);
    }
  }
  if (spec->grad_accum_steps() == 0) spec->set_grad_accum_steps(1);
  if (spec->precision() == JobSpec::PRECISION_UNSPECIFIED) spec->set_precision(JobSpec::FP32);
  if (spec->comm_backend() == JobSpec::COMM_BACKEND_UNSPECIFIED) {
    spec->set_comm_backend(JobSpec::AUTO);
  }
}

}  // namespace

void ApplyJobSpecDefaults(const SpecLimits& limits, v1::JobSpec* spec) {
  using v1::JobSpec;
  if (spec->device() == JobSpec::DEVICE_UNSPECIFIED) spec->set_device(JobSpec::CPU);
  if (spec->threads_per_rank() == 0) spec->set_threads_per_rank(1);
  if (spec->has_command()) {
    ApplyCommandDefaults(spec);
  } else {
    ApplyTrainerDefaults(spec);
  }

  if (spec->checkpoint().keep_last() == 0) spec->mutable_checkpoint()->set_keep_last(3);
  if (!spec->has_max_restarts()) spec->set_max_restarts(limits.default_max_restarts);

  v1::TimeoutsSpec* timeouts = spec->mutable_timeouts();
  if (!timeouts->has_rendezvous()) {
    *timeouts->mutable_rendezvous() = ToDuration(limits.default_rendezvous_timeout);
  }
  if (!timeouts->has_worker())
    *timeouts->mutable_worker() = ToDuration(limits.default_worker_timeout);
  if (!timeouts->has_restart_backoff()) {
    *timeouts->mutable_restart_backoff() = ToDuration(kDefaultRestartBackoff);
  }
}

// Reports the first problem, checking in a fixed order, so a spec with several
// problems always gets the same one.
absl::Status ValidateJobSpec(const SpecLimits& limits, const v1::JobSpec& spec) {
  AIDN_RETURN_IF_ERROR(CheckText("name", spec.name(), kMaxNameBytes));
  AIDN_RETURN_IF_ERROR(ValidatePlacement(limits, spec));
  if (spec.has_command()) {
    AIDN_RETURN_IF_ERROR(ValidateCommandSpec(spec));
    if (spec.checkpoint().has_resume_from()) {
      return Invalid("checkpoint.resume_from",
                     "applies to model jobs; a command job's program loads its own checkpoints");
    }
  } else {
    AIDN_RETURN_IF_ERROR(ValidateTrainerFields(spec));
  }
  AIDN_RETURN_IF_ERROR(ValidateCheckpoint(spec.checkpoint()));
  AIDN_RETURN_IF_ERROR(ValidateMaxRestarts(spec));
  AIDN_RETURN_IF_ERROR(ValidateTimeouts(spec.timeouts()));
  AIDN_RETURN_IF_ERROR(CheckIntRange("priority", spec.priority(), -kMaxPriority, kMaxPriority));
  return ValidateLabels(spec.labels());
}

absl::Status ValidateSpecPath(const char* field, const std::string& path) {
  if (path.empty()) return Invalid(field, "path must not be empty");
  if (path.size() > kMaxPathBytes) {
    return Invalid(
        field, absl::StrCat("path must be at most ", kMaxPathBytes, " bytes, got ", path.size()));
  }
  for (char c : path) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7F) {
      return Invalid(field,
                     absl::StrCat("path must not contain control characters, got ", Quote(path)));
    }
  }
  for (absl::string_view component : absl::StrSplit(path, '/')) {
    if (component == "..") return Invalid(field, "path must not contain \"..\"");
  }
  return absl::OkStatus();
}

}  // namespace aidn::coordinator
