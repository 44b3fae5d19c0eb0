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
  if (options.world_size > 1 && options.store == nullptr) {
    return absl::InvalidArgumentError("gpu session: more than one rank needs a store for NCCL");
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

double SessionDdp::allreduce_seconds() const {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) return reducer->last_allreduce_seconds();
#endif
  return 0;
}

double SessionDdp::exposed_seconds() const {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) return reducer->last_exposed_seconds();
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
#endif
  m.optimizer_state = optimizer_state_bytes;
  return m;
}

const std::vector<GpuParameter*>* SessionDdp::shards() const {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr && !reducer->shard_parameters().empty()) {
    return &reducer->shard_parameters();
  }
#endif
  return nullptr;
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
#endif
  return 0;
}

int64_t SessionDdp::bytes_uncompressed() const {
#if AIDN_HAVE_NCCL
  if (reducer != nullptr) return reducer->last_bytes_uncompressed();
#endif
  return 0;
}

absl::Status SetUpSessionDdp(const GpuSessionOptions& options, GpuContext* ctx,
                             const std::vector<GpuParameter*>& parameters, SessionDdp* ddp,
                             std::string* description) {
  if (options.world_size <= 1) return absl::OkStatus();
#if AIDN_HAVE_NCCL
  NcclOptions nccl;
  nccl.rank = options.rank;
  nccl.world_size = options.world_size;
  nccl.device = options.device;
  nccl.timeout = options.timeout;
  AIDN_ASSIGN_OR_RETURN(ddp->nccl, NcclCommunicator::Create(nccl, options.store));
  AIDN_ASSIGN_OR_RETURN(
      ddp->reducer,
      GpuDdpReducer::Create(ctx, parameters, ddp->nccl.get(),
                            DdpOptions{.bucket_mb = options.bucket_mb,
                                       .shard_optimizer = options.zero1 != nullptr,
                                       .powersgd = options.powersgd,
                                       .half = options.compression,
                                       .find_unused_parameters = options.find_unused_parameters},
                            options.zero1));
  absl::StrAppend(description, ", NCCL ", options.world_size, " ranks, ",
                  ddp->reducer->num_buckets(), " gradient buckets");
  if (options.compression.has_value()) {
    absl::StrAppend(description, " allreduced in ", HalfFormatName(*options.compression));
  }
  if (options.powersgd.has_value()) {
    absl::StrAppend(description, " compressed by PowerSGD of rank ", options.powersgd->rank,
                    " from step ", options.powersgd->start_step);
  }
  if (options.zero1 != nullptr) {
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
