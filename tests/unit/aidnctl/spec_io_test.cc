// Tests of aidnctl's job spec formats: specs in (ParseJobSpec) and messages out as JSON/YAML.

#include "aidnctl/spec_io.h"
#include "coordinator/spec.h"

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "aidnctl/config.h"
#include "aidnctl/output.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace aidn::ctl {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::Pair;
using ::testing::UnorderedElementsAre;

std::string ExamplePath(const std::string& name) {
  // This file is tests/unit/aidnctl/spec_io_test.cc under the source root.
  // __FILE__ is relative to the build directory when the compiler was given
  // relative paths (ccache's base_dir does that), so also look upwards from
  // the working directory, which ctest sets inside the build directory.
  std::filesystem::path file = __FILE__;
  for (std::filesystem::path dir = std::filesystem::current_path();
       file.is_relative() && !std::filesystem::exists(file) && dir.has_relative_path();
       dir = dir.parent_path()) {
    if (std::filesystem::exists(dir / __FILE__)) file = dir / __FILE__;
  }
  return (file.parent_path() / "../../../examples" / name).string();
}

v1::JobSpec MustParse(const std::string& text, const std::string& source = "job.yaml") {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(text, source);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : v1::JobSpec();
}

std::string ErrorOf(const std::string& text, const std::string& source = "job.yaml") {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(text, source);
  EXPECT_FALSE(spec.ok()) << "parsed: " << spec->ShortDebugString();
  if (spec.ok()) return "";
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(spec.status().message());
}

// ---------------------------------------------------------------------------
// Reading specs.

TEST(ParseJobSpec, ReadsTheMlpExample) {
  absl::StatusOr<std::string> text = ReadFileToString(ExamplePath("fashion-mnist-mlp.yaml"));
  ASSERT_TRUE(text.ok()) << text.status();
  const v1::JobSpec spec = MustParse(*text, "fashion-mnist-mlp.yaml");
  EXPECT_EQ(spec.name(), "fashion-mnist-mlp");
  EXPECT_EQ(spec.world_size(), 2);
  EXPECT_EQ(spec.device(), v1::JobSpec::CPU);
  EXPECT_EQ(spec.strategy(), v1::JobSpec::DDP);
  EXPECT_EQ(spec.model().name(), "mlp");
  EXPECT_THAT(spec.model().hidden_sizes(), ElementsAre(256, 256));
  EXPECT_EQ(spec.dataset().kind(), "fashion-mnist");
  EXPECT_EQ(spec.optimizer().name(), "sgd");
  EXPECT_DOUBLE_EQ(spec.optimizer().lr(), 0.05);
  EXPECT_DOUBLE_EQ(spec.optimizer().momentum(), 0.9);
  EXPECT_EQ(spec.batch_size(), 64);
  EXPECT_EQ(spec.checkpoint().every_steps(), 500);
  EXPECT_THAT(spec.labels(), UnorderedElementsAre(Pair("team", "demo")));
}

TEST(ParseJobSpec, ReadsTheCnnExample) {
  absl::StatusOr<std::string> text = ReadFileToString(ExamplePath("fashion-mnist-cnn.yaml"));
  ASSERT_TRUE(text.ok()) << text.status();
  const v1::JobSpec spec = MustParse(*text, "fashion-mnist-cnn.yaml");
  EXPECT_EQ(spec.model().name(), "cnn");
  EXPECT_EQ(spec.world_size(), 2);
  EXPECT_EQ(spec.device(), v1::JobSpec::CPU);
  EXPECT_TRUE(spec.optimizer().has_lr());
}

// The language-model example parses, and the coordinator's rules accept it
// as written.
TEST(ParseJobSpec, ReadsTheGptExampleAndTheCoordinatorAcceptsIt) {
  absl::StatusOr<std::string> text = ReadFileToString(ExamplePath("gpt-fortunes.yaml"));
  ASSERT_TRUE(text.ok()) << text.status();
  v1::JobSpec spec = MustParse(*text, "gpt-fortunes.yaml");
  EXPECT_EQ(spec.model().name(), "gpt");
  EXPECT_EQ(spec.model().config(), "gpt-mini");
  EXPECT_EQ(spec.dataset().kind(), "text");
  EXPECT_THAT(spec.dataset().files(), ElementsAre("/usr/share/games/fortunes"));
  EXPECT_EQ(spec.eval_every_steps(), 100);
  coordinator::ApplyJobSpecDefaults(coordinator::SpecLimits{}, &spec);
  EXPECT_TRUE(coordinator::ValidateJobSpec(coordinator::SpecLimits{}, spec).ok())
      << coordinator::ValidateJobSpec(coordinator::SpecLimits{}, spec);
  EXPECT_EQ(spec.model().n_layer(), 4);
  EXPECT_EQ(spec.model().block_size(), 128);
}

// The sharded example: strategy fsdp with its options and activation
// checkpointing, accepted as written.
TEST(ParseJobSpec, ReadsTheFsdpExampleAndTheCoordinatorAcceptsIt) {
  absl::StatusOr<std::string> text = ReadFileToString(ExamplePath("gpt-fsdp.yaml"));
  ASSERT_TRUE(text.ok()) << text.status();
  v1::JobSpec spec = MustParse(*text, "gpt-fsdp.yaml");
  EXPECT_EQ(spec.strategy(), v1::JobSpec::FSDP);
  EXPECT_EQ(spec.fsdp().sharding(), v1::FsdpSpec::FULL_SHARD);
  EXPECT_TRUE(spec.model().activation_checkpointing());
  coordinator::ApplyJobSpecDefaults(coordinator::SpecLimits{}, &spec);
  EXPECT_TRUE(coordinator::ValidateJobSpec(coordinator::SpecLimits{}, spec).ok())
      << coordinator::ValidateJobSpec(coordinator::SpecLimits{}, spec);
}

// Going on at 2 ranks from the 4-rank job: checkpoint.resume_from parses
// and passes the static checks (the coordinator checks the job at
// submission).
TEST(ParseJobSpec, ReadsTheResumeAtTwoRanksExample) {
  absl::StatusOr<std::string> text = ReadFileToString(ExamplePath("gpt-fsdp-2-ranks.yaml"));
  ASSERT_TRUE(text.ok()) << text.status();
  v1::JobSpec spec = MustParse(*text, "gpt-fsdp-2-ranks.yaml");
  EXPECT_EQ(spec.checkpoint().resume_from().job(), "job-1");
  EXPECT_EQ(spec.checkpoint().resume_from().step(), 0);
  // The global batch of the job it goes on from.
  absl::StatusOr<std::string> first = ReadFileToString(ExamplePath("gpt-fsdp.yaml"));
  ASSERT_TRUE(first.ok()) << first.status();
  const v1::JobSpec four = MustParse(*first, "gpt-fsdp.yaml");
  EXPECT_EQ(spec.world_size() * spec.batch_size(), four.world_size() * four.batch_size());
  EXPECT_EQ(spec.model().config(), four.model().config());
  coordinator::ApplyJobSpecDefaults(coordinator::SpecLimits{}, &spec);
  EXPECT_TRUE(coordinator::ValidateJobSpec(coordinator::SpecLimits{}, spec).ok())
      << coordinator::ValidateJobSpec(coordinator::SpecLimits{}, spec);
}

constexpr char kRichYaml[] = R"(
name: fmnist   # a comment
world_size: 4
device: gpu
threads_per_rank: 2
model:
  name: mlp
  hidden_sizes:
    - 512
    - 128
  dropout: .25
dataset:
  kind: idx
  train_images: /data/train-images
  shuffle: false
  drop_last: True
optimizer:
  name: adamw
  lr: 1e-3
  weight_decay: 0
  eps: 1.5e-8
lr_schedule:
  kind: cosine
  warmup_steps: 100
  min_lr: 0.0
seed: 18446744073709551615
strategy: DDP
bucket_mb: 25
max_restarts: 0
timeouts:
  rendezvous: 90s
  worker: 1.5s
priority: -5
labels:
  team: ml
  run: "7"
)";

constexpr char kRichJson[] = R"(  {
  "name": "fmnist", "world_size": 4, "device": "GPU", "threads_per_rank": 2,
  "model": {"name": "mlp", "hidden_sizes": [512, 128], "dropout": 0.25},
  "dataset": {"kind": "idx", "train_images": "/data/train-images", "shuffle": false,
              "drop_last": true},
  "optimizer": {"name": "adamw", "lr": 0.001, "weight_decay": 0, "eps": 1.5e-8},
  "lr_schedule": {"kind": "COSINE", "warmup_steps": "100", "min_lr": 0},
  "seed": "18446744073709551615", "strategy": "ddp", "bucket_mb": 25, "max_restarts": 0,
  "timeouts": {"rendezvous": "90s", "worker": "1.5s"},
  "priority": -5,
  "labels": {"team": "ml", "run": "7"}
})";

// Every job example parses and the coordinator accepts it as written; the
// pipeline example with ZeRO-1 too (its comment offers it).
TEST(ParseJobSpec, EveryExampleParsesAndTheCoordinatorAcceptsIt) {
  const std::filesystem::path dir = std::filesystem::path(ExamplePath("."));
  int read = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".yaml") continue;
    SCOPED_TRACE(entry.path().filename().string());
    absl::StatusOr<std::string> text = ReadFileToString(entry.path().string());
    ASSERT_TRUE(text.ok()) << text.status();
    v1::JobSpec spec = MustParse(*text, entry.path().filename().string());
    coordinator::ApplyJobSpecDefaults(coordinator::SpecLimits{}, &spec);
    EXPECT_TRUE(coordinator::ValidateJobSpec(coordinator::SpecLimits{}, spec).ok())
        << coordinator::ValidateJobSpec(coordinator::SpecLimits{}, spec);
    if (entry.path().filename() == "gpt-pipeline.yaml") {
      spec.set_strategy(v1::JobSpec::ZERO1);
      EXPECT_TRUE(coordinator::ValidateJobSpec(coordinator::SpecLimits{}, spec).ok())
          << coordinator::ValidateJobSpec(coordinator::SpecLimits{}, spec);
    }
    ++read;
  }
  EXPECT_GE(read, 7);
}

TEST(ParseJobSpec, YamlAndJsonOfTheSameSpecAreEqual) {
  const v1::JobSpec from_yaml = MustParse(kRichYaml, "job.yaml");
  const v1::JobSpec from_json = MustParse(kRichJson, "job.json");
  EXPECT_TRUE(MessageDifferencer::Equals(from_yaml, from_json))
      << from_yaml.ShortDebugString() << "\nvs\n"
      << from_json.ShortDebugString();
  // And the values are what was written.
  EXPECT_EQ(from_yaml.device(), v1::JobSpec::GPU);
  EXPECT_THAT(from_yaml.model().hidden_sizes(), ElementsAre(512, 128));
  EXPECT_DOUBLE_EQ(from_yaml.model().dropout(), 0.25);
  EXPECT_DOUBLE_EQ(from_yaml.optimizer().lr(), 0.001);
  EXPECT_DOUBLE_EQ(from_yaml.optimizer().eps(), 1.5e-8);
  EXPECT_TRUE(from_yaml.optimizer().has_weight_decay());
  EXPECT_TRUE(from_yaml.dataset().has_shuffle());
  EXPECT_FALSE(from_yaml.dataset().shuffle());
  EXPECT_TRUE(from_yaml.dataset().drop_last());
  EXPECT_EQ(from_yaml.seed(), 18446744073709551615ULL);
  EXPECT_TRUE(from_yaml.has_max_restarts());
  EXPECT_EQ(from_yaml.max_restarts(), 0);
  EXPECT_EQ(from_yaml.priority(), -5);
  EXPECT_EQ(from_yaml.lr_schedule().warmup_steps(), 100);
}

TEST(ParseJobSpec, EnumNamesAreReadInAnyCase) {
  const v1::JobSpec spec = MustParse(R"(
device: cpu
strategy: ddp
precision: Fp32
lr_schedule:
  kind: cosine
)");
  EXPECT_EQ(spec.device(), v1::JobSpec::CPU);
  EXPECT_EQ(spec.strategy(), v1::JobSpec::DDP);
  EXPECT_EQ(spec.precision(), v1::JobSpec::FP32);
  EXPECT_EQ(spec.lr_schedule().kind(), v1::LrScheduleSpec::COSINE);
  EXPECT_EQ(MustParse("lr_schedule: {kind: Step}").lr_schedule().kind(), v1::LrScheduleSpec::STEP);
}

TEST(ParseJobSpec, DurationsAreReadInProtobufAndAbseilForms) {
  const v1::JobSpec spec = MustParse(R"(
timeouts:
  rendezvous: 1.5s
  worker: 5m
  progress: 1h30m
)");
  EXPECT_EQ(spec.timeouts().rendezvous().seconds(), 1);
  EXPECT_EQ(spec.timeouts().rendezvous().nanos(), 500000000);
  EXPECT_EQ(spec.timeouts().worker().seconds(), 300);
  EXPECT_EQ(spec.timeouts().progress().seconds(), 5400);

  const v1::JobSpec json = MustParse(R"({"timeouts": {"worker": "250ms", "progress": "10s"}})");
  EXPECT_EQ(json.timeouts().worker().seconds(), 0);
  EXPECT_EQ(json.timeouts().worker().nanos(), 250000000);
  EXPECT_EQ(json.timeouts().progress().seconds(), 10);
}

TEST(ParseJobSpec, ADurationWithoutUnitNamesTheField) {
  const std::string error = ErrorOf("timeouts:\n  worker: 30\n");
  EXPECT_THAT(error, HasSubstr("job.yaml: timeouts.worker: invalid duration"));
  EXPECT_THAT(error, HasSubstr("\"30s\""));
  EXPECT_THAT(error, HasSubstr("(line 2)"));
}

TEST(ParseJobSpec, NumbersWrittenForStringFieldsStayTheTextWritten) {
  EXPECT_EQ(MustParse("name: \"123\"").name(), "123");
  EXPECT_EQ(MustParse("name: '1.50'").name(), "1.50");
  EXPECT_EQ(MustParse("name: 123").name(), "123");
  EXPECT_EQ(MustParse("name: 1.50").name(), "1.50");
  EXPECT_EQ(MustParse("name: 007").name(), "007");
  EXPECT_EQ(MustParse("name: true").name(), "true");
  EXPECT_EQ(MustParse("name: \"~\"").name(), "~");
  EXPECT_EQ(MustParse("dataset: {dir: 2024}").dataset().dir(), "2024");
  const v1::JobSpec spec = MustParse("labels:\n  version: 1\n  debug: true\n  rate: 0.5\n");
  EXPECT_THAT(spec.labels(), UnorderedElementsAre(Pair("version", "1"), Pair("debug", "true"),
                                                  Pair("rate", "0.5")));
}

TEST(ParseJobSpec, QuotedNumbersAreAcceptedForNumericFields) {
  const v1::JobSpec spec = MustParse("world_size: \"3\"\noptimizer: {lr: '0.5'}\n");
  EXPECT_EQ(spec.world_size(), 3);
  EXPECT_DOUBLE_EQ(spec.optimizer().lr(), 0.5);
}

TEST(ParseJobSpec, NullAndEmptyValuesLeaveFieldsUnset) {
  const v1::JobSpec spec = MustParse("name: ~\nmax_restarts: null\nbucket_mb:\nworld_size: 2\n");
  EXPECT_EQ(spec.name(), "");
  EXPECT_FALSE(spec.has_max_restarts());
  EXPECT_FALSE(spec.has_bucket_mb());
  EXPECT_EQ(spec.world_size(), 2);
}

TEST(ParseJobSpec, HiddenSizesAreReadInFlowAndBlockForm) {
  EXPECT_THAT(MustParse("model: {hidden_sizes: [64, 32, 16]}").model().hidden_sizes(),
              ElementsAre(64, 32, 16));
  EXPECT_THAT(MustParse("model:\n  hidden_sizes:\n  - 8\n  - 4\n").model().hidden_sizes(),
              ElementsAre(8, 4));
}

TEST(ParseJobSpec, AnUnknownFieldIsNamedWithTheFileAndLine) {
  const std::string error = ErrorOf("name: x\noptimizer:\n  name: sgd\n  lrr: 0.1\n");
  EXPECT_THAT(error, HasSubstr("job.yaml: optimizer.lrr: unknown field"));
  EXPECT_THAT(error, HasSubstr("(line 4)"));
  EXPECT_THAT(ErrorOf("world_sise: 2\n", "my.yaml"),
              HasSubstr("my.yaml: world_sise: unknown field (line 1)"));
  EXPECT_THAT(ErrorOf(R"({"optimizer": {"lrr": 1}})", "job.json"),
              HasSubstr("job.json: optimizer.lrr: unknown field"));
}

TEST(ParseJobSpec, AValueOfTheWrongTypeNamesTheField) {
  EXPECT_THAT(ErrorOf("world_size: four\n"),
              HasSubstr("job.yaml: world_size: invalid value \"four\": expected an integer"));
  EXPECT_THAT(ErrorOf("model:\n  hidden_sizes: [1, x]\n"),
              HasSubstr("job.yaml: model.hidden_sizes[1]: invalid value"));
  EXPECT_THAT(ErrorOf("dataset: {drop_last: 1}\n"),
              HasSubstr("job.yaml: dataset.drop_last: invalid value 1: expected true or false"));
  EXPECT_THAT(ErrorOf("model: [1]\n"), HasSubstr("job.yaml: model:"));
}

TEST(ParseJobSpec, AnUnknownEnumValueListsTheKnownOnes) {
  const std::string error = ErrorOf("name: x\ndevice: tpu\n");
  EXPECT_THAT(error,
              HasSubstr("job.yaml: device: invalid value \"tpu\": expected one of CPU, GPU"));
  EXPECT_THAT(error, HasSubstr("(line 2)"));
}

TEST(ParseJobSpec, MalformedYamlIsReportedWithFileAndLine) {
  const std::string error = ErrorOf("name: x\nmodel:\n  hidden_sizes: [1, 2\n", "bad.yaml");
  EXPECT_THAT(error, HasSubstr("bad.yaml: line "));
  EXPECT_THAT(ErrorOf("name: x\n  world_size: 2\n", "bad.yaml"), HasSubstr("bad.yaml: line 2"));
}

TEST(ParseJobSpec, MalformedJsonIsReportedWithFileAndLine) {
  const std::string error = ErrorOf("{\n  \"name\": \"x\",\n  \"world_size\": ,\n}\n", "bad.json");
  EXPECT_THAT(error, HasSubstr("bad.json: parse error at line 3"));
  EXPECT_THAT(error, Not(HasSubstr("json.exception")));
}

TEST(ParseJobSpec, RefusesWhatIsNotOneMapping) {
  EXPECT_THAT(ErrorOf(""), HasSubstr("job.yaml: the job spec is empty"));
  EXPECT_THAT(ErrorOf("# only a comment\n"), HasSubstr("job.yaml: the job spec is empty"));
  EXPECT_THAT(ErrorOf("- name: x\n"), HasSubstr("job.yaml: expected a mapping"));
  EXPECT_THAT(ErrorOf("name: a\n---\nname: b\n"),
              HasSubstr("job.yaml: a second YAML document starts at line 2"));
  // Found by fuzzing: yaml-cpp's LoadAll never returns on this.
  EXPECT_THAT(ErrorOf("name: a\n\"x\",\n y\n"), HasSubstr("job.yaml: "));
  EXPECT_THAT(ErrorOf("name: a\nname: b\n"),
              HasSubstr("job.yaml: duplicate key \"name\" (line 2)"));
}

TEST(ReadJobSpec, ReadsStdinForADashAndNamesItInErrors) {
  std::istringstream in("name: from-stdin\nworld_size: 1\n");
  absl::StatusOr<v1::JobSpec> spec = ReadJobSpec("-", in);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name(), "from-stdin");

  std::istringstream bad("nam: x\n");
  EXPECT_THAT(std::string(ReadJobSpec("-", bad).status().message()),
              HasSubstr("<stdin>: nam: unknown field"));
}

TEST(ReadJobSpec, AMissingFileIsNamed) {
  std::istringstream unused;
  const absl::Status status = ReadJobSpec("/nonexistent/job.yaml", unused).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(status.message()), HasSubstr("/nonexistent/job.yaml"));
}

// ---------------------------------------------------------------------------
// Writing JSON and YAML.

TEST(MessageToYaml, ASpecReadsBackAsTheSameSpec) {
  const v1::JobSpec spec = MustParse(kRichYaml);
  absl::StatusOr<std::string> yaml = MessageToYaml(spec);
  ASSERT_TRUE(yaml.ok()) << yaml.status();
  const v1::JobSpec again = MustParse(*yaml, "round-trip.yaml");
  EXPECT_TRUE(MessageDifferencer::Equals(spec, again)) << *yaml;
  // 64-bit integers print as numbers, strings that look like numbers quoted.
  EXPECT_THAT(*yaml, HasSubstr("seed: 18446744073709551615\n"));
  EXPECT_THAT(*yaml, HasSubstr("warmup_steps: 100\n"));
  EXPECT_THAT(*yaml, HasSubstr("run: \"7\"\n"));
  EXPECT_THAT(*yaml, HasSubstr("hidden_sizes: [512, 128]\n"));
}

TEST(JsonToYaml, QuotesStringsAYamlReaderWouldTakeForOtherTypes) {
  const nlohmann::ordered_json json = {{"a", "123"},   {"b", "true"},       {"c", ""},
                                       {"d", "yes"},   {"e", "plain text"}, {"f", 1.5},
                                       {"g", nullptr}, {"h", false}};
  EXPECT_EQ(
      JsonToYaml(json),
      "a: \"123\"\nb: \"true\"\nc: \"\"\nd: \"yes\"\ne: plain text\nf: 1.5\ng: ~\nh: false\n");
}

TEST(MessageToJson, UsesProtoFieldNamesAndLeavesDefaultsOut) {
  v1::JobSpec spec;
  spec.set_world_size(2);
  spec.set_max_steps(1000);
  spec.set_device(v1::JobSpec::CPU);
  absl::StatusOr<std::string> json = MessageToJson(spec);
  ASSERT_TRUE(json.ok()) << json.status();
  const auto parsed = nlohmann::json::parse(*json);
  EXPECT_EQ(parsed["world_size"], 2);
  EXPECT_EQ(parsed["max_steps"], "1000");  // int64 as the JSON mapping writes it
  EXPECT_EQ(parsed["device"], "CPU");
  EXPECT_FALSE(parsed.contains("name"));
  EXPECT_FALSE(parsed.contains("worldSize"));
  EXPECT_EQ(json->back(), '\n');
}

// ---------------------------------------------------------------------------
// Sizes checked before sending.

constexpr size_t kCallLimit = 4 * 1024 * 1024;

v1::JobSpec SmallSpec() {
  v1::JobSpec spec;
  spec.set_name("x");
  spec.set_world_size(2);
  (*spec.mutable_labels())["team"] = "vision";
  return spec;
}

TEST(CheckJobSpecSizes, ASpecWithinTheLimitsPasses) {
  EXPECT_TRUE(CheckJobSpecSizes(SmallSpec(), "job.yaml", kCallLimit).ok());
  v1::JobSpec at_limits = SmallSpec();
  at_limits.set_name(std::string(128, 'n'));
  (*at_limits.mutable_labels())[std::string(63, 'k')] = std::string(256, 'v');
  at_limits.mutable_checkpoint()->set_dir(std::string(4096, 'd'));
  EXPECT_TRUE(CheckJobSpecSizes(at_limits, "job.yaml", kCallLimit).ok());
}

TEST(CheckJobSpecSizes, ATenMegabyteLabelIsNamed) {
  v1::JobSpec spec = SmallSpec();
  (*spec.mutable_labels())["notes"] = std::string(10 * 1024 * 1024, 'x');
  const absl::Status status = CheckJobSpecSizes(spec, "job.yaml", kCallLimit);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "job.yaml: labels[\"notes\"]: 10485760 bytes, the coordinator takes at most 256");
}

TEST(CheckJobSpecSizes, ALongLabelKeyAndTooManyLabelsAreNamed) {
  v1::JobSpec spec = SmallSpec();
  (*spec.mutable_labels())[std::string(64, 'k')] = "v";
  EXPECT_THAT(std::string(CheckJobSpecSizes(spec, "job.yaml", kCallLimit).message()),
              HasSubstr("labels: key \"kkkk"));
  spec = SmallSpec();
  for (int i = 0; i < 64; ++i) (*spec.mutable_labels())[absl::StrCat("k", i)] = "v";
  EXPECT_EQ(CheckJobSpecSizes(spec, "job.yaml", kCallLimit).message(),
            "job.yaml: labels: 65 labels, the coordinator takes at most 64");
}

TEST(CheckJobSpecSizes, ALongNameOrPathIsNamedWithItsField) {
  v1::JobSpec spec = SmallSpec();
  spec.set_name(std::string(129, 'n'));
  EXPECT_EQ(CheckJobSpecSizes(spec, "<stdin>", kCallLimit).message(),
            "<stdin>: name: 129 bytes, the coordinator takes at most 128");
  spec = SmallSpec();
  spec.mutable_dataset()->set_train_images(std::string(5 * 1024 * 1024, 'p'));
  EXPECT_EQ(CheckJobSpecSizes(spec, "job.yaml", kCallLimit).message(),
            "job.yaml: dataset.train_images: 5242880 bytes, the coordinator takes at most 4096");
}

TEST(CheckJobSpecSizes, ASpecOverTheCallLimitNamesItsLargestField) {
  v1::JobSpec spec = SmallSpec();
  for (int i = 0; i < 1000; ++i) spec.mutable_model()->add_hidden_sizes(100'000);
  const absl::Status status = CheckJobSpecSizes(spec, "job.yaml", /*max_message_bytes=*/1000);
  EXPECT_THAT(std::string(status.message()), HasSubstr("more than the 1000 a call carries"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("; model takes "));
}

}  // namespace
}  // namespace aidn::ctl
