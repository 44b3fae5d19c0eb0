// FlashAttention-2 for the GPT decoder (flash_attention.h).
//
// Every kernel runs 4 warps over a tile of 64 rows, each warp owning 16.
// Tiles live in shared memory: bf16 Q, K, V, dO tiles ([64, hd + 8]), fp32
// score tiles ([64, 64 + 4]), bf16 probability tiles ([64, 64 + 8]) and fp32
// accumulators ([64, hd + 4]); the paddings keep WMMA's leading dimensions
// legal (multiples of 8 halves or 4 floats) and every fragment pointer
// 32-byte aligned (16 rows of any of them are a multiple of 256 bytes).
//
// In the elementwise steps a warp's lane pair (2r, 2r + 1) owns its row r,
// each lane 32 of the 64 columns; the pair combines row maxima and sums with
// one shuffle.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/flash_attention.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {
namespace {

using namespace nvcuda;  // NOLINT: wmma's fragments

constexpr int kTile = 64;  // rows of a query or key tile
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kScoreLd = kTile + 4;  // fp32 score rows
constexpr int kProbLd = kTile + 8;   // bf16 probability rows

using Bf16 = __nv_bfloat16;
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf16, wmma::row_major>;
using FragATransposed = wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf16, wmma::col_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::row_major>;
using FragBTransposed = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::col_major>;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

template <int HD>
struct Ld {
  static constexpr int kHalf = HD + 8;  // bf16 tiles of hd columns
  static constexpr int kAcc = HD + 4;   // fp32 accumulators of hd columns
};

// Rows [0, rows_valid) of a [64, HD] tile from fp32 global memory (row
// stride `stride`) into bf16 shared memory (leading dimension `ld`); rows
// past the end are zeros. 16-byte loads (`src` and `stride` multiples of 4
// floats: the launchers check), every one of a thread's issued before the
// first is used, so the tile's loads overlap instead of waiting one by one.
template <int HD>
__device__ void LoadTile(const float* src, int64_t stride, int rows_valid, Bf16* dst, int ld) {
  constexpr int kVecsPerRow = HD / 4;
  constexpr int kPerThread = kTile * kVecsPerRow / kThreads;
  static_assert(kTile * kVecsPerRow % kThreads == 0, "whole float4s per thread");
  float4 v[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * kThreads;
    const int r = i / kVecsPerRow;
    const int d = (i - r * kVecsPerRow) * 4;
    v[j] = r < rows_valid ? *reinterpret_cast<const float4*>(src + r * stride + d)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * kThreads;
    const int r = i / kVecsPerRow;
    const int d = (i - r * kVecsPerRow) * 4;
    // ld and d are even: 4-byte aligned pairs.
    auto* out = reinterpret_cast<__nv_bfloat162*>(dst + r * ld + d);
    out[0] = __floats2bfloat162_rn(v[j].x, v[j].y);
    out[1] = __floats2bfloat162_rn(v[j].z, v[j].w);
  }
}

__device__ void ZeroFloats(float* p, int n) {
  for (int i = threadIdx.x; i < n; i += kThreads) p[i] = 0.0f;
}

// A warp's 16 x 64 block of a [64, HD] x [64, HD]^T product: rows 16w..
// of `a` against every row of `b`, into `out` (leading dimension kScoreLd).
template <int HD>
__device__ void RowsTimesTransposed(const Bf16* a, const Bf16* b, float* out) {
  constexpr int ld = Ld<HD>::kHalf;
  for (int nt = 0; nt < kTile / 16; ++nt) {
    FragAcc acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < HD / 16; ++kk) {
      FragA fa;
      FragBTransposed fb;
      wmma::load_matrix_sync(fa, a + kk * 16, ld);
      wmma::load_matrix_sync(fb, b + nt * 16 * ld + kk * 16, ld);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + nt * 16, acc, kScoreLd, wmma::mem_row_major);
  }
}

// acc (16 x HD, fp32, leading dimension Ld<HD>::kAcc) += p (16 x 64 bf16,
// kProbLd; transposed: its columns 16w.. of a [64, 64] tile as rows) times
// v ([64, HD] bf16).
template <int HD, bool kTransposeP>
__device__ void AccumulateProduct(const Bf16* p, const Bf16* v, float* acc_rows) {
  constexpr int ld = Ld<HD>::kHalf;
  constexpr int lda = Ld<HD>::kAcc;
  for (int dt = 0; dt < HD / 16; ++dt) {
    FragAcc acc;
    wmma::load_matrix_sync(acc, acc_rows + dt * 16, lda, wmma::mem_row_major);
    for (int kk = 0; kk < kTile / 16; ++kk) {
      FragB fb;
      wmma::load_matrix_sync(fb, v + kk * 16 * ld + dt * 16, ld);
      if constexpr (kTransposeP) {
        // Element (i, j) of the transposed block is p[(16 kk + j) * ld + i].
        FragATransposed fa;
        wmma::load_matrix_sync(fa, p + kk * 16 * kProbLd, kProbLd);
        wmma::mma_sync(acc, fa, fb, acc);
      } else {
        FragA fa;
        wmma::load_matrix_sync(fa, p + kk * 16, kProbLd);
        wmma::mma_sync(acc, fa, fb, acc);
      }
    }
    wmma::store_matrix_sync(acc_rows + dt * 16, acc, lda, wmma::mem_row_major);
  }
}

// acc[dt] (fragments of a warp's 16 x HD block, kept in registers across
// calls) += p^T v, with p's columns 16w.. of a [64, 64] tile as rows: the
// same products in the same order as AccumulateProduct<HD, true>, without
// the accumulator's trips through shared memory.
template <int HD>
__device__ void AccumulateTransposedProduct(const Bf16* p, const Bf16* v, FragAcc* acc) {
  constexpr int ld = Ld<HD>::kHalf;
#pragma unroll
  for (int dt = 0; dt < HD / 16; ++dt) {
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      FragB fb;
      wmma::load_matrix_sync(fb, v + kk * 16 * ld + dt * 16, ld);
      FragATransposed fa;
      wmma::load_matrix_sync(fa, p + kk * 16 * kProbLd, kProbLd);
      wmma::mma_sync(acc[dt], fa, fb, acc[dt]);
    }
  }
}

template <int HD>
__global__ void __launch_bounds__(kThreads)
    FlashForwardKernel(const float* qkv, int t_len, int heads, float scale, float* y, float* lse) {
  constexpr int ldh = Ld<HD>::kHalf;
  constexpr int ldo = Ld<HD>::kAcc;
  const int bh = blockIdx.x;
  const int b = bh / heads;
  const int h = bh - b * heads;
  const int q0 = blockIdx.y * kTile;
  const int c = heads * HD;
  const int64_t ld3 = 3LL * c;
  const int64_t row0 = static_cast<int64_t>(b) * t_len;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  extern __shared__ __align__(128) unsigned char smem[];
  Bf16* qs = reinterpret_cast<Bf16*>(smem);
  Bf16* ks = qs + kTile * ldh;
  Bf16* vs = ks + kTile * ldh;
  float* ss = reinterpret_cast<float*>(vs + kTile * ldh);
  Bf16* ps = reinterpret_cast<Bf16*>(ss + kTile * kScoreLd);
  float* os = reinterpret_cast<float*>(ps + kTile * kProbLd);

  LoadTile<HD>(qkv + (row0 + q0) * ld3 + h * HD, ld3, min(kTile, t_len - q0), qs, ldh);
  ZeroFloats(os, kTile * ldo);

  const int r = lane >> 1;
  const int half = lane & 1;
  const int q = q0 + warp * 16 + r;
  float* sw = ss + warp * 16 * kScoreLd;
  Bf16* pw = ps + warp * 16 * kProbLd;
  float* ow = os + warp * 16 * ldo;
  float m = -INFINITY;
  float l = 0.0f;
  const int last_key_tile = min(q0 + kTile - 1, t_len - 1) / kTile;
  for (int kt = 0; kt <= last_key_tile; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the last tile's K and V are read no more (and Q, O are ready)
    LoadTile<HD>(qkv + (row0 + k0) * ld3 + c + h * HD, ld3, min(kTile, t_len - k0), ks, ldh);
    LoadTile<HD>(qkv + (row0 + k0) * ld3 + 2 * c + h * HD, ld3, min(kTile, t_len - k0), vs, ldh);
    __syncthreads();
    RowsTimesTransposed<HD>(qs + warp * 16 * ldh, ks, sw);
    __syncwarp();
    // Online softmax of the lane pair's row.
    float s[32];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int key = k0 + half * 32 + j;
      const bool valid = q < t_len && key < t_len && key <= q;
      s[j] = valid ? sw[r * kScoreLd + half * 32 + j] * scale : -INFINITY;
      mx = fmaxf(mx, s[j]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    const float m_new = fmaxf(m, mx);
    // Nothing valid in the row yet (a row past the end): nothing to scale.
    const float alpha = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const float p = s[j] == -INFINITY ? 0.0f : expf(s[j] - m_new);
      sum += p;
      pw[r * kProbLd + half * 32 + j] = __float2bfloat16(p);
    }
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    l = l * alpha + sum;
    m = m_new;
    for (int d = half * (HD / 2); d < (half + 1) * (HD / 2); ++d) ow[r * ldo + d] *= alpha;
    __syncwarp();
    AccumulateProduct<HD, false>(pw, vs, ow);
    __syncwarp();
  }
  if (q < t_len) {
    const float inv = 1.0f / l;
    float* out = y + (row0 + q) * c + h * HD;
    for (int d = half * (HD / 2); d < (half + 1) * (HD / 2); ++d) out[d] = ow[r * ldo + d] * inv;
    if (half == 0) lse[static_cast<int64_t>(bh) * t_len + q] = m + logf(l);
  }
}

// delta[b, h, t] = sum over d of y * dy (the row's dot product), one warp a
// (row, head).
__global__ void FlashDeltaKernel(const float* y, const float* dy, int64_t rows, int t_len,
                                 int heads, int hd, float* delta) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= rows * heads) return;
  const int64_t row = w / heads;
  const int h = static_cast<int>(w - row * heads);
  const int64_t at = row * heads * hd + h * hd;
  float s = 0.0f;
  for (int d = lane; d < hd; d += 32) s += y[at + d] * dy[at + d];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFullMask, s, o);
  if (lane == 0) {
    const int64_t b = row / t_len;
    const int64_t t = row - b * t_len;
    delta[(b * heads + h) * t_len + t] = s;
  }
}

// The probabilities and the scores' gradient of a warp's 16 rows (query
// positions q0 + 16w + r) against one key tile: p = exp(scale s - lse),
// ds = scale p (dp - delta), zero where the key is after the query or past
// the end.
__device__ void ProbabilitiesAndScoreGrads(const float* sw, const float* dpw, const float* lse_s,
                                           const float* delta_s, int q0, int k0, int t_len,
                                           float scale, Bf16* pw, Bf16* dsw) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int r = lane >> 1;
  const int half = lane & 1;
  const int qi = warp * 16 + r;
  const int q = q0 + qi;
#pragma unroll 4
  for (int j = 0; j < 32; ++j) {
    const int col = half * 32 + j;
    const int key = k0 + col;
    const bool valid = q < t_len && key < t_len && key <= q;
    const float p = valid ? expf(sw[r * kScoreLd + col] * scale - lse_s[qi]) : 0.0f;
    const float ds = p * (dpw[r * kScoreLd + col] - delta_s[qi]) * scale;
    if (pw != nullptr) pw[r * kProbLd + col] = __float2bfloat16(p);
    dsw[r * kProbLd + col] = __float2bfloat16(ds);
  }
}

// The log-sum-exp and delta of a query tile's rows (from `at` in the
// [B, H, T] arrays; zeros past `rows`) into shared memory.
__device__ void LoadRowStats(const float* lse, const float* delta, int64_t at, int rows,
                             float* lse_s, float* delta_s) {
  for (int i = threadIdx.x; i < kTile; i += kThreads) {
    lse_s[i] = i < rows ? lse[at + i] : 0.0f;
    delta_s[i] = i < rows ? delta[at + i] : 0.0f;
  }
}

// dK and dV of one key tile, summed over the query tiles at and after it.
// kRegisters (head sizes up to 64): the sums stay in each warp's fragments
// and go through shared memory once, at the end, which leaves the block
// 2 x 64 x (hd + 4) floats less shared memory (at 64, 35 KB: two blocks a
// Hopper multiprocessor instead of one).
template <int HD, bool kRegisters>
__global__ void __launch_bounds__(kThreads)
    FlashBackwardKvKernel(const float* qkv, const float* dy, const float* lse, const float* delta,
                          int t_len, int heads, float scale, float* dqkv) {
  constexpr int ldh = Ld<HD>::kHalf;
  constexpr int ldo = Ld<HD>::kAcc;
  const int bh = blockIdx.x;
  const int b = bh / heads;
  const int h = bh - b * heads;
  const int k0 = blockIdx.y * kTile;
  const int c = heads * HD;
  const int64_t ld3 = 3LL * c;
  const int64_t row0 = static_cast<int64_t>(b) * t_len;
  const int warp = threadIdx.x >> 5;

  extern __shared__ __align__(128) unsigned char smem[];
  Bf16* ks = reinterpret_cast<Bf16*>(smem);
  Bf16* vs = ks + kTile * ldh;
  Bf16* qs = vs + kTile * ldh;
  Bf16* dos = qs + kTile * ldh;
  float* ss = reinterpret_cast<float*>(dos + kTile * ldh);
  float* dps = ss + kTile * kScoreLd;
  Bf16* ps = reinterpret_cast<Bf16*>(dps + kTile * kScoreLd);
  Bf16* dss = ps + kTile * kProbLd;
  float* after = reinterpret_cast<float*>(dss + kTile * kProbLd);
  // kRegisters: the sums are staged at the end where the scores were.
  static_assert(!kRegisters || ldo <= kScoreLd, "dK and dV staged in the score tiles");
  float* dks = kRegisters ? ss : after;
  float* dvs = kRegisters ? dps : after + kTile * ldo;
  float* lse_s = kRegisters ? after : after + 2 * kTile * ldo;
  float* delta_s = lse_s + kTile;
  FragAcc dk_acc[kRegisters ? HD / 16 : 1];
  FragAcc dv_acc[kRegisters ? HD / 16 : 1];

  const int keys = min(kTile, t_len - k0);
  LoadTile<HD>(qkv + (row0 + k0) * ld3 + c + h * HD, ld3, keys, ks, ldh);
  LoadTile<HD>(qkv + (row0 + k0) * ld3 + 2 * c + h * HD, ld3, keys, vs, ldh);
  if constexpr (kRegisters) {
#pragma unroll
    for (int dt = 0; dt < HD / 16; ++dt) {
      wmma::fill_fragment(dk_acc[dt], 0.0f);
      wmma::fill_fragment(dv_acc[dt], 0.0f);
    }
  } else {
    ZeroFloats(dks, kTile * ldo);
    ZeroFloats(dvs, kTile * ldo);
  }
  const int last_query_tile = (t_len - 1) / kTile;
  for (int qt = k0 / kTile; qt <= last_query_tile; ++qt) {
    const int q0 = qt * kTile;
    const int queries = min(kTile, t_len - q0);
    __syncthreads();  // the last query tile is read no more
    LoadTile<HD>(qkv + (row0 + q0) * ld3 + h * HD, ld3, queries, qs, ldh);
    LoadTile<HD>(dy + (row0 + q0) * c + h * HD, c, queries, dos, ldh);
    LoadRowStats(lse, delta, static_cast<int64_t>(bh) * t_len + q0, queries, lse_s, delta_s);
    __syncthreads();
    float* sw = ss + warp * 16 * kScoreLd;
    float* dpw = dps + warp * 16 * kScoreLd;
    RowsTimesTransposed<HD>(qs + warp * 16 * ldh, ks, sw);
    RowsTimesTransposed<HD>(dos + warp * 16 * ldh, vs, dpw);
    __syncwarp();
    ProbabilitiesAndScoreGrads(sw, dpw, lse_s, delta_s, q0, k0, t_len, scale,
                               ps + warp * 16 * kProbLd, dss + warp * 16 * kProbLd);
    __syncthreads();  // every warp's probabilities, for the transposed products
    // Warp w: key rows 16w.. of dV += P^T dO and dK += dS^T Q.
    if constexpr (kRegisters) {
      AccumulateTransposedProduct<HD>(ps + warp * 16, dos, dv_acc);
      AccumulateTransposedProduct<HD>(dss + warp * 16, qs, dk_acc);
    } else {
      AccumulateProduct<HD, true>(ps + warp * 16, dos, dvs + warp * 16 * ldo);
      AccumulateProduct<HD, true>(dss + warp * 16, qs, dks + warp * 16 * ldo);
    }
  }
  __syncthreads();  // every warp is done with the score tiles
  if constexpr (kRegisters) {
#pragma unroll
    for (int dt = 0; dt < HD / 16; ++dt) {
      wmma::store_matrix_sync(dks + warp * 16 * ldo + dt * 16, dk_acc[dt], ldo,
                              wmma::mem_row_major);
      wmma::store_matrix_sync(dvs + warp * 16 * ldo + dt * 16, dv_acc[dt], ldo,
                              wmma::mem_row_major);
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < kTile * HD; i += kThreads) {
    const int r = i / HD;
    const int d = i - r * HD;
    if (r >= keys) continue;
    float* out = dqkv + (row0 + k0 + r) * ld3 + h * HD + d;
    out[c] = dks[r * ldo + d];
    out[2 * c] = dvs[r * ldo + d];
  }
}

// dQ of one query tile, summed over the key tiles up to it.
template <int HD>
__global__ void __launch_bounds__(kThreads)
    FlashBackwardQKernel(const float* qkv, const float* dy, const float* lse, const float* delta,
                         int t_len, int heads, float scale, float* dqkv) {
  constexpr int ldh = Ld<HD>::kHalf;
  constexpr int ldo = Ld<HD>::kAcc;
  const int bh = blockIdx.x;
  const int b = bh / heads;
  const int h = bh - b * heads;
  const int q0 = blockIdx.y * kTile;
  const int c = heads * HD;
  const int64_t ld3 = 3LL * c;
  const int64_t row0 = static_cast<int64_t>(b) * t_len;
  const int warp = threadIdx.x >> 5;

  extern __shared__ __align__(128) unsigned char smem[];
  Bf16* qs = reinterpret_cast<Bf16*>(smem);
  Bf16* dos = qs + kTile * ldh;
  Bf16* ks = dos + kTile * ldh;
  Bf16* vs = ks + kTile * ldh;
  float* ss = reinterpret_cast<float*>(vs + kTile * ldh);
  float* dps = ss + kTile * kScoreLd;
  Bf16* dss = reinterpret_cast<Bf16*>(dps + kTile * kScoreLd);
  float* dqs = reinterpret_cast<float*>(dss + kTile * kProbLd);
  float* lse_s = dqs + kTile * ldo;
  float* delta_s = lse_s + kTile;

  const int queries = min(kTile, t_len - q0);
  LoadTile<HD>(qkv + (row0 + q0) * ld3 + h * HD, ld3, queries, qs, ldh);
  LoadTile<HD>(dy + (row0 + q0) * c + h * HD, c, queries, dos, ldh);
  LoadRowStats(lse, delta, static_cast<int64_t>(bh) * t_len + q0, queries, lse_s, delta_s);
  ZeroFloats(dqs, kTile * ldo);
  float* sw = ss + warp * 16 * kScoreLd;
  float* dpw = dps + warp * 16 * kScoreLd;
  Bf16* dsw = dss + warp * 16 * kProbLd;
  const int last_key_tile = min(q0 + kTile - 1, t_len - 1) / kTile;
  for (int kt = 0; kt <= last_key_tile; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the last key tile is read no more (and Q, dO are ready)
    LoadTile<HD>(qkv + (row0 + k0) * ld3 + c + h * HD, ld3, min(kTile, t_len - k0), ks, ldh);
    LoadTile<HD>(qkv + (row0 + k0) * ld3 + 2 * c + h * HD, ld3, min(kTile, t_len - k0), vs, ldh);
    __syncthreads();
    RowsTimesTransposed<HD>(qs + warp * 16 * ldh, ks, sw);
    RowsTimesTransposed<HD>(dos + warp * 16 * ldh, vs, dpw);
    __syncwarp();
    ProbabilitiesAndScoreGrads(sw, dpw, lse_s, delta_s, q0, k0, t_len, scale, nullptr, dsw);
    __syncwarp();
    // dQ (16 rows) += dS K.
    AccumulateProduct<HD, false>(dsw, ks, dqs + warp * 16 * ldo);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTile * HD; i += kThreads) {
    const int r = i / HD;
    const int d = i - r * HD;
    if (r >= queries) continue;
    dqkv[(row0 + q0 + r) * ld3 + h * HD + d] = dqs[r * ldo + d];
  }
}

template <int HD>
constexpr size_t ForwardSmem() {
  return sizeof(Bf16) * 3 * kTile * Ld<HD>::kHalf + sizeof(float) * kTile * kScoreLd +
         sizeof(Bf16) * kTile * kProbLd + sizeof(float) * kTile * Ld<HD>::kAcc;
}
template <int HD, bool kRegisters>
constexpr size_t BackwardKvSmem() {
  return sizeof(Bf16) * 4 * kTile * Ld<HD>::kHalf + sizeof(float) * 2 * kTile * kScoreLd +
         sizeof(Bf16) * 2 * kTile * kProbLd +
         (kRegisters ? 0 : sizeof(float) * 2 * kTile * Ld<HD>::kAcc) + sizeof(float) * 2 * kTile;
}
template <int HD>
constexpr size_t BackwardQSmem() {
  return sizeof(Bf16) * 4 * kTile * Ld<HD>::kHalf + sizeof(float) * 2 * kTile * kScoreLd +
         sizeof(Bf16) * kTile * kProbLd + sizeof(float) * kTile * Ld<HD>::kAcc +
         sizeof(float) * 2 * kTile;
}

absl::Status CheckSizes(int64_t batch, int64_t t_len, int64_t heads, int64_t head_dim) {
  if (!FlashAttentionSupports(head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash attention: head size ", head_dim, " (supported: 32, 64, 96, 128)"));
  }
  if (batch < 1 || t_len < 1 || heads < 1 || batch * heads > INT32_MAX ||
      t_len > int64_t{65535} * kTile || heads * head_dim * 3 > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash attention: batch ", batch, ", length ", t_len, ", heads ", heads));
  }
  return absl::OkStatus();
}

// The tiles are loaded 16 bytes at a time (LoadTile).
absl::Status CheckAligned(const char* what, const float* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash attention: ", what, " is not 16-byte aligned"));
  }
  return absl::OkStatus();
}

template <int HD>
absl::Status Forward(cudaStream_t stream, const float* qkv, int64_t batch, int64_t t_len,
                     int64_t heads, float scale, float* y, float* lse) {
  constexpr size_t smem = ForwardSmem<HD>();
  AIDN_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(
      FlashForwardKernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(batch * heads),
                  static_cast<unsigned>((t_len + kTile - 1) / kTile));
  FlashForwardKernel<HD><<<grid, kThreads, smem, stream>>>(qkv, static_cast<int>(t_len),
                                                           static_cast<int>(heads), scale, y, lse);
  AIDN_RETURN_IF_LAUNCH_FAILED("FlashForwardKernel");
  return absl::OkStatus();
}

template <int HD>
absl::Status Backward(cudaStream_t stream, const float* qkv, const float* dy, const float* lse,
                      const float* delta, int64_t batch, int64_t t_len, int64_t heads, float scale,
                      float* dqkv) {
  const dim3 grid(static_cast<unsigned>(batch * heads),
                  static_cast<unsigned>((t_len + kTile - 1) / kTile));
  // AIDN_FLASH_KV_SMEM=1 keeps dK and dV in shared memory at every head
  // size (the two kernels are measured against each other).
  static const bool smem_sums = [] {
    const char* v = std::getenv("AIDN_FLASH_KV_SMEM");
    return v != nullptr && std::string_view(v) == "1";
  }();
  if constexpr (Ld<HD>::kAcc <= kScoreLd) {
    if (!smem_sums) {
      constexpr size_t kv_smem = BackwardKvSmem<HD, true>();
      AIDN_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(FlashBackwardKvKernel<HD, true>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     static_cast<int>(kv_smem)));
      FlashBackwardKvKernel<HD, true><<<grid, kThreads, kv_smem, stream>>>(
          qkv, dy, lse, delta, static_cast<int>(t_len), static_cast<int>(heads), scale, dqkv);
      AIDN_RETURN_IF_LAUNCH_FAILED("FlashBackwardKvKernel");
    }
  }
  if (smem_sums || Ld<HD>::kAcc > kScoreLd) {
    constexpr size_t kv_smem = BackwardKvSmem<HD, false>();
    AIDN_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(FlashBackwardKvKernel<HD, false>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(kv_smem)));
    FlashBackwardKvKernel<HD, false><<<grid, kThreads, kv_smem, stream>>>(
        qkv, dy, lse, delta, static_cast<int>(t_len), static_cast<int>(heads), scale, dqkv);
    AIDN_RETURN_IF_LAUNCH_FAILED("FlashBackwardKvKernel");
  }
  constexpr size_t q_smem = BackwardQSmem<HD>();
  AIDN_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(FlashBackwardQKernel<HD>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(q_smem)));
  FlashBackwardQKernel<HD><<<grid, kThreads, q_smem, stream>>>(
      qkv, dy, lse, delta, static_cast<int>(t_len), static_cast<int>(heads), scale, dqkv);
  AIDN_RETURN_IF_LAUNCH_FAILED("FlashBackwardQKernel");
  return absl::OkStatus();
}

}  // namespace

bool FlashAttentionSupports(int64_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128;
}

namespace {

// What the default kernels take (the dK/dV sums in registers where the
// head size allows: at 64, 99 KB, within sm_86/89's limit). With
// AIDN_FLASH_KV_SMEM=1 the backward may need more than a device allows;
// its launch then fails with CUDA's error.
template <int HD>
constexpr size_t LargestSmem() {
  return std::max(
      {ForwardSmem<HD>(), BackwardKvSmem<HD, Ld<HD>::kAcc <= kScoreLd>(), BackwardQSmem<HD>()});
}

}  // namespace

bool FlashAttentionFits(int64_t head_dim, int device) {
  if (!FlashAttentionSupports(head_dim)) return false;
  int limit = 0;
  if (cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
      cudaSuccess) {
    cudaGetLastError();  // not sticky; clear it
    return false;
  }
  size_t need = 0;
  switch (head_dim) {
    case 32:
      need = LargestSmem<32>();
      break;
    case 64:
      need = LargestSmem<64>();
      break;
    case 96:
      need = LargestSmem<96>();
      break;
    default:
      need = LargestSmem<128>();
      break;
  }
  return need <= static_cast<size_t>(limit);
}

absl::Status LaunchFlashAttentionForward(cudaStream_t stream, const float* qkv, int64_t batch,
                                         int64_t t_len, int64_t heads, int64_t head_dim,
                                         float scale, float* y, float* lse) {
  AIDN_RETURN_IF_ERROR(CheckSizes(batch, t_len, heads, head_dim));
  AIDN_RETURN_IF_ERROR(CheckAligned("qkv", qkv));
  switch (head_dim) {
    case 32:
      return Forward<32>(stream, qkv, batch, t_len, heads, scale, y, lse);
    case 64:
      return Forward<64>(stream, qkv, batch, t_len, heads, scale, y, lse);
    case 96:
      return Forward<96>(stream, qkv, batch, t_len, heads, scale, y, lse);
    default:
      return Forward<128>(stream, qkv, batch, t_len, heads, scale, y, lse);
  }
}

absl::Status LaunchFlashAttentionBackward(cudaStream_t stream, const float* qkv, const float* y,
                                          const float* dy, const float* lse, int64_t batch,
                                          int64_t t_len, int64_t heads, int64_t head_dim,
                                          float scale, float* dqkv, float* delta) {
  AIDN_RETURN_IF_ERROR(CheckSizes(batch, t_len, heads, head_dim));
  AIDN_RETURN_IF_ERROR(CheckAligned("qkv", qkv));
  AIDN_RETURN_IF_ERROR(CheckAligned("the output gradient", dy));
  const int64_t rows = batch * t_len;
  const int64_t warps = rows * heads;
  const int64_t per_block = kThreads / 32;
  FlashDeltaKernel<<<static_cast<unsigned>((warps + per_block - 1) / per_block), kThreads, 0,
                     stream>>>(y, dy, rows, static_cast<int>(t_len), static_cast<int>(heads),
                               static_cast<int>(head_dim), delta);
  AIDN_RETURN_IF_LAUNCH_FAILED("FlashDeltaKernel");
  switch (head_dim) {
    case 32:
      return Backward<32>(stream, qkv, dy, lse, delta, batch, t_len, heads, scale, dqkv);
    case 64:
      return Backward<64>(stream, qkv, dy, lse, delta, batch, t_len, heads, scale, dqkv);
    case 96:
      return Backward<96>(stream, qkv, dy, lse, delta, batch, t_len, heads, scale, dqkv);
    default:
      return Backward<128>(stream, qkv, dy, lse, delta, batch, t_len, heads, scale, dqkv);
  }
}

}  // namespace aidn::engine::cuda
