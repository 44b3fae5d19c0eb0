// ResNet-18 and ResNet-50 against torchvision 0.14 (python3-torchvision)
// with the same small-image stem (resnet_torch.py): torchvision's model
// loads aidn's initial weights and buffers through safetensors by their
// names, picks a batch whose ReLU inputs keep clear of the kink (see the
// script), and both run it through a training forward and backward (mean
// cross-entropy) and then an eval forward. The logits, the loss, every
// running statistic after the training forward and the eval logits must
// agree within 1e-4 relative (‖a − b‖ / ‖b‖ per tensor), every gradient
// within 1e-3 (through 20-50 layers of BatchNorm).
//
// Skips only when /usr/bin/python3 cannot import torchvision.

#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "worker/engine/loss.h"
#include "worker/engine/model.h"
#include "worker/engine/safetensors.h"

namespace aidn::engine {
namespace {

constexpr char kPython[] = "/usr/bin/python3";
constexpr double kTolerance = 1e-4;
constexpr double kGradientTolerance = 1e-3;

double RelativeError(const Tensor& a, const Tensor& b) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class ResNetTorchTest : public ::testing::TestWithParam<const char*> {};

TEST_P(ResNetTorchTest, TrainingAndEvalPassesMatchTorchvision) {
  const std::string probe = absl::StrCat(kPython, " -c 'import torchvision' >/dev/null 2>&1");
  if (std::system(probe.c_str()) != 0) GTEST_SKIP() << "no torchvision for " << kPython;
  ModelConfig config;
  config.name = GetParam();
  config.in_channels = 1;
  // 12, 6, 3 and 2 px in layers 1-4: BatchNorm over at least 8 values.
  config.height = 12;
  config.width = 12;
  config.classes = 10;
  constexpr int64_t kBatch = 2;
  absl::StatusOr<std::unique_ptr<Sequential>> built = BuildModel(config, 3);
  ASSERT_TRUE(built.ok()) << built.status();
  Sequential& model = **built;

  std::string dir = (std::filesystem::temp_directory_path() / "aidn_resnet_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  std::vector<const Parameter*> state(model.Parameters().begin(), model.Parameters().end());
  state.insert(state.end(), model.Buffers().begin(), model.Buffers().end());
  ASSERT_TRUE(SaveSafetensors(dir + "/init.safetensors", state).ok());
  const std::string command =
      absl::StrCat(kPython, " ", AIDN_SOURCE_DIR, "/tests/integration/resnet_torch.py ", dir, " ",
                   config.name, " 1 ", config.height, " ", config.classes, " ", kBatch, " 2>&1");
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  absl::StatusOr<std::map<std::string, Tensor>> torch = ReadSafetensors(dir + "/torch.safetensors");
  ASSERT_TRUE(torch.ok()) << torch.status();
  Tensor images({kBatch, 1, config.height, config.width});
  const std::string image_bytes = Slurp(dir + "/images.f32");
  const std::string label_bytes = Slurp(dir + "/labels.i32");
  std::filesystem::remove_all(dir);
  ASSERT_EQ(image_bytes.size(), sizeof(float) * images.numel());
  ASSERT_EQ(label_bytes.size(), sizeof(int32_t) * kBatch);
  std::memcpy(images.data(), image_bytes.data(), image_bytes.size());
  std::vector<int32_t> labels(kBatch);
  std::memcpy(labels.data(), label_bytes.data(), label_bytes.size());

  Tensor logits, grad_logits, eval_logits;
  model.ZeroGrad();
  model.Forward(images, &logits, /*training=*/true);
  const double loss = SoftmaxCrossEntropy(logits, labels, &grad_logits);
  model.Backward(grad_logits);
  EXPECT_LT(RelativeError(logits, torch->at("logits")), kTolerance);
  EXPECT_NEAR(loss, torch->at("loss")[0], kTolerance * std::abs(loss));
  int checked = 0;
  double worst = 0;
  for (const Parameter* p : model.Parameters()) {
    const auto it = torch->find("grad." + p->name);
    ASSERT_NE(it, torch->end()) << p->name;
    ASSERT_EQ(it->second.shape(), p->grad.shape()) << p->name;
    const double error = RelativeError(p->grad, it->second);
    EXPECT_LT(error, kGradientTolerance) << "gradient of " << p->name;
    worst = std::max(worst, error);
    ++checked;
  }
  for (const Parameter* b : model.Buffers()) {
    const auto it = torch->find(b->name);
    ASSERT_NE(it, torch->end()) << b->name;
    EXPECT_LT(RelativeError(b->value, it->second), kTolerance) << b->name;
    ++checked;
  }
  model.Forward(images, &eval_logits, /*training=*/false);
  EXPECT_LT(RelativeError(eval_logits, torch->at("eval_logits")), kTolerance);
  // Every tensor torch wrote (but the logits and the loss) was compared.
  EXPECT_EQ(checked + 3, static_cast<int>(torch->size()));
  std::printf("%s: %zu parameters, %zu buffers; worst gradient error %.2e\n", GetParam(),
              model.Parameters().size(), model.Buffers().size(), worst);
}

INSTANTIATE_TEST_SUITE_P(Models, ResNetTorchTest, ::testing::Values("resnet18", "resnet50"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace aidn::engine
