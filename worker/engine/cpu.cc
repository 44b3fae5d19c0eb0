#include "worker/engine/cpu.h"

#include <cblas.h>

#include <stdlib.h>

#include <algorithm>
#include <string>

#include "worker/engine/gemm.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace aidn::engine {

// MXCSR (like every FP control register) is per thread: this sets
// flush-to-zero and denormals-are-zero only for the calling thread and for
// threads it creates afterwards. Call it on every thread that computes
// (the trainer's main thread; a compute thread calls it itself). OpenBLAS's
// own worker threads, when threads > 1, are started at library load and keep
// the MXCSR they had then, unless OpenBLAS was built with CONSISTENT_FPCSR.
void ConfigureCpu(int threads) {
  openblas_set_num_threads(std::max(1, threads));
  SetGemmThreads(std::max(1, threads));
#if defined(__x86_64__) || defined(__i386__)
  // 0x8000 flush-to-zero, 0x0040 denormals-are-zero.
  _mm_setcsr(_mm_getcsr() | 0x8040);
#endif
}

std::string BlasCoreName() {
  const char* name = openblas_get_corename();
  return name == nullptr ? "" : name;
}

std::string BlasCoreOverride() {
#if defined(__x86_64__)
  if (getenv("OPENBLAS_CORETYPE") != nullptr) return "";  // the user's choice stands
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("avx512vl")) {
    return "";
  }
  // OpenBLAS's cores with AVX-512 kernels.
  const std::string core = BlasCoreName();
  for (const char* avx512 : {"SkylakeX", "Cooperlake", "SapphireRapids"}) {
    if (core == avx512) return "";
  }
  return "OPENBLAS_CORETYPE=SkylakeX";
#else
  return "";
#endif
}

}  // namespace aidn::engine
