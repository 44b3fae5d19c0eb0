#ifndef AIDN_WORKER_ENGINE_GEMM_H_
#define AIDN_WORKER_ENGINE_GEMM_H_

// Row-major single-precision GEMM for the engine's layers:
// C = alpha * op(A) * op(B) + beta * C, with the arguments of
// cblas_sgemm(CblasRowMajor, ...).
//
// Two libraries, picked per call. oneDNN's JIT sgemm (Debian's libdnnl 2.6)
// beats OpenBLAS 0.3.21 by 6-16 % on this project's larger shapes (the
// MLP's 64 x 256 x 784 and 256 x 784 x 64, on an AVX-512 core) and loses on
// thin ones (a dimension of 10: 0.4-0.9x), so it takes the calls whose every
// dimension is at least kDnnlMinDim, and only on one thread: oneDNN
// threads through OpenMP, whose spinning pool would fight OpenBLAS's for the
// cores. Everything else, and every call in a build without oneDNN, is
// OpenBLAS. Both are deterministic for a given shape, so a run repeats bit
// for bit; the two differ from each other in the last bits (summation
// order), which is why a rank's choice depends only on the shape and the
// thread count, the same on every rank.

#include <cstdint>
#include <string>

namespace aidn::engine {

inline constexpr int64_t kDnnlMinDim = 32;

void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// Set by ConfigureCpu: oneDNN is used only with one compute thread.
void SetGemmThreads(int threads);

// "oneDNN 2.6.3 (calls with every dimension >= 32, one thread) + OpenBLAS
// Cooperlake" or "OpenBLAS Cooperlake", for logs and benchmark headers.
std::string GemmDescription();

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_GEMM_H_
