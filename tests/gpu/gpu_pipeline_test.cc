// GpuPipelineSession on one GPU: the stages of a GPT pipeline run in one
// process, each on its own thread with its own context (stream), linked by
// an in-process stand-in for NCCL (the links and groups below move device
// buffers through host memory, host-synchronously, in the stream's
// order). Against the whole decoder trained with the same micro-batches as
// gradient accumulation: the pipeline computes the same step under GPipe
// and 1F1B. NCCL's link itself is gpu_nccl_test's (it needs two GPUs to
// pair two stages). Skips without a device.
#include "worker/engine/cuda/gpu_pipeline.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/gpu/gpu_test_util.h"
#include "worker/engine/cuda/gpu_gpt.h"
#include "worker/engine/cuda/gpu_optimizer.h"
#include "worker/engine/gpt.h"

namespace aidn::engine::cuda {
namespace {

using testing::MaxRelError;

// Host copies of device buffers, after the stream's work so far.
std::vector<char> Down(cudaStream_t stream, const void* data, size_t bytes) {
  std::vector<char> host(bytes);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  if (bytes > 0) {
    EXPECT_EQ(cudaMemcpy(host.data(), data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return host;
}
void Up(cudaStream_t stream, const std::vector<char>& host, void* data) {
  if (host.empty()) return;
  // On the stage's stream, waited for: the copy from pageable memory is
  // done before `host` goes and before the stream's next kernels.
  EXPECT_EQ(cudaMemcpyAsync(data, host.data(), host.size(), cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
}

// A stage that fails leaves the others waiting on it: Abort wakes them
// with an error instead.
absl::Status Aborted() { return absl::AbortedError("loopback: another stage failed"); }

// Two ends of a link: a one-message mailbox each way.
class LoopbackPair {
 public:
  class End final : public DeviceLink {
   public:
    End(LoopbackPair* pair, int side) : pair_(pair), side_(side) {}
    absl::Status ExchangeOn(cudaStream_t stream, const float* send, size_t send_count, float* recv,
                            size_t recv_count) override {
      std::vector<char> out = Down(stream, send, sizeof(float) * send_count);
      std::unique_lock<std::mutex> lock(pair_->mu_);
      if (send_count > 0) {
        Box& box = pair_->boxes_[side_];
        pair_->cv_.wait(lock, [&] { return !box.full || pair_->aborted_; });
        if (pair_->aborted_) return Aborted();
        box.data = std::move(out);
        box.full = true;
        pair_->cv_.notify_all();
      }
      if (recv_count > 0) {
        Box& box = pair_->boxes_[1 - side_];
        pair_->cv_.wait(lock, [&] { return box.full || pair_->aborted_; });
        if (pair_->aborted_) return Aborted();
        if (box.data.size() != sizeof(float) * recv_count) {
          return absl::InternalError("loopback: the peer sent another count");
        }
        std::vector<char> in = std::move(box.data);
        box.full = false;
        pair_->cv_.notify_all();
        lock.unlock();
        Up(stream, in, recv);
      }
      return absl::OkStatus();
    }

   private:
    LoopbackPair* pair_;
    int side_;
  };
  End* end(int side) { return &ends_[side]; }
  void Abort() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  struct Box {
    std::vector<char> data;
    bool full = false;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  bool aborted_ = false;
  Box boxes_[2];
  End ends_[2] = {End(this, 0), End(this, 1)};
};

// A group of `world` threads: each sums every member's buffer in rank
// order (the same result on all).
class LoopbackGroup {
 public:
  explicit LoopbackGroup(int world) : world_(world), parts_(world) {
    for (int r = 0; r < world; ++r) members_.push_back(std::make_unique<Member>(this, r));
  }
  StreamCollectives* member(int rank) { return members_[static_cast<size_t>(rank)].get(); }
  void Abort() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  class Member final : public StreamCollectives {
   public:
    Member(LoopbackGroup* group, int rank) : group_(group), rank_(rank) {}
    int world_size() const override { return group_->world_; }
    absl::Status AllGatherOn(cudaStream_t, const float*, size_t, float*) override {
      return absl::UnimplementedError("loopback: no all-gather");
    }
    absl::Status AllReduceSumOn(cudaStream_t stream, float* data, size_t count) override {
      return group_->Sum<float>(rank_, stream, data, count);
    }
    absl::Status AllReduceDoubleSumOn(cudaStream_t stream, double* data, size_t count) override {
      return group_->Sum<double>(rank_, stream, data, count);
    }
    absl::Status WaitForEvent(cudaEvent_t event, absl::string_view) override {
      return cudaEventSynchronize(event) == cudaSuccess
                 ? absl::OkStatus()
                 : absl::InternalError("loopback: cudaEventSynchronize");
    }

   private:
    LoopbackGroup* group_;
    int rank_;
  };

  template <typename T>
  absl::Status Sum(int rank, cudaStream_t stream, T* data, size_t count) {
    std::vector<char> mine = Down(stream, data, sizeof(T) * count);
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t round = round_;
    parts_[static_cast<size_t>(rank)] = std::move(mine);
    if (++arrived_ == world_) {
      std::vector<T> sum(count, T(0));
      for (const std::vector<char>& part : parts_) {
        const T* p = reinterpret_cast<const T*>(part.data());
        for (size_t i = 0; i < count; ++i) sum[i] += p[i];
      }
      result_.assign(reinterpret_cast<const char*>(sum.data()),
                     reinterpret_cast<const char*>(sum.data()) + sizeof(T) * count);
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return round_ != round || aborted_; });
      if (round_ == round) return Aborted();
    }
    std::vector<char> result = result_;
    lock.unlock();
    Up(stream, result, data);
    return absl::OkStatus();
  }

  const int world_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<char>> parts_;
  std::vector<char> result_;
  int arrived_ = 0;
  int64_t round_ = 0;
  bool aborted_ = false;
  std::vector<std::unique_ptr<Member>> members_;
};

GptConfig Config(double dropout = 0.0) {
  GptConfig c;
  c.dropout = dropout;
  c.n_layer = 3;
  c.n_head = 4;
  c.n_embd = 64;
  c.block_size = 32;
  c.vocab_size = 97;
  return c;
}

OptimizerConfig AdamW() {
  OptimizerConfig o;
  o.name = "adamw";
  o.lr = 1e-3;
  o.weight_decay = 0.1;
  o.decay_matrices_only = true;
  o.grad_clip_norm = 0.5;
  return o;
}

struct Batches {
  std::vector<std::vector<int32_t>> tokens, targets;
  std::vector<MicroBatch> micro;
};
Batches MakeBatches(int step, int m) {
  Batches b;
  std::mt19937_64 rng(100 + step);
  for (int i = 0; i < m; ++i) {
    b.tokens.emplace_back();
    b.targets.emplace_back();
    for (int j = 0; j < 2 * 16; ++j) {
      b.tokens.back().push_back(static_cast<int32_t>(rng() % 97));
      b.targets.back().push_back(static_cast<int32_t>(rng() % 97));
    }
  }
  for (int i = 0; i < m; ++i) {
    b.micro.push_back(MicroBatch{nullptr, &b.targets[static_cast<size_t>(i)],
                                 static_cast<uint64_t>(10 * step + i),
                                 &b.tokens[static_cast<size_t>(i)], 16});
  }
  return b;
}

// `stages` stages of the 3-block decoder (three: a block each; two: the
// first block, then the other two) against the whole decoder, kSteps steps
// of kMicro micro-batches.
void ExpectThePipelineTrainsAsTheWholeDecoder(PipelineSchedule schedule, int stages,
                                              double dropout = 0.0) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions{});
  constexpr int kSteps = 3;
  constexpr int kMicro = 4;
  const GptConfig config = Config(dropout);
  absl::StatusOr<std::unique_ptr<Gpt>> cpu = Gpt::Create(config, 7);
  ASSERT_TRUE(cpu.ok()) << cpu.status();

  // The whole decoder, accumulating the micro-batches.
  auto whole = GpuGpt::Create(ctx.get(), **cpu);
  ASSERT_TRUE(whole.ok());
  auto whole_opt = GpuOptimizer::Create(ctx.get(), AdamW(), (*whole)->Parameters());
  ASSERT_TRUE(whole_opt.ok());
  std::vector<double> want_losses;
  for (int step = 0; step < kSteps; ++step) {
    Batches b = MakeBatches(step, kMicro);
    ASSERT_TRUE((*whole)->ZeroGrad().ok());
    double loss = 0;
    for (int i = 0; i < kMicro; ++i) {
      const MicroBatch& mb = b.micro[static_cast<size_t>(i)];
      (*whole)->SetSeed(*mb.seed);
      ASSERT_TRUE((*whole)->Forward(mb.tokens->data(), mb.labels->data(), 2, 16, true).ok());
      ASSERT_TRUE((*whole)->Backward(1.0 / kMicro).ok());
      auto l = (*whole)->ReadLoss();
      ASSERT_TRUE(l.ok());
      loss += *l / kMicro;
    }
    ASSERT_TRUE((*whole_opt)->Step(AdamW().lr).ok());
    want_losses.push_back(loss);
  }

  // The pipeline: stage s runs blocks [s * 3 / stages, (s + 1) * 3 / stages).
  std::vector<std::unique_ptr<LoopbackPair>> links;
  for (int s = 0; s + 1 < stages; ++s) links.push_back(std::make_unique<LoopbackPair>());
  LoopbackGroup pipeline(stages), tied(2);
  std::vector<std::vector<double>> losses(static_cast<size_t>(stages));
  std::vector<std::unique_ptr<Gpt>> weights;
  for (int s = 0; s < stages; ++s) weights.push_back(*Gpt::Create(config, 9));
  std::vector<int> recomputed(static_cast<size_t>(stages), 0);
  // The names of what each stage holds.
  std::vector<std::vector<std::string>> held(static_cast<size_t>(stages));
  std::vector<std::thread> threads;
  for (int s = 0; s < stages; ++s) {
    threads.emplace_back([&, s] {
      // Leaving early (a failed assertion) wakes the other stages.
      struct Release {
        std::function<void()> abort;
        bool done = false;
        ~Release() {
          if (!done) abort();
        }
      } release{[&] {
        for (auto& link : links) link->Abort();
        pipeline.Abort();
        tied.Abort();
      }};
      std::string why;
      auto stage_ctx = testing::MakeContext(GpuContextOptions{}, &why);
      ASSERT_NE(stage_ctx, nullptr) << why;
      auto model = GpuGpt::Create(stage_ctx.get(), **cpu);
      ASSERT_TRUE(model.ok());
      ASSERT_TRUE((*model)->SetStage(s * 3 / stages, (s + 1) * 3 / stages).ok());
      GpuPipelineOptions o;
      o.schedule = schedule;
      o.stage = s;
      o.stages = stages;
      if (s > 0) o.prev = links[static_cast<size_t>(s - 1)]->end(1);
      if (s + 1 < stages) o.next = links[static_cast<size_t>(s)]->end(0);
      o.pipeline = pipeline.member(s);
      if (s == 0) o.tied = tied.member(0);
      if (s == stages - 1) o.tied = tied.member(1);
      auto session = GpuPipelineSession::Create(stage_ctx.get(), model->get(), AdamW(), o);
      ASSERT_TRUE(session.ok()) << session.status();
      for (int step = 0; step < kSteps; ++step) {
        Batches b = MakeBatches(step, kMicro);
        absl::StatusOr<double> loss = (*session)->Step(b.micro, AdamW().lr);
        ASSERT_TRUE(loss.ok()) << "stage " << s << ": " << loss.status();
        losses[static_cast<size_t>(s)].push_back(*loss);
        recomputed[static_cast<size_t>(s)] += (*session)->last_stats().recomputed;
      }
      ASSERT_TRUE((*model)->CopyWeightsTo(weights[static_cast<size_t>(s)]->Parameters()).ok());
      for (const GpuParameter* p : (*model)->StageParameters()) {
        held[static_cast<size_t>(s)].push_back(p->name);
      }
      release.done = true;
    });
  }
  for (std::thread& t : threads) t.join();
  if (::testing::Test::HasFatalFailure()) return;

  for (int s = 0; s < stages; ++s) {
    ASSERT_EQ(losses[static_cast<size_t>(s)].size(), want_losses.size());
    for (int step = 0; step < kSteps; ++step) {
      // The loss goes to the other stages as a float.
      EXPECT_NEAR(losses[static_cast<size_t>(s)][static_cast<size_t>(step)],
                  want_losses[static_cast<size_t>(step)], 1e-5 * want_losses[0])
          << "stage " << s << " step " << step;
    }
  }
  // Every parameter from the stage that holds it (wte: the first's).
  auto want = Gpt::Create(config, 8);
  ASSERT_TRUE(want.ok());
  ASSERT_TRUE((*whole)->CopyWeightsTo((*want)->Parameters()).ok());
  for (size_t k = 0; k < (*want)->Parameters().size(); ++k) {
    const Parameter& w = *(*want)->Parameters()[k];
    const Parameter* got = nullptr;
    for (int s = stages - 1; s >= 0; --s) {
      const std::vector<std::string>& names = held[static_cast<size_t>(s)];
      if (std::find(names.begin(), names.end(), w.name) != names.end()) {
        got = weights[static_cast<size_t>(s)]->Parameters()[k];
      }
    }
    ASSERT_NE(got, nullptr) << w.name;
    if (!w.name.ends_with("attn.c_attn.bias")) {
      EXPECT_LE(MaxRelError(got->value, w.value), 1e-5) << w.name;
      continue;
    }
    // The key bias's gradient is zero in exact arithmetic (it shifts all
    // of a query's scores by q.b, which the softmax cancels), so AdamW
    // turns its rounding noise into steps of up to lr, and cuBLAS rounds
    // the whole batch's products and a micro-batch's differently (seen on
    // an H200: 1e-4 against the largest bias). The query and value biases
    // are held to 1e-5 as every other weight; the key bias to what
    // kSteps steps of at most lr can move it.
    const int64_t c = config.n_embd;
    Tensor got_qv({2 * c}), want_qv({2 * c});
    double key_diff = 0;
    for (int64_t i = 0; i < c; ++i) {
      got_qv[i] = got->value[i];
      want_qv[i] = w.value[i];
      got_qv[c + i] = got->value[2 * c + i];
      want_qv[c + i] = w.value[2 * c + i];
      key_diff =
          std::max(key_diff, std::fabs(static_cast<double>(got->value[c + i]) - w.value[c + i]));
    }
    EXPECT_LE(MaxRelError(got_qv, want_qv), 1e-5) << w.name << " (query and value)";
    EXPECT_LE(key_diff, 2.0 * kSteps * AdamW().lr) << w.name << " (key)";
  }
  // 1F1B's last stage runs each backward right after its forward; GPipe's
  // backwards come in micro-batch order after every forward, each after
  // another micro-batch's activations (the last forward's are replaced by
  // the first backward's recomputation).
  if (schedule == PipelineSchedule::k1F1B) {
    EXPECT_EQ(recomputed[static_cast<size_t>(stages - 1)], 0);
  } else {
    EXPECT_EQ(recomputed[static_cast<size_t>(stages - 1)], kSteps * kMicro);
  }
}

TEST(GpuPipeline, ThreeStagesOf1F1BTrainAsTheWholeDecoder) {
  ExpectThePipelineTrainsAsTheWholeDecoder(PipelineSchedule::k1F1B, 3);
}

TEST(GpuPipeline, TwoStagesOfGPipeTrainAsTheWholeDecoder) {
  ExpectThePipelineTrainsAsTheWholeDecoder(PipelineSchedule::kGPipe, 2);
}

// With dropout: a recomputed forward draws its first run's masks, and the
// stages' masks are the whole decoder's (keyed by block).
TEST(GpuPipeline, RecomputedForwardsDrawTheirMasksAgain) {
  ExpectThePipelineTrainsAsTheWholeDecoder(PipelineSchedule::kGPipe, 3, /*dropout=*/0.1);
}

TEST(GpuPipeline, AModelThatIsNotTheStageIsRefused) {
  AIDN_GPU_CONTEXT_OR_SKIP(ctx, GpuContextOptions{});
  auto cpu = Gpt::Create(Config(), 7);
  ASSERT_TRUE(cpu.ok());
  auto model = GpuGpt::Create(ctx.get(), **cpu);
  ASSERT_TRUE(model.ok());
  GpuPipelineOptions o;
  o.stage = 1;
  o.stages = 2;
  EXPECT_EQ(GpuPipelineSession::Create(ctx.get(), model->get(), AdamW(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*model)->SetStage(1, 3).ok());
  // The last stage without its link back, or the groups.
  EXPECT_EQ(GpuPipelineSession::Create(ctx.get(), model->get(), AdamW(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace aidn::engine::cuda
