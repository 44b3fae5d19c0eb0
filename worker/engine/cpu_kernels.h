#ifndef AIDN_WORKER_ENGINE_CPU_KERNELS_H_
#define AIDN_WORKER_ENGINE_CPU_KERNELS_H_

// The CPU engine's raw loops (cpu_kernels.cc), beside the layers that call
// them (layers.cc) as cuda/kernels.h sits beside the GPU layers: plain
// pointers and element counts, no tensors, no shape checks (the layers
// check). A count of zero touches nothing.
//
// Every result is bit-for-bit what the obvious scalar loop gives: the
// elementwise kernels are compiled for SSE2, AVX2 and AVX-512 (simd.h) and
// picked at load time (AIDN_VECTOR_CLONES on their definitions), and no
// clone reorders or fuses a float operation.
// `__restrict` pointers must not alias; "in place" kernels take one pointer.
//
// Thread-compatible: no state.

#include <cstdint>
#include <cstring>
#include <random>

namespace aidn::engine::cpu {

// Copies `n` floats.
inline void Copy(const float* src, float* dst, int64_t n) {
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

// ---- Elementwise

// y = max(x, 0)
void ReluKernel(const float* __restrict x, float* __restrict y, int64_t n);
// gx = x > 0 ? g : 0 (x: the ReLU's input, or its output: positive at the
// same places)
void ReluGradKernel(const float* __restrict x, const float* __restrict g, float* __restrict gx,
                    int64_t n);
// y = max(y, 0)
void ReluInPlace(float* y, int64_t n);
// y = max(a * scale + b, 0) (a residual sum: a * 1 is a, exactly)
void ScaledAddReluKernel(const float* __restrict a, float scale, const float* __restrict b,
                         float* __restrict y, int64_t n);
// y = max(x + c, 0)
void AddScalarReluKernel(const float* __restrict x, float c, float* __restrict y, int64_t n);
// y += c
void AddScalarInPlace(float* y, float c, int64_t n);
// y = max(y + c, 0)
void AddScalarReluInPlace(float* y, float c, int64_t n);
// y = a * b
void MulKernel(const float* __restrict a, const float* __restrict b, float* __restrict y,
               int64_t n);
// y += x
void AccumulateKernel(const float* __restrict x, float* __restrict y, int64_t n);
// y = x + c
void AddScalarKernel(const float* __restrict x, float c, float* __restrict y, int64_t n);
// The sum of x in 16 interleaved partial sums, added up in order at the
// end, then the tail: a fixed order for a given n.
float SumKernel(const float* __restrict x, int64_t n);

// ---- Convolution (im2col)

// One sample's convolution geometry.
struct ConvShape {
  int64_t channels;
  int64_t height;
  int64_t width;
  int64_t kernel;
  int64_t stride;
  int64_t padding;
  int64_t out_height;
  int64_t out_width;
};

// im2col of one sample x [C, H, W]: row (c, ki, kj), at dst + row * ld,
// column (oh, ow) = x[c, oh*s-p+ki, ow*s-p+kj], or 0 in the padding.
void Im2Col(const float* __restrict x, const ConvShape& s, float* __restrict dst, int64_t ld);
// The adjoint of Im2Col: adds each column entry back onto the input element
// it was read from. `gx` [C, H, W] must hold zeros (or what to add to).
void Col2Im(const float* __restrict src, int64_t ld, const ConvShape& s, float* __restrict gx);

// ---- Max pooling

// MaxPool2d with kernel 2 and stride 2 (the CNN's), one plane [h, w] ->
// [h/2, w/2]: each output the first maximum of its window in row-major
// order (strictly greater replaces), `arg` its offset in the plane.
void MaxPool2x2Plane(const float* __restrict x, int64_t h, int64_t w, float* __restrict y,
                     int32_t* __restrict arg);
// Its backward: writes every element of the input gradient plane gx [h, w]
// (the winner of each window gets its output's gradient, all else 0). With
// `y` (the pooled outputs) not null, a ReLU before the pool is folded in:
// a gradient passes only where y > 0.
void MaxPool2x2PlaneBackward(const float* __restrict g, const float* __restrict y,
                             const int32_t* __restrict arg, int64_t h, int64_t w,
                             float* __restrict gx);
// Any kernel and stride, one plane of width `w` -> [oh, ow], with the same
// first-maximum rule and `arg` as MaxPool2x2Plane.
void MaxPoolPlane(const float* __restrict x, int64_t w, int64_t kernel, int64_t stride, int64_t oh,
                  int64_t ow, float* __restrict y, int32_t* __restrict arg);
// Its backward: gx[arg[i]] += g[i] for the plane's `out_plane` outputs
// (windows may overlap); gx must hold zeros (or what to add to).
void MaxPoolPlaneBackward(const float* __restrict g, const int32_t* __restrict arg,
                          int64_t out_plane, float* __restrict gx);

// ---- Dropout

// The inverted-dropout mask for drop probability p in [0, 1): m[i] =
// 1/(1-p) where kept, else 0, from two 32-bit uniforms per draw of `rng`.
void DropoutMask(std::mt19937_64& rng, double p, float* m, int64_t n);

}  // namespace aidn::engine::cpu

#endif  // AIDN_WORKER_ENGINE_CPU_KERNELS_H_
