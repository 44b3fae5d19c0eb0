#include "worker/engine/cuda/gpu_layers.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/dropout_mask.h"
#include "worker/engine/cuda/gpu_gemm.h"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/cuda/status.h"
#include "worker/engine/layers.h"

namespace aidn::engine::cuda {
namespace {

constexpr float kOne = 1.0f;
constexpr float kZero = 0.0f;

bool FitsInt(int64_t v) { return v >= 0 && v <= INT_MAX; }

absl::Status BadShape(const std::string& layer, const std::string& what, const GpuTensor& t) {
  return absl::InvalidArgumentError(absl::StrCat(layer, " got ", what, " ", t.ShapeString()));
}

// A parameter of `shape`, zero-filled, gradient zero-filled.
absl::Status InitParameter(GpuContext* ctx, const std::string& name,
                           const std::vector<int64_t>& shape, GpuParameter* p) {
  p->name = name;
  AIDN_RETURN_IF_ERROR(p->value.Resize(ctx, shape));
  AIDN_RETURN_IF_ERROR(p->value.Zero(ctx));
  AIDN_RETURN_IF_ERROR(p->grad.Resize(ctx, shape));
  return p->grad.Zero(ctx);
}

absl::Status CopyDeviceToDevice(GpuContext* ctx, const float* src, float* dst, int64_t n) {
  if (n == 0 || src == dst) return absl::OkStatus();
  AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dst, src, sizeof(float) * static_cast<size_t>(n),
                                            cudaMemcpyDeviceToDevice, ctx->stream()));
  return absl::OkStatus();
}

bool IsHalf(const GpuContext* ctx) { return ctx->options().precision != Precision::kFp32; }

HalfType HalfOf(const GpuContext* ctx) {
  return ctx->options().precision == Precision::kBf16 ? HalfType::kBf16 : HalfType::kFp16;
}

cudaDataType_t CublasHalf(const GpuContext* ctx) {
  return ctx->options().precision == Precision::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
}

cudnnDataType_t CudnnDataType(const GpuContext* ctx) {
  switch (ctx->options().precision) {
    case Precision::kBf16:
      return CUDNN_DATA_BFLOAT16;
    case Precision::kFp16:
      return CUDNN_DATA_HALF;
    case Precision::kFp32:
      break;
  }
  return CUDNN_DATA_FLOAT;
}

// C (fp32, column-major m x n, ld ldc) = alpha op(A) op(B) + beta C with A
// and B 16-bit, accumulated in fp32 on the tensor cores.
absl::Status HalfGemm(GpuContext* ctx, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                      int k, const void* a, int lda, const void* b, int ldb, float beta, float* c,
                      int ldc) {
  const cudaDataType_t t = CublasHalf(ctx);
  AIDN_RETURN_IF_CUBLAS_ERROR(cublasGemmEx(ctx->cublas(), ta, tb, m, n, k, &kOne, a, t, lda, b, t,
                                           ldb, &beta, c, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                                           CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

bool IsTensorOpMath(cudnnMathType_t math) {
  return math == CUDNN_TENSOR_OP_MATH || math == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
}

// FFT and Winograd algorithms (GpuContextOptions::allow_transform_convolutions).
bool IsTransform(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_FFT || a == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
}
bool IsTransform(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
}
bool IsTransform(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
}

// Tensor-core math: for TF32 when allowed, always for 16-bit operands.
bool TensorOpsAllowed(const GpuContextOptions& options) {
  return options.allow_tf32 || options.precision != Precision::kFp32;
}

// The first usable result in cuDNN's order (fastest first for Find, best
// guess first for Get_v7): it succeeded, fits the workspace limit, does not
// use tensor cores unless TF32 is allowed nor FFT/Winograd unless those are
// allowed, and, on the first pass when deterministic convolutions are
// asked for, is deterministic (so that two runs of a step give the same
// bits).
template <typename Perf>
const Perf* PickAlgorithm(const std::vector<Perf>& perf, int returned,
                          const GpuContextOptions& options) {
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < returned; ++i) {
      const Perf& p = perf[static_cast<size_t>(i)];
      if (p.status != CUDNN_STATUS_SUCCESS || p.memory > options.max_workspace_bytes) continue;
      if (!TensorOpsAllowed(options) && IsTensorOpMath(p.mathType)) continue;
      if (!options.allow_transform_convolutions && IsTransform(p.algo)) continue;
      if (pass == 0 && options.deterministic_convolutions && p.determinism != CUDNN_DETERMINISTIC) {
        continue;
      }
      return &p;
    }
  }
  return nullptr;
}

// The start of Linear's and Conv2d's backward: the backward of a fused ReLU
// when `output` (the layer's output, positive exactly where the ReLU's input
// was) is not null, into `masked`; then the bias gradient, its scratch in
// `partials` (grown as needed). Returns the gradient of the pre-activation
// output: `grad_output`'s data, or `masked`'s.
// dbias may be null (a layer without a bias): the ReLU's mask alone.
absl::StatusOr<const float*> ReluAndBiasBackward(GpuContext* ctx, const GpuTensor& grad_output,
                                                 const GpuTensor* output, int64_t batch,
                                                 int64_t channels, int64_t inner, GpuTensor* masked,
                                                 GpuTensor* partials, GpuTensor* dbias) {
  const float* g = grad_output.data();
  if (output != nullptr) {
    AIDN_RETURN_IF_ERROR(masked->Resize(ctx, grad_output.shape()));
    AIDN_RETURN_IF_ERROR(
        LaunchReluBackward(ctx->stream(), output->data(), g, masked->data(), grad_output.numel()));
    g = masked->data();
  }
  if (dbias == nullptr) return g;
  const int64_t floats = std::max<int64_t>(BiasGradScratchFloats(batch, channels, inner), 1);
  AIDN_RETURN_IF_ERROR(partials->Resize(ctx, {floats}));
  AIDN_RETURN_IF_ERROR(LaunchBiasGrad(ctx->stream(), g, dbias->data(), batch, channels, inner,
                                      partials->data(), floats));
  return g;
}

}  // namespace

// ---------------------------------------------------------------- Linear
//
// cuBLAS is column-major: a row-major [r, c] matrix is, to cuBLAS, the
// column-major [c, r] matrix (its transpose) with leading dimension c. So
// with x [n, in], W [out, in], y [n, out] row-major:
//   y = x W^T    <=>  y^T [out, n] = W [out, in] (= op T of W's storage
//                     [in, out], ld in) * x^T [in, n] (x's storage, ld in)
//   dx = g W     <=>  dx^T [in, n] = W^T [in, out] (W's storage, ld in, op N)
//                     * g^T [out, n] (g's storage, ld out, op N)
//   dW += g^T x  <=>  dW^T [in, out] = x^T [in, n] (x's storage, ld in, op N)
//                     * g [n, out] (op T of g's storage [out, n], ld out)

absl::StatusOr<std::unique_ptr<GpuLinear>> GpuLinear::Create(GpuContext* ctx, int64_t in_features,
                                                             int64_t out_features) {
  if (in_features <= 0 || out_features <= 0 || !FitsInt(in_features) || !FitsInt(out_features)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Linear(", in_features, ", ", out_features, "): bad sizes"));
  }
  std::unique_ptr<GpuLinear> layer(new GpuLinear(ctx, in_features, out_features));
  AIDN_RETURN_IF_ERROR(InitParameter(ctx, "weight", {out_features, in_features}, &layer->weight_));
  AIDN_RETURN_IF_ERROR(InitParameter(ctx, "bias", {out_features}, &layer->bias_));
  return layer;
}

std::string GpuLinear::Describe() const {
  return absl::StrCat("Linear(in_features=", in_, ", out_features=", out_, ", bias=True)");
}

bool GpuLinear::Fuse(const GpuLayer& next) {
  if (fused_relu_ || dynamic_cast<const GpuReLU*>(&next) == nullptr) return false;
  fused_relu_ = true;
  return true;
}

absl::Status GpuLinear::Forward(const GpuTensor& input, GpuTensor* output, bool /*training*/) {
  if (input.rank() != 2 || input.dim(1) != in_ || !FitsInt(input.dim(0))) {
    return BadShape(Describe(), "input", input);
  }
  const int64_t n = input.dim(0);
  AIDN_RETURN_IF_ERROR(output->Resize(ctx_, {n, out_}));
  input_ = &input;
  output_ = output;
  if (n == 0) return absl::OkStatus();
  const int m = static_cast<int>(out_);
  const int k = static_cast<int>(in_);
  if (IsHalf(ctx_)) {
    // Backward reuses both rounded operands.
    AIDN_ASSIGN_OR_RETURN(void* xh, RoundToHalf(ctx_, input.data(), n * in_, &x_half_));
    AIDN_ASSIGN_OR_RETURN(void* wh, RoundToHalf(ctx_, weight_.value.data(), out_ * in_, &w_half_));
    AIDN_RETURN_IF_ERROR(HalfGemm(ctx_, CUBLAS_OP_T, CUBLAS_OP_N, m, static_cast<int>(n), k, wh, k,
                                  xh, k, kZero, output->data(), m));
  } else {
    AIDN_RETURN_IF_CUBLAS_ERROR(cublasSgemm(ctx_->cublas(), CUBLAS_OP_T, CUBLAS_OP_N, m,
                                            static_cast<int>(n), k, &kOne, weight_.value.data(), k,
                                            input.data(), k, &kZero, output->data(), m));
  }
  return LaunchBiasActivation(ctx_->stream(), output->data(), bias_.value.data(), output->data(),
                              n * out_, out_, 1, fused_relu_);
}

absl::Status GpuLinear::Backward(const GpuTensor& grad_output, GpuTensor* grad_input) {
  if (input_ == nullptr) return absl::FailedPreconditionError("Linear::Backward before Forward");
  const GpuTensor& x = *input_;
  const int64_t n = x.dim(0);
  if (grad_output.rank() != 2 || grad_output.dim(0) != n || grad_output.dim(1) != out_) {
    return BadShape(Describe(), "grad_output", grad_output);
  }
  const float* g = grad_output.data();
  const int in = static_cast<int>(in_);
  const int out = static_cast<int>(out_);
  const int batch = static_cast<int>(n);
  if (n > 0) {
    AIDN_ASSIGN_OR_RETURN(
        g, ReluAndBiasBackward(ctx_, grad_output, fused_relu_ ? output_ : nullptr, n, out_, 1,
                               &masked_grad_, &bias_partials_, &bias_.grad));
  }
  const bool half = IsHalf(ctx_);
  void* gh = nullptr;
  if (half && n > 0) {
    AIDN_ASSIGN_OR_RETURN(gh, RoundToHalf(ctx_, g, n * out_, &g_half_));
  }
  if (n > 0) {
    if (half) {
      AIDN_RETURN_IF_ERROR(HalfGemm(ctx_, CUBLAS_OP_N, CUBLAS_OP_T, in, out, batch, x_half_.data(),
                                    in, gh, out, kOne, weight_.grad.data(), in));
    } else {
      AIDN_RETURN_IF_CUBLAS_ERROR(cublasSgemm(ctx_->cublas(), CUBLAS_OP_N, CUBLAS_OP_T, in, out,
                                              batch, &kOne, x.data(), in, g, out, &kOne,
                                              weight_.grad.data(), in));
    }
  }
  if (grad_input != nullptr) {
    AIDN_RETURN_IF_ERROR(grad_input->Resize(ctx_, {n, in_}));
    if (n > 0 && half) {
      AIDN_RETURN_IF_ERROR(HalfGemm(ctx_, CUBLAS_OP_N, CUBLAS_OP_N, in, batch, out, w_half_.data(),
                                    in, gh, out, kZero, grad_input->data(), in));
    } else if (n > 0) {
      AIDN_RETURN_IF_CUBLAS_ERROR(cublasSgemm(ctx_->cublas(), CUBLAS_OP_N, CUBLAS_OP_N, in, batch,
                                              out, &kOne, weight_.value.data(), in, g, out, &kZero,
                                              grad_input->data(), in));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- ReLU

absl::Status GpuReLU::Forward(const GpuTensor& input, GpuTensor* output, bool /*training*/) {
  AIDN_RETURN_IF_ERROR(output->Resize(ctx_, input.shape()));
  input_ = &input;
  return LaunchRelu(ctx_->stream(), input.data(), output->data(), input.numel());
}

absl::Status GpuReLU::Backward(const GpuTensor& grad_output, GpuTensor* grad_input) {
  if (input_ == nullptr) return absl::FailedPreconditionError("ReLU::Backward before Forward");
  if (grad_output.numel() != input_->numel()) return BadShape("ReLU", "grad_output", grad_output);
  if (grad_input == nullptr) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(grad_input->Resize(ctx_, input_->shape()));
  return LaunchReluBackward(ctx_->stream(), input_->data(), grad_output.data(), grad_input->data(),
                            input_->numel());
}

// ---------------------------------------------------------------- Conv2d

absl::StatusOr<std::unique_ptr<GpuConv2d>> GpuConv2d::Create(GpuContext* ctx, int64_t in_channels,
                                                             int64_t out_channels, int64_t kernel,
                                                             int64_t stride, int64_t padding,
                                                             bool bias) {
  if (in_channels <= 0 || out_channels <= 0 || kernel <= 0 || stride <= 0 || padding < 0 ||
      !FitsInt(in_channels) || !FitsInt(out_channels) || !FitsInt(kernel) || !FitsInt(padding) ||
      !FitsInt(stride)) {
    return absl::InvalidArgumentError(absl::StrCat("Conv2d(", in_channels, ", ", out_channels,
                                                   ", kernel ", kernel, ", stride ", stride,
                                                   ", padding ", padding, "): bad sizes"));
  }
  std::unique_ptr<GpuConv2d> layer(
      new GpuConv2d(ctx, in_channels, out_channels, kernel, stride, padding));
  layer->has_bias_ = bias;
  AIDN_RETURN_IF_ERROR(layer->Init());
  return layer;
}

absl::Status GpuConv2d::Init() {
  AIDN_RETURN_IF_ERROR(InitParameter(ctx_, "weight", {out_, in_, kernel_, kernel_}, &weight_));
  AIDN_RETURN_IF_ERROR(InitParameter(ctx_, "bias", {out_}, &bias_));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnCreateTensorDescriptor(&x_desc_));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnCreateTensorDescriptor(&y_desc_));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnCreateFilterDescriptor(&w_desc_));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnCreateConvolutionDescriptor(&conv_desc_));
  const int k = static_cast<int>(kernel_);
  data_type_ = CudnnDataType(ctx_);
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetFilter4dDescriptor(
      w_desc_, data_type_, CUDNN_TENSOR_NCHW, static_cast<int>(out_), static_cast<int>(in_), k, k));
  const int pad = static_cast<int>(padding_);
  const int stride = static_cast<int>(stride_);
  // Cross-correlation, as torch's Conv2d (no kernel flip); fp32 compute
  // for 16-bit data too (cuDNN's "pseudo" half and bfloat16 configurations).
  AIDN_RETURN_IF_CUDNN_ERROR(
      cudnnSetConvolution2dDescriptor(conv_desc_, pad, pad, stride, stride, /*dilation_h=*/1,
                                      /*dilation_w=*/1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  return absl::OkStatus();
}

GpuConv2d::~GpuConv2d() {
  if (conv_desc_ != nullptr) cudnnDestroyConvolutionDescriptor(conv_desc_);
  if (w_desc_ != nullptr) cudnnDestroyFilterDescriptor(w_desc_);
  if (y_desc_ != nullptr) cudnnDestroyTensorDescriptor(y_desc_);
  if (x_desc_ != nullptr) cudnnDestroyTensorDescriptor(x_desc_);
}

std::string GpuConv2d::Describe() const {
  std::string s = absl::StrCat("Conv2d(", in_, ", ", out_, ", kernel_size=(", kernel_, ", ",
                               kernel_, "), stride=(", stride_, ", ", stride_, ")");
  if (padding_ != 0) absl::StrAppend(&s, ", padding=(", padding_, ", ", padding_, ")");
  if (!has_bias_) s += ", bias=False";
  return s + ")";
}

bool GpuConv2d::Fuse(const GpuLayer& next) {
  if (fused_relu_ || dynamic_cast<const GpuReLU*>(&next) == nullptr) return false;
  fused_relu_ = true;
  return true;
}

absl::Status GpuConv2d::ChooseAlgorithms(Algorithms* algos) {
  const bool tf32 = TensorOpsAllowed(ctx_->options());
  const bool benchmark = ctx_->options().benchmark_convolutions;
  cudnnHandle_t h = ctx_->cudnn();
  // FMA math keeps fp32 convolutions off the tensor cores (cuDNN's default
  // math would use TF32 for them on Ampere and newer); 16-bit operands go
  // to the tensor cores.
  const cudnnMathType_t base_math = !tf32          ? CUDNN_FMA_MATH
                                    : IsHalf(ctx_) ? CUDNN_TENSOR_OP_MATH
                                                   : CUDNN_DEFAULT_MATH;
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetConvolutionMathType(conv_desc_, base_math));
  // The math type an algorithm runs with: the one cuDNN measured it with
  // when tensor cores are allowed (TF32, 16-bit), else FMA (PickAlgorithm
  // only returns non-tensor-op results then).
  auto math_for = [&](cudnnMathType_t measured) { return tf32 ? measured : CUDNN_FMA_MATH; };

  {
    int max_count = 0;
    AIDN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionForwardAlgorithmMaxCount(h, &max_count));
    std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(static_cast<size_t>(max_count));
    int returned = 0;
    bool found = false;
    if (benchmark) {
      // Times every algorithm (on cuDNN's own scratch memory) and sorts the
      // results fastest first; falls back to the heuristics on failure.
      found =
          cudnnFindConvolutionForwardAlgorithm(h, x_desc_, w_desc_, conv_desc_, y_desc_, max_count,
                                               &returned, perf.data()) == CUDNN_STATUS_SUCCESS;
    }
    if (!found) {
      AIDN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionForwardAlgorithm_v7(
          h, x_desc_, w_desc_, conv_desc_, y_desc_, max_count, &returned, perf.data()));
    }
    const cudnnConvolutionFwdAlgoPerf_t* p = PickAlgorithm(perf, returned, ctx_->options());
    if (p == nullptr) {
      return absl::UnimplementedError(Describe() + ": no usable cuDNN forward algorithm");
    }
    algos->forward = p->algo;
    algos->forward_math = math_for(p->mathType);
  }
  {
    int max_count = 0;
    AIDN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(h, &max_count));
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perf(static_cast<size_t>(max_count));
    int returned = 0;
    bool found = false;
    if (benchmark) {
      found = cudnnFindConvolutionBackwardDataAlgorithm(h, w_desc_, y_desc_, conv_desc_, x_desc_,
                                                        max_count, &returned,
                                                        perf.data()) == CUDNN_STATUS_SUCCESS;
    }
    if (!found) {
      AIDN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardDataAlgorithm_v7(
          h, w_desc_, y_desc_, conv_desc_, x_desc_, max_count, &returned, perf.data()));
    }
    const cudnnConvolutionBwdDataAlgoPerf_t* p = PickAlgorithm(perf, returned, ctx_->options());
    if (p == nullptr) {
      return absl::UnimplementedError(Describe() + ": no usable cuDNN backward-data algorithm");
    }
    algos->backward_data = p->algo;
    algos->backward_data_math = math_for(p->mathType);
  }
  {
    int max_count = 0;
    AIDN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(h, &max_count));
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perf(static_cast<size_t>(max_count));
    int returned = 0;
    bool found = false;
    if (benchmark) {
      found = cudnnFindConvolutionBackwardFilterAlgorithm(h, x_desc_, y_desc_, conv_desc_, w_desc_,
                                                          max_count, &returned,
                                                          perf.data()) == CUDNN_STATUS_SUCCESS;
    }
    if (!found) {
      AIDN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
          h, x_desc_, y_desc_, conv_desc_, w_desc_, max_count, &returned, perf.data()));
    }
    const cudnnConvolutionBwdFilterAlgoPerf_t* p = PickAlgorithm(perf, returned, ctx_->options());
    if (p == nullptr) {
      return absl::UnimplementedError(Describe() + ": no usable cuDNN backward-filter algorithm");
    }
    algos->backward_filter = p->algo;
    algos->backward_filter_math = math_for(p->mathType);
  }

  // The workspace each needs with the math type it will run with.
  size_t bytes = 0;
  size_t ws = 0;
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetConvolutionMathType(conv_desc_, algos->forward_math));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionForwardWorkspaceSize(
      h, x_desc_, w_desc_, conv_desc_, y_desc_, algos->forward, &ws));
  bytes = std::max(bytes, ws);
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetConvolutionMathType(conv_desc_, algos->backward_data_math));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardDataWorkspaceSize(
      h, w_desc_, y_desc_, conv_desc_, x_desc_, algos->backward_data, &ws));
  bytes = std::max(bytes, ws);
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetConvolutionMathType(conv_desc_, algos->backward_filter_math));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardFilterWorkspaceSize(
      h, x_desc_, y_desc_, conv_desc_, w_desc_, algos->backward_filter, &ws));
  bytes = std::max(bytes, ws);
  algos->workspace_bytes = bytes;
  return absl::OkStatus();
}

absl::Status GpuConv2d::Prepare(int64_t n, int64_t h, int64_t w) {
  const auto key = std::make_tuple(n, h, w);
  if (key == shape_ && current_ != nullptr) return absl::OkStatus();
  // Any failure below leaves the descriptors half-set: forget the shape.
  shape_ = {-1, -1, -1};
  current_ = nullptr;
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetTensor4dDescriptor(x_desc_, CUDNN_TENSOR_NCHW, data_type_,
                                                        static_cast<int>(n), static_cast<int>(in_),
                                                        static_cast<int>(h), static_cast<int>(w)));
  int dn = 0, dc = 0, dh = 0, dw = 0;
  AIDN_RETURN_IF_CUDNN_ERROR(
      cudnnGetConvolution2dForwardOutputDim(conv_desc_, x_desc_, w_desc_, &dn, &dc, &dh, &dw));
  if (dn != n || dc != out_ || dh != out_h_ || dw != out_w_) {
    return absl::InternalError(absl::StrCat(Describe(), ": cuDNN's output shape [", dn, ", ", dc,
                                            ", ", dh, ", ", dw, "] differs from [", n, ", ", out_,
                                            ", ", out_h_, ", ", out_w_, "]"));
  }
  AIDN_RETURN_IF_CUDNN_ERROR(
      cudnnSetTensor4dDescriptor(y_desc_, CUDNN_TENSOR_NCHW, data_type_, dn, dc, dh, dw));
  auto it = algorithms_.find(key);
  if (it == algorithms_.end()) {
    Algorithms algos;
    AIDN_RETURN_IF_ERROR(ChooseAlgorithms(&algos));
    it = algorithms_.emplace(key, algos).first;
  }
  current_ = &it->second;
  shape_ = key;
  return absl::OkStatus();
}

absl::Status GpuConv2d::Forward(const GpuTensor& input, GpuTensor* output, bool /*training*/) {
  if (input.rank() != 4 || input.dim(1) != in_ || !FitsInt(input.dim(0)) ||
      !FitsInt(input.dim(2)) || !FitsInt(input.dim(3)) || input.dim(2) + 2 * padding_ < kernel_ ||
      input.dim(3) + 2 * padding_ < kernel_) {
    return BadShape(Describe(), "input", input);
  }
  const int64_t n = input.dim(0);
  const int64_t h = input.dim(2);
  const int64_t w = input.dim(3);
  const int64_t oh = (h + 2 * padding_ - kernel_) / stride_ + 1;
  const int64_t ow = (w + 2 * padding_ - kernel_) / stride_ + 1;
  out_h_ = oh;
  out_w_ = ow;
  AIDN_RETURN_IF_ERROR(output->Resize(ctx_, {n, out_, oh, ow}));
  input_ = &input;
  output_ = output;
  if (n == 0) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(Prepare(n, h, w));
  AIDN_ASSIGN_OR_RETURN(void* ws, ctx_->Workspace(current_->workspace_bytes));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetConvolutionMathType(conv_desc_, current_->forward_math));
  if (IsHalf(ctx_)) {
    // Backward reuses both rounded operands; the output comes back to fp32.
    AIDN_ASSIGN_OR_RETURN(void* xh, RoundToHalf(ctx_, input.data(), input.numel(), &x_half_));
    AIDN_ASSIGN_OR_RETURN(void* wh,
                          RoundToHalf(ctx_, weight_.value.data(), weight_.value.numel(), &w_half_));
    AIDN_ASSIGN_OR_RETURN(void* yh, HalfScratch(ctx_, &y_half_, output->numel()));
    AIDN_RETURN_IF_CUDNN_ERROR(cudnnConvolutionForward(
        ctx_->cudnn(), &kOne, x_desc_, xh, w_desc_, wh, conv_desc_, current_->forward, ws,
        current_->workspace_bytes, &kZero, y_desc_, yh));
    AIDN_RETURN_IF_ERROR(LaunchFromHalf(ctx_->stream(), yh, output->data(), output->numel(),
                                        HalfOf(ctx_), /*accumulate=*/false));
  } else {
    AIDN_RETURN_IF_CUDNN_ERROR(cudnnConvolutionForward(
        ctx_->cudnn(), &kOne, x_desc_, input.data(), w_desc_, weight_.value.data(), conv_desc_,
        current_->forward, ws, current_->workspace_bytes, &kZero, y_desc_, output->data()));
  }
  if (!has_bias_) {
    return fused_relu_ ? LaunchRelu(ctx_->stream(), output->data(), output->data(), output->numel())
                       : absl::OkStatus();
  }
  return LaunchBiasActivation(ctx_->stream(), output->data(), bias_.value.data(), output->data(),
                              output->numel(), out_, oh * ow, fused_relu_);
}

absl::Status GpuConv2d::Backward(const GpuTensor& grad_output, GpuTensor* grad_input) {
  if (input_ == nullptr) return absl::FailedPreconditionError("Conv2d::Backward before Forward");
  const GpuTensor& x = *input_;
  const int64_t n = x.dim(0);
  if (grad_output.rank() != 4 || grad_output.dim(0) != n || grad_output.dim(1) != out_ ||
      grad_output.dim(2) != out_h_ || grad_output.dim(3) != out_w_) {
    return BadShape(Describe(), "grad_output", grad_output);
  }
  if (grad_input != nullptr) AIDN_RETURN_IF_ERROR(grad_input->Resize(ctx_, x.shape()));
  if (n == 0) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(Prepare(n, x.dim(2), x.dim(3)));
  AIDN_ASSIGN_OR_RETURN(const float* g,
                        ReluAndBiasBackward(ctx_, grad_output, fused_relu_ ? output_ : nullptr, n,
                                            out_, out_h_ * out_w_, &masked_grad_, &bias_partials_,
                                            has_bias_ ? &bias_.grad : nullptr));
  AIDN_ASSIGN_OR_RETURN(void* ws, ctx_->Workspace(current_->workspace_bytes));
  if (IsHalf(ctx_)) return BackwardHalf(g, ws, grad_input);
  // beta = 1: accumulate into the weight gradient, as the CPU layer does.
  AIDN_RETURN_IF_CUDNN_ERROR(
      cudnnSetConvolutionMathType(conv_desc_, current_->backward_filter_math));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnConvolutionBackwardFilter(
      ctx_->cudnn(), &kOne, x_desc_, x.data(), y_desc_, g, conv_desc_, current_->backward_filter,
      ws, current_->workspace_bytes, &kOne, w_desc_, weight_.grad.data()));
  if (grad_input != nullptr) {
    AIDN_RETURN_IF_CUDNN_ERROR(
        cudnnSetConvolutionMathType(conv_desc_, current_->backward_data_math));
    AIDN_RETURN_IF_CUDNN_ERROR(cudnnConvolutionBackwardData(
        ctx_->cudnn(), &kOne, w_desc_, weight_.value.data(), y_desc_, g, conv_desc_,
        current_->backward_data, ws, current_->workspace_bytes, &kZero, x_desc_,
        grad_input->data()));
  }
  return absl::OkStatus();
}

absl::Status GpuConv2d::BackwardHalf(const float* g, void* ws, GpuTensor* grad_input) {
  const GpuTensor& x = *input_;
  const int64_t g_numel = x.dim(0) * out_ * out_h_ * out_w_;
  AIDN_ASSIGN_OR_RETURN(void* gh, RoundToHalf(ctx_, g, g_numel, &g_half_));
  // The 16-bit weight gradient, then added into the fp32 one.
  AIDN_ASSIGN_OR_RETURN(void* dwh, HalfScratch(ctx_, &dw_half_, weight_.grad.numel()));
  AIDN_RETURN_IF_CUDNN_ERROR(
      cudnnSetConvolutionMathType(conv_desc_, current_->backward_filter_math));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnConvolutionBackwardFilter(
      ctx_->cudnn(), &kOne, x_desc_, x_half_.data(), y_desc_, gh, conv_desc_,
      current_->backward_filter, ws, current_->workspace_bytes, &kZero, w_desc_, dwh));
  AIDN_RETURN_IF_ERROR(LaunchFromHalf(ctx_->stream(), dwh, weight_.grad.data(),
                                      weight_.grad.numel(), HalfOf(ctx_), /*accumulate=*/true));
  if (grad_input == nullptr) return absl::OkStatus();
  AIDN_ASSIGN_OR_RETURN(void* dxh, HalfScratch(ctx_, &dx_half_, x.numel()));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetConvolutionMathType(conv_desc_, current_->backward_data_math));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnConvolutionBackwardData(
      ctx_->cudnn(), &kOne, w_desc_, w_half_.data(), y_desc_, gh, conv_desc_,
      current_->backward_data, ws, current_->workspace_bytes, &kZero, x_desc_, dxh));
  return LaunchFromHalf(ctx_->stream(), dxh, grad_input->data(), x.numel(), HalfOf(ctx_),
                        /*accumulate=*/false);
}

// ---------------------------------------------------------------- MaxPool2d

absl::StatusOr<std::unique_ptr<GpuMaxPool2d>> GpuMaxPool2d::Create(GpuContext* ctx, int64_t kernel,
                                                                   int64_t stride) {
  if (stride <= 0) stride = kernel;  // as MaxPool2d: the stride defaults to the kernel
  if (kernel <= 0 || !FitsInt(kernel) || !FitsInt(stride)) {
    return absl::InvalidArgumentError(absl::StrCat("MaxPool2d kernel ", kernel));
  }
  std::unique_ptr<GpuMaxPool2d> layer(new GpuMaxPool2d(ctx, kernel, stride));
  AIDN_RETURN_IF_ERROR(layer->Init());
  return layer;
}

absl::Status GpuMaxPool2d::Init() {
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnCreatePoolingDescriptor(&pool_desc_));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnCreateTensorDescriptor(&x_desc_));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnCreateTensorDescriptor(&y_desc_));
  const int k = static_cast<int>(kernel_);
  const int s = static_cast<int>(stride_);
  // No padding; the deterministic variant routes each gradient to one
  // maximum without atomics.
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetPooling2dDescriptor(
      pool_desc_, CUDNN_POOLING_MAX_DETERMINISTIC, CUDNN_NOT_PROPAGATE_NAN, k, k, 0, 0, s, s));
  return absl::OkStatus();
}

GpuMaxPool2d::~GpuMaxPool2d() {
  if (y_desc_ != nullptr) cudnnDestroyTensorDescriptor(y_desc_);
  if (x_desc_ != nullptr) cudnnDestroyTensorDescriptor(x_desc_);
  if (pool_desc_ != nullptr) cudnnDestroyPoolingDescriptor(pool_desc_);
}

std::string GpuMaxPool2d::Describe() const {
  return absl::StrCat("MaxPool2d(kernel_size=", kernel_, ", stride=", stride_,
                      ", padding=0, dilation=1, ceil_mode=False)");
}

absl::Status GpuMaxPool2d::Forward(const GpuTensor& input, GpuTensor* output, bool /*training*/) {
  if (input.rank() != 4 || input.dim(2) < kernel_ || input.dim(3) < kernel_ ||
      !FitsInt(input.dim(0)) || !FitsInt(input.dim(1)) || !FitsInt(input.dim(2)) ||
      !FitsInt(input.dim(3))) {
    return BadShape(Describe(), "input", input);
  }
  const int64_t n = input.dim(0);
  const int64_t c = input.dim(1);
  const int64_t oh = (input.dim(2) - kernel_) / stride_ + 1;
  const int64_t ow = (input.dim(3) - kernel_) / stride_ + 1;
  AIDN_RETURN_IF_ERROR(output->Resize(ctx_, {n, c, oh, ow}));
  input_ = &input;
  output_ = output;
  if (n == 0 || c == 0) return absl::OkStatus();
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnSetTensor4dDescriptor(
      x_desc_, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, static_cast<int>(n), static_cast<int>(c),
      static_cast<int>(input.dim(2)), static_cast<int>(input.dim(3))));
  AIDN_RETURN_IF_CUDNN_ERROR(
      cudnnSetTensor4dDescriptor(y_desc_, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, static_cast<int>(n),
                                 static_cast<int>(c), static_cast<int>(oh), static_cast<int>(ow)));
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnPoolingForward(ctx_->cudnn(), pool_desc_, &kOne, x_desc_,
                                                 input.data(), &kZero, y_desc_, output->data()));
  return absl::OkStatus();
}

absl::Status GpuMaxPool2d::Backward(const GpuTensor& grad_output, GpuTensor* grad_input) {
  if (input_ == nullptr) return absl::FailedPreconditionError("MaxPool2d::Backward before Forward");
  if (grad_output.shape() != output_->shape()) {
    return BadShape(Describe(), "grad_output", grad_output);
  }
  if (grad_input == nullptr) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(grad_input->Resize(ctx_, input_->shape()));
  if (input_->numel() == 0) return absl::OkStatus();
  // The descriptors still describe the last Forward's shapes.
  AIDN_RETURN_IF_CUDNN_ERROR(cudnnPoolingBackward(
      ctx_->cudnn(), pool_desc_, &kOne, y_desc_, output_->data(), y_desc_, grad_output.data(),
      x_desc_, input_->data(), &kZero, x_desc_, grad_input->data()));
  return absl::OkStatus();
}

// ---------------------------------------------------------------- Flatten

absl::Status GpuFlatten::Forward(const GpuTensor& input, GpuTensor* output, bool /*training*/) {
  if (input.rank() < 1) return BadShape("Flatten", "input", input);
  input_shape_ = input.shape();
  int64_t rest = 1;
  for (int i = 1; i < input.rank(); ++i) rest *= input.dim(i);
  // Same memory, new shape: Flatten moves no data.
  *output = GpuTensor::View(const_cast<float*>(input.data()), {input.dim(0), rest});
  return absl::OkStatus();
}

absl::Status GpuFlatten::Backward(const GpuTensor& grad_output, GpuTensor* grad_input) {
  int64_t numel = 1;
  for (int64_t d : input_shape_) numel *= d;
  if (input_shape_.empty() || grad_output.numel() != numel) {
    return BadShape("Flatten", "grad_output", grad_output);
  }
  if (grad_input == nullptr) return absl::OkStatus();
  *grad_input = GpuTensor::View(const_cast<float*>(grad_output.data()), input_shape_);
  return absl::OkStatus();
}

// ---------------------------------------------------------------- Dropout

std::string GpuDropout::Describe() const {
  // As Dropout::Describe (ostream's default formatting of a double).
  std::ostringstream os;
  os << p_;
  return "Dropout(p=" + os.str() + ", inplace=False)";
}

absl::Status GpuDropout::Forward(const GpuTensor& input, GpuTensor* output, bool training) {
  AIDN_RETURN_IF_ERROR(output->Resize(ctx_, input.shape()));
  last_training_ = training;
  last_numel_ = input.numel();
  if (!training) return CopyDeviceToDevice(ctx_, input.data(), output->data(), input.numel());
  key_ = DropoutKey(seed_, draws_++);
  const float scale = p_ < 1.0 ? static_cast<float>(1.0 / (1.0 - p_)) : 0.0f;
  return LaunchDropout(ctx_->stream(), input.data(), output->data(), input.numel(), key_,
                       DropoutThreshold(p_), scale);
}

absl::Status GpuDropout::Backward(const GpuTensor& grad_output, GpuTensor* grad_input) {
  if (grad_output.numel() != last_numel_) return BadShape("Dropout", "grad_output", grad_output);
  if (grad_input == nullptr) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(grad_input->Resize(ctx_, grad_output.shape()));
  if (!last_training_) {
    return CopyDeviceToDevice(ctx_, grad_output.data(), grad_input->data(), grad_output.numel());
  }
  const float scale = p_ < 1.0 ? static_cast<float>(1.0 / (1.0 - p_)) : 0.0f;
  return LaunchDropout(ctx_->stream(), grad_output.data(), grad_input->data(), grad_output.numel(),
                       key_, DropoutThreshold(p_), scale);
}

}  // namespace aidn::engine::cuda
