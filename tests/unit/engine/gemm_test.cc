// Sgemm against a double-precision reference, on both of its libraries:
// shapes that go to oneDNN (every dimension >= 32, one thread) and thin ones
// that stay with OpenBLAS, every transpose, beta 0 and 1, padded leading
// dimensions; and the same call twice gives the same bits.
#include "worker/engine/gemm.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace aidn::engine {
namespace {

struct Case {
  bool ta, tb;
  int64_t m, n, k;
  float beta;
};

// Row-major element (r, c) of op(X) where X is stored with leading dim ld.
double At(const std::vector<float>& x, bool trans, int64_t ld, int64_t r, int64_t c) {
  return trans ? x[static_cast<size_t>(c * ld + r)] : x[static_cast<size_t>(r * ld + c)];
}

void Check(const Case& t, int threads) {
  SCOPED_TRACE(::testing::Message()
               << (t.ta ? 'T' : 'N') << (t.tb ? 'T' : 'N') << " m" << t.m << " n" << t.n << " k"
               << t.k << " beta " << t.beta << " threads " << threads);
  SetGemmThreads(threads);
  const int64_t pad = 3;  // leading dimensions wider than the rows
  const int64_t lda = (t.ta ? t.m : t.k) + pad, ldb = (t.tb ? t.k : t.n) + pad, ldc = t.n + pad;
  const int64_t a_rows = t.ta ? t.k : t.m, b_rows = t.tb ? t.n : t.k;
  std::mt19937 rng(static_cast<uint32_t>(t.m * 131 + t.n * 7 + t.k));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> a(static_cast<size_t>(a_rows * lda)), b(static_cast<size_t>(b_rows * ldb)),
      c(static_cast<size_t>(t.m * ldc));
  for (float& x : a) x = u(rng);
  for (float& x : b) x = u(rng);
  for (float& x : c) x = u(rng);
  std::vector<float> c0 = c;
  Sgemm(t.ta, t.tb, t.m, t.n, t.k, 0.5f, a.data(), lda, b.data(), ldb, t.beta, c.data(), ldc);
  double worst = 0;
  for (int64_t r = 0; r < t.m; ++r) {
    for (int64_t col = 0; col < t.n; ++col) {
      double want = t.beta * c0[static_cast<size_t>(r * ldc + col)];
      for (int64_t i = 0; i < t.k; ++i)
        want += 0.5 * At(a, t.ta, lda, r, i) * At(b, t.tb, ldb, i, col);
      worst = std::max(worst, std::fabs(c[static_cast<size_t>(r * ldc + col)] - want));
    }
    // The padding past each row is left alone.
    for (int64_t col = t.n; col < ldc; ++col) {
      ASSERT_EQ(c[static_cast<size_t>(r * ldc + col)], c0[static_cast<size_t>(r * ldc + col)]);
    }
  }
  EXPECT_LT(worst, 1e-5 * std::sqrt(static_cast<double>(t.k)) + 1e-6);
  // Deterministic: the same inputs give the same bits.
  std::vector<float> again = c0;
  Sgemm(t.ta, t.tb, t.m, t.n, t.k, 0.5f, a.data(), lda, b.data(), ldb, t.beta, again.data(), ldc);
  EXPECT_EQ(std::memcmp(again.data(), c.data(), c.size() * sizeof(float)), 0);
  SetGemmThreads(1);
}

TEST(Sgemm, MatchesAReferenceOnEveryPathAndRepeatsBitForBit) {
  // The MLP's shapes at batch 64 (NT forward, TN weight gradient, NN input
  // gradient), thin ones, odd ones.
  const std::vector<Case> cases = {{false, true, 64, 256, 784, 1},  {true, false, 256, 784, 64, 1},
                                   {false, false, 64, 256, 256, 0}, {false, true, 64, 10, 256, 1},
                                   {true, false, 10, 256, 64, 1},   {false, false, 64, 256, 10, 0},
                                   {true, true, 33, 47, 65, 0},     {true, true, 33, 47, 65, 1},
                                   {false, false, 1, 1, 1, 0},      {false, true, 37, 31, 40, 1}};
  for (const Case& t : cases) {
    Check(t, 1);
    Check(t, 2);
  }
}

TEST(Sgemm, EmptyShapesTouchNothing) {
  std::vector<float> c = {7.0f};
  Sgemm(false, false, 0, 1, 4, 1.0f, nullptr, 4, nullptr, 1, 0.0f, c.data(), 1);
  Sgemm(false, false, 1, 0, 4, 1.0f, nullptr, 4, nullptr, 1, 0.0f, c.data(), 1);
  EXPECT_EQ(c[0], 7.0f);
}

TEST(Sgemm, SaysWhichLibrariesItUses) {
  const std::string d = GemmDescription();
  EXPECT_NE(d.find("OpenBLAS"), std::string::npos) << d;
  std::printf("gemm: %s\n", d.c_str());
}

}  // namespace
}  // namespace aidn::engine
