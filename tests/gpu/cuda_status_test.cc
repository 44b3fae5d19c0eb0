// Parts of the GPU engine that need no device: error conversion, the
// allocator's size classes, the dropout mask function. These run on every
// machine with nvcc, GPU or not.
#include <cmath>
#include <cstdint>
#include <string>

#include <gtest/gtest.h>

#include "worker/engine/cuda/allocator.h"
#include "worker/engine/cuda/dropout_mask.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {
namespace {

absl::Status FailingCudaCall() {
  AIDN_RETURN_IF_CUDA_ERROR(cudaErrorMemoryAllocation);
  return absl::OkStatus();
}

absl::StatusOr<int> FailingCublasCall() {
  AIDN_RETURN_IF_CUBLAS_ERROR(CUBLAS_STATUS_INVALID_VALUE);
  return 1;
}

absl::Status FailingCudnnCall() {
  AIDN_RETURN_IF_CUDNN_ERROR(CUDNN_STATUS_BAD_PARAM_NULL_POINTER);
  return absl::OkStatus();
}

TEST(CudaStatus, SuccessIsOk) {
  EXPECT_TRUE(CudaError("x", cudaSuccess).ok());
  EXPECT_TRUE(CublasError("x", CUBLAS_STATUS_SUCCESS).ok());
  EXPECT_TRUE(CudnnError("x", CUDNN_STATUS_SUCCESS).ok());
}

TEST(CudaStatus, MacrosNameTheCallAndWhereItWas) {
  absl::Status s = FailingCudaCall();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("cudaErrorMemoryAllocation at cuda_status_test.cc:"),
            absl::string_view::npos)
      << s;
  EXPECT_NE(s.message().find("cudaErrorMemoryAllocation)"), absl::string_view::npos) << s;

  absl::StatusOr<int> r = FailingCublasCall();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("CUBLAS_STATUS_INVALID_VALUE"), absl::string_view::npos)
      << r.status();

  absl::Status d = FailingCudnnCall();
  EXPECT_EQ(d.code(), absl::StatusCode::kInvalidArgument) << d;
  EXPECT_NE(d.message().find("cuda_status_test.cc:"), absl::string_view::npos) << d;
}

TEST(CudaStatus, MapsCodesByKind) {
  EXPECT_EQ(CudaError("c", cudaErrorInsufficientDriver).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CudaError("c", cudaErrorNoDevice).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CudaError("c", cudaErrorIllegalAddress).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(CublasError("c", CUBLAS_STATUS_ALLOC_FAILED).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CublasError("c", CUBLAS_STATUS_EXECUTION_FAILED).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(CudnnError("c", CUDNN_STATUS_NOT_SUPPORTED_SHAPE).code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(CudnnError("c", CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CudnnError("c", CUDNN_STATUS_EXECUTION_FAILED).code(), absl::StatusCode::kInternal);
  const absl::Status s = CudaError("cudaMalloc grads", cudaErrorInvalidValue);
  EXPECT_EQ(s.message().substr(0, 18), "cudaMalloc grads: ");
}

TEST(CachingAllocator, RoundsSmallRequestsTo512BytesAndLargeTo2MiB) {
  EXPECT_EQ(CachingAllocator::RoundSize(1), 512u);
  EXPECT_EQ(CachingAllocator::RoundSize(512), 512u);
  EXPECT_EQ(CachingAllocator::RoundSize(513), 1024u);
  EXPECT_EQ(CachingAllocator::RoundSize(size_t{1} << 20), size_t{1} << 20);
  EXPECT_EQ(CachingAllocator::RoundSize((size_t{1} << 20) + 1), size_t{2} << 20);
  EXPECT_EQ(CachingAllocator::RoundSize((size_t{5} << 20) + 7), size_t{6} << 20);
}

TEST(CachingAllocator, ZeroBytesIsAnEmptyBufferWithoutADevice) {
  CachingAllocator alloc;
  absl::StatusOr<DeviceBuffer> b = alloc.Allocate(0);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->data(), nullptr);
  EXPECT_EQ(alloc.stats().cuda_mallocs, 0);
}

TEST(DropoutMask, KeepsOneMinusPOfTheElements) {
  for (double p : {0.1, 0.5, 0.9}) {
    const uint64_t threshold = DropoutThreshold(p);
    const uint64_t key = DropoutKey(42, 0);
    const int64_t n = 1 << 20;
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) kept += DropoutKeep(key, static_cast<uint64_t>(i), threshold);
    const double rate = static_cast<double>(kept) / n;
    // Binomial: 5 standard deviations.
    const double sigma = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(rate, 1 - p, 5 * sigma) << "p " << p;
  }
}

TEST(DropoutMask, EdgesKeepAllOrNothing) {
  const uint64_t key = DropoutKey(7, 3);
  for (uint64_t i = 0; i < 10000; ++i) {
    EXPECT_TRUE(DropoutKeep(key, i, DropoutThreshold(0.0)));
    EXPECT_FALSE(DropoutKeep(key, i, DropoutThreshold(1.0)));
  }
}

TEST(DropoutMask, DrawsAndSeedsGiveUnrelatedMasks) {
  const uint64_t threshold = DropoutThreshold(0.5);
  auto agreement = [&](uint64_t k1, uint64_t k2) {
    int same = 0;
    const int n = 100000;
    for (int i = 0; i < n; ++i) {
      same += DropoutKeep(k1, i, threshold) == DropoutKeep(k2, i, threshold);
    }
    return static_cast<double>(same) / n;
  };
  // Independent masks agree on half the elements (sigma 0.0016).
  EXPECT_NEAR(agreement(DropoutKey(1, 0), DropoutKey(1, 1)), 0.5, 0.01);
  EXPECT_NEAR(agreement(DropoutKey(1, 0), DropoutKey(2, 0)), 0.5, 0.01);
  EXPECT_EQ(agreement(DropoutKey(1, 5), DropoutKey(1, 5)), 1.0);
  // Neighbouring elements are not correlated either.
  const uint64_t key = DropoutKey(9, 0);
  int both = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i)
    both += DropoutKeep(key, i, threshold) && DropoutKeep(key, i + 1, threshold);
  EXPECT_NEAR(static_cast<double>(both) / n, 0.25, 0.01);
}

}  // namespace
}  // namespace aidn::engine::cuda
