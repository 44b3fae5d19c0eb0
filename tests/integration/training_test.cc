// End to end: a real coordinator, two real aidn-worker daemons and the real
// trainer processes they start, training on Debian's Fashion-MNIST over Gloo.

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"

namespace aidn::testing {
namespace {

constexpr std::chrono::milliseconds kLong{120'000};
constexpr const char* kDataset = kFashionMnist;

class TrainingTest : public ClusterFixture {
 protected:
  TrainingTest() : ClusterFixture("aidn-training-test") {}

  void SetUp() override {
    if (!FashionMnistInstalled()) {
      GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh)";
    }
    ClusterFixture::SetUp();
    ASSERT_TRUE(
        cluster().StartCoordinator({"--worker-timeout=3s", "--heartbeat-interval=500ms"}).ok());
    ASSERT_TRUE(cluster().StartWorkers({"w1", "w2"}, {.args = {"--metrics-addr=127.0.0.1:0"}}));
  }

  v1::JobSpec MlpSpec() {
    v1::JobSpec spec;
    spec.set_name("training-test");
    spec.set_world_size(2);
    spec.mutable_model()->set_name("mlp");
    spec.mutable_optimizer()->set_name("sgd");
    spec.mutable_optimizer()->set_lr(0.05);
    spec.mutable_optimizer()->set_momentum(0.9);
    spec.set_batch_size(64);
    spec.set_max_steps(300);
    spec.set_seed(1);
    spec.set_max_restarts(0);
    return spec;
  }

  std::string Submit(const v1::JobSpec& spec) {
    absl::StatusOr<std::string> id = cluster().Submit(spec);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }
  v1::Job WaitForEnd(const std::string& id) { return cluster().WaitForEnd(id, kLong); }
  std::vector<v1::StepMetrics> Metrics(const std::string& id) { return cluster().Metrics(id); }
  std::string TrainerLog(const std::string& worker, const std::string& id, int rank) {
    return ReadFileOrEmpty(
        absl::StrCat(cluster().WorkDir(worker), "/logs/", id, "/gen-1/rank-", rank, ".log"));
  }
};

TEST_F(TrainingTest, TwoWorkersTrainTheMlpToARealTestAccuracy) {
  const std::string id = Submit(MlpSpec());
  v1::Job job = WaitForEnd(id);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
  EXPECT_EQ(job.generation(), 1);

  std::vector<v1::StepMetrics> steps = Metrics(id);
  int train = 0;
  double first_loss = 0, last_loss = 0;
  double accuracy = -1;
  for (const v1::StepMetrics& s : steps) {
    if (s.kind() == v1::MetricRecord::EVAL) {
      accuracy = s.test_accuracy();
      continue;
    }
    ++train;
    EXPECT_EQ(s.step(), train) << "one combined step each, in order";
    // Every step of both ranks arrived.
    EXPECT_EQ(s.ranks_reported(), 2) << "step " << s.step();
    EXPECT_EQ(s.samples(), 128) << "2 ranks x 64";
    EXPECT_GT(s.samples_per_second(), 0);
    if (s.step() == 1) first_loss = s.loss();
    if (s.step() == 300) last_loss = s.loss();
  }
  EXPECT_EQ(train, 300);
  EXPECT_GT(first_loss, 1.5) << "an untrained 10-class model starts near ln 10";
  EXPECT_LT(last_loss, 0.9);
  // 300 steps x 128 samples (under one epoch) already reach ~0.8 on
  // Fashion-MNIST; a broken gradient or allreduce stays near 0.1.
  EXPECT_GT(accuracy, 0.72);
  // The trainers wrote their logs where the workers keep them.
  EXPECT_TRUE(
      std::filesystem::exists(absl::StrCat(cluster().WorkDir("w1"), "/logs/", id, "/gen-1")));
}

// Both workers run on this host, so by default the ranks meet in shared
// memory; `comm_backend: gloo` makes them use TCP. For two ranks both sum
// a + b and halve it, so the runs must agree bit for bit, step by step.
TEST_F(TrainingTest, SharedMemoryAndGlooTrainTheSameLossesBitForBit) {
  std::map<std::string, std::vector<double>> losses;
  for (v1::JobSpec::CommBackend backend : {v1::JobSpec::AUTO, v1::JobSpec::GLOO}) {
    v1::JobSpec spec = MlpSpec();
    spec.set_max_steps(120);
    spec.set_comm_backend(backend);
    const std::string id = Submit(spec);
    v1::Job job = WaitForEnd(id);
    ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
    std::string logs;
    for (const char* w : {"w1", "w2"}) {
      for (int rank : {0, 1}) {
        logs += TrainerLog(w, id, rank);
      }
    }
    const std::string want = backend == v1::JobSpec::AUTO ? "transport=shm" : "transport=gloo";
    int found = 0;
    for (size_t at = logs.find(want); at != std::string::npos; at = logs.find(want, at + 1)) {
      ++found;
    }
    EXPECT_EQ(found, 2) << "both ranks log their transport:\n" << logs;
    std::vector<double>& mine = losses[v1::JobSpec::CommBackend_Name(backend)];
    for (const v1::StepMetrics& s : Metrics(id)) {
      if (s.kind() == v1::MetricRecord::TRAIN) mine.push_back(s.loss());
    }
    EXPECT_EQ(mine.size(), 120u);
  }
  EXPECT_EQ(losses["AUTO"], losses["GLOO"]);
}

TEST_F(TrainingTest, TheCnnTrainsToo) {
  v1::JobSpec spec = MlpSpec();
  spec.mutable_model()->set_name("cnn");
  spec.set_max_steps(20);
  const std::string id = Submit(spec);
  v1::Job job = WaitForEnd(id);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
  bool eval = false;
  for (const v1::StepMetrics& s : Metrics(id)) eval = eval || s.kind() == v1::MetricRecord::EVAL;
  EXPECT_TRUE(eval);
}

// ddp: {compression: powersgd}: the MLP's three weight matrices go as rank-4
// factors after 20 plain steps (with error feedback and warm start) and
// the job reaches the test accuracy of the same job uncompressed within
// 0.03; with bf16 buckets within 0.01. Each step's metrics say how many
// bytes the gradient collectives carried against the uncompressed
// buckets', and the trainer logs it.
TEST_F(TrainingTest, CompressedDdpTrainsTheMlpToTheAccuracyOfPlainDdp) {
  v1::JobSpec plain = MlpSpec();
  v1::JobSpec powersgd = MlpSpec();
  powersgd.mutable_ddp()->set_compression(v1::DdpSpec::POWERSGD);
  powersgd.mutable_ddp()->set_powersgd_rank(4);
  powersgd.mutable_ddp()->set_powersgd_start_step(20);
  v1::JobSpec bf16 = MlpSpec();
  bf16.mutable_ddp()->set_compression(v1::DdpSpec::BF16);
  std::vector<double> accuracy;
  std::vector<std::string> ids;
  // The last training step's bytes: sent, and uncompressed.
  std::vector<std::pair<int64_t, int64_t>> bytes;
  for (const v1::JobSpec& spec : {plain, powersgd, bf16}) {
    const std::string id = Submit(spec);
    ids.push_back(id);
    const v1::Job job = WaitForEnd(id);
    ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
    double last = -1;
    std::pair<int64_t, int64_t> sent;
    for (const v1::StepMetrics& s : Metrics(id)) {
      if (s.kind() == v1::MetricRecord::EVAL) last = s.test_accuracy();
      if (s.kind() == v1::MetricRecord::TRAIN) {
        sent = {s.gradient_comm_bytes(), s.gradient_comm_bytes_uncompressed()};
      }
    }
    accuracy.push_back(last);
    bytes.push_back(sent);
  }
  std::printf("test accuracy: plain %.4f, powersgd rank 4 %.4f, bf16 %.4f\n", accuracy[0],
              accuracy[1], accuracy[2]);
  EXPECT_GT(accuracy[0], 0.72);
  EXPECT_NEAR(accuracy[1], accuracy[0], 0.03) << "PowerSGD against plain DDP";
  EXPECT_NE(accuracy[1], accuracy[0]) << "the compressed job trained as the plain one did";
  EXPECT_NEAR(accuracy[2], accuracy[0], 0.01) << "bf16 buckets against plain DDP";
  // Plain: 269,322 gradients and the loss, with each gradient's padding to
  // 16 floats.
  EXPECT_GE(bytes[0].first, 4 * 269'323);
  EXPECT_EQ(bytes[0].first, bytes[0].second);
  // (256+784)4 + (256+256)4 + (10+256)4, the biases whole and the loss:
  // 4,160 + 2,048 + 1,064 + 522 + 1 = 7,795 floats a step.
  EXPECT_EQ(bytes[1], std::make_pair(int64_t{4 * 7'795}, bytes[0].second));
  // Two bytes a value; the loss goes apart.
  EXPECT_EQ(bytes[2], std::make_pair((bytes[0].second - 4) / 2, bytes[0].second));
  const std::string log = TrainerLog("w1", ids[1], 0) + TrainerLog("w2", ids[1], 0);
  EXPECT_TRUE(absl::StrContains(log, "compressed gradients")) << log;
  EXPECT_TRUE(absl::StrContains(log, "bytes_sent=31180")) << log;
}

TEST_F(TrainingTest, AMissingDatasetFailsTheJobAtOnceNamingTheFile) {
  // Under a root the workers allow (/usr/share), so that the job gets as far
  // as a rank opening the file.
  const std::string missing = "/usr/share/aidn-no-such-dataset";
  v1::JobSpec spec = MlpSpec();
  spec.set_max_restarts(3);
  spec.mutable_dataset()->set_kind("idx");
  spec.mutable_dataset()->set_train_images(missing + "/train-images.gz");
  spec.mutable_dataset()->set_train_labels(missing + "/train-labels.gz");
  spec.mutable_dataset()->set_test_images(missing + "/test-images.gz");
  spec.mutable_dataset()->set_test_labels(missing + "/test-labels.gz");
  const std::string id = Submit(spec);
  v1::Job job = WaitForEnd(id);
  EXPECT_EQ(job.state(), v1::Job::FAILED);
  EXPECT_EQ(job.restarts(), 0) << "a permanent failure must not use up restarts";
  EXPECT_TRUE(absl::StrContains(job.message(), missing + "/train-images.gz")) << job.message();
}

TEST_F(TrainingTest, GradientAccumulationTrainsWithFewerOptimizerSteps) {
  v1::JobSpec spec = MlpSpec();
  spec.set_grad_accum_steps(2);
  spec.set_max_steps(150);
  const std::string id = Submit(spec);
  v1::Job job = WaitForEnd(id);
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.message();
  int64_t last_step = 0;
  double accuracy = -1;
  for (const v1::StepMetrics& s : Metrics(id)) {
    if (s.kind() == v1::MetricRecord::EVAL) {
      accuracy = s.test_accuracy();
    } else {
      last_step = std::max(last_step, s.step());
      EXPECT_EQ(s.samples(), 256) << "2 ranks x two micro-batches of 64 per optimizer step";
    }
  }
  EXPECT_EQ(last_step, 150);
  EXPECT_GT(accuracy, 0.7);
}

TEST_F(TrainingTest, ATruncatedDatasetFileFailsTheJobNamingTheFileAndTheProblem) {
  // The real labels, and a training image file cut off after its header.
  const std::string images = cluster().Path("train-images-truncated");
  {
    std::ofstream out(images, std::ios::binary);
    const unsigned char header[16] = {0, 0, 8, 3, 0, 0, 0xea, 0x60, 0, 0, 0, 28, 0, 0, 0, 28};
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
    out << std::string(1000, '\x7f');
  }
  v1::JobSpec spec = MlpSpec();
  spec.set_max_restarts(2);
  v1::DatasetSpec* d = spec.mutable_dataset();
  d->set_kind("idx");
  d->set_train_images(images);
  d->set_train_labels(std::string(kDataset) + "/train-labels-idx1-ubyte.gz");
  d->set_test_images(std::string(kDataset) + "/t10k-images-idx3-ubyte.gz");
  d->set_test_labels(std::string(kDataset) + "/t10k-labels-idx1-ubyte.gz");
  const std::string id = Submit(spec);
  v1::Job job = WaitForEnd(id);
  EXPECT_EQ(job.state(), v1::Job::FAILED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_TRUE(absl::StrContains(job.message(), images)) << job.message();
  EXPECT_TRUE(absl::StrContains(job.message(), "truncated")) << job.message();
}

TEST_F(TrainingTest, CancelStopsEveryTrainerWithinSeconds) {
  v1::JobSpec spec = MlpSpec();
  spec.set_max_steps(0);
  spec.set_epochs(1000);
  const std::string id = Submit(spec);
  ASSERT_TRUE(cluster().WaitForState(id, v1::Job::RUNNING, kLong));
  const std::vector<std::string> trainers = {cluster().dir(), "--job=" + id + " "};
  ASSERT_TRUE(WaitFor([&] { return ProcessesWith(trainers).size() == 2; }, kLong,
                      "two trainer processes running the job"));
  ASSERT_TRUE(cluster().Cancel(id).ok());
  EXPECT_TRUE(WaitFor([&] { return ProcessesWith(trainers).empty(); }, std::chrono::seconds(15),
                      "every trainer gone",
                      [&] { return absl::StrCat(ProcessesWith(trainers).size(), " left"); }));
}

}  // namespace
}  // namespace aidn::testing
