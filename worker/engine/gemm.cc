#include "worker/engine/gemm.h"

#include <cblas.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#if AIDN_HAVE_DNNL
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#endif

namespace aidn::engine {
namespace {

std::atomic<int> g_threads{1};

}  // namespace

void SetGemmThreads(int threads) { g_threads.store(threads < 1 ? 1 : threads); }

void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
#if AIDN_HAVE_DNNL
  if (m >= kDnnlMinDim && n >= kDnnlMinDim && k >= kDnnlMinDim &&
      g_threads.load(std::memory_order_relaxed) == 1) {
    // oneDNN sizes its OpenMP team from the calling thread's setting, which
    // defaults to every core: one thread here, as documented.
    thread_local bool one_thread = [] {
      omp_set_num_threads(1);
      return true;
    }();
    (void)one_thread;
    const dnnl_status_t s = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a,
                                       lda, b, ldb, beta, c, ldc);
    // Only bad arguments fail, and the layers pass checked shapes.
    AIDN_CHECK(s == dnnl_success) << "dnnl_sgemm " << m << "x" << n << "x" << k << ": status "
                                  << static_cast<int>(s);
    return;
  }
#endif
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

std::string GemmDescription() {
  const char* core = openblas_get_corename();
  const std::string openblas = absl::StrCat("OpenBLAS ", core == nullptr ? "?" : core);
#if AIDN_HAVE_DNNL
  const dnnl_version_t* v = dnnl_version();
  return absl::StrCat("oneDNN ", v->major, ".", v->minor, ".", v->patch,
                      " (dimensions >= ", kDnnlMinDim, ", one thread) + ", openblas);
#else
  return openblas;
#endif
}

}  // namespace aidn::engine
