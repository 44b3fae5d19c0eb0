#include "worker/engine/cuda/session_setup.h"

#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/cuda/status.h"
#include "worker/engine/device.h"

namespace aidn::engine::cuda {

absl::StatusOr<SessionDevice> SetUpSessionDevice(const GpuSessionOptions& options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu session: rank ", options.rank, " is not in a world of size ", options.world_size));
  }
  Precision precision = Precision::kFp32;
  if (options.precision == "bf16") {
    precision = Precision::kBf16;
  } else if (options.precision == "fp16") {
    precision = Precision::kFp16;
  } else if (options.precision != "fp32") {
    return absl::InvalidArgumentError(absl::StrCat("gpu session: precision \"", options.precision,
                                                   "\" (known: fp32, bf16, fp16)"));
  }
  if ((options.world_size > 1 || options.sharding != Sharding::kNone) && options.store == nullptr) {
    return absl::InvalidArgumentError(
        "gpu session: more than one rank, or sharding, needs a store for NCCL");
  }
  DeviceInventory inventory = DiscoverDevices();
  if (inventory.gpus.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("device: gpu: no CUDA device here (", inventory.gpu_note, ")"));
  }
  if (options.device < 0 || options.device >= static_cast<int>(inventory.gpus.size())) {
    return absl::FailedPreconditionError(absl::StrCat("device: gpu: device ", options.device,
                                                      " not found; this process sees ",
                                                      inventory.gpus.size()));
  }
  SessionDevice out;
  out.description = absl::StrCat(inventory.gpus[static_cast<size_t>(options.device)].name,
                                 " (device ", options.device, "), ", options.precision);
  GpuContextOptions context;
  context.device = options.device;
  context.allow_tf32 = options.allow_tf32;
  context.precision = precision;
  if (options.fast_convolutions) {
    context.allow_transform_convolutions = true;
    context.deterministic_convolutions = false;
  }
  AIDN_ASSIGN_OR_RETURN(out.ctx, GpuContext::Create(context));
  if (precision == Precision::kBf16) {
    int major = 0;
    AIDN_RETURN_IF_CUDA_ERROR(
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, options.device));
    if (major < 8) {
      return absl::FailedPreconditionError(
          absl::StrCat("precision: bf16 needs a GPU of compute capability 8.0 or newer (Ampere); ",
                       out.description, " is ", major, ".x (use fp16 or fp32)"));
    }
  }
  return out;
}

absl::StatusOr<int64_t> CountCorrectOnDevice(GpuContext* ctx, const GpuTensor& logits,
                                             const std::vector<int32_t>& labels,
                                             EvalScratch* scratch) {
  const int64_t rows = static_cast<int64_t>(labels.size());
  if (logits.rank() != 2 || logits.dim(0) != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(rows, " labels for logits ", logits.ShapeString()));
  }
  if (rows == 0) return 0;
  const size_t bytes = sizeof(int32_t) * labels.size();
  for (DeviceBuffer* b : {&scratch->labels, &scratch->correct}) {
    if (b->bytes() < bytes) {
      b->Release();
      AIDN_ASSIGN_OR_RETURN(*b, ctx->allocator().Allocate(bytes));
    }
  }
  int32_t* device_labels = static_cast<int32_t*>(scratch->labels.data());
  int32_t* correct = static_cast<int32_t*>(scratch->correct.data());
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(device_labels, labels.data(), bytes, cudaMemcpyHostToDevice, ctx->stream()));
  AIDN_RETURN_IF_ERROR(
      LaunchCorrectRows(ctx->stream(), logits.data(), device_labels, rows, logits.dim(1), correct));
  std::vector<int32_t> flags(labels.size());
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(flags.data(), correct, bytes, cudaMemcpyDeviceToHost, ctx->stream()));
  AIDN_RETURN_IF_ERROR(ctx->Synchronize());
  int64_t count = 0;
  for (const int32_t f : flags) count += f;
  return count;
}

bool SessionDdp::active() const {
#if AIDN_HAVE_NCCL
  return reducer != nullptr || fsdp != nullptr;
#else
  return false;
#endif
}

absl::Status SessionDdp::BeginStep(const std::vector<GpuParameter*>& buffers) {
#if AIDN_HAVE_NCCL
  if (fsdp != nullptr) AIDN_RETURN_IF_ERROR(fsdp->BeginStep());
  if (broadcast_buffers && !buffers.empty()) {
    if (reducer != nullptr) return reducer->BroadcastBuffers(buffers);
    if (fsdp != nullptr) return fsdp->BroadcastBuffers(buffers);
  }
#endif
  (void)buffers;
  return absl::OkStatus();
}

std::function<absl::Status(const std::vector<GpuParameter*>&)> SessionDdp::GradReady() const {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) {
    GpuDdpReducer* r = reducer.get();
    return [r](const std::vector<GpuParameter*>& p) { return r->OnGradReady(p); };
  }
#endif
  return nullptr;
}

absl::Status SessionDdp::BeginBackward(const std::vector<bool>& used,
                                       const std::vector<GpuParameter*>& unused_now) {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) return reducer->BeginBackward(used, unused_now);
  if (fsdp != nullptr) return fsdp->BeginBackward(used);
#endif
  (void)used;
  (void)unused_now;
  return absl::OkStatus();
}

absl::Status SessionDdp::AfterBackward() {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) return reducer->AfterBackward();
  if (fsdp != nullptr) return fsdp->AfterBackward();
#endif
  return absl::OkStatus();
}

absl::Status SessionDdp::WaitForCheck(cudaEvent_t event) {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) return reducer->WaitForCheck(event);
  if (fsdp != nullptr) return fsdp->WaitForCheck(event);
#endif
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(event));
  return absl::OkStatus();
}

absl::Status SessionDdp::Wait(cudaEvent_t done) {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) return reducer->Wait(done);
  if (fsdp != nullptr) return fsdp->Wait(done);
#endif
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(done));
  return absl::OkStatus();
}

GpuUnitHooks* SessionDdp::unit_hooks() const {
#if AIDN_HAVE_NCCL
  return fsdp.get();
#else
  return nullptr;
#endif
}

absl::Status SessionDdp::GatherFullParameters() {
#if AIDN_HAVE_NCCL
  if (fsdp != nullptr) return fsdp->GatherFullParameters();
#endif
  return absl::OkStatus();
}

void SessionDdp::ReleaseFullParameters() {
#if AIDN_HAVE_NCCL
  if (fsdp != nullptr) fsdp->ReleaseFullParameters();
#endif
}

double SessionDdp::allreduce_seconds() const {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) return reducer->last_allreduce_seconds();
  if (fsdp != nullptr) return fsdp->last_comm_seconds();
#endif
  return 0;
}

double SessionDdp::exposed_seconds() const {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) return reducer->last_exposed_seconds();
  if (fsdp != nullptr) return fsdp->last_exposed_seconds();
#endif
  return 0;
}

int64_t SessionDdp::collective_sequence() const {
#if AIDN_HAVE_NCCL
  if (nccl != nullptr) return nccl->sequence();
#endif
  return 0;
}

GpuSession::StateMemory SessionDdp::Memory(const std::vector<GpuParameter*>& parameters,
                                           const std::vector<GpuParameter*>& buffers,
                                           int64_t optimizer_state_bytes) const {
  GpuSession::StateMemory m;
  for (const GpuParameter* p : parameters) {
    m.parameters += 4 * p->value.numel();
    m.gradients += 4 * p->grad.numel();
  }
  for (const GpuParameter* b : buffers) m.buffers += 4 * b->value.numel();
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) {
    m.gradients = reducer->bucket_bytes();
    if (reducer->weight_bytes() > 0) m.parameters = reducer->weight_bytes();
  }
  if (fsdp != nullptr) {
    const GpuFsdpReducer::Memory f = fsdp->memory();
    m.parameters = f.weights;
    m.gradients = f.gradients;
    m.buffers += f.buffers;
  }
#endif
  m.optimizer_state = optimizer_state_bytes;
  return m;
}

const std::vector<GpuParameter*>* SessionDdp::shards() const {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr && !reducer->shard_parameters().empty()) {
    return &reducer->shard_parameters();
  }
  if (fsdp != nullptr) return &fsdp->shard_parameters();
#endif
  return nullptr;
}

absl::Status SessionDdp::CopyShardsTo(GpuContext* ctx, const std::vector<Parameter*>& host) const {
  const std::vector<GpuParameter*>* mine = shards();
  if (mine == nullptr) {
    return absl::FailedPreconditionError("gpu session: no shards (not a sharded strategy)");
  }
  if (mine->size() != host.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu session: ", host.size(), " host shards for ", mine->size(), " here"));
  }
  for (size_t k = 0; k < host.size(); ++k) {
    const GpuParameter* d = (*mine)[k];
    if (host[k]->name != d->name || host[k]->value.numel() != d->value.numel()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpu session: host shard ", k, " is ", host[k]->name, ", here ", d->name));
    }
  }
  for (size_t k = 0; k < host.size(); ++k) {
    const GpuParameter* d = (*mine)[k];
    if (d->value.numel() == 0) continue;
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(host[k]->value.data(), d->value.data(),
                                              sizeof(float) * static_cast<size_t>(d->value.numel()),
                                              cudaMemcpyDeviceToHost, ctx->stream()));
  }
  return ctx->Synchronize();
}

std::function<absl::Status(int32_t*)> SessionDdp::OverflowAllReduce(GpuContext* ctx) const {
#if AIDN_HAVE_NCCL
  NcclCommunicator* comm = nccl.get();
  return [comm, ctx](int32_t* flag) { return comm->AllReduceIntMaxOn(ctx->stream(), flag, 1); };
#else
  (void)ctx;
  return nullptr;
#endif
}

std::function<absl::Status(double*)> SessionDdp::NormAllReduce(GpuContext* ctx) const {
#if AIDN_HAVE_NCCL
  NcclCommunicator* comm = nccl.get();
  return [comm, ctx](double* total) { return comm->AllReduceDoubleSumOn(ctx->stream(), total, 1); };
#else
  (void)ctx;
  return nullptr;
#endif
}

int64_t SessionDdp::bytes_sent() const {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) return reducer->last_bytes_sent();
  if (fsdp != nullptr) return fsdp->last_bytes_sent();
#endif
  return 0;
}

int64_t SessionDdp::bytes_uncompressed() const {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) return reducer->last_bytes_uncompressed();
  if (fsdp != nullptr) return fsdp->last_bytes_uncompressed();
#endif
  return 0;
}

absl::Status SetUpSessionDdp(const GpuSessionOptions& options, GpuContext* ctx,
                             const std::vector<GpuParameter*>& parameters, SessionDdp* ddp,
                             std::string* description) {
  // One rank averages nothing, unless it shards (as a CPU job does then).
  if (options.world_size <= 1 && options.sharding == Sharding::kNone) return absl::OkStatus();
#if AIDN_HAVE_NCCL
  NcclOptions nccl;
  nccl.rank = options.rank;
  nccl.world_size = options.world_size;
  nccl.device = options.device;
  nccl.timeout = options.timeout;
  AIDN_ASSIGN_OR_RETURN(ddp->nccl, NcclCommunicator::Create(nccl, options.store));
  ddp->broadcast_buffers = options.broadcast_buffers;
  absl::StrAppend(description, ", NCCL ", options.world_size, " ranks");
  const Sharding sharding = options.sharding;
  if (sharding == Sharding::kGradients || sharding == Sharding::kShardGradOp ||
      sharding == Sharding::kFullShard) {
    if (options.shards == nullptr) {
      return absl::InvalidArgumentError("gpu session: ZeRO-2 and FSDP need the shards' layout");
    }
    if (options.compression.has_value() || options.powersgd.has_value()) {
      return absl::InvalidArgumentError(
          "gpu session: gradient compression does not go with ZeRO-2 or FSDP");
    }
    AIDN_ASSIGN_OR_RETURN(
        ddp->fsdp, GpuFsdpReducer::Create(ctx, ddp->nccl.get(), *options.shards, parameters,
                                          {.sharding = sharding,
                                           .find_unused_parameters = options.find_unused_parameters,
                                           .param_half = options.fsdp_param_half,
                                           .reduce_half = options.fsdp_reduce_half}));
    absl::StrAppend(description, ", ",
                    sharding == Sharding::kGradients   ? "ZeRO-2"
                    : sharding == Sharding::kFullShard ? "FSDP full_shard"
                                                       : "FSDP shard_grad_op",
                    " over ", ddp->fsdp->num_units(), " units, ",
                    ddp->fsdp->shard_parameters().size(), " shards");
    if (options.fsdp_param_half.has_value()) {
      absl::StrAppend(description, ", weights gathered in ",
                      HalfFormatName(*options.fsdp_param_half));
    }
    if (options.fsdp_reduce_half.has_value()) {
      absl::StrAppend(description, ", gradients reduce-scattered in ",
                      HalfFormatName(*options.fsdp_reduce_half));
    }
    return absl::OkStatus();
  }
  const bool zero1 = sharding == Sharding::kOptimizer;
  AIDN_ASSIGN_OR_RETURN(
      ddp->reducer,
      GpuDdpReducer::Create(ctx, parameters, ddp->nccl.get(),
                            DdpOptions{.bucket_mb = options.bucket_mb,
                                       .shard_optimizer = zero1,
                                       .powersgd = options.powersgd,
                                       .half = options.compression,
                                       .find_unused_parameters = options.find_unused_parameters},
                            zero1 ? options.shards : nullptr));
  absl::StrAppend(description, ", ", ddp->reducer->num_buckets(), " gradient buckets");
  if (options.compression.has_value()) {
    absl::StrAppend(description, " allreduced in ", HalfFormatName(*options.compression));
  }
  if (options.powersgd.has_value()) {
    absl::StrAppend(description, " compressed by PowerSGD of rank ", options.powersgd->rank,
                    " from step ", options.powersgd->start_step);
  }
  if (zero1) {
    absl::StrAppend(description,
                    " reduce-scattered, ZeRO-1: ", ddp->reducer->shard_parameters().size(),
                    " shards of the optimizer's state");
  }
  return absl::OkStatus();
#else
  (void)ctx;
  (void)parameters;
  (void)ddp;
  (void)description;
  return absl::UnimplementedError(
      "device: gpu with more than one rank needs NCCL, which this build lacks");
#endif
}

}  // namespace aidn::engine::cuda
