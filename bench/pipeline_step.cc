// A GPT trained as a pipeline of P stages (threads of one process over
// shared memory, one CPU thread each), GPipe against 1F1B, for several
// numbers of micro-batches m, beside the same step on one rank:
//
//   build/bench/pipeline_step [--config gpt-mini] [--stages 2] [--micro 1,4,8]
//                             [--batch 4] [--seq 128] [--steps 6] [--warmup 2]
//                             [--checkpointing 0|1] [--tensor T]
//
// Per row: the median step, the measured bubble against the ideal
// (P - 1) / (m + P - 1), per stage: the share of the step it spent not
// computing (waiting for its neighbours), the forwards it ran again before
// their backward (with --checkpointing, none: each block's forward runs
// again inside the backward instead), and the activations it kept for the
// micro-batches in flight (m under GPipe, at most P - s under 1F1B). "one rank" is the same
// micro-batches accumulated by one CpuSession on one thread. Stages run faster than one rank only
// with a core each; the header warns when there are fewer. With --tensor T the GPT is split over T
// tensor-parallel ranks instead, and the table gives the step against one rank's and the share of
// it in the group's collectives.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "worker/engine/comm/grid_communicators.h"
#include "worker/engine/comm/kv_store.h"
#include "worker/engine/cpu.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/gpt.h"
#include "worker/engine/pipeline_session.h"
#include "worker/engine/tensor_parallel.h"
#include "worker/engine/trainable.h"

namespace {

using namespace aidn::engine;  // NOLINT: a benchmark's main file

struct Options {
  std::string config = "gpt-mini";
  int stages = 2;
  std::vector<int> micro = {1, 4, 8};
  int batch = 4;
  int seq = 128;
  int steps = 6;
  int warmup = 2;
  bool checkpointing = false;
  // Above 1: the GPT split over this many tensor-parallel ranks instead of
  // cut into stages.
  int tensor = 1;
};

OptimizerConfig Adam() {
  OptimizerConfig o;
  o.name = "adamw";
  o.lr = 1e-3;
  o.beta2 = 0.95;
  o.weight_decay = 0.1;
  o.decay_matrices_only = true;
  o.grad_clip_norm = 1.0;
  return o;
}

// Micro-batches of random byte windows, the same for every stage.
struct Batches {
  std::vector<std::vector<int32_t>> tokens, targets;
  std::vector<MicroBatch> micro;
  Batches(int m, int batch, int seq, int step) {
    std::mt19937 gen(static_cast<uint32_t>(step));
    tokens.resize(static_cast<size_t>(m));
    targets.resize(static_cast<size_t>(m));
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < batch * seq; ++j) {
        tokens[static_cast<size_t>(i)].push_back(static_cast<int32_t>(gen() % 256));
        targets[static_cast<size_t>(i)].push_back(static_cast<int32_t>(gen() % 256));
      }
    }
    for (int i = 0; i < m; ++i) {
      MicroBatch b;
      b.tokens = &tokens[static_cast<size_t>(i)];
      b.labels = &targets[static_cast<size_t>(i)];
      b.seq_len = seq;
      b.seed = static_cast<uint64_t>(step * 100 + i);
      micro.push_back(b);
    }
  }
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct StageResult {
  std::vector<PipelineSession::Stats> steps;  // after the warm-up
};

// Every stage's stats of the measured steps.
std::vector<StageResult> RunPipeline(const Options& o, const GptConfig& config,
                                     PipelineSchedule schedule, int m) {
  const int p = o.stages;
  std::vector<StageResult> results(static_cast<size_t>(p));
  InMemoryKeyValueStore store;
  std::vector<std::thread> threads;
  static int run = 0;
  const std::string prefix = "bench" + std::to_string(run++);
  for (int rank = 0; rank < p; ++rank) {
    threads.emplace_back([&, rank] {
      ConfigureCpu(1);
      auto fail = [rank](const absl::Status& s) {
        std::fprintf(stderr, "stage %d: %s\n", rank, s.ToString().c_str());
        std::exit(1);
      };
      absl::StatusOr<ProcessGrid> grid = ProcessGrid::Create(p, {1, 1, p});
      if (!grid.ok()) fail(grid.status());
      CpuCommunicatorOptions options;
      options.gloo.rank = rank;
      options.gloo.world_size = p;
      options.gloo.prefix = prefix;
      options.gloo.timeout = std::chrono::seconds(120);
      options.transport = CpuTransport::kShm;
      absl::StatusOr<GridCommunicators> comms = CreateGridCommunicators(options, *grid, &store);
      if (!comms.ok()) fail(comms.status());
      std::unique_ptr<Gpt> gpt = *Gpt::Create(config, 1);
      gpt->SetActivationCheckpointing(o.checkpointing);
      absl::StatusOr<std::unique_ptr<PipelineStageModel>> stage =
          MakeLanguageModelStage(gpt.get(), p, rank);
      if (!stage.ok()) fail(stage.status());
      absl::StatusOr<std::unique_ptr<PipelineSession>> session =
          PipelineSession::Create(comms->SessionOptions(schedule, 25.0), stage->get(), Adam());
      if (!session.ok()) fail(session.status());
      for (int step = 0; step < o.warmup + o.steps; ++step) {
        Batches b(m, o.batch, o.seq, step);
        absl::StatusOr<double> loss = (*session)->Step(b.micro, 1e-3);
        if (!loss.ok()) fail(loss.status());
        if (step >= o.warmup)
          results[static_cast<size_t>(rank)].steps.push_back((*session)->last_stats());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// The GPT split over o.tensor ranks (threads over shared memory), one
// CpuSession each: the median step and the median share of it spent in
// the tensor group's collectives (rank 0's).
std::pair<double, double> TensorStep(const Options& o, const GptConfig& config, int m) {
  const int t = o.tensor;
  InMemoryKeyValueStore store;
  std::vector<double> steps, shares;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < t; ++rank) {
    threads.emplace_back([&, rank] {
      ConfigureCpu(1);
      CpuCommunicatorOptions options;
      options.gloo.rank = rank;
      options.gloo.world_size = t;
      options.gloo.prefix = "tensor" + std::to_string(m);
      options.gloo.timeout = std::chrono::seconds(120);
      options.transport = CpuTransport::kShm;
      absl::StatusOr<CpuCommunicator> comm = CreateCpuCommunicator(options, &store);
      if (!comm.ok()) std::exit(1);
      std::unique_ptr<Gpt> gpt = *Gpt::Create(config, 1);
      gpt->SetActivationCheckpointing(o.checkpointing);
      if (!gpt->SetTensorParallel(comm->communicator.get()).ok()) std::exit(1);
      LanguageModel model(gpt.get());
      std::unique_ptr<CpuSession> session = *CpuSession::Create({}, &model, Adam());
      std::vector<const Parameter*> whole;
      for (const Parameter* p : gpt->Parameters()) {
        if (!gpt->SplitOf(*p).has_value()) whole.push_back(p);
      }
      session->optimizer().SetSumOfSquaresReduction(
          TensorParallelSumOfSquares(comm->communicator.get(), whole));
      for (int step = 0; step < o.warmup + o.steps; ++step) {
        Batches b(m, o.batch, o.seq, step);
        gpt->TakeTensorParallelSeconds();
        const auto start = std::chrono::steady_clock::now();
        if (!session->Step(b.micro, 1e-3).ok()) std::exit(1);
        const double took =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (rank == 0 && step >= o.warmup) {
          steps.push_back(took);
          shares.push_back(gpt->TakeTensorParallelSeconds() / took);
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  return {Median(steps), Median(shares)};
}

double OneRankStep(const Options& o, const GptConfig& config, int m) {
  ConfigureCpu(1);
  std::unique_ptr<Gpt> gpt = *Gpt::Create(config, 1);
  gpt->SetActivationCheckpointing(o.checkpointing);
  LanguageModel model(gpt.get());
  std::unique_ptr<CpuSession> session = *CpuSession::Create({}, &model, Adam());
  std::vector<double> times;
  for (int step = 0; step < o.warmup + o.steps; ++step) {
    Batches b(m, o.batch, o.seq, step);
    const auto start = std::chrono::steady_clock::now();
    if (!session->Step(b.micro, 1e-3).ok()) std::exit(1);
    if (step >= o.warmup) {
      times.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  return Median(times);
}

int Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--config gpt-mini] [--stages 2] [--micro 1,4,8] [--batch 4] "
               "[--seq 128] [--steps 6] [--warmup 2] [--checkpointing 0|1] [--tensor T]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return Usage(argv[0]);
    const std::string v = argv[++i];
    bool ok = true;
    if (a == "--config") {
      o.config = v;
    } else if (a == "--stages") {
      ok = absl::SimpleAtoi(v, &o.stages);
    } else if (a == "--micro") {
      o.micro.clear();
      for (absl::string_view s : absl::StrSplit(v, ',')) {
        int m = 0;
        ok = ok && absl::SimpleAtoi(s, &m) && m >= 1;
        o.micro.push_back(m);
      }
    } else if (a == "--batch") {
      ok = absl::SimpleAtoi(v, &o.batch);
    } else if (a == "--seq") {
      ok = absl::SimpleAtoi(v, &o.seq);
    } else if (a == "--steps") {
      ok = absl::SimpleAtoi(v, &o.steps);
    } else if (a == "--warmup") {
      ok = absl::SimpleAtoi(v, &o.warmup);
    } else if (a == "--tensor") {
      ok = absl::SimpleAtoi(v, &o.tensor) && o.tensor >= 1;
    } else if (a == "--checkpointing") {
      o.checkpointing = v == "1" || v == "true";
    } else {
      return Usage(argv[0]);
    }
    if (!ok) return Usage(argv[0]);
  }
  absl::StatusOr<GptConfig> config = NamedGptConfig(o.config);
  if (!config.ok() || o.stages < 2 || o.steps < 1) return Usage(argv[0]);
  if (o.tensor > 1) {
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    std::printf(
        "# %s (%d layers, %d heads, %d wide) over %d tensor-parallel ranks, batches of "
        "%d x %d tokens, %ld cores%s\n",
        o.config.c_str(), config->n_layer, config->n_head, config->n_embd, o.tensor, o.batch, o.seq,
        cores, cores < o.tensor ? " (WARNING: fewer cores than ranks: they share them)" : "");
    std::printf("%2s %9s %9s %8s %12s\n", "m", "step ms", "1-rank ms", "speed-up", "comm share");
    for (int m : o.micro) {
      const double one = OneRankStep(o, *config, m);
      const auto [step, share] = TensorStep(o, *config, m);
      std::printf("%2d %9.1f %9.1f %7.2fx %12.3f\n", m, 1e3 * step, 1e3 * one, one / step, share);
    }
    std::printf(
        "# comm share: the part of rank 0's step in the tensor group's all-reduces and "
        "gathers (two a block each way, the embedding, the loss)\n");
    return 0;
  }
  if (o.seq > config->block_size) o.seq = config->block_size;
#ifndef NDEBUG
  std::printf("# WARNING: built with assertions (not a release build): timings are slow\n");
#endif
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  std::printf(
      "# %s (%d layers, %d wide), %d stages of %d blocks, micro-batches of %d x %d "
      "tokens, activation checkpointing %s, %ld cores%s\n",
      o.config.c_str(), config->n_layer, config->n_embd, o.stages, config->n_layer / o.stages,
      o.batch, o.seq, o.checkpointing ? "on" : "off", cores,
      cores < o.stages ? " (WARNING: fewer cores than stages: stages share them)" : "");
  std::printf("%-8s %2s %9s %9s %7s %7s  %-24s %-14s %-22s\n", "schedule", "m", "step ms",
              "1-rank ms", "bubble", "ideal", "idle share per stage", "recomputed",
              "kept per stage");
  for (int m : o.micro) {
    const double one = OneRankStep(o, *config, m);
    for (PipelineSchedule schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
      const std::vector<StageResult> r = RunPipeline(o, *config, schedule, m);
      std::vector<double> step;
      for (size_t i = 0; i < r[0].steps.size(); ++i) {
        double longest = 0;
        for (const StageResult& s : r) longest = std::max(longest, s.steps[i].step_seconds);
        step.push_back(longest);
      }
      std::string idle, recomputed, kept;
      double idle_sum = 0;
      for (const StageResult& s : r) {
        std::vector<double> shares;
        for (const PipelineSession::Stats& st : s.steps) {
          shares.push_back(1.0 - st.compute_seconds / st.step_seconds);
        }
        const double share = Median(shares);
        idle_sum += share;
        char buf[64];
        std::snprintf(buf, sizeof(buf), "%s%.2f", idle.empty() ? "" : " ", share);
        idle += buf;
        std::snprintf(buf, sizeof(buf), "%s%d", recomputed.empty() ? "" : " ",
                      s.steps.back().recomputed);
        recomputed += buf;
        std::snprintf(buf, sizeof(buf), "%s%d:%.1fM", kept.empty() ? "" : " ",
                      s.steps.back().peak_in_flight,
                      static_cast<double>(s.steps.back().peak_kept_bytes) / 1048576.0);
        kept += buf;
      }
      std::printf("%-8s %2d %9.1f %9.1f %7.3f %7.3f  %-24s %-14s %-22s\n",
                  schedule == PipelineSchedule::kGPipe ? "gpipe" : "1f1b", m, 1e3 * Median(step),
                  1e3 * one, idle_sum / static_cast<double>(r.size()), IdealBubble(o.stages, m),
                  idle.c_str(), recomputed.c_str(), kept.c_str());
    }
  }
  std::printf(
      "# bubble: the stages' mean idle share (1 - compute / step); ideal (P-1)/(m+P-1). "
      "kept: micro-batches in flight at most : MiB of their activations held at once\n");
  return 0;
}
