// Allreduce bandwidth, nccl-tests style: aidn's Communicators (the
// shared-memory one, which a job whose ranks share a host gets, and the
// Gloo one over TCP, which ranks on different hosts get) against raw Gloo
// (gloo::allreduce, ring, on a context of its own), 2 ranks on loopback,
// 4 KB to 256 MB. All run in the same two processes, size by size and
// interleaved round by round, so they see the same machine.
//
//   build/bench/allreduce [--max-mb 256] [--rounds 3] [--min-seconds 0.2]
//
// Prints, from rank 0, one row per size and implementation:
//   size(B) count(floats) impl time(us) algbw(GB/s) busbw(GB/s)
// with impl aidn-shm, aidn (the Gloo communicator) and gloo.
// time is the median over rounds of each round's mean time per call; busbw
// = algbw * 2(n-1)/n, as nccl-tests define it. bench/allreduce.sh adds
// torch.distributed's gloo backend beside these.

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/transport/tcp/device.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/comm/shm_communicator.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kWorld = 2;

struct Options {
  size_t max_bytes = size_t{256} << 20;
  int rounds = 3;
  double min_seconds = 0.2;
};

void SumFloats(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<float*>(c);
  const auto* x = static_cast<const float*>(a);
  const auto* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int RunRank(int rank, const std::string& store_dir, const Options& options) {
  aidn::engine::FileKeyValueStore kv(store_dir);
  aidn::engine::GlooOptions gloo_options;
  gloo_options.rank = rank;
  gloo_options.world_size = kWorld;
  gloo_options.prefix = "aidn";
  gloo_options.timeout = std::chrono::milliseconds(120'000);
  absl::StatusOr<std::unique_ptr<aidn::engine::Communicator>> comm =
      aidn::engine::CreateGlooCommunicator(gloo_options, &kv);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, comm.status().ToString().c_str());
    return 1;
  }
  aidn::engine::ShmOptions shm_options;
  shm_options.rank = rank;
  shm_options.world_size = kWorld;
  shm_options.prefix = "aidn-shm";
  shm_options.timeout = gloo_options.timeout;
  absl::StatusOr<aidn::engine::ShmAttempt> shm =
      aidn::engine::CreateShmCommunicator(shm_options, &kv);
  if (!shm.ok() || shm->communicator == nullptr) {
    std::fprintf(stderr, "rank %d: shared memory: %s\n", rank,
                 shm.ok() ? shm->description.c_str() : shm.status().ToString().c_str());
    return 1;
  }
  // Raw Gloo: a context of its own over Gloo's own file store in the same
  // directory, as a Gloo user would set it up.
  auto store = std::make_shared<gloo::rendezvous::FileStore>(store_dir);
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, kWorld);
  context->setTimeout(std::chrono::milliseconds(120'000));
  gloo::rendezvous::PrefixStore prefixed("raw", *store);
  context->connectFullMesh(prefixed, device);
  uint32_t tag = 0;

  std::vector<float> a(options.max_bytes / sizeof(float)), b(a.size());
  for (size_t i = 0; i < a.size(); ++i) a[i] = b[i] = static_cast<float>(i % 7) * 0.5f;

  // Runs `op` `iters` times; both ranks agree on iters (rank 0 decides).
  auto timed = [&](const std::function<void()>& op, int iters) {
    gloo::BarrierOptions barrier(context);
    barrier.setTag(tag++);
    gloo::barrier(barrier);
    const Clock::time_point start = Clock::now();
    for (int i = 0; i < iters; ++i) op();
    return std::chrono::duration<double>(Clock::now() - start).count() / iters;
  };

  if (rank == 0) {
    std::printf("%12s %12s %-8s %12s %12s %12s\n", "size(B)", "count", "impl", "time(us)",
                "algbw(GB/s)", "busbw(GB/s)");
  }
  for (size_t bytes = 4096; bytes <= options.max_bytes; bytes *= 4) {
    const size_t count = bytes / sizeof(float);
    auto run = [&](aidn::engine::Communicator& c) {
      absl::Status s = c.AllReduce(a.data(), count, aidn::engine::ReduceOp::kSum);
      if (!s.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
        std::exit(1);
      }
    };
    auto shm_op = [&] { run(*shm->communicator); };
    auto aidn_op = [&] { run(**comm); };
    gloo::AllreduceOptions raw(context);
    raw.setOutput<float>(b.data(), count);
    raw.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    raw.setReduceFunction(&SumFloats);
    auto gloo_op = [&] {
      raw.setTag(tag++);
      gloo::allreduce(raw);
    };
    const std::vector<std::pair<const char*, std::function<void()>>> impls = {
        {"aidn-shm", shm_op}, {"aidn", aidn_op}, {"gloo", gloo_op}};
    // Warm up each, then pick an iteration count per implementation that
    // fills min_seconds (rank 0 decides; both ranks must agree).
    std::vector<int> iters;
    for (const auto& impl : impls) {
      const double probe = timed(impl.second, 2);
      float n = static_cast<float>(
          std::clamp(static_cast<int>(options.min_seconds / std::max(probe, 1e-7)), 3, 100000));
      (*comm)->Broadcast(&n, 1, 0).IgnoreError();
      iters.push_back(static_cast<int>(n));
    }
    std::vector<std::vector<double>> times(impls.size());
    for (int r = 0; r < options.rounds; ++r) {
      // Rotate which goes first.
      for (size_t k = 0; k < impls.size(); ++k) {
        const size_t i = (k + r) % impls.size();
        times[i].push_back(timed(impls[i].second, iters[i]));
      }
    }
    if (rank == 0) {
      for (size_t i = 0; i < impls.size(); ++i) {
        const double t = Median(times[i]);
        const double algbw = static_cast<double>(bytes) / t / 1e9;
        const double busbw = algbw * 2.0 * (kWorld - 1) / kWorld;
        std::printf("%12zu %12zu %-8s %12.1f %12.3f %12.3f\n", bytes, count, impls[i].first,
                    t * 1e6, algbw, busbw);
      }
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

void PrintUsage(std::FILE* out, const char* argv0) {
  const Options d;
  std::fprintf(out,
               "usage: %s [--max-mb N] [--rounds N] [--min-seconds S]\n"
               "  --max-mb       largest message in MiB (default: %zu)\n"
               "  --rounds       rounds per size, the median reported (default: %d)\n"
               "  --min-seconds  least time per round (default: %g)\n",
               argv0, d.max_bytes >> 20, d.rounds, d.min_seconds);
}

int main(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      PrintUsage(stdout, argv[0]);
      return 0;
    }
  }
  if (argc % 2 == 0) {
    PrintUsage(stderr, argv[0]);
    return 2;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--max-mb") {
      options.max_bytes = static_cast<size_t>(std::atol(argv[i + 1])) << 20;
    } else if (flag == "--rounds") {
      options.rounds = std::max(1, std::atoi(argv[i + 1]));
    } else if (flag == "--min-seconds") {
      options.min_seconds = std::atof(argv[i + 1]);
    } else {
      PrintUsage(stderr, argv[0]);
      return 2;
    }
  }
  char tmpl[] = "/tmp/aidn-allreduce-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;
  std::vector<pid_t> children;
  for (int rank = 0; rank < kWorld; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) _exit(RunRank(rank, dir, options));
    children.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return failed;
}
