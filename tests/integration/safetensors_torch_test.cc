// The checkpoint's model.safetensors is a file PyTorch users can load: a real
// coordinator and real aidn-worker daemons train a job to the end, then
// /usr/bin/python3 (Debian's torch; python3-safetensors is not packaged)
// parses the final checkpoint's model.safetensors by the published layout,
// loads it with load_state_dict(strict=True) into the same torch.nn.Sequential
// and evaluates it on the Fashion-MNIST test split. Its test accuracy must be
// the one aidn reported for that step.
//
// Skips when /usr/bin/python3 cannot import torch or the dataset is missing.

#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"
#include "worker/engine/data.h"

namespace aidn::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr char kPython[] = "/usr/bin/python3";
constexpr char kScript[] = AIDN_SOURCE_DIR "/tests/integration/torch_eval_checkpoint.py";
constexpr milliseconds kJobTimeout{300'000};

bool TorchImports() {
  static const bool ok =
      RunCommand({kPython, "-c", "import torch, numpy"}, {}, seconds(60)).exit_code == 0;
  return ok;
}

// What the script printed: "tensor NAME DTYPE [shape]" lines, the count, and
// the number of test images it classified correctly.
struct TorchEval {
  std::map<std::string, std::string> tensors;  // name -> "F32 [d0, d1]"
  int64_t tensor_count = -1;
  int64_t correct = -1;
  int64_t total = -1;
};

TorchEval ParseEval(const std::string& out) {
  TorchEval eval;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    const std::vector<absl::string_view> words = absl::StrSplit(line, ' ');
    if (words.size() >= 4 && words[0] == "tensor") {
      // "tensor NAME DTYPE [D0, D1]": the shape keeps its spaces.
      std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(' ', 2));
      eval.tensors[std::string(parts[1])] = std::string(parts[2]);
    } else if (words.size() == 2 && words[0] == "tensors") {
      if (!absl::SimpleAtoi(words[1], &eval.tensor_count)) eval.tensor_count = -1;
    } else if (words.size() == 4 && words[0] == "correct" && words[2] == "/") {
      if (!absl::SimpleAtoi(words[1], &eval.correct) || !absl::SimpleAtoi(words[3], &eval.total)) {
        eval.correct = eval.total = -1;
      }
    }
  }
  return eval;
}

class SafetensorsTorchTest : public ClusterFixture {
 protected:
  SafetensorsTorchTest() : ClusterFixture("aidn-safetensors-torch-test") {}

  void SetUp() override {
    if (!fs::exists(std::string(engine::kFashionMnistDir) + "/t10k-images-idx3-ubyte.gz") ||
        !fs::exists(std::string(engine::kFashionMnistDir) + "/train-images-idx3-ubyte.gz")) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed in "
                   << engine::kFashionMnistDir << " (scripts/setup.sh installs it)";
    }
    if (!TorchImports()) {
      GTEST_SKIP() << kPython << " cannot import torch and numpy (Debian's python3-torch; "
                   << "scripts/setup.sh installs it)";
    }
    ClusterFixture::SetUp();
    ckpt_root_ = cluster().Path("ckpt");
    const absl::Status started = cluster().StartCoordinator();
    ASSERT_TRUE(started.ok()) << started;
  }

  void TearDown() override {
    StopAllAndExpectNoProcesses();
    ClusterFixture::TearDown();
  }

  // Worker daemons with one CPU slot each, sharing the checkpoint root.
  void StartWorkers(const std::vector<std::string>& ids) {
    ASSERT_TRUE(cluster().StartWorkers(
        ids, {.args = {"--checkpoint-root=" + ckpt_root_, "--stop-grace=1s"}}));
  }

  v1::JobSpec Spec(const std::string& model, const std::vector<int>& hidden, int world_size,
                   int64_t steps) {
    v1::JobSpec spec;
    spec.set_name("safetensors-torch-test");
    spec.set_world_size(world_size);
    spec.mutable_model()->set_name(model);
    for (int h : hidden) spec.mutable_model()->add_hidden_sizes(h);
    spec.mutable_optimizer()->set_name("sgd");
    spec.mutable_optimizer()->set_lr(0.05);
    spec.mutable_optimizer()->set_momentum(0.9);
    spec.set_batch_size(64);
    spec.set_max_steps(steps);
    spec.set_seed(3);
    spec.set_max_restarts(0);
    spec.mutable_checkpoint()->set_dir("runs");
    spec.mutable_checkpoint()->set_every_steps(100);
    return spec;
  }

  // Submits `spec`, waits until the job has ended, and returns it.
  v1::Job RunJob(const v1::JobSpec& spec) {
    absl::StatusOr<std::string> id = cluster().Submit(spec);
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return v1::Job();
    return cluster().WaitForEnd(*id, kJobTimeout);
  }

  // The EVAL metrics aidn recorded for `step`; kind TRAIN if there are none.
  v1::StepMetrics EvalAt(const std::string& job_id, int64_t step) {
    for (const v1::StepMetrics& m : cluster().Metrics(job_id, step, step)) {
      if (m.kind() == v1::MetricRecord::EVAL && m.step() == step) return m;
    }
    return v1::StepMetrics();
  }

  // Trains `spec` to the end with aidn, evaluates the final checkpoint's
  // model.safetensors in torch, and compares. `expected_tensors` is the
  // file's content as torch's nn.Sequential names and shapes it.
  void TrainAndCompare(const v1::JobSpec& spec,
                       const std::map<std::string, std::string>& expected_tensors) {
    const v1::Job job = RunJob(spec);
    ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
    const int64_t steps = spec.max_steps();
    // The trainer checkpoints at the end, so the last checkpoint is the
    // final step's, and evaluates at the end, so there is an EVAL record.
    ASSERT_EQ(job.last_checkpoint_step(), steps);
    const v1::StepMetrics eval = EvalAt(job.id(), steps);
    ASSERT_EQ(eval.kind(), v1::MetricRecord::EVAL) << "no evaluation recorded at step " << steps;
    const std::string file = absl::StrFormat("%s/%s/%s/step-%08d/model.safetensors", ckpt_root_,
                                             spec.checkpoint().dir(), job.id(), steps);
    ASSERT_TRUE(fs::exists(file)) << file;

    std::vector<std::string> argv = {kPython, kScript, file, spec.model().name()};
    for (int h : spec.model().hidden_sizes()) argv.push_back(absl::StrCat(h));
    argv.push_back(engine::kFashionMnistDir);
    argv.push_back(absl::StrFormat("--mean=%.9g", engine::kFashionMnistMean));
    argv.push_back(absl::StrFormat("--std=%.9g", engine::kFashionMnistStd));
    const auto start = std::chrono::steady_clock::now();
    const CommandResult result = RunCommand(argv, {}, seconds(300));
    const double script_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_EQ(result.exit_code, 0) << absl::StrJoin(argv, " ") << "\n"
                                   << result.out << "\n"
                                   << result.err;

    // The script really parsed the file: it lists exactly the tensors, with
    // the shapes, that the model has.
    const TorchEval torch_eval = ParseEval(result.out);
    EXPECT_EQ(torch_eval.tensor_count, static_cast<int64_t>(expected_tensors.size())) << result.out;
    EXPECT_EQ(torch_eval.tensors, expected_tensors) << result.out;

    // aidn reports correct / total as a fraction of the whole test split.
    ASSERT_EQ(torch_eval.total, 10000) << result.out;
    // The trainer divides in float32; 0.8183f is 8183.00009 images.
    const int64_t aidn_correct =
        std::llround(eval.test_accuracy() * static_cast<double>(torch_eval.total));
    const double torch_accuracy =
        static_cast<double>(torch_eval.correct) / static_cast<double>(torch_eval.total);
    std::printf(
        "%s, %d rank(s), %lld steps: aidn test accuracy %.4f, torch %.4f (%lld / %lld); "
        "torch evaluation %.1f s\n",
        spec.model().name().c_str(), spec.world_size(), static_cast<long long>(steps),
        eval.test_accuracy(), torch_accuracy, static_cast<long long>(torch_eval.correct),
        static_cast<long long>(torch_eval.total), script_s);
    // A trained model, so that agreement means something (an untrained one
    // scores about 0.1).
    EXPECT_GT(eval.test_accuracy(), 0.6);
    // Within one image in 10000: aidn's kernels and torch's sum the logits in
    // different orders, and a test image whose two largest logits lie within
    // float rounding of each other may have its argmax flipped by that.
    EXPECT_LE(std::abs(aidn_correct - torch_eval.correct), 1)
        << "aidn reported " << eval.test_accuracy() << ", torch measured " << torch_accuracy;
  }

  std::string ckpt_root_;
};

TEST(SafetensorsTorchEval, ParsesTheScriptsReport) {
  const TorchEval eval = ParseEval(
      "tensor 1.weight F32 [128, 784]\ntensor 1.bias F32 [128]\ntensors 2\n"
      "correct 8512 / 10000\naccuracy 0.851200\n");
  EXPECT_EQ(eval.tensor_count, 2);
  EXPECT_EQ(eval.tensors, (std::map<std::string, std::string>{{"1.weight", "F32 [128, 784]"},
                                                              {"1.bias", "F32 [128]"}}));
  EXPECT_EQ(eval.correct, 8512);
  EXPECT_EQ(eval.total, 10000);
}

// nn.Sequential(Flatten, Linear, ReLU, Linear, ReLU, Linear): parameters at
// indices 1, 3 and 5.
TEST_F(SafetensorsTorchTest, AnMlpCheckpointScoresInTorchWhatAidnReported) {
  StartWorkers({"w1"});
  TrainAndCompare(Spec("mlp", {128, 64}, 1, 300), {{"1.weight", "F32 [128, 784]"},
                                                   {"1.bias", "F32 [128]"},
                                                   {"3.weight", "F32 [64, 128]"},
                                                   {"3.bias", "F32 [64]"},
                                                   {"5.weight", "F32 [10, 64]"},
                                                   {"5.bias", "F32 [10]"}});
}

// nn.Sequential(Conv2d, ReLU, MaxPool2d, Conv2d, ReLU, MaxPool2d, Flatten,
// Linear, ReLU, Linear), trained with DDP on 2 ranks (rank 0 writes).
TEST_F(SafetensorsTorchTest, ACnnCheckpointOfTwoRanksScoresInTorchWhatAidnReported) {
  StartWorkers({"w1", "w2"});
  TrainAndCompare(Spec("cnn", {}, 2, 200), {{"0.weight", "F32 [32, 1, 3, 3]"},
                                            {"0.bias", "F32 [32]"},
                                            {"3.weight", "F32 [64, 32, 3, 3]"},
                                            {"3.bias", "F32 [64]"},
                                            {"7.weight", "F32 [128, 1600]"},
                                            {"7.bias", "F32 [128]"},
                                            {"9.weight", "F32 [10, 128]"},
                                            {"9.bias", "F32 [10]"}});
}

}  // namespace
}  // namespace aidn::testing
