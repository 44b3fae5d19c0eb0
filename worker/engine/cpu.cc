#include <cblas.h>

#include <algorithm>

#include "worker/engine/model.h"

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
#if defined(__x86_64__) || defined(__i386__)
  // 0x8000 flush-to-zero, 0x0040 denormals-are-zero.
  _mm_setcsr(_mm_getcsr() | 0x8040);
#endif
}

}  // namespace aidn::engine
