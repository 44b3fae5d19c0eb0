#include "worker/engine/tensor.h"

#include <cstdint>
#include <utility>

#include <gtest/gtest.h>

namespace aidn::engine {
namespace {

bool IsAligned64(const float* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

TEST(Tensor, IsZeroFilledAndAlignedOnConstruction) {
  Tensor t({3, 5, 7});
  EXPECT_EQ(t.rank(), 3);
  EXPECT_EQ(t.dim(0), 3);
  EXPECT_EQ(t.dim(2), 7);
  EXPECT_EQ(t.numel(), 105);
  EXPECT_EQ(t.device(), Device::kCpu);
  ASSERT_NE(t.data(), nullptr);
  EXPECT_TRUE(IsAligned64(t.data()));
  for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t[i], 0.0f) << i;
}

TEST(Tensor, DefaultAndZeroSizedTensorsHoldNothing) {
  Tensor empty;
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.rank(), 0);
  Tensor zero({0, 4});
  EXPECT_EQ(zero.numel(), 0);
  EXPECT_EQ(zero.ShapeString(), "[0, 4]");
}

TEST(Tensor, ShapeStringListsTheDimensions) {
  EXPECT_EQ(Tensor({64, 784}).ShapeString(), "[64, 784]");
  EXPECT_EQ(Tensor({3}).ShapeString(), "[3]");
  EXPECT_EQ(Tensor().ShapeString(), "[]");
}

TEST(Tensor, FillAndZeroSetEveryElement) {
  Tensor t({4, 4});
  t.Fill(2.5f);
  for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t[i], 2.5f);
  t.Zero();
  for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t[i], 0.0f);
}

TEST(Tensor, ResizeKeepsTheStorageWhenTheNewShapeFits) {
  Tensor t({8, 8});
  float* before = t.data();
  t.Resize({4, 16});
  EXPECT_EQ(t.data(), before);
  EXPECT_EQ(t.ShapeString(), "[4, 16]");
  t.Resize({2, 3});
  EXPECT_EQ(t.data(), before);
  EXPECT_EQ(t.numel(), 6);
  // Growing back within the original capacity still reuses it.
  t.Resize({64});
  EXPECT_EQ(t.data(), before);
}

TEST(Tensor, ResizeBeyondCapacityAllocatesZeroedAlignedStorage) {
  Tensor t({2});
  t.Fill(1.0f);
  t.Resize({100, 3});
  EXPECT_EQ(t.numel(), 300);
  EXPECT_TRUE(IsAligned64(t.data()));
  for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t[i], 0.0f) << i;
}

TEST(Tensor, CloneIsADeepCopy) {
  Tensor t({2, 3});
  for (int64_t i = 0; i < t.numel(); ++i) t[i] = static_cast<float>(i);
  Tensor c = t.Clone();
  EXPECT_EQ(c.shape(), t.shape());
  EXPECT_NE(c.data(), t.data());
  for (int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(c[i], t[i]);
  c[0] = 42.0f;
  EXPECT_EQ(t[0], 0.0f);
}

TEST(Tensor, MoveTransfersTheStorageAndEmptiesTheSource) {
  Tensor a({4, 4});
  a.Fill(3.0f);
  float* storage = a.data();
  Tensor b(std::move(a));
  EXPECT_EQ(b.data(), storage);
  EXPECT_EQ(b.numel(), 16);
  EXPECT_EQ(a.numel(), 0);  // NOLINT(bugprone-use-after-move): the contract under test
  EXPECT_EQ(a.data(), nullptr);
  // Reusing the moved-from tensor must not write into b's storage.
  a.Resize({4});
  a.Fill(-1.0f);
  EXPECT_NE(a.data(), storage);
  EXPECT_EQ(b[0], 3.0f);

  Tensor c({1});
  c = std::move(b);
  EXPECT_EQ(c.data(), storage);
  EXPECT_EQ(c.ShapeString(), "[4, 4]");
  EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move)
}

TEST(Parameter, HoldsAValueAndAGradientOfTheSameShape) {
  Parameter p{"1.weight", Tensor({3, 2}), Tensor({3, 2})};
  EXPECT_EQ(p.name, "1.weight");
  EXPECT_EQ(p.value.shape(), p.grad.shape());
}

}  // namespace
}  // namespace aidn::engine
