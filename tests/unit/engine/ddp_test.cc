// DdpReducer: bucketing, averaging across real Gloo ranks (threads over an
// in-process store), the extra value, accumulation micro-steps, and faults
// injected through a Communicator that fails.

#include "worker/engine/ddp.h"
#include "worker/engine/fsdp.h"
#include "worker/engine/host_shards.h"

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/optimizer.h"

namespace aidn::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Parameters named p0..pN-1 with the given sizes.
std::vector<std::unique_ptr<Parameter>> MakeParameters(const std::vector<int64_t>& sizes) {
  std::vector<std::unique_ptr<Parameter>> params;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto p = std::make_unique<Parameter>();
    p->name = "p" + std::to_string(i);
    p->value = Tensor({sizes[i]});
    p->grad = Tensor({sizes[i]});
    params.push_back(std::move(p));
  }
  return params;
}

std::vector<Parameter*> Raw(const std::vector<std::unique_ptr<Parameter>>& params) {
  std::vector<Parameter*> raw;
  for (const auto& p : params) raw.push_back(p.get());
  return raw;
}

// A world of one that records what it was asked, and fails from call
// `fail_at` on (0: never).
class FakeCommunicator final : public Communicator {
 public:
  explicit FakeCommunicator(int fail_at = 0, int world_size = 2)
      : fail_at_(fail_at), world_size_(world_size) {}
  int rank() const override { return 0; }
  // Two ranks by default, so the reducer buckets and launches as it does
  // for real; the recorder leaves the data as it is (the average of equal
  // gradients).
  int world_size() const override { return world_size_; }
  absl::Status AllReduce(float*, size_t count, ReduceOp) override {
    counts.push_back(count);
    return Next();
  }
  absl::Status Broadcast(float*, size_t, int) override { return Next(); }
  absl::Status AllGather(const float* in, size_t count, float* out) override {
    std::copy(in, in + count, out);
    return Next();
  }
  absl::Status ReduceScatter(const float* in, size_t count, float* out, ReduceOp) override {
    std::copy(in, in + count, out);
    return Next();
  }
  absl::Status Barrier() override { return Next(); }
  int64_t sequence() const override { return calls_; }
  std::vector<size_t> counts;

 private:
  absl::Status Next() {
    ++calls_;
    if (fail_at_ > 0 && calls_ >= fail_at_) return absl::UnavailableError("peer went away");
    return absl::OkStatus();
  }
  int fail_at_;
  int world_size_;
  int64_t calls_ = 0;
};

TEST(PlanBuckets, ReverseOrderPaddedSlotsAndExtrasAtTheEndOfTheLastBucket) {
  // 250 floats per bucket.
  absl::StatusOr<BucketPlan> plan = PlanBuckets({100, 240, 3, 400}, 0.001, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // p3 alone fills a bucket; p2 (3 floats) leaves room for p1; p0 starts a
  // third because p2 + p1 already reached 250.
  EXPECT_THAT(plan->buckets, ElementsAre(ElementsAre(3), ElementsAre(2, 1), ElementsAre(0)));
  ASSERT_EQ(plan->slots.size(), 4u);
  EXPECT_EQ(plan->slots[3].bucket, 0);
  EXPECT_EQ(plan->slots[3].offset, 0u);
  EXPECT_EQ(plan->slots[2].bucket, 1);
  EXPECT_EQ(plan->slots[2].offset, 0u);
  EXPECT_EQ(plan->slots[1].bucket, 1);
  EXPECT_EQ(plan->slots[1].offset, 16u) << "each gradient on a 64-byte boundary";
  EXPECT_EQ(plan->slots[0].bucket, 2);
  EXPECT_THAT(plan->floats, ElementsAre(400u, 16u + 240u, 112u + 1u));
}

TEST(PlanBuckets, NoParametersGiveOneBucketOfExtrasAndBadSizesAreRefused) {
  absl::StatusOr<BucketPlan> plan = PlanBuckets({}, 25, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->buckets.size(), 1u);
  EXPECT_THAT(plan->floats, ElementsAre(2u));
  EXPECT_EQ(PlanBuckets({4}, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanBuckets({4}, std::nan(""), 0).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status negative = PlanBuckets({4, -1}, 1, 0).status();
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.message(), HasSubstr("parameter 1"));
}

TEST(DdpReducer, BucketsFollowReverseRegistrationOrderUpToTheCap) {
  auto params = MakeParameters({100, 200, 300, 400});
  FakeCommunicator comm;
  // 1000 bytes = 250 floats per bucket.
  auto reducer = DdpReducer::Create({.bucket_mb = 0.001}, Raw(params), &comm);
  ASSERT_TRUE(reducer.ok()) << reducer.status();
  EXPECT_THAT((*reducer)->BucketLayout(),
              ElementsAre(ElementsAre("p3"), ElementsAre("p2"), ElementsAre("p1", "p0")));
}

TEST(DdpReducer, RefusesANonPositiveBucketSize) {
  auto params = MakeParameters({4});
  FakeCommunicator comm;
  EXPECT_EQ(DdpReducer::Create({.bucket_mb = 0}, Raw(params), &comm).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DdpReducer, LaunchesEachBucketOnceItsLastGradientArrives) {
  auto params = MakeParameters({100, 200, 300, 400});
  FakeCommunicator comm;
  auto reducer = DdpReducer::Create({.bucket_mb = 0.001}, Raw(params), &comm);
  ASSERT_TRUE(reducer.ok());
  (*reducer)->BeginBackward(true, 1.5f);
  for (int i = 3; i >= 0; --i) (*reducer)->OnGradReady(params[i].get());
  double wait = -1, allreduce = -1;
  ASSERT_TRUE((*reducer)->Finish(&wait, &allreduce).ok());
  // p3, p2, then p1+p0 with the extra slot; each gradient padded to whole
  // cache lines (16 floats): 300 -> 304, 200 -> 208, 100 -> 112.
  EXPECT_THAT(comm.counts, ElementsAre(400u, 304u, 321u));
  EXPECT_GE(wait, 0.0);
  EXPECT_GE(allreduce, 0.0);
  EXPECT_FLOAT_EQ((*reducer)->averaged_extra(), 1.5f);
}

TEST(DdpReducer, GradientsLiveInTheBucketsAndGetStorageOfTheirOwnBackWhenTheReducerGoes) {
  auto params = MakeParameters({100, 200});
  params[1]->grad[3] = 2.5f;
  FakeCommunicator comm;
  auto reducer = DdpReducer::Create({}, Raw(params), &comm);
  ASSERT_TRUE(reducer.ok());
  for (auto& p : params) EXPECT_TRUE(p->grad.is_view());
  // One bucket, in reverse order: p1 first, p0 at the next cache line.
  EXPECT_EQ(params[0]->grad.data(), params[1]->grad.data() + 208);
  EXPECT_EQ(params[1]->grad[3], 2.5f) << "the values moved into the bucket";
  params[0]->grad[0] = 7.0f;
  reducer->reset();
  for (auto& p : params) EXPECT_FALSE(p->grad.is_view());
  EXPECT_EQ(params[1]->grad[3], 2.5f);
  EXPECT_EQ(params[0]->grad[0], 7.0f);
}

TEST(DdpReducer, AccumulationMicroStepsDoNotCommunicate) {
  auto params = MakeParameters({10, 10});
  FakeCommunicator comm;
  auto reducer = DdpReducer::Create({}, Raw(params), &comm);
  ASSERT_TRUE(reducer.ok());
  (*reducer)->BeginBackward(false, 0.0f);
  for (int i = 1; i >= 0; --i) (*reducer)->OnGradReady(params[i].get());
  ASSERT_TRUE((*reducer)->Finish(nullptr, nullptr).ok());
  EXPECT_TRUE(comm.counts.empty());
}

TEST(DdpReducer, AMissingGradientIsAnErrorNotAHang) {
  auto params = MakeParameters({10, 10});
  FakeCommunicator comm;
  auto reducer = DdpReducer::Create({}, Raw(params), &comm);
  ASSERT_TRUE(reducer.ok());
  (*reducer)->BeginBackward(true, 0.0f);
  (*reducer)->OnGradReady(params[1].get());
  absl::Status s = (*reducer)->Finish(nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("1 parameter got no gradient this step (p0)"));
  EXPECT_THAT(s.message(), HasSubstr("find_unused_parameters: true"));
}

TEST(DdpReducer, OneRankLeavesGradientsInPlaceCommunicatesNothingAndStillCatchesAMissingOne) {
  auto params = MakeParameters({100, 200});
  for (auto& p : params) {
    for (int64_t i = 0; i < p->grad.numel(); ++i) p->grad[i] = 0.25f * static_cast<float>(i);
  }
  FakeCommunicator comm(/*fail_at=*/0, /*world_size=*/1);
  auto reducer = DdpReducer::Create({}, Raw(params), &comm);
  ASSERT_TRUE(reducer.ok());
  (*reducer)->BeginBackward(true, 1.5f);
  for (auto& p : params) (*reducer)->OnGradReady(p.get());
  ASSERT_TRUE((*reducer)->Finish(nullptr, nullptr).ok());
  EXPECT_THAT(comm.counts, IsEmpty());
  EXPECT_EQ((*reducer)->averaged_extra(), 1.5f);
  EXPECT_EQ(params[1]->grad[7], 1.75f);
  (*reducer)->BeginBackward(true, 0.0f);
  (*reducer)->OnGradReady(params[0].get());
  absl::Status s = (*reducer)->Finish(nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("1 parameter got no gradient this step (p1)"));
}

TEST(DdpReducer, ACommunicatorFailureComesBackFromFinishNamingTheBucket) {
  auto params = MakeParameters({100, 200, 300});
  FakeCommunicator comm(/*fail_at=*/2);
  auto reducer = DdpReducer::Create({.bucket_mb = 0.001}, Raw(params), &comm);
  ASSERT_TRUE(reducer.ok());
  (*reducer)->BeginBackward(true, 0.0f);
  for (int i = 2; i >= 0; --i) (*reducer)->OnGradReady(params[i].get());
  absl::Status s = (*reducer)->Finish(nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("ddp bucket 1"));
  EXPECT_THAT(s.message(), HasSubstr("peer went away"));
}

// Runs `body(rank, communicator)` on `n` threads over real Gloo communicators.
template <typename Body>
void OnRanks(int n, const Body& body) {
  InMemoryKeyValueStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions options;
      options.rank = r;
      options.world_size = n;
      options.timeout = std::chrono::seconds(20);
      options.prefix = "ddp-test";
      auto comm = CreateGlooCommunicator(options, &store);
      ASSERT_TRUE(comm.ok()) << comm.status();
      body(r, comm->get());
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(DdpReducer, AveragesGradientsAndTheExtraValueAcrossGlooRanks) {
  for (int n : {2, 3}) {
    OnRanks(n, [n](int rank, Communicator* comm) {
      auto params = MakeParameters({1000, 3, 50000});
      auto reducer = DdpReducer::Create({.bucket_mb = 0.01}, Raw(params), comm);
      ASSERT_TRUE(reducer.ok()) << reducer.status();
      for (int step = 0; step < 3; ++step) {
        for (auto& p : params) {
          for (int64_t i = 0; i < p->grad.numel(); ++i) {
            p->grad[i] = static_cast<float>(rank + i % 7 + step);
          }
        }
        (*reducer)->BeginBackward(true, static_cast<float>(rank));
        for (int i = 2; i >= 0; --i) (*reducer)->OnGradReady(params[i].get());
        ASSERT_TRUE((*reducer)->Finish(nullptr, nullptr).ok());
        const float mean_rank = static_cast<float>(n - 1) / 2.0f;
        for (auto& p : params) {
          for (int64_t i = 0; i < p->grad.numel(); ++i) {
            ASSERT_FLOAT_EQ(p->grad[i], mean_rank + static_cast<float>(i % 7 + step))
                << p->name << "[" << i << "] rank " << rank << " of " << n;
          }
        }
        EXPECT_FLOAT_EQ((*reducer)->averaged_extra(), mean_rank);
      }
    });
  }
}

// PowerSGD in the buckets (DdpOptions::powersgd): a plain allreduce before
// start_step, then the compressed one, which at full rank averages every
// gradient and the extra value to rounding, also gradients of lower rank
// than r (these are sin(x_row + y_col): rank 2); the floats sent are P's
// and Q's.
TEST(DdpReducer, PowerSgdAtFullRankAveragesAsAPlainAllreduceDoes) {
  for (int n : {2, 3}) {
    OnRanks(n, [n](int rank, Communicator* comm) {
      const std::vector<std::vector<int64_t>> shapes = {{12, 8}, {5}, {6, 10}};
      std::vector<std::unique_ptr<Parameter>> params;
      for (size_t i = 0; i < shapes.size(); ++i) {
        auto p = std::make_unique<Parameter>();
        p->name = "p" + std::to_string(i);
        p->value = Tensor(shapes[i]);
        p->grad = Tensor(shapes[i]);
        params.push_back(std::move(p));
      }
      PowerSgdOptions psgd;
      psgd.rank = 12;
      psgd.start_step = 1;
      psgd.min_compression_rate = 0.0;  // every gradient compressed
      auto reducer = DdpReducer::Create({.bucket_mb = 0.0002, .powersgd = psgd}, Raw(params), comm);
      ASSERT_TRUE(reducer.ok()) << reducer.status();
      ASSERT_GT((*reducer)->num_buckets(), 1);
      for (int step = 0; step < 3; ++step) {
        for (auto& p : params) {
          for (int64_t i = 0; i < p->grad.numel(); ++i) {
            p->grad[i] = std::sin(static_cast<float>(1 + rank * 31 + i * 7 + step * 3));
          }
        }
        (*reducer)->BeginBackward(true, static_cast<float>(rank));
        for (int i = 2; i >= 0; --i) (*reducer)->OnGradReady(params[i].get());
        ASSERT_TRUE((*reducer)->Finish(nullptr, nullptr).ok());
        for (auto& p : params) {
          for (int64_t i = 0; i < p->grad.numel(); ++i) {
            float mean = 0;
            for (int r = 0; r < n; ++r)
              mean += std::sin(static_cast<float>(1 + r * 31 + i * 7 + step * 3));
            mean /= static_cast<float>(n);
            ASSERT_NEAR(p->grad[i], mean, 1e-5f) << p->name << "[" << i << "] step " << step;
          }
        }
        EXPECT_NEAR((*reducer)->averaged_extra(), static_cast<float>(n - 1) / 2.0f, 1e-5f);
        // (n + m) r a gradient, the extra value as a 1 x 1 matrix.
        EXPECT_EQ((*reducer)->last_bytes_sent(),
                  step == 0 ? (*reducer)->last_bytes_uncompressed()
                            : 4 * ((12 + 8) * 8 + (5 + 1) * 1 + (6 + 10) * 6 + 2))
            << "step " << step;
      }
    });
  }
}

// find_unused_parameters over 2 Gloo ranks: rank 0 skips p1, rank 1 skips
// p1 and p2. Every bucket still finishes; p1, which no rank used, is
// marked no_grad; p2 is averaged with rank 1's zero.
TEST(DdpReducer, FindUnusedParametersFinishesEveryBucketAndMarksTheGloballyUnused) {
  OnRanks(2, [](int rank, Communicator* comm) {
    auto params = MakeParameters({10, 20, 30});
    auto reducer = DdpReducer::Create({.bucket_mb = 0.0001, .find_unused_parameters = true},
                                      Raw(params), comm);
    ASSERT_TRUE(reducer.ok()) << reducer.status();
    ASSERT_GT((*reducer)->num_buckets(), 1);
    std::vector<bool> used = {true, false, rank == 0};
    std::vector<Parameter*> unused = {params[1].get()};
    if (rank == 1) unused.push_back(params[2].get());
    for (size_t i = 0; i < params.size(); ++i) {
      for (int64_t k = 0; k < params[i]->grad.numel(); ++k) params[i]->grad[k] = used[i] ? 2.0f : 0;
    }
    (*reducer)->BeginBackward(true, 1.0f, used, unused);
    for (int i = 2; i >= 0; --i) {
      if (used[static_cast<size_t>(i)])
        (*reducer)->OnGradReady(params[static_cast<size_t>(i)].get());
    }
    ASSERT_TRUE((*reducer)->Finish(nullptr, nullptr).ok());
    EXPECT_FALSE(params[0]->no_grad);
    EXPECT_TRUE(params[1]->no_grad);
    EXPECT_FALSE(params[2]->no_grad);
    EXPECT_EQ(params[0]->grad[3], 2.0f);
    EXPECT_EQ(params[2]->grad[3], 1.0f);
    EXPECT_EQ((*reducer)->averaged_extra(), 1.0f);
    // The next step uses everything again.
    (*reducer)->BeginBackward(true, 0.0f, {true, true, true}, {});
    for (int i = 2; i >= 0; --i) (*reducer)->OnGradReady(params[static_cast<size_t>(i)].get());
    ASSERT_TRUE((*reducer)->Finish(nullptr, nullptr).ok());
    EXPECT_FALSE(params[1]->no_grad);
  });
}

// Ranks that skip different parameters have different buckets ready
// first: the buckets still go in the same order on every rank (a mismatch
// would pair one rank's bucket with another's). Plain buckets, and
// compressed ones: fp16, bf16 and PowerSGD (compressing from the first
// step, error feedback on, over several steps so that the error it feeds
// back is not zero). The used flags are exact; the loss is averaged.
TEST(DdpReducer, FindUnusedParametersWorksWithCompressedBuckets) {
  struct Case {
    const char* name;
    DdpOptions options;
  };
  const Case cases[] = {
      {"plain", {.bucket_mb = 0.0001, .find_unused_parameters = true}},
      {"fp16", {.bucket_mb = 0.0001, .half = HalfFormat::kFp16, .find_unused_parameters = true}},
      {"bf16", {.bucket_mb = 0.0001, .half = HalfFormat::kBf16, .find_unused_parameters = true}},
      {"powersgd",
       {.bucket_mb = 0.0001,
        .powersgd = PowerSgdOptions{.rank = 1, .start_step = 0, .min_compression_rate = 1.0},
        .find_unused_parameters = true}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    OnRanks(2, [&](int rank, Communicator* comm) {
      auto params = MakeParameters({16, 64, 30});
      params[1]->grad = Tensor({8, 8});
      params[1]->value = Tensor({8, 8});
      auto reducer = DdpReducer::Create(c.options, Raw(params), comm);
      ASSERT_TRUE(reducer.ok()) << reducer.status();
      for (int step = 0; step < 4; ++step) {
        // p0 always used; p1 by rank 0 on even steps only; p2 by nobody on
        // step 2, else by rank 1.
        const std::vector<bool> used = {true, rank == 0 && step % 2 == 0, rank == 1 && step != 2};
        std::vector<Parameter*> unused;
        for (size_t i = 0; i < params.size(); ++i) {
          if (!used[i]) unused.push_back(params[i].get());
          for (int64_t k = 0; k < params[i]->grad.numel(); ++k) {
            params[i]->grad[k] = used[i] ? std::sin(static_cast<float>(k + step + rank)) : 0.0f;
          }
        }
        (*reducer)->BeginBackward(true, 2.0f + static_cast<float>(rank), used, unused);
        for (int i = 2; i >= 0; --i) {
          if (used[static_cast<size_t>(i)]) {
            (*reducer)->OnGradReady(params[static_cast<size_t>(i)].get());
          }
        }
        ASSERT_TRUE((*reducer)->Finish(nullptr, nullptr).ok()) << "step " << step;
        EXPECT_FALSE(params[0]->no_grad) << "step " << step;
        EXPECT_EQ(params[1]->no_grad, step % 2 == 1) << "step " << step;
        EXPECT_EQ(params[2]->no_grad, step == 2) << "step " << step;
        EXPECT_EQ((*reducer)->averaged_extra(), 2.5f) << "step " << step;
      }
    });
  }
}

// fp16 and bf16 buckets (DdpOptions::half): each averaged gradient lies
// within the format's rounding of the float mean (each rank's value divided
// by the world size and rounded, the sum rounded again), the loss is
// averaged exactly, and two bytes go per value. The large gradient runs
// Gloo's ring, the small ones its direct exchange.
TEST(DdpReducer, HalfCompressionAveragesWithinTheFormatsRounding) {
  for (HalfFormat format : {HalfFormat::kFp16, HalfFormat::kBf16}) {
    // Relative precision: 2^-11 (fp16), 2^-8 (bf16); fp16's subnormals
    // below 2^-14 are spaced 2^-24.
    const float eps = format == HalfFormat::kFp16 ? 1.0f / 2048 : 1.0f / 256;
    const float floor = format == HalfFormat::kFp16 ? 6e-8f : 0.0f;
    for (int n : {2, 3}) {
      OnRanks(n, [&](int rank, Communicator* comm) {
        auto params = MakeParameters({300'000, 33, 7});
        auto reducer = DdpReducer::Create({.bucket_mb = 0.5, .half = format}, Raw(params), comm);
        ASSERT_TRUE(reducer.ok()) << reducer.status();
        auto value = [](int r, int64_t i) {
          // Spread over many binades, some below fp16's normal range.
          return std::sin(static_cast<float>(1 + r * 31 + i * 7)) *
                 std::pow(10.0f, static_cast<float>(i % 9) - 6.0f);
        };
        for (auto& p : params) {
          for (int64_t i = 0; i < p->grad.numel(); ++i) p->grad[i] = value(rank, i);
        }
        (*reducer)->BeginBackward(true, 1.0f + static_cast<float>(rank) / 3.0f);
        for (int i = 2; i >= 0; --i) (*reducer)->OnGradReady(params[i].get());
        ASSERT_TRUE((*reducer)->Finish(nullptr, nullptr).ok());
        int64_t values = 0;
        for (auto& p : params) {
          values += p->grad.numel();
          for (int64_t i = 0; i < p->grad.numel(); ++i) {
            float mean = 0;
            float magnitude = 0;
            for (int r = 0; r < n; ++r) {
              mean += value(r, i) / static_cast<float>(n);
              magnitude += std::abs(value(r, i)) / static_cast<float>(n);
            }
            // Each term rounded once and the sum up to n - 1 times.
            const float tolerance = static_cast<float>(n) * (eps * magnitude + floor);
            ASSERT_NEAR(p->grad[i], mean, tolerance)
                << HalfFormatName(format) << " " << p->name << "[" << i << "] of " << n;
          }
        }
        float mean_extra = 0;
        for (int r = 0; r < n; ++r) mean_extra += 1.0f + static_cast<float>(r) / 3.0f;
        EXPECT_FLOAT_EQ((*reducer)->averaged_extra(), mean_extra / static_cast<float>(n));
        EXPECT_LE((*reducer)->last_bytes_sent(), 2 * (values + 16 * 3));
        EXPECT_GE((*reducer)->last_bytes_sent(), 2 * values);
        EXPECT_EQ((*reducer)->last_bytes_uncompressed(), 4 * (*reducer)->last_bytes_sent() / 2 + 4);
      });
    }
  }
}

TEST(DdpReducer, HalfCompressionIsRefusedWithShardedOptimizerStateOrPowerSgd) {
  auto params = MakeParameters({10});
  FakeCommunicator comm;
  auto zero =
      DdpReducer::Create({.shard_optimizer = true, .half = HalfFormat::kBf16}, Raw(params), &comm);
  ASSERT_FALSE(zero.ok());
  EXPECT_THAT(std::string(zero.status().message()), HasSubstr("bf16 compression casts"));
  auto both = DdpReducer::Create({.powersgd = PowerSgdOptions{}, .half = HalfFormat::kFp16},
                                 Raw(params), &comm);
  ASSERT_FALSE(both.ok());
  EXPECT_THAT(std::string(both.status().message()), HasSubstr("exclusive"));
}

TEST(DdpReducer, PowerSgdIsRefusedWithShardedOptimizerState) {
  auto params = MakeParameters({10});
  FakeCommunicator comm;
  auto reducer = DdpReducer::Create({.shard_optimizer = true, .powersgd = PowerSgdOptions{}},
                                    Raw(params), &comm);
  ASSERT_FALSE(reducer.ok());
  EXPECT_THAT(std::string(reducer.status().message()), HasSubstr("not ZeRO-1's reduce-scatter"));
}

// A GPU job's ZeRO layout on the host (HostShards): over the ranks the
// shards cover every element of every parameter exactly once, named
// "<p>[a:b]" with the whole shape kept; their weights are the whole
// parameters' slices, and an optimizer over them gives checkpoint pieces.
using MakeShards = std::function<absl::StatusOr<std::unique_ptr<HostShards>>(int rank, int world)>;
void ExpectTheRanksShardsCoverEveryParameterOnce(
    const std::vector<std::unique_ptr<Parameter>>& params, const MakeShards& make) {
  constexpr int kWorld = 3;
  std::vector<std::vector<int>> covered(params.size());
  for (size_t i = 0; i < params.size(); ++i) covered[i].assign(params[i]->value.numel(), 0);
  for (int rank = 0; rank < kWorld; ++rank) {
    absl::StatusOr<std::unique_ptr<HostShards>> shards = make(rank, kWorld);
    ASSERT_TRUE(shards.ok()) << shards.status();
    const ShardMap& map = (*shards)->map();
    EXPECT_GE(map.num_groups(), 2);
    for (int g = 0; g < map.num_groups(); ++g) EXPECT_EQ(map.group(g).floats % (16 * kWorld), 0u);
    for (size_t k = 0; k < map.shards().size(); ++k) {
      const ShardMap::ShardPlace at = map.place(k);
      const Parameter& whole = *params[at.parameter];
      const size_t begin = at.lo - at.offset, end = at.hi - at.offset;
      EXPECT_EQ(map.shards()[k]->name, absl::StrCat(whole.name, "[", begin, ":", end, "]"));
      EXPECT_EQ(map.shards()[k]->whole_shape, whole.value.shape());
      for (size_t j = begin; j < end; ++j) {
        ++covered[at.parameter][j];
        EXPECT_EQ(map.shards()[k]->value[static_cast<int64_t>(j - begin)],
                  whole.value[static_cast<int64_t>(j)]);
      }
    }
    auto optimizer = Optimizer::Create(OptimizerConfig{.name = "adamw"}, map.shards());
    ASSERT_TRUE(optimizer.ok()) << optimizer.status();
    absl::StatusOr<std::vector<ShardMap::Piece>> pieces = map.StatePieces((*optimizer)->State());
    ASSERT_TRUE(pieces.ok()) << pieces.status();
    EXPECT_EQ(pieces->size(), 2 * map.shards().size());
  }
  for (size_t i = 0; i < params.size(); ++i) {
    for (const int c : covered[i]) ASSERT_EQ(c, 1) << params[i]->name;
  }
}

std::vector<std::unique_ptr<Parameter>> NumberedParameters() {
  auto params = MakeParameters({1000, 24, 700, 5, 333});
  for (size_t i = 0; i < params.size(); ++i) {
    for (int64_t j = 0; j < params[i]->value.numel(); ++j) {
      params[i]->value[j] = static_cast<float>(1000 * i + static_cast<size_t>(j));
    }
  }
  return params;
}

// ZeRO-1: the groups are the buckets. Too many ranks for the model are
// refused.
TEST(HostShards, BucketShardsCoverEveryParameterOnce) {
  auto params = NumberedParameters();
  ExpectTheRanksShardsCoverEveryParameterOnce(params, [&](int rank, int world) {
    return HostShards::ForBuckets(Raw(params), /*bucket_mb=*/0.004, rank, world);
  });
  // 29 floats: some rank of 8 would own only padding.
  auto tiny = MakeParameters({29});
  EXPECT_EQ(HostShards::ForBuckets(Raw(tiny), 1.0, 0, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ZeRO-2 and FSDP: the groups are the model's units, laid out as the CPU
// reducer lays them (the same shards, named alike, on every rank).
TEST(HostShards, UnitShardsCoverEveryParameterOnceAsTheCpuReducersDo) {
  auto params = NumberedParameters();
  const std::vector<std::vector<Parameter*>> units = {
      {params[0].get()}, {params[1].get(), params[2].get()}, {params[3].get(), params[4].get()}};
  ExpectTheRanksShardsCoverEveryParameterOnce(params, [&](int rank, int world) {
    return HostShards::ForUnits(units, Raw(params), rank, world);
  });
  OnRanks(3, [&](int rank, Communicator* comm) {
    auto mine = MakeParameters({1000, 24, 700, 5, 333});
    const std::vector<std::vector<Parameter*>> my_units = {
        {mine[0].get()}, {mine[1].get(), mine[2].get()}, {mine[3].get(), mine[4].get()}};
    auto cpu = FsdpReducer::Create({.sharding = Sharding::kFullShard}, my_units, Raw(mine), comm);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto host = HostShards::ForUnits(units, Raw(params), rank, 3);
    ASSERT_TRUE(host.ok()) << host.status();
    const ShardMap& a = (*cpu)->map();
    const ShardMap& b = (*host)->map();
    ASSERT_EQ(a.num_groups(), b.num_groups());
    for (int g = 0; g < a.num_groups(); ++g) EXPECT_EQ(a.group(g).floats, b.group(g).floats);
    ASSERT_EQ(a.shards().size(), b.shards().size());
    for (size_t k = 0; k < a.shards().size(); ++k) {
      EXPECT_EQ(a.shards()[k]->name, b.shards()[k]->name);
    }
  });
  // A parameter in no unit is refused, naming it.
  const std::vector<std::vector<Parameter*>> missing = {{params[0].get()}};
  absl::StatusOr<std::unique_ptr<HostShards>> bad =
      HostShards::ForUnits(missing, Raw(params), 0, 2);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(params[1]->name));
}

TEST(DdpReducer, BroadcastGivesEveryRankTheRootsWeights) {
  OnRanks(3, [](int rank, Communicator* comm) {
    auto params = MakeParameters({5, 7});
    for (auto& p : params) p->value.Fill(static_cast<float>(rank + 1));
    ASSERT_TRUE(DdpReducer::BroadcastParameters(Raw(params), comm, /*root=*/0).ok());
    for (auto& p : params) {
      for (int64_t i = 0; i < p->value.numel(); ++i) ASSERT_EQ(p->value[i], 1.0f);
    }
  });
}

}  // namespace
}  // namespace aidn::engine
