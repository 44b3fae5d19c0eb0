// The numerical oracle: PyTorch trains the MLP and the CNN for 20 steps with
// SGD (momentum) and with AdamW from the same initial weights on the same
// batches; aidn, started from torch's initial weights (read through
// safetensors), trains the same steps with 1 rank and with 2 ranks (threads
// with a Gloo communicator each and a DdpReducer, each rank half of every
// batch), and must end within 1e-4 relative error (‖a − b‖ / ‖b‖ per tensor)
// of torch's single-process weights. Each step's loss is checked too.
//
// The batches are the first 1280 Fashion-MNIST training images, normalised as
// aidn's data loader does. A 20-step trajectory passes through discrete
// decisions (a ReLU's sign, a max-pool's argmax) that float32 rounding tips
// when two values lie within an ulp or two, and AdamW turns such a one-unit
// difference into lr-sized steps that spread. How sensitive a trajectory is
// depends on the batches: on random normal images torch disagrees with itself
// (oneDNN against native convolutions, one backward pass against two
// half-batch ones, float32 against float64) by more than 1e-4 on the CNN for 5
// of 6 seeds tried, and so it does on each of 4 other 1280-image Fashion-MNIST
// slices tried (3 of 4 counting the float32 variants only). On this slice its
// float32 variants agree within 1.3e-6 (float64 within 1.7e-5, from one
// max-pool near-tie, 3e-7 apart, at step 12). The script trains those float32
// variants too and reports how far they end from its reference beside every
// comparison, so that a failure tells an aidn error from an ill-conditioned
// oracle. The spread is reported, not asserted: it depends on which kernels
// the machine's libraries pick. Where torch's native (im2col + GEMM)
// convolutions end beyond the tolerance from its oneDNN reference (seen on
// AMD EPYC and on Xeon machines), aidn must match one of those two torch runs,
// weights and per-step losses, within the tolerance.
//
// Skips only when /usr/bin/python3 cannot import torch; fails (naming it) if
// the dataset is missing.

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/cpu.h"
#include "worker/engine/cpu_session.h"
#include "worker/engine/data.h"
#include "worker/engine/ddp.h"
#include "worker/engine/loss.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/safetensors.h"

namespace aidn::engine {
namespace {

constexpr char kPython[] = "/usr/bin/python3";
constexpr int kSteps = 20;
constexpr int kBatch = 64;
constexpr int64_t kImageSize = 28 * 28;
constexpr double kTolerance = 1e-4;

constexpr char kTorchScript[] = R"PY(
# The PyTorch side of the oracle: the same models on the same batches, 20 steps
# each of SGD with momentum and of AdamW from the same initial weights. Usage:
#   oracle.py OUT_DIR FASHION_MNIST_DIR MEAN STD
# Besides the reference run (torch's defaults: oneDNN convolutions, one backward
# pass per batch), it trains two variants that are just as correct in float32:
# the native (im2col + GEMM) convolutions, and two half-batch backward passes
# per step (what 2 ranks compute). How far these end from the reference tells
# how sensitive the trajectory is to rounding.
import gzip, json, struct, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

d, data_dir, mean, std = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
STEPS, BATCH = 20, 64
torch.set_num_threads(1)
if hasattr(torch, "set_flush_denormal"):
    torch.set_flush_denormal(True)


def save(path, tensors):
    """safetensors by its published layout (python3-safetensors is not packaged)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        b = t.detach().contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    text = json.dumps(header).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_idx(name, magic, count, item_bytes):
    path = f"{data_dir}/{name}"
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read(4 * (magic & 0xFF) + 4 + count * item_bytes)
    except OSError as e:
        sys.exit(f"cannot read {path}: {e} (install dataset-fashion-mnist; scripts/setup.sh does)")
    header = 4 * (magic & 0xFF) + 4
    if len(raw) < header + count * item_bytes or struct.unpack(">I", raw[:4])[0] != magic:
        sys.exit(f"{path}: not an IDX file with {count} items")
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8)


def build(name):
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256),
                             nn.ReLU(), nn.Linear(256, 10))
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1600, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def train(model, init, opt_name, halves=False):
    model.load_state_dict(init)
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for s in range(STEPS):
        x = images[s * BATCH:(s + 1) * BATCH]
        y = labels[s * BATCH:(s + 1) * BATCH]
        opt.zero_grad()
        if halves:
            h = BATCH // 2
            for k in range(2):
                (F.cross_entropy(model(x[k * h:(k + 1) * h]), y[k * h:(k + 1) * h]) / 2).backward()
            losses.append(float("nan"))
        else:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
        opt.step()
    return model.state_dict(), losses


# The first STEPS * BATCH training images, as torchvision's ToTensor + Normalize.
n = STEPS * BATCH
images = ((read_idx("train-images-idx3-ubyte.gz", 0x803, n, 784).to(torch.float32) / 255 - mean)
          / std).reshape(n, 1, 28, 28)
labels = read_idx("train-labels-idx1-ubyte.gz", 0x801, n, 1).to(torch.int64)
with open(f"{d}/images.f32", "wb") as f:
    f.write(images.numpy().astype("<f4").tobytes())
with open(f"{d}/labels.i32", "wb") as f:
    f.write(labels.numpy().astype("<i4").tobytes())

for name in ("mlp", "cnn"):
    torch.manual_seed(0)
    model = build(name)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save(f"{d}/{name}_init.safetensors", init)
    for opt_name in ("sgd", "adamw"):
        start = time.perf_counter()
        final, losses = train(model, init, opt_name)
        seconds = time.perf_counter() - start
        save(f"{d}/{name}_{opt_name}_final.safetensors", final)
        with open(f"{d}/{name}_{opt_name}_losses.f64", "wb") as f:
            f.write(struct.pack("<%dd" % len(losses), *losses))
        save(f"{d}/{name}_{opt_name}_halves.safetensors", train(model, init, opt_name, True)[0])
        if name == "cnn":  # an MLP has no convolutions
            torch.backends.mkldnn.enabled = False
            native, native_losses = train(model, init, opt_name)
            torch.backends.mkldnn.enabled = True
            save(f"{d}/{name}_{opt_name}_native.safetensors", native)
            with open(f"{d}/{name}_{opt_name}_native_losses.f64", "wb") as f:
                f.write(struct.pack("<%dd" % len(native_losses), *native_losses))
        print("torch %s %-5s: %d steps in %.2f s, loss %.4f -> %.4f" % (
            name, opt_name, STEPS, seconds, losses[0], losses[-1]))
print("ok")
)PY";

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

template <typename T>
std::vector<T> ReadArray(const std::string& path) {
  const std::string bytes = ReadAll(path);
  std::vector<T> out(bytes.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

// The script's outputs, produced once for every test of the suite.
struct Oracle {
  bool torch_available = false;
  // Empty when the script ran and wrote everything; else why not.
  std::string failure;
  std::string dir;
  std::vector<float> images;    // [kSteps * kBatch, 1, 28, 28]
  std::vector<int32_t> labels;  // [kSteps * kBatch]

  ~Oracle() {
    if (!dir.empty()) std::filesystem::remove_all(dir);
  }
};

const Oracle& GetOracle() {
  // Destroyed at exit, which removes the directory.
  static const std::unique_ptr<Oracle> oracle = [] {
    auto o = std::make_unique<Oracle>();
    const std::string probe = absl::StrCat(kPython, " -c 'import torch' >/dev/null 2>&1");
    o->torch_available = std::system(probe.c_str()) == 0;
    if (!o->torch_available) return o;
    std::string tmpl = (std::filesystem::temp_directory_path() / "aidn_oracle_XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) {
      o->failure = "mkdtemp failed";
      return o;
    }
    o->dir = tmpl;
    { std::ofstream(o->dir + "/oracle.py") << kTorchScript; }
    const std::string command =
        absl::StrCat(kPython, " ", o->dir, "/oracle.py ", o->dir, " ", kFashionMnistDir, " ",
                     absl::StrFormat("%.9g %.9g", kFashionMnistMean, kFashionMnistStd), " >",
                     o->dir, "/oracle.log 2>&1");
    const auto start = std::chrono::steady_clock::now();
    const int rc = std::system(command.c_str());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string log = ReadAll(o->dir + "/oracle.log");
    if (rc != 0) {
      o->failure = absl::StrCat("the torch script failed (status ", rc, "):\n", log);
      return o;
    }
    std::printf("%s(torch script: %.1f s with python start-up)\n", log.c_str(), seconds);
    o->images = ReadArray<float>(o->dir + "/images.f32");
    o->labels = ReadArray<int32_t>(o->dir + "/labels.i32");
    if (o->images.size() != static_cast<size_t>(kSteps * kBatch * kImageSize) ||
        o->labels.size() != static_cast<size_t>(kSteps * kBatch)) {
      o->failure = absl::StrCat("the torch script wrote ", o->images.size(), " pixels and ",
                                o->labels.size(), " labels");
    }
    return o;
  }();
  return *oracle;
}

struct Case {
  std::string model;      // "mlp" or "cnn"
  std::string optimizer;  // "sgd" or "adamw"
  int ranks = 1;
};

OptimizerConfig OptimizerFor(const std::string& name) {
  OptimizerConfig config;
  config.name = name;
  if (name == "sgd") {
    config.lr = 0.05;
    config.momentum = 0.9;
  } else {
    config.lr = 1e-3;
    config.weight_decay = 0.01;  // torch's AdamW default
  }
  return config;
}

ModelConfig ModelFor(const std::string& name) {
  ModelConfig config;
  config.name = name;
  config.hidden_sizes = {256, 256};
  return config;
}

// What one rank ends with.
struct RankResult {
  absl::Status status;
  std::unique_ptr<Sequential> model;
  std::vector<double> losses;  // the mean loss over all ranks, per step
};

// Trains one rank (its rows of every batch) from torch's initial weights;
// `communicator` is null for a single rank.
absl::Status TrainRank(const Case& c, const Oracle& oracle, int rank, Communicator* communicator,
                       RankResult* result) {
  // Per thread: flush-to-zero lives in each thread's MXCSR.
  ConfigureCpu(1);
  AIDN_ASSIGN_OR_RETURN(result->model, BuildModel(ModelFor(c.model), /*seed=*/7));
  Sequential& model = *result->model;
  AIDN_RETURN_IF_ERROR(LoadSafetensors(absl::StrCat(oracle.dir, "/", c.model, "_init.safetensors"),
                                       model.Parameters()));
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer,
                        Optimizer::Create(OptimizerFor(c.optimizer), model.Parameters()));
  // The trainer's step; with 2 ranks over a DDP reducer whose small
  // buckets make several allreduces overlap backward.
  CpuSessionOptions options;
  if (communicator != nullptr) {
    options.communicator = communicator;
    options.bucket_mb = 0.25;
    AIDN_RETURN_IF_ERROR(DdpReducer::BroadcastParameters(model.Parameters(), communicator));
  }
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<CpuSession> session,
                        CpuSession::Create(options, &model, optimizer.get()));
  const int64_t rows = kBatch / c.ranks;
  Tensor images({rows, 1, 28, 28});
  std::vector<int32_t> labels(static_cast<size_t>(rows));
  for (int step = 0; step < kSteps; ++step) {
    const int64_t first = int64_t{step} * kBatch + rank * rows;
    std::memcpy(images.data(), oracle.images.data() + first * kImageSize,
                static_cast<size_t>(rows * kImageSize) * sizeof(float));
    std::memcpy(labels.data(), oracle.labels.data() + first,
                static_cast<size_t>(rows) * sizeof(int32_t));
    // The mean over the ranks with 2, this rank's with 1.
    AIDN_ASSIGN_OR_RETURN(const double loss,
                          session->Step(images, labels, OptimizerFor(c.optimizer).lr));
    result->losses.push_back(loss);
  }
  return absl::OkStatus();
}

// Every rank on a thread of its own; Gloo over one in-memory store.
std::vector<RankResult> Train(const Case& c, const Oracle& oracle) {
  std::vector<RankResult> results(static_cast<size_t>(c.ranks));
  InMemoryKeyValueStore store;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < c.ranks; ++rank) {
    threads.emplace_back([&, rank] {
      RankResult& result = results[static_cast<size_t>(rank)];
      if (c.ranks == 1) {
        result.status = TrainRank(c, oracle, rank, nullptr, &result);
        return;
      }
      GlooOptions options;
      options.rank = rank;
      options.world_size = c.ranks;
      options.timeout = std::chrono::milliseconds(30'000);
      options.prefix = "oracle";
      absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateGlooCommunicator(options, &store);
      if (!comm.ok()) {
        result.status = comm.status();
        return;
      }
      result.status = TrainRank(c, oracle, rank, comm->get(), &result);
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

double Norm(const float* a, const float* b, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - (b != nullptr ? static_cast<double>(b[i]) : 0.0);
    sum += d * d;
  }
  return std::sqrt(sum);
}

using TensorMap = std::map<std::string, Tensor>;

// How far `got` ends from `want`, tensor by tensor.
struct Distance {
  std::map<std::string, double> relative;  // ‖got − want‖ / ‖want‖
  double worst = 0;
  std::string worst_name;
  // max ‖got − want‖ / ‖want − init‖: the error against how far torch moved
  // the tensor, a stricter view, reported only.
  double worst_of_update = 0;
};

Distance Compare(const std::map<std::string, const Tensor*>& got, const TensorMap& want,
                 const TensorMap& init) {
  Distance d;
  for (const auto& [name, a] : got) {
    const auto b = want.find(name);
    const auto i = init.find(name);
    if (b == want.end() || i == init.end() || b->second.shape() != a->shape()) {
      ADD_FAILURE() << "tensor " << name << " is missing from torch's file or has another shape";
      continue;
    }
    const int64_t n = a->numel();
    const double diff = Norm(a->data(), b->second.data(), n);
    const double error = diff / Norm(b->second.data(), nullptr, n);
    d.relative[name] = error;
    if (error >= d.worst) {
      d.worst = error;
      d.worst_name = name;
    }
    const double update = Norm(b->second.data(), i->second.data(), n);
    if (update > 0) d.worst_of_update = std::max(d.worst_of_update, diff / update);
  }
  return d;
}

std::map<std::string, const Tensor*> View(const TensorMap& tensors) {
  std::map<std::string, const Tensor*> view;
  for (const auto& [name, t] : tensors) view[name] = &t;
  return view;
}

class TorchOracle : public ::testing::TestWithParam<std::tuple<std::string, std::string, int>> {};

TEST_P(TorchOracle, EndsTwentyStepsWithinOneInTenThousandOfPyTorch) {
  const Case c{std::get<0>(GetParam()), std::get<1>(GetParam()), std::get<2>(GetParam())};
  const std::string label = absl::StrCat(c.model, " ", c.optimizer, " ", c.ranks, " rank(s)");
  const Oracle& oracle = GetOracle();
  if (!oracle.torch_available) {
    GTEST_SKIP() << kPython << " cannot import torch (install python3-torch): no PyTorch oracle";
  }
  ASSERT_TRUE(oracle.failure.empty()) << oracle.failure;
  const std::string prefix = absl::StrCat(oracle.dir, "/", c.model, "_");
  absl::StatusOr<TensorMap> init = ReadSafetensors(prefix + "init.safetensors");
  ASSERT_TRUE(init.ok()) << init.status();
  absl::StatusOr<TensorMap> want =
      ReadSafetensors(absl::StrCat(prefix, c.optimizer, "_final.safetensors"));
  ASSERT_TRUE(want.ok()) << want.status();

  // The oracle is only as good as torch's agreement with itself.
  double torch_spread = 0;
  std::string spread_note;
  for (const std::string variant : {"halves", "native"}) {
    const std::string path = absl::StrCat(prefix, c.optimizer, "_", variant, ".safetensors");
    if (!std::filesystem::exists(path)) continue;  // no "native" for the MLP
    absl::StatusOr<TensorMap> other = ReadSafetensors(path);
    ASSERT_TRUE(other.ok()) << other.status();
    const Distance d = Compare(View(*other), *want, *init);
    absl::StrAppend(&spread_note, spread_note.empty() ? "" : ", ", variant, " ",
                    absl::StrFormat("%.1e", d.worst), " (", d.worst_name, ")");
    torch_spread = std::max(torch_spread, d.worst);
  }
  // Not asserted: how sensitive torch's trajectory is depends on the kernels
  // the machine's libraries pick (on an AMD EPYC, OpenBLAS's native
  // convolutions tip a max-pool near-tie that oneDNN does not and end 1.1e-2
  // from the reference, while aidn stays within 1.7e-5 of it). aidn must still
  // match the reference run; when it does not, the spread in the message tells
  // whether the oracle was ill-conditioned on this machine.
  if (torch_spread >= kTolerance) {
    std::printf(
        "[  oracle  ] note: torch's own float32 variants end %.1e from its reference "
        "run (%s): the trajectory is sensitive to rounding on this machine\n",
        torch_spread, spread_note.c_str());
  }

  const auto start = std::chrono::steady_clock::now();
  std::vector<RankResult> results = Train(c, oracle);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int rank = 0; rank < c.ranks; ++rank) {
    ASSERT_TRUE(results[static_cast<size_t>(rank)].status.ok())
        << "rank " << rank << ": " << results[static_cast<size_t>(rank)].status;
  }
  const std::vector<Parameter*>& params = results[0].model->Parameters();

  // Every tensor of torch's model is one of aidn's (LoadSafetensors found
  // each of aidn's), so nothing kept aidn's own initialisation.
  EXPECT_EQ(init->size(), params.size());
  ASSERT_EQ(want->size(), params.size());

  // Ranks apply the same averaged gradients, so they agree bit for bit.
  for (int rank = 1; rank < c.ranks; ++rank) {
    const std::vector<Parameter*>& other = results[static_cast<size_t>(rank)].model->Parameters();
    ASSERT_EQ(other.size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(std::memcmp(other[i]->value.data(), params[i]->value.data(),
                            static_cast<size_t>(params[i]->value.numel()) * sizeof(float)),
                0)
          << "rank " << rank << " differs from rank 0 in " << params[i]->name;
    }
    EXPECT_EQ(results[static_cast<size_t>(rank)].losses, results[0].losses);
  }

  std::map<std::string, const Tensor*> got;
  for (const Parameter* p : params) got[p->name] = &p->value;
  Distance d = Compare(got, *want, *init);
  // Where torch's native (im2col + GEMM) convolutions end further from its
  // oneDNN reference than the tolerance, both runs are equally valid float32
  // trajectories of the same training: aidn, whose convolutions are im2col +
  // GEMM too, must then match one of them, weights and losses of that run.
  std::string against = "reference";
  std::string losses_file = absl::StrCat(prefix, c.optimizer, "_losses.f64");
  const std::string native_path = absl::StrCat(prefix, c.optimizer, "_native.safetensors");
  if (d.worst >= kTolerance && torch_spread >= kTolerance && std::filesystem::exists(native_path)) {
    absl::StatusOr<TensorMap> native = ReadSafetensors(native_path);
    ASSERT_TRUE(native.ok()) << native.status();
    const Distance n = Compare(got, *native, *init);
    if (n.worst < d.worst) {
      d = n;
      against = "native";
      losses_file = absl::StrCat(prefix, c.optimizer, "_native_losses.f64");
    }
  }
  for (const auto& [name, error] : d.relative) {
    EXPECT_LT(error, kTolerance) << label << ": tensor " << name << " against torch's " << against
                                 << " run (torch's own spread " << spread_note << ")";
  }

  const std::vector<double> torch_losses = ReadArray<double>(losses_file);
  ASSERT_EQ(torch_losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(results[0].losses.size(), static_cast<size_t>(kSteps));
  double worst_loss = 0;
  for (int step = 0; step < kSteps; ++step) {
    const double a = results[0].losses[static_cast<size_t>(step)];
    const double b = torch_losses[static_cast<size_t>(step)];
    EXPECT_LT(std::fabs(a - b) / std::fabs(b), kTolerance)
        << label << ": step " << step << ": aidn loss " << a << ", torch " << b;
    worst_loss = std::max(worst_loss, std::fabs(a - b) / std::fabs(b));
  }
  std::printf(
      "[  oracle  ] %-19s max ‖a−b‖/‖b‖ %.2e (%s), max ‖a−b‖/‖update‖ %.2e, max loss error "
      "%.2e, %.2f s, against torch's %s run; torch's own spread: %s\n",
      label.c_str(), d.worst, d.worst_name.c_str(), d.worst_of_update, worst_loss, seconds,
      against.c_str(), spread_note.c_str());
}

INSTANTIATE_TEST_SUITE_P(ModelsOptimizersRanks, TorchOracle,
                         ::testing::Combine(::testing::Values("mlp", "cnn"),
                                            ::testing::Values("sgd", "adamw"),
                                            ::testing::Values(1, 2)),
                         [](const ::testing::TestParamInfo<TorchOracle::ParamType>& info) {
                           return absl::StrCat(std::get<0>(info.param), "_",
                                               std::get<1>(info.param), "_",
                                               std::get<2>(info.param), "rank");
                         });

}  // namespace
}  // namespace aidn::engine
