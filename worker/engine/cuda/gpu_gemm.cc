#include "worker/engine/cuda/gpu_gemm.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {
namespace {

bool FitsCublasInt(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

// Floats from an operand's first element to its batch's last one.
int64_t OperandSpan(const GemmOperand& x, int64_t rows, int64_t cols, int64_t batch) {
  // Stored as [rows, cols] (op(X)'s transpose when transposed).
  if (x.transposed) std::swap(rows, cols);
  return (rows - 1) * x.ld + cols + (batch - 1) * x.stride;
}

}  // namespace

absl::StatusOr<void*> HalfScratch(GpuContext* ctx, DeviceBuffer* buf, int64_t n) {
  const size_t bytes = 2 * static_cast<size_t>(std::max<int64_t>(n, 1));
  if (buf->bytes() < bytes) {
    buf->Release();
    AIDN_ASSIGN_OR_RETURN(*buf, ctx->allocator().Allocate(bytes));
  }
  return buf->data();
}

absl::StatusOr<void*> RoundToHalf(GpuContext* ctx, const float* src, int64_t n, DeviceBuffer* buf) {
  AIDN_ASSIGN_OR_RETURN(void* half, HalfScratch(ctx, buf, n));
  const HalfType type =
      ctx->options().precision == Precision::kBf16 ? HalfType::kBf16 : HalfType::kFp16;
  AIDN_RETURN_IF_ERROR(LaunchToHalf(ctx->stream(), src, half, n, type));
  return half;
}

absl::StatusOr<GemmOperand> RoundOperand(GpuContext* ctx, GemmOperand op, int64_t rows,
                                         int64_t cols, int64_t batch, DeviceBuffer* buf) {
  if (ctx->options().precision == Precision::kFp32) return op;  // products use the floats
  AIDN_ASSIGN_OR_RETURN(op.half,
                        RoundToHalf(ctx, op.data, OperandSpan(op, rows, cols, batch), buf));
  return op;
}

absl::Status RowMajorGemm(GpuContext* ctx, int64_t m, int64_t n, int64_t k, float alpha,
                          const GemmOperand& a, const GemmOperand& b, float beta, float* c,
                          int64_t ldc, int64_t stride_c, int64_t batch, GemmScratch* scratch) {
  if (!FitsCublasInt(m) || !FitsCublasInt(n) || !FitsCublasInt(k) || !FitsCublasInt(a.ld) ||
      !FitsCublasInt(b.ld) || !FitsCublasInt(ldc) || !FitsCublasInt(batch)) {
    return absl::InvalidArgumentError(absl::StrCat("GEMM [", m, ", ", k, "] x [", k, ", ", n,
                                                   "] (batch ", batch, ") is beyond cuBLAS's int"));
  }
  if (m == 0 || n == 0 || batch == 0) return absl::OkStatus();
  // Column-major: C^T [n, m] = op(B)^T [n, k] op(A)^T [k, m].
  const cublasOperation_t op_b = b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int mi = static_cast<int>(m);
  const int ni = static_cast<int>(n);
  const int ki = static_cast<int>(k);
  const int bi = static_cast<int>(batch);
  if (ctx->options().precision == Precision::kFp32) {
    AIDN_RETURN_IF_CUBLAS_ERROR(cublasSgemmStridedBatched(
        ctx->cublas(), op_b, op_a, ni, mi, ki, &alpha, b.data, static_cast<int>(b.ld), b.stride,
        a.data, static_cast<int>(a.ld), a.stride, &beta, c, static_cast<int>(ldc), stride_c, bi));
    return absl::OkStatus();
  }
  if (scratch == nullptr) {
    return absl::FailedPreconditionError("a 16-bit GEMM needs scratch for its rounded operands");
  }
  // k == 0 leaves the operands empty: C = beta C.
  const void* ah = nullptr;
  const void* bh = nullptr;
  if (k > 0) {
    ah = a.half;
    bh = b.half;
    if (ah == nullptr) {
      AIDN_ASSIGN_OR_RETURN(ah, RoundToHalf(ctx, a.data, OperandSpan(a, m, k, batch), &scratch->a));
    }
    if (bh == nullptr) {
      AIDN_ASSIGN_OR_RETURN(bh, RoundToHalf(ctx, b.data, OperandSpan(b, k, n, batch), &scratch->b));
    }
  }
  const cudaDataType_t t = ctx->options().precision == Precision::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
  AIDN_RETURN_IF_CUBLAS_ERROR(cublasGemmStridedBatchedEx(
      ctx->cublas(), op_b, op_a, ni, mi, ki, &alpha, bh, t, static_cast<int>(b.ld), b.stride, ah, t,
      static_cast<int>(a.ld), a.stride, &beta, c, CUDA_R_32F, static_cast<int>(ldc), stride_c, bi,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

}  // namespace aidn::engine::cuda
