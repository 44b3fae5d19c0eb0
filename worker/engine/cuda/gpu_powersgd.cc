#include "worker/engine/cuda/gpu_powersgd.h"

#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/ddp_kernels.h"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {

absl::StatusOr<std::unique_ptr<GpuPowerSgd>> GpuPowerSgd::Create(GpuContext* ctx,
                                                                 NcclCommunicator* nccl,
                                                                 const PowerSgdOptions& options) {
  if (ctx == nullptr || nccl == nullptr) {
    return absl::InvalidArgumentError("gpu powersgd: no context or no communicator");
  }
  if (options.rank < 1) return absl::InvalidArgumentError("gpu powersgd: rank must be >= 1");
  std::unique_ptr<GpuPowerSgd> p(new GpuPowerSgd(ctx, nccl, options));
  AIDN_RETURN_IF_ERROR(ctx->Activate());
  AIDN_RETURN_IF_CUBLAS_ERROR(cublasCreate(&p->cublas_));
  AIDN_RETURN_IF_CUBLAS_ERROR(cublasSetStream(p->cublas_, nccl->stream()));
  AIDN_RETURN_IF_CUBLAS_ERROR(cublasSetMathMode(p->cublas_, CUBLAS_DEFAULT_MATH));
  return p;
}

GpuPowerSgd::~GpuPowerSgd() {
  cudaStreamSynchronize(nccl_->stream());
  for (auto& [index, state] : buckets_) {
    if (state.q_host != nullptr) cudaFreeHost(state.q_host);
  }
  if (cublas_ != nullptr) cublasDestroy(cublas_);
}

absl::Status GpuPowerSgd::Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                               const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                               int64_t ldc) {
  // Row-major C [m, n] is column-major C^T = op(B)^T op(A)^T.
  const float one = 1.0f;
  const float zero = 0.0f;
  AIDN_RETURN_IF_CUBLAS_ERROR(cublasSgemm(
      cublas_, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &one, b, static_cast<int>(ldb),
      a, static_cast<int>(lda), &zero, c, static_cast<int>(ldc)));
  return absl::OkStatus();
}

absl::StatusOr<GpuPowerSgd::BucketState*> GpuPowerSgd::State(int bucket, size_t floats,
                                                             const std::vector<Gradient>& grads) {
  auto it = buckets_.find(bucket);
  if (it != buckets_.end()) {
    if (it->second.floats != floats || it->second.plan.grads.size() != grads.size()) {
      return absl::FailedPreconditionError(
          absl::StrCat("gpu powersgd: bucket ", bucket, " changed its gradients"));
    }
    return &it->second;
  }
  std::vector<std::vector<int64_t>> shapes;
  for (const Gradient& g : grads) shapes.push_back(g.shape);
  BucketState state;
  state.plan = PlanPowerSgd(shapes, options_);
  for (const PowerSgdPlan::Matrix& mat : state.plan.grads) {
    if (mat.n > 0x7fffffff || mat.m > 0x7fffffff) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpu powersgd: a gradient of ", mat.n, " x ", mat.m, " is beyond cuBLAS"));
    }
  }
  state.floats = floats;
  CachingAllocator& memory = ctx_->allocator();
  auto room = [&](int64_t n) { return sizeof(float) * static_cast<size_t>(n > 0 ? n : 1); };
  AIDN_ASSIGN_OR_RETURN(state.p, memory.Allocate(room(state.plan.p_floats)));
  AIDN_ASSIGN_OR_RETURN(state.q, memory.Allocate(room(state.plan.q_floats)));
  AIDN_ASSIGN_OR_RETURN(state.packed, memory.Allocate(room(state.plan.plain_floats)));
  if (options_.error_feedback) {
    AIDN_ASSIGN_OR_RETURN(state.error, memory.Allocate(room(static_cast<int64_t>(floats))));
    AIDN_ASSIGN_OR_RETURN(state.input, memory.Allocate(room(static_cast<int64_t>(floats))));
    AIDN_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(state.error.data(), 0, sizeof(float) * floats, nccl_->stream()));
  }
  AIDN_RETURN_IF_CUDA_ERROR(cudaMallocHost(&state.q_host, room(state.plan.q_floats)));
  return &buckets_.emplace(bucket, std::move(state)).first->second;
}

absl::Status GpuPowerSgd::Reduce(int bucket, float* buffer, size_t floats,
                                 const std::vector<Gradient>& grads) {
  if (!active()) {
    std::vector<std::vector<int64_t>> shapes;
    for (const Gradient& g : grads) shapes.push_back(g.shape);
    last_uncompressed_ = last_sent_ = PlanPowerSgd(shapes, options_).total_floats;
    return nccl_->EnqueueAllReduce(buffer, floats, ReduceOp::kAvg);
  }
  AIDN_ASSIGN_OR_RETURN(BucketState * state, State(bucket, floats, grads));
  const PowerSgdPlan& plan = state->plan;
  cudaStream_t s = nccl_->stream();
  const int64_t n_floats = static_cast<int64_t>(floats);
  last_uncompressed_ = plan.total_floats;
  last_sent_ = plan.floats_sent();
  float* error = static_cast<float*>(state->error.data());
  float* input = static_cast<float*>(state->input.data());
  float* p = static_cast<float*>(state->p.data());
  float* q = static_cast<float*>(state->q.data());
  float* packed = static_cast<float*>(state->packed.data());
  if (options_.error_feedback) {
    AIDN_RETURN_IF_ERROR(LaunchAdd(s, buffer, error, buffer, n_floats));
    AIDN_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(input, buffer, sizeof(float) * floats, cudaMemcpyDeviceToDevice, s));
  }
  // Q: random (the same on every rank) the first time or without warm
  // start, else the last step's; orthogonalised either way.
  if (!options_.warm_start || !state->has_q) {
    RandomPowerSgdQ(options_, step_, bucket, state->q_host, plan.q_floats);
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(q, state->q_host,
                                              sizeof(float) * static_cast<size_t>(plan.q_floats),
                                              cudaMemcpyHostToDevice, s));
  }
  // Each compressed gradient's Q orthogonalised, then P = M Q; the others
  // packed.
  int64_t p_at = 0, q_at = 0, plain_at = 0;
  for (size_t g = 0; g < grads.size(); ++g) {
    const PowerSgdPlan::Matrix& mat = plan.grads[g];
    if (mat.r == 0) {
      AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(packed + plain_at, grads[g].data,
                                                sizeof(float) * static_cast<size_t>(mat.numel),
                                                cudaMemcpyDeviceToDevice, s));
      plain_at += mat.numel;
      continue;
    }
    AIDN_RETURN_IF_ERROR(LaunchOrthogonalizeColumns(s, q + q_at, mat.m, mat.r));
    AIDN_RETURN_IF_ERROR(Gemm(false, false, mat.n, mat.r, mat.m, grads[g].data, mat.m, q + q_at,
                              mat.r, p + p_at, mat.r));
    p_at += mat.n * mat.r;
    q_at += mat.m * mat.r;
  }
  // The uncompressed gradients averaged; P summed (orthogonalised next: no
  // need to average).
  AIDN_RETURN_IF_ERROR(Annotate(
      nccl_->EnqueueAllReduce(packed, static_cast<size_t>(plan.plain_floats), ReduceOp::kAvg),
      "powersgd uncompressed allreduce"));
  AIDN_RETURN_IF_ERROR(
      Annotate(nccl_->EnqueueAllReduce(p, static_cast<size_t>(plan.p_floats), ReduceOp::kSum),
               "powersgd P allreduce"));
  // P orthogonalised, Q = M^T P, then averaged.
  p_at = q_at = plain_at = 0;
  for (size_t g = 0; g < grads.size(); ++g) {
    const PowerSgdPlan::Matrix& mat = plan.grads[g];
    if (mat.r == 0) {
      AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(grads[g].data, packed + plain_at,
                                                sizeof(float) * static_cast<size_t>(mat.numel),
                                                cudaMemcpyDeviceToDevice, s));
      plain_at += mat.numel;
      continue;
    }
    AIDN_RETURN_IF_ERROR(LaunchOrthogonalizeColumns(s, p + p_at, mat.n, mat.r));
    AIDN_RETURN_IF_ERROR(Gemm(true, false, mat.m, mat.r, mat.n, grads[g].data, mat.m, p + p_at,
                              mat.r, q + q_at, mat.r));
    p_at += mat.n * mat.r;
    q_at += mat.m * mat.r;
  }
  AIDN_RETURN_IF_ERROR(
      Annotate(nccl_->EnqueueAllReduce(q, static_cast<size_t>(plan.q_floats), ReduceOp::kAvg),
               "powersgd Q allreduce"));
  // M = P Q^T.
  p_at = q_at = 0;
  for (size_t g = 0; g < grads.size(); ++g) {
    const PowerSgdPlan::Matrix& mat = plan.grads[g];
    if (mat.r == 0) continue;
    AIDN_RETURN_IF_ERROR(Gemm(false, true, mat.n, mat.m, mat.r, p + p_at, mat.r, q + q_at, mat.r,
                              grads[g].data, mat.m));
    p_at += mat.n * mat.r;
    q_at += mat.m * mat.r;
  }
  state->has_q = options_.warm_start;
  if (options_.error_feedback) {
    AIDN_RETURN_IF_ERROR(LaunchSubtract(s, input, buffer, error, n_floats));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> GpuPowerSgd::Error(int bucket) const {
  auto it = buckets_.find(bucket);
  if (it == buckets_.end() || it->second.error.data() == nullptr) return std::vector<float>();
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(nccl_->stream()));
  std::vector<float> host(it->second.floats);
  AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpy(host.data(), it->second.error.data(),
                                       sizeof(float) * host.size(), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace aidn::engine::cuda
