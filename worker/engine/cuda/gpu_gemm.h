#ifndef AIDN_WORKER_ENGINE_CUDA_GPU_GEMM_H_
#define AIDN_WORKER_ENGINE_CUDA_GPU_GEMM_H_

// Row-major matrix products on cuBLAS (which is column-major) for the
// decoder (gpu_gpt.h), batched with fixed strides: a row-major matrix is
// its transpose in column-major order, so C = op(A) op(B) is computed as
// C^T = op(B)^T op(A)^T with the operands swapped, nothing copied.
//
// In fp32 (the context's precision) it is cublasSgemmStridedBatched in
// default math (TF32 only where the context allows it). In bf16 / fp16 the
// operands are rounded to 16 bits into the scratch's buffers first (the
// span of memory each one covers, strides and leading dimensions
// included) and multiplied by cublasGemmStridedBatchedEx with fp32
// accumulation and an fp32 result, as GpuLinear does.

#include <cstdint>

#include "absl/status/status.h"
#include "worker/engine/cuda/allocator.h"
#include "worker/engine/cuda/gpu_context.h"

namespace aidn::engine::cuda {

// Room for `n` 16-bit values in `buf` (grown as needed; contents then
// unspecified).
absl::StatusOr<void*> HalfScratch(GpuContext* ctx, DeviceBuffer* buf, int64_t n);
// `n` floats of `src` rounded (nearest-even) into `buf`, in the context's
// 16-bit type (bf16 or fp16), queued on its stream.
absl::StatusOr<void*> RoundToHalf(GpuContext* ctx, const float* src, int64_t n, DeviceBuffer* buf);

// One operand: a row-major matrix at `data` with leading dimension `ld`,
// used as stored or transposed; the batch's next matrix `stride` floats on.
struct GemmOperand {
  const float* data = nullptr;
  int64_t ld = 0;
  bool transposed = false;
  int64_t stride = 0;
  // bf16 / fp16: the operand's span already rounded (RoundToHalf), used
  // instead of rounding it again, as when one gradient feeds two products.
  const void* half = nullptr;
};

// 16-bit copies of the operands (bf16 / fp16 only); grown as needed.
// `shared` holds one that two products use (GemmOperand::half).
struct GemmScratch {
  DeviceBuffer a;
  DeviceBuffer b;
  DeviceBuffer shared;
};

// `op`'s span of a product's [rows, cols] operand (strides, leading
// dimension and batch included) rounded into `buf`: op with `half` set.
absl::StatusOr<GemmOperand> RoundOperand(GpuContext* ctx, GemmOperand op, int64_t rows,
                                         int64_t cols, int64_t batch, DeviceBuffer* buf);

// C (row-major [m, n], leading dimension ldc; batch entries stride_c
// apart) = alpha op(A) op(B) + beta C, with op(A) [m, k] and op(B) [k, n].
// INVALID_ARGUMENT for a size beyond cuBLAS's int; `scratch` may be null
// in fp32.
absl::Status RowMajorGemm(GpuContext* ctx, int64_t m, int64_t n, int64_t k, float alpha,
                          const GemmOperand& a, const GemmOperand& b, float beta, float* c,
                          int64_t ldc, int64_t stride_c = 0, int64_t batch = 1,
                          GemmScratch* scratch = nullptr);

}  // namespace aidn::engine::cuda

#endif  // AIDN_WORKER_ENGINE_CUDA_GPU_GEMM_H_
