#ifndef AIDN_WORKER_ENGINE_CPU_H_
#define AIDN_WORKER_ENGINE_CPU_H_

// The process-wide CPU set-up of a rank (cpu.cc): BLAS threads, denormal
// handling, and which OpenBLAS kernels this CPU should get.

#include <string>

namespace aidn::engine {

// Process-wide CPU setup for a rank: BLAS thread count and flush-to-zero /
// denormals-are-zero (denormals slow training several-fold as weights decay).
// The FP mode is per thread: it applies to the calling thread and the
// threads it creates afterwards.
void ConfigureCpu(int threads);

// OpenBLAS 0.3.21 (Debian 12's) picks its kernels by CPU model and gives
// CPUs it does not know, AMD's AVX-512 ones among them, its AVX2 (Haswell)
// kernels. OPENBLAS_CORETYPE, read once when the library loads, overrides
// that. Returns "OPENBLAS_CORETYPE=SkylakeX" when this CPU has AVX-512
// (F, BW, DQ, VL) but the loaded OpenBLAS chose a core without it and the
// environment does not already name one; else "". The worker puts it in
// every trainer's environment; it cannot take effect in this process.
std::string BlasCoreOverride();
// The OpenBLAS core in use ("Haswell", "SkylakeX", ...).
std::string BlasCoreName();

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_CPU_H_
