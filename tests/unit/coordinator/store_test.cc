#include "coordinator/store.h"

#include <sqlite3.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace aidn::coordinator {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Compares with MessageDifferencer and prints both sides when they differ.
MATCHER_P(ProtoEquals, expected, "") {
  if (MessageDifferencer::Equals(arg, expected)) return true;
  *result_listener << "\n  actual: " << arg.ShortDebugString()
                   << "\nexpected: " << expected.ShortDebugString();
  return false;
}

void SetTime(google::protobuf::Timestamp* time, int64_t seconds, int32_t nanos) {
  time->set_seconds(seconds);
  time->set_nanos(nanos);
}

StoredJob MakeJob(int64_t number) {
  StoredJob stored;
  stored.number = number;
  stored.trainer_token = absl::StrCat("trainer-token-", number, "-\x01\xff");
  v1::Job& job = stored.job;
  job.set_id(absl::StrCat("job-", number));
  v1::JobSpec& spec = *job.mutable_spec();
  spec.set_name("resnet \"quoted\" name");
  spec.set_world_size(4);
  spec.set_device(v1::JobSpec::GPU);
  spec.set_threads_per_rank(2);
  spec.mutable_model()->set_name("mlp");
  spec.mutable_model()->add_hidden_sizes(512);
  spec.mutable_model()->add_hidden_sizes(128);
  spec.mutable_model()->set_dropout(0.25);
  spec.mutable_dataset()->set_kind("fashion-mnist");
  spec.mutable_dataset()->set_dir("/data/fm");
  spec.mutable_dataset()->set_shuffle(false);  // optional, explicitly false
  spec.mutable_optimizer()->set_name("adamw");
  spec.mutable_optimizer()->set_lr(3e-4);
  spec.mutable_optimizer()->set_weight_decay(0.0);  // optional, explicitly zero
  spec.mutable_lr_schedule()->set_kind(v1::LrScheduleSpec::COSINE);
  spec.mutable_lr_schedule()->set_warmup_steps(100);
  spec.set_batch_size(64);
  spec.set_max_steps(5000);
  spec.set_seed(0xfedcba9876543210ULL);
  spec.set_bucket_mb(25.5);
  spec.mutable_checkpoint()->set_dir("ckpt/run");
  spec.mutable_checkpoint()->set_every_steps(500);
  spec.set_max_restarts(0);
  spec.mutable_timeouts()->mutable_rendezvous()->set_seconds(300);
  spec.set_priority(-7);
  (*spec.mutable_labels())["team"] = "vision";
  (*spec.mutable_labels())["ü"] = "ünïcode";
  job.set_state(v1::Job::RUNNING);
  job.set_message("training");
  job.set_generation(3);
  job.set_restarts(2);
  for (int rank = 0; rank < 2; ++rank) {
    v1::RankPlacement* placement = job.add_placement();
    placement->set_rank(rank);
    placement->set_worker_id(absl::StrCat("worker-", rank));
    placement->set_slot(rank * 2);
    placement->set_address(absl::StrCat("10.0.0.", rank + 1, ":4000", rank));
  }
  SetTime(job.mutable_created_at(), 1700000000, 1);
  SetTime(job.mutable_updated_at(), 1700000100, 999999999);
  SetTime(job.mutable_started_at(), 1700000050, 0);
  job.set_last_step(1234);
  job.set_last_checkpoint_step(1000);
  job.set_owner("alice");
  return stored;
}

v1::Worker MakeWorker(const std::string& id) {
  v1::Worker worker;
  v1::WorkerInfo& info = *worker.mutable_info();
  info.set_id(id);
  info.set_hostname(absl::StrCat(id, ".example"));
  info.set_address("192.168.1.20");
  info.set_cpu_slots(16);
  v1::GpuInfo* gpu = info.add_gpus();
  gpu->set_index(1);
  gpu->set_name("NVIDIA H100");
  gpu->set_memory_bytes(int64_t{80} << 30);
  gpu->set_pci_bus_id("0000:1b:00.0");
  (*info.mutable_labels())["zone"] = "b";
  info.set_version("0.1.0");
  worker.set_state(v1::Worker::LOST);
  SetTime(worker.mutable_registered_at(), 1700000000, 5);
  SetTime(worker.mutable_last_heartbeat(), 1700000300, 6);
  worker.set_cpu_slots_used(8);
  worker.set_gpus_used(1);
  worker.add_job_ids("job-1");
  worker.add_job_ids("job-2");
  return worker;
}

v1::Event MakeEvent(const std::string& job_id, const std::string& type) {
  v1::Event event;
  SetTime(event.mutable_time(), 1700000000, 42);
  event.set_job_id(job_id);
  event.set_worker_id("worker-0");
  event.set_generation(2);
  event.set_type(type);
  event.set_message(absl::StrCat(type, " of ", job_id.empty() ? "no job" : job_id));
  return event;
}

v1::Checkpoint MakeCheckpoint(const std::string& job_id, int64_t step) {
  v1::Checkpoint checkpoint;
  checkpoint.set_job_id(job_id);
  checkpoint.set_step(step);
  checkpoint.set_generation(1);
  checkpoint.set_path(absl::StrCat("/ckpt/", job_id, "/step-", step));
  checkpoint.set_committed(false);
  checkpoint.add_ranks_reported(0);
  checkpoint.add_ranks_reported(2);
  checkpoint.add_ranks_expected(0);
  checkpoint.add_ranks_expected(1);
  checkpoint.add_ranks_expected(2);
  checkpoint.set_bytes(123456789);
  checkpoint.set_manifest_sha256(std::string(64, 'a'));
  SetTime(checkpoint.mutable_created_at(), 1700000000 + step, 7);
  return checkpoint;
}

v1::MetricRecord MakeMetric(int64_t step, int32_t rank, v1::MetricRecord::Kind kind) {
  v1::MetricRecord record;
  record.set_kind(kind);
  record.set_step(step);
  record.set_epoch(static_cast<int32_t>(step / 10));
  record.set_rank(rank);
  record.set_generation(1);
  record.set_loss(1.0 / static_cast<double>(step + 1));
  record.set_samples(64 * step);
  record.set_step_seconds(0.0125);
  record.set_allreduce_seconds(0.002);
  record.set_lr(1e-3);
  if (kind == v1::MetricRecord::EVAL) {
    record.set_test_loss(0.5);
    record.set_test_accuracy(0.875);
  }
  SetTime(record.mutable_time(), 1700000000 + step, rank);
  return record;
}

v1::StepMetrics MakeStep(int64_t step, v1::MetricRecord::Kind kind) {
  v1::StepMetrics s;
  s.set_kind(kind);
  s.set_step(step);
  s.set_epoch(static_cast<int32_t>(step / 10) + 1);
  s.set_generation(1);
  s.set_world_size(2);
  s.set_ranks_reported(2);
  if (kind == v1::MetricRecord::TRAIN) {
    s.set_loss(1.0 / static_cast<double>(step + 1));
    s.set_samples(128);
    s.set_step_seconds(0.0125);
    s.set_slowest_rank(1);
    s.set_allreduce_seconds(0.002);
    s.set_samples_per_second(128 / 0.0125);
    s.set_lr(1e-3);
    s.add_rank_step_seconds(0.011);
    s.add_rank_step_seconds(0.0125);
    s.add_rank_allreduce_seconds(0.002);
    s.add_rank_allreduce_seconds(0.002);
  } else {
    s.set_test_loss(0.5);
    s.set_test_accuracy(0.875);
  }
  SetTime(s.mutable_time(), 1700000000 + step, 0);
  return s;
}

// Runs SQL on the file through a connection of its own, as another process
// (or an older or newer binary) would.
void RawExec(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr), SQLITE_OK) << path;
  char* error = nullptr;
  int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &error);
  std::string message = error != nullptr ? error : "";
  sqlite3_free(error);
  sqlite3_close(db);
  ASSERT_EQ(rc, SQLITE_OK) << sql << ": " << message;
}

std::string RawJournalMode(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr) != SQLITE_OK) {
    sqlite3_close(db);
    return "<cannot open>";
  }
  std::string mode = "<no row>";
  sqlite3_stmt* stmt = nullptr;
  if (sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &stmt, nullptr) == SQLITE_OK &&
      sqlite3_step(stmt) == SQLITE_ROW) {
    mode = reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0));
  }
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return mode;
}

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = getenv("TMPDIR");
    std::string pattern =
        absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/aidn-store-test-XXXXXX");
    ASSERT_NE(mkdtemp(pattern.data()), nullptr) << pattern;
    dir_ = pattern;
    path_ = (std::filesystem::path(dir_) / "state.db").string();
  }
  void TearDown() override {
    if (!dir_.empty()) {
      std::error_code error;
      std::filesystem::remove_all(dir_, error);
    }
  }

  std::unique_ptr<Store> OpenStore() {
    absl::StatusOr<std::unique_ptr<Store>> store = Store::Open({.path = path_});
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(*store) : nullptr;
  }

  std::string dir_;
  std::string path_;
};

TEST_F(StoreTest, OpenCreatesAFileAtTheCurrentSchemaVersion) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->SchemaVersion(), Store::CurrentSchemaVersion());
  EXPECT_TRUE(std::filesystem::exists(path_));
}

TEST_F(StoreTest, InMemoryDatabaseWorks) {
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open({.path = ":memory:"});
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->SchemaVersion(), Store::CurrentSchemaVersion());
  StoredJob job = MakeJob(1);
  ASSERT_TRUE((*store)->PutJob(job).ok());
  absl::StatusOr<std::vector<StoredJob>> jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_THAT((*jobs)[0].job, ProtoEquals(job.job));
}

TEST_F(StoreTest, OpenRefusesAnEmptyPath) {
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open({.path = ""});
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(StoreTest, JobRoundTripsWithEveryField) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  StoredJob job = MakeJob(7);
  ASSERT_TRUE(store->PutJob(job).ok());
  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_THAT((*jobs)[0].job, ProtoEquals(job.job));
  EXPECT_EQ((*jobs)[0].trainer_token, job.trainer_token);
  EXPECT_EQ((*jobs)[0].number, 7);
}

TEST_F(StoreTest, PutJobReplacesTheJobWithTheSameId) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  StoredJob job = MakeJob(1);
  ASSERT_TRUE(store->PutJob(job).ok());
  job.job.set_state(v1::Job::FAILED);
  job.job.set_message("rank 3 exited with status 1");
  job.job.clear_placement();
  SetTime(job.job.mutable_finished_at(), 1700001000, 0);
  job.trainer_token = "rotated";
  ASSERT_TRUE(store->PutJob(job).ok());

  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_THAT((*jobs)[0].job, ProtoEquals(job.job));
  EXPECT_EQ((*jobs)[0].trainer_token, "rotated");
}

TEST_F(StoreTest, PutJobRefusesANumberAnotherJobHolds) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  StoredJob first = MakeJob(5);
  ASSERT_TRUE(store->PutJob(first).ok());
  StoredJob second = MakeJob(5);
  second.job.set_id("job-other");
  absl::Status status = store->PutJob(second);
  EXPECT_EQ(status.code(), absl::StatusCode::kAlreadyExists) << status;
  EXPECT_THAT(status.message(), HasSubstr("job-other"));

  // The first job is untouched (INSERT OR REPLACE would have deleted it).
  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].job.id(), "job-5");
}

TEST_F(StoreTest, PutJobRefusesAJobWithoutId) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  StoredJob job = MakeJob(1);
  job.job.clear_id();
  EXPECT_EQ(store->PutJob(job).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(StoreTest, LoadJobsOrdersByNumberNotById) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  // Ids sort the other way round from numbers, and insertion order is a third.
  const std::vector<std::pair<std::string, int64_t>> rows = {
      {"b", 2}, {"c", 1}, {"a", 10}, {"d", 0}};
  for (const auto& [id, number] : rows) {
    StoredJob job = MakeJob(number);
    job.job.set_id(id);
    ASSERT_TRUE(store->PutJob(job).ok());
  }
  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  std::vector<std::string> ids;
  std::vector<int64_t> numbers;
  for (const StoredJob& job : *jobs) {
    ids.push_back(job.job.id());
    numbers.push_back(job.number);
  }
  EXPECT_THAT(ids, ::testing::ElementsAre("d", "c", "b", "a"));
  EXPECT_THAT(numbers, ::testing::ElementsAre(0, 1, 2, 10));
}

// Job n finished at second 1000 + n when `finished`, else it runs.
StoredJob JobFinishedAt(int64_t number, bool finished, v1::Job::State state = v1::Job::SUCCEEDED) {
  StoredJob job = MakeJob(number);
  if (finished) {
    job.job.set_state(state);
    SetTime(job.job.mutable_finished_at(), 1000 + number, 0);
  }
  return job;
}

TEST_F(StoreTest, FinishedJobsAreLoadedOnlyWhenRecentButStayListedAndFound) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  // 1 and 2 finished long ago, 3 runs, 4 finished recently, 5 was cancelled.
  for (auto [number, finished] :
       std::vector<std::pair<int64_t, bool>>{{1, true}, {2, true}, {3, false}, {4, true}}) {
    ASSERT_TRUE(store->PutJob(JobFinishedAt(number, finished)).ok());
  }
  ASSERT_TRUE(store->PutJob(JobFinishedAt(5, true, v1::Job::CANCELLED)).ok());
  absl::StatusOr<std::vector<StoredJob>> loaded = store->LoadJobs(absl::FromUnixSeconds(1004));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  std::vector<int64_t> numbers;
  for (const StoredJob& job : *loaded) numbers.push_back(job.number);
  EXPECT_THAT(numbers, ElementsAre(3, 4, 5));
  EXPECT_EQ(store->LoadJobs()->size(), 5u);

  absl::StatusOr<std::map<int, int64_t>> counts =
      store->CountJobsFinishedBefore(absl::FromUnixSeconds(1006));
  ASSERT_TRUE(counts.ok()) << counts.status();
  EXPECT_THAT(*counts, ElementsAre(std::pair<const int, int64_t>(v1::Job::SUCCEEDED, 3),
                                   std::pair<const int, int64_t>(v1::Job::CANCELLED, 1)));

  absl::StatusOr<std::optional<StoredJob>> one = store->GetJob("job-2");
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_TRUE(one->has_value());
  EXPECT_EQ((*one)->number, 2);
  EXPECT_EQ((*one)->job.state(), v1::Job::SUCCEEDED);
  EXPECT_FALSE(store->GetJob("job-9")->has_value());

  // Newest first, below a number, in some states, as long as take wants.
  std::vector<int64_t> scanned;
  auto next = [&](int64_t number) {
    if (scanned.size() == 2) return Store::ScanNext::kStop;
    return number == 2 ? Store::ScanNext::kSkip : Store::ScanNext::kRead;
  };
  auto take = [&](StoredJob job) { scanned.push_back(job.number); };
  ASSERT_TRUE(store->ScanJobs(5, {}, next, take).ok());
  EXPECT_THAT(scanned, ElementsAre(4, 3));
  scanned.clear();
  ASSERT_TRUE(store->ScanJobs(4, {}, next, take).ok());
  EXPECT_THAT(scanned, ElementsAre(3, 1));
  scanned.clear();
  ASSERT_TRUE(store->ScanJobs(INT64_MAX, {v1::Job::RUNNING, v1::Job::CANCELLED}, next, take).ok());
  EXPECT_THAT(scanned, ElementsAre(5, 3));

  // A job that finishes after all is no longer loaded once old enough.
  ASSERT_TRUE(store->PutJob(JobFinishedAt(3, true)).ok());
  EXPECT_EQ(store->LoadJobs(absl::FromUnixSeconds(1004))->size(), 2u);
}

TEST_F(StoreTest, MaxJobNumberIsZeroWhenEmptyAndTheLargestOtherwise) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  absl::StatusOr<int64_t> max = store->MaxJobNumber();
  ASSERT_TRUE(max.ok()) << max.status();
  EXPECT_EQ(*max, 0);
  for (int64_t number : {3, 41, 12}) ASSERT_TRUE(store->PutJob(MakeJob(number)).ok());
  max = store->MaxJobNumber();
  ASSERT_TRUE(max.ok()) << max.status();
  EXPECT_EQ(*max, 41);
}

TEST_F(StoreTest, WorkerRoundTripsAndPutWorkerReplaces) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  v1::Worker b = MakeWorker("worker-b");
  v1::Worker a = MakeWorker("worker-a");
  ASSERT_TRUE(store->PutWorker(b).ok());
  ASSERT_TRUE(store->PutWorker(a).ok());
  b.set_state(v1::Worker::ALIVE);
  b.clear_job_ids();
  b.set_cpu_slots_used(0);
  ASSERT_TRUE(store->PutWorker(b).ok());

  absl::StatusOr<std::vector<v1::Worker>> workers = store->LoadWorkers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  ASSERT_EQ(workers->size(), 2u);
  EXPECT_THAT((*workers)[0], ProtoEquals(a));
  EXPECT_THAT((*workers)[1], ProtoEquals(b));
}

TEST_F(StoreTest, PutWorkerRefusesAWorkerWithoutId) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->PutWorker(v1::Worker()).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(StoreTest, AppendEventAssignsIncreasingSeqsAndStoresThem) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  std::vector<v1::Event> appended;
  for (const char* type : {"job.submitted", "worker.registered", "job.running"}) {
    v1::Event event = MakeEvent(type[0] == 'w' ? "" : "job-1", type);
    ASSERT_TRUE(store->AppendEvent(&event).ok());
    if (!appended.empty()) {
      EXPECT_GT(event.seq(), appended.back().seq());
    }
    EXPECT_GT(event.seq(), 0);
    appended.push_back(event);
  }
  absl::StatusOr<std::vector<v1::Event>> events = store->ListEvents("", 0, 0);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), appended.size());
  for (size_t i = 0; i < appended.size(); ++i) {
    EXPECT_THAT((*events)[i], ProtoEquals(appended[i]));  // seq included
  }
}

TEST_F(StoreTest, ListEventsFiltersByJobAndAfterSeqAndHonoursLimit) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  std::vector<int64_t> job1_seqs;
  std::vector<int64_t> all_seqs;
  for (int i = 0; i < 10; ++i) {
    const std::string job_id = i % 3 == 0 ? "job-2" : (i % 3 == 1 ? "job-1" : "");
    v1::Event event = MakeEvent(job_id, absl::StrCat("type.", i));
    ASSERT_TRUE(store->AppendEvent(&event).ok());
    all_seqs.push_back(event.seq());
    if (job_id == "job-1") job1_seqs.push_back(event.seq());
  }
  auto seqs = [](const absl::StatusOr<std::vector<v1::Event>>& events) {
    std::vector<int64_t> out;
    EXPECT_TRUE(events.ok()) << events.status();
    if (events.ok()) {
      for (const v1::Event& event : *events) out.push_back(event.seq());
    }
    return out;
  };

  // Of one job, every one, oldest first.
  EXPECT_EQ(seqs(store->ListEvents("job-1", 0, 0)), job1_seqs);
  // After a seq: strictly after.
  EXPECT_EQ(seqs(store->ListEvents("job-1", job1_seqs[0], 0)),
            std::vector<int64_t>(job1_seqs.begin() + 1, job1_seqs.end()));
  EXPECT_EQ(seqs(store->ListEvents("", all_seqs[6], 0)),
            std::vector<int64_t>(all_seqs.begin() + 7, all_seqs.end()));
  // Limit keeps the oldest.
  EXPECT_EQ(seqs(store->ListEvents("", all_seqs[1], 3)),
            std::vector<int64_t>(all_seqs.begin() + 2, all_seqs.begin() + 5));
  EXPECT_EQ(seqs(store->ListEvents("job-1", 0, 2)),
            std::vector<int64_t>(job1_seqs.begin(), job1_seqs.begin() + 2));
  // Nothing after the newest, nothing of an unknown job.
  EXPECT_TRUE(seqs(store->ListEvents("", all_seqs.back(), 0)).empty());
  EXPECT_TRUE(seqs(store->ListEvents("job-9", 0, 0)).empty());
}

TEST_F(StoreTest, ListEventsWithoutLimitReturnsAtMostOneThousand) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  for (int i = 0; i < 1005; ++i) {
    v1::Event event = MakeEvent("job-1", "kv.set");
    ASSERT_TRUE(store->AppendEvent(&event).ok());
  }
  for (int limit : {0, -1}) {
    absl::StatusOr<std::vector<v1::Event>> events = store->ListEvents("", 0, limit);
    ASSERT_TRUE(events.ok()) << events.status();
    EXPECT_EQ(events->size(), 1000u) << "limit " << limit;
  }
  absl::StatusOr<std::vector<v1::Event>> events = store->ListEvents("", 0, 2000);
  ASSERT_TRUE(events.ok()) << events.status();
  EXPECT_EQ(events->size(), 1005u);
}

TEST_F(StoreTest, EventSeqSurvivesReopenAndIsNeverReused) {
  int64_t last_seq = 0;
  {
    std::unique_ptr<Store> store = OpenStore();
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 3; ++i) {
      v1::Event event = MakeEvent("job-1", "job.submitted");
      ASSERT_TRUE(store->AppendEvent(&event).ok());
      last_seq = event.seq();
    }
  }
  // Remove the newest row behind the store's back: a plain rowid table would
  // hand its seq out again.
  RawExec(path_, absl::StrCat("DELETE FROM events WHERE seq = ", last_seq));

  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  absl::StatusOr<std::vector<v1::Event>> events = store->ListEvents("", 0, 0);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 2u);
  EXPECT_LT((*events)[1].seq(), last_seq);

  v1::Event event = MakeEvent("job-1", "job.running");
  ASSERT_TRUE(store->AppendEvent(&event).ok());
  EXPECT_GT(event.seq(), last_seq);
}

TEST_F(StoreTest, CheckpointsRoundTripReplaceAndDelete) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  v1::Checkpoint c200 = MakeCheckpoint("job-1", 200);
  v1::Checkpoint c100 = MakeCheckpoint("job-1", 100);
  ASSERT_TRUE(store->PutCheckpoint(c200).ok());
  ASSERT_TRUE(store->PutCheckpoint(c100).ok());
  ASSERT_TRUE(store->PutCheckpoint(MakeCheckpoint("job-2", 100)).ok());
  c100.set_committed(true);
  c100.add_ranks_reported(1);
  ASSERT_TRUE(store->PutCheckpoint(c100).ok());

  absl::StatusOr<std::vector<v1::Checkpoint>> checkpoints = store->ListCheckpoints("job-1");
  ASSERT_TRUE(checkpoints.ok()) << checkpoints.status();
  ASSERT_EQ(checkpoints->size(), 2u);
  EXPECT_THAT((*checkpoints)[0], ProtoEquals(c100));
  EXPECT_THAT((*checkpoints)[1], ProtoEquals(c200));

  ASSERT_TRUE(store->DeleteCheckpoint("job-1", 100).ok());
  checkpoints = store->ListCheckpoints("job-1");
  ASSERT_TRUE(checkpoints.ok()) << checkpoints.status();
  ASSERT_EQ(checkpoints->size(), 1u);
  EXPECT_THAT((*checkpoints)[0], ProtoEquals(c200));
  // Deleting is idempotent, and only touches its own job.
  EXPECT_TRUE(store->DeleteCheckpoint("job-1", 100).ok());
  checkpoints = store->ListCheckpoints("job-2");
  ASSERT_TRUE(checkpoints.ok()) << checkpoints.status();
  EXPECT_EQ(checkpoints->size(), 1u);
}

TEST_F(StoreTest, CheckpointKeepsWhyItIsInvalid) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  v1::Checkpoint c = MakeCheckpoint("job-1", 40);
  c.set_committed(true);
  ASSERT_TRUE(store->PutCheckpoint(c).ok());
  c.set_invalid_reason("model.safetensors: size 1024, manifest says 1086784");
  ASSERT_TRUE(store->PutCheckpoint(c).ok());
  absl::StatusOr<std::vector<v1::Checkpoint>> checkpoints = store->ListCheckpoints("job-1");
  ASSERT_TRUE(checkpoints.ok()) << checkpoints.status();
  ASSERT_EQ(checkpoints->size(), 1u);
  EXPECT_THAT((*checkpoints)[0], ProtoEquals(c));
}

TEST_F(StoreTest, LastStepOfGenerationSkipsRowsOfOlderGenerationsAbove) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  // Generation 1 got to step 10; generation 2 resumed from 5 and redid 6..8
  // (with an evaluation at 8); another job's generation 2 went further.
  std::vector<Store::JobStep> batch;
  for (int64_t step = 1; step <= 10; ++step) {
    batch.push_back({"job-1", MakeStep(step, v1::MetricRecord::TRAIN)});
  }
  ASSERT_TRUE(store->PutSteps(batch).ok());
  batch.clear();
  for (int64_t step = 6; step <= 8; ++step) {
    v1::StepMetrics s = MakeStep(step, v1::MetricRecord::TRAIN);
    s.set_generation(2);
    batch.push_back({"job-1", s});
  }
  v1::StepMetrics eval = MakeStep(8, v1::MetricRecord::EVAL);
  eval.set_generation(2);
  batch.push_back({"job-1", eval});
  v1::StepMetrics other = MakeStep(50, v1::MetricRecord::TRAIN);
  other.set_generation(2);
  batch.push_back({"job-2", other});
  ASSERT_TRUE(store->PutSteps(batch).ok());

  absl::StatusOr<std::optional<v1::StepMetrics>> last = store->LastStepOfGeneration("job-1", 2, 5);
  ASSERT_TRUE(last.ok()) << last.status();
  ASSERT_TRUE(last->has_value());
  EXPECT_EQ((*last)->step(), 8);
  EXPECT_EQ((*last)->kind(), v1::MetricRecord::EVAL);

  last = store->LastStepOfGeneration("job-1", 1, 0);
  ASSERT_TRUE(last.ok()) << last.status();
  ASSERT_TRUE(last->has_value());
  EXPECT_EQ((*last)->step(), 10);

  // Nothing above the bound, nothing of a generation that stored nothing.
  last = store->LastStepOfGeneration("job-1", 2, 8);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_FALSE(last->has_value());
  last = store->LastStepOfGeneration("job-1", 3, 0);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_FALSE(last->has_value());
  last = store->LastStepOfGeneration("job-3", 1, 0);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_FALSE(last->has_value());
}

TEST_F(StoreTest, GetStepsSelectsAnInclusiveRangeOrderedByStepTrainBeforeEval) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  // Written in scrambled order, over several batches and jobs.
  ASSERT_TRUE(store
                  ->PutSteps({{"job-1", MakeStep(5, v1::MetricRecord::TRAIN)},
                              {"job-1", MakeStep(3, v1::MetricRecord::EVAL)},
                              {"job-2", MakeStep(3, v1::MetricRecord::TRAIN)},
                              {"job-1", MakeStep(1, v1::MetricRecord::TRAIN)}})
                  .ok());
  ASSERT_TRUE(store
                  ->PutSteps({{"job-1", MakeStep(4, v1::MetricRecord::TRAIN)},
                              {"job-1", MakeStep(3, v1::MetricRecord::TRAIN)},
                              {"job-1", MakeStep(2, v1::MetricRecord::TRAIN)}})
                  .ok());
  ASSERT_TRUE(store->PutSteps({}).ok());

  using Rows = std::vector<std::pair<int64_t, int>>;
  auto rows = [](const absl::StatusOr<std::vector<v1::StepMetrics>>& steps) {
    Rows out;
    EXPECT_TRUE(steps.ok()) << steps.status();
    if (steps.ok()) {
      for (const v1::StepMetrics& step : *steps) out.emplace_back(step.step(), step.kind());
    }
    return out;
  };
  const int kTrain = v1::MetricRecord::TRAIN, kEval = v1::MetricRecord::EVAL;
  EXPECT_EQ(rows(store->GetSteps("job-1", 2, 4, 0)),
            (Rows{{2, kTrain}, {3, kTrain}, {3, kEval}, {4, kTrain}}));
  EXPECT_EQ(rows(store->GetSteps("job-1", 4, 0, 0)), (Rows{{4, kTrain}, {5, kTrain}}));
  EXPECT_EQ(rows(store->GetSteps("job-1", 0, 0, 3)), (Rows{{1, kTrain}, {2, kTrain}, {3, kTrain}}));
  EXPECT_EQ(rows(store->GetSteps("job-1", 6, 0, 0)), Rows{});
  EXPECT_EQ(rows(store->GetSteps("job-2", 0, 0, 0)), (Rows{{3, kTrain}}));
  EXPECT_EQ(rows(store->GetSteps("job-3", 0, 0, 0)), Rows{});

  // Whole steps come back as written.
  absl::StatusOr<std::vector<v1::StepMetrics>> steps = store->GetSteps("job-1", 3, 3, 0);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 2u);
  EXPECT_THAT((*steps)[0], ProtoEquals(MakeStep(3, v1::MetricRecord::TRAIN)));
  EXPECT_THAT((*steps)[1], ProtoEquals(MakeStep(3, v1::MetricRecord::EVAL)));
}

TEST_F(StoreTest, AStepWrittenAgainReplacesTheOldRow) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->PutSteps({{"job-1", MakeStep(7, v1::MetricRecord::TRAIN)}}).ok());
  // A restarted generation redoes step 7.
  v1::StepMetrics redone = MakeStep(7, v1::MetricRecord::TRAIN);
  redone.set_generation(2);
  redone.set_loss(0.25);
  ASSERT_TRUE(store->PutSteps({{"job-1", redone}}).ok());
  absl::StatusOr<std::vector<v1::StepMetrics>> steps = store->GetSteps("job-1", 0, 0, 0);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 1u);
  EXPECT_THAT((*steps)[0], ProtoEquals(redone));
}

TEST_F(StoreTest, PutStepsStoresNothingWhenOneStepFails) {
  {
    std::unique_ptr<Store> store = OpenStore();
    ASSERT_NE(store, nullptr);
  }
  // Another connection adds a trigger refusing step 3, so the third insert of
  // the batch fails after two succeeded.
  RawExec(path_,
          "CREATE TRIGGER refuse_step_3 BEFORE INSERT ON steps WHEN NEW.step = 3 "
          "BEGIN SELECT RAISE(ABORT, 'step 3 refused by test'); END");
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  std::vector<Store::JobStep> batch;
  for (int64_t step = 1; step <= 5; ++step) {
    batch.push_back({"job-1", MakeStep(step, v1::MetricRecord::TRAIN)});
  }
  absl::Status status = store->PutSteps(batch);
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("store: put 5 metric steps"));
  EXPECT_THAT(status.message(), HasSubstr("step 3 refused by test"));

  absl::StatusOr<std::vector<v1::StepMetrics>> steps = store->GetSteps("job-1", 0, 0, 0);
  ASSERT_TRUE(steps.ok()) << steps.status();
  EXPECT_TRUE(steps->empty()) << steps->size() << " steps survived the rollback";

  // The connection is usable afterwards (no transaction left open).
  ASSERT_TRUE(store->PutSteps({batch[0], batch[1]}).ok());
  steps = store->GetSteps("job-1", 0, 0, 0);
  ASSERT_TRUE(steps.ok()) << steps.status();
  EXPECT_EQ(steps->size(), 2u);
}

TEST_F(StoreTest, DataSurvivesClosingAndReopening) {
  StoredJob job = MakeJob(9);
  v1::Worker worker = MakeWorker("worker-0");
  v1::Event event = MakeEvent("job-9", "job.submitted");
  v1::Checkpoint checkpoint = MakeCheckpoint("job-9", 500);
  v1::StepMetrics metric = MakeStep(500, v1::MetricRecord::EVAL);
  {
    std::unique_ptr<Store> store = OpenStore();
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->PutJob(job).ok());
    ASSERT_TRUE(store->PutWorker(worker).ok());
    ASSERT_TRUE(store->AppendEvent(&event).ok());
    ASSERT_TRUE(store->PutCheckpoint(checkpoint).ok());
    ASSERT_TRUE(store->PutSteps({{"job-9", metric}}).ok());
  }
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->SchemaVersion(), Store::CurrentSchemaVersion());

  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_THAT((*jobs)[0].job, ProtoEquals(job.job));
  EXPECT_EQ((*jobs)[0].trainer_token, job.trainer_token);
  EXPECT_EQ((*jobs)[0].number, 9);
  absl::StatusOr<int64_t> max = store->MaxJobNumber();
  ASSERT_TRUE(max.ok()) << max.status();
  EXPECT_EQ(*max, 9);

  absl::StatusOr<std::vector<v1::Worker>> workers = store->LoadWorkers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  ASSERT_EQ(workers->size(), 1u);
  EXPECT_THAT((*workers)[0], ProtoEquals(worker));

  absl::StatusOr<std::vector<v1::Event>> events = store->ListEvents("job-9", 0, 0);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 1u);
  EXPECT_THAT((*events)[0], ProtoEquals(event));

  absl::StatusOr<std::vector<v1::Checkpoint>> checkpoints = store->ListCheckpoints("job-9");
  ASSERT_TRUE(checkpoints.ok()) << checkpoints.status();
  ASSERT_EQ(checkpoints->size(), 1u);
  EXPECT_THAT((*checkpoints)[0], ProtoEquals(checkpoint));

  absl::StatusOr<std::vector<v1::StepMetrics>> metrics = store->GetSteps("job-9", 0, 0, 0);
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  ASSERT_EQ(metrics->size(), 1u);
  EXPECT_THAT((*metrics)[0], ProtoEquals(metric));
}

TEST_F(StoreTest, OpenRefusesAFileWithANewerSchemaVersion) {
  {
    std::unique_ptr<Store> store = OpenStore();
    ASSERT_NE(store, nullptr);
    ASSERT_EQ(store->SchemaVersion(), Store::CurrentSchemaVersion());
  }
  RawExec(path_, "INSERT INTO schema_version(version) VALUES(1000)");
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open({.path = path_});
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
  EXPECT_THAT(store.status().message(), HasSubstr(path_));
  EXPECT_THAT(store.status().message(), HasSubstr("schema version 1000"));
  EXPECT_THAT(store.status().message(),
              HasSubstr(absl::StrCat("version ", Store::CurrentSchemaVersion(), ",")));
}

// Rewrites the file at path_ (current schema, empty) as schema version
// `version` (1 or 2) with the per-rank metrics table of those versions,
// holding `records` of job-1.
void MakeOldMetricsFile(const std::string& path, int version,
                        const std::vector<v1::MetricRecord>& records) {
  std::string sql = R"sql(
      DROP TABLE steps;
      DROP TABLE log_lines;
      DROP TABLE log_streams;
      DROP TABLE log_jobs;
      DROP INDEX jobs_finished_us;
      ALTER TABLE jobs DROP COLUMN finished_us;
      CREATE TABLE metrics(job_id TEXT NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL,
                           kind INTEGER NOT NULL, record BLOB NOT NULL);
      CREATE INDEX metrics_job_id_step_rank ON metrics(job_id, step, rank);)sql";
  if (version >= 2) sql += "CREATE INDEX metrics_job_id_rowid ON metrics(job_id);";
  sql += absl::StrCat("DELETE FROM schema_version WHERE version > ", version, ";");
  for (const v1::MetricRecord& r : records) {
    sql += absl::StrCat("INSERT INTO metrics VALUES('job-1', ", r.step(), ", ", r.rank(), ", ",
                        r.kind(), ", X'", absl::BytesToHexString(r.SerializeAsString()), "');");
  }
  RawExec(path, sql);
}

TEST_F(StoreTest, OpenCombinesTheRanksRecordsOfAnOlderFileIntoSteps) {
  for (int version : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("from schema version ", version));
    for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(path_ + suffix);
    {
      std::unique_ptr<Store> store = OpenStore();
      ASSERT_NE(store, nullptr);
    }
    v1::MetricRecord r0 = MakeMetric(1, 0, v1::MetricRecord::TRAIN);
    v1::MetricRecord r1 = MakeMetric(1, 1, v1::MetricRecord::TRAIN);
    r1.set_loss(r0.loss() + 1.0);
    r1.set_step_seconds(0.05);
    v1::MetricRecord lone = MakeMetric(2, 0, v1::MetricRecord::TRAIN);
    v1::MetricRecord eval = MakeMetric(2, 0, v1::MetricRecord::EVAL);
    // r0 twice: a batch the trainer sent again counts once.
    MakeOldMetricsFile(path_, version, {r1, r0, r0, lone, eval});

    std::unique_ptr<Store> store = OpenStore();
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(store->SchemaVersion(), Store::CurrentSchemaVersion());
    absl::StatusOr<std::vector<v1::StepMetrics>> steps = store->GetSteps("job-1", 0, 0, 0);
    ASSERT_TRUE(steps.ok()) << steps.status();
    ASSERT_EQ(steps->size(), 3u);
    const v1::StepMetrics& both = (*steps)[0];
    EXPECT_EQ(both.step(), 1);
    EXPECT_EQ(both.ranks_reported(), 2);
    EXPECT_EQ(both.world_size(), 2);
    EXPECT_DOUBLE_EQ(both.loss(), r0.loss() + 0.5);
    EXPECT_EQ(both.samples(), r0.samples() + r1.samples());
    EXPECT_EQ(both.slowest_rank(), 1);
    EXPECT_DOUBLE_EQ(both.step_seconds(), 0.05);
    EXPECT_EQ((*steps)[1].step(), 2);
    EXPECT_EQ((*steps)[1].kind(), v1::MetricRecord::TRAIN);
    EXPECT_EQ((*steps)[1].ranks_reported(), 1);
    EXPECT_EQ((*steps)[2].kind(), v1::MetricRecord::EVAL);
    EXPECT_DOUBLE_EQ((*steps)[2].test_accuracy(), 0.875);
    // The old table is gone.
    store.reset();
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open_v2(path_.c_str(), &db, SQLITE_OPEN_READONLY, nullptr), SQLITE_OK);
    sqlite3_stmt* select = nullptr;
    EXPECT_NE(sqlite3_prepare_v2(db, "SELECT * FROM metrics", -1, &select, nullptr), SQLITE_OK);
    EXPECT_THAT(sqlite3_errmsg(db), HasSubstr("no such table"));
    sqlite3_finalize(select);
    sqlite3_close(db);
  }
}

TEST_F(StoreTest, OpenFillsInWhenTheJobsOfAnOlderFileFinished) {
  {
    std::unique_ptr<Store> store = OpenStore();
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->PutJob(JobFinishedAt(1, true)).ok());
    ASSERT_TRUE(store->PutJob(JobFinishedAt(2, false)).ok());
    ASSERT_TRUE(store->PutJob(JobFinishedAt(7, true, v1::Job::FAILED)).ok());
  }
  // Schema version 4: no finished_us.
  RawExec(path_, R"sql(
      DROP INDEX jobs_finished_us;
      ALTER TABLE jobs DROP COLUMN finished_us;
      DELETE FROM schema_version WHERE version > 4;)sql");
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->SchemaVersion(), Store::CurrentSchemaVersion());
  absl::StatusOr<std::vector<StoredJob>> loaded = store->LoadJobs(absl::FromUnixSeconds(1005));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), 2u);
  EXPECT_EQ((*loaded)[0].number, 2);
  EXPECT_EQ((*loaded)[1].number, 7);
}

TEST_F(StoreTest, OpenRefusesAFileThatIsNotADatabase) {
  std::mt19937 random(42);
  std::string bytes(8192, '\0');
  for (char& byte : bytes) byte = static_cast<char>(random() & 0xff);
  for (const std::string& content : {bytes, std::string("this is a text file, not SQLite\n")}) {
    {
      std::ofstream file(path_, std::ios::binary | std::ios::trunc);
      file << content;
      ASSERT_TRUE(file.good());
    }
    absl::StatusOr<std::unique_ptr<Store>> store = Store::Open({.path = path_});
    ASSERT_FALSE(store.ok()) << content.size() << " bytes opened as a database";
    EXPECT_THAT(store.status().code(),
                AnyOf(absl::StatusCode::kFailedPrecondition, absl::StatusCode::kDataLoss))
        << store.status();
    EXPECT_THAT(store.status().message(), HasSubstr(path_));
  }
}

TEST_F(StoreTest, ABlobThatDoesNotParseIsDataLossNamingTableAndKey) {
  {
    std::unique_ptr<Store> store = OpenStore();
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->PutJob(MakeJob(3)).ok());
  }
  // A truncated varint tag: no proto parses it.
  RawExec(path_, "UPDATE jobs SET job = x'ffffffff' WHERE id = 'job-3'");
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadJobs();
  ASSERT_FALSE(jobs.ok());
  EXPECT_EQ(jobs.status().code(), absl::StatusCode::kDataLoss) << jobs.status();
  EXPECT_THAT(jobs.status().message(), HasSubstr("jobs"));
  EXPECT_THAT(jobs.status().message(), HasSubstr("job-3"));
}

TEST_F(StoreTest, ConcurrentAppendEventsGetDistinctSeqs) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 100;
  std::vector<std::vector<int64_t>> seqs(kThreads);
  std::vector<int> failures(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        v1::Event event = MakeEvent(absl::StrCat("job-", t), absl::StrCat("type.", i));
        if (store->AppendEvent(&event).ok()) {
          seqs[t].push_back(event.seq());
        } else {
          ++failures[t];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();

  std::set<int64_t> distinct;
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(failures[t], 0) << "thread " << t;
    // Each thread sees its own seqs increase.
    EXPECT_TRUE(std::is_sorted(seqs[t].begin(), seqs[t].end())) << "thread " << t;
    distinct.insert(seqs[t].begin(), seqs[t].end());
  }
  EXPECT_EQ(distinct.size(), static_cast<size_t>(kThreads * kPerThread));

  absl::StatusOr<std::vector<v1::Event>> events = store->ListEvents("", 0, 10000);
  ASSERT_TRUE(events.ok()) << events.status();
  std::set<int64_t> listed;
  for (const v1::Event& event : *events) listed.insert(event.seq());
  EXPECT_EQ(listed, distinct);
  for (int t = 0; t < kThreads; ++t) {
    absl::StatusOr<std::vector<v1::Event>> of_job =
        store->ListEvents(absl::StrCat("job-", t), 0, 10000);
    ASSERT_TRUE(of_job.ok()) << of_job.status();
    EXPECT_EQ(of_job->size(), static_cast<size_t>(kPerThread)) << "job-" << t;
  }
}

TEST_F(StoreTest, OpenedFileIsInWalMode) {
  std::unique_ptr<Store> store = OpenStore();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(RawJournalMode(path_), "wal");
  store.reset();
  // WAL mode is a property of the file: it stays after the store closed.
  EXPECT_EQ(RawJournalMode(path_), "wal");
}

}  // namespace
}  // namespace aidn::coordinator
