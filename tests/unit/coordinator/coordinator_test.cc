#include "coordinator/coordinator.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the shared fixture
using ::google::protobuf::util::MessageDifferencer;
using std::chrono::milliseconds;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;
using ::testing::UnorderedElementsAre;
using v1::Job;

TEST_F(CoordinatorTest, SubmitRefusesAnInvalidSpecAndStoresNothing) {
  absl::StatusOr<Job> job = c().SubmitJob(Spec(0), "alice");
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(job.status().message()), StartsWith("world_size"));

  v1::JobSpec bad_model = Spec(1);
  bad_model.mutable_model()->set_name("transformer");
  EXPECT_EQ(c().SubmitJob(bad_model, "alice").status().code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<v1::ListJobsResponse> list = c().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->jobs_size(), 0);
  EXPECT_THAT(Events(""), IsEmpty());
  // Refused specs used up no job number.
  EXPECT_EQ(Submit(Spec(1)), "job-1");
}

TEST_F(CoordinatorTest, SubmitFillsDefaultsAndNumbersJobsFromOne) {
  absl::StatusOr<Job> first = c().SubmitJob(Spec(2), "alice");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->id(), "job-1");
  EXPECT_EQ(first->state(), Job::PENDING);
  EXPECT_EQ(first->generation(), 0);
  EXPECT_EQ(first->restarts(), 0);
  EXPECT_EQ(first->owner(), "alice");
  EXPECT_TRUE(first->has_created_at());
  const v1::JobSpec& spec = first->spec();
  EXPECT_EQ(spec.device(), v1::JobSpec::CPU);
  EXPECT_EQ(spec.threads_per_rank(), 1);
  EXPECT_EQ(spec.batch_size(), 64);
  EXPECT_EQ(spec.optimizer().name(), "sgd");
  EXPECT_TRUE(spec.has_max_restarts());
  EXPECT_EQ(spec.max_restarts(), 3);
  EXPECT_EQ(spec.timeouts().rendezvous().seconds(), 300);
  EXPECT_EQ(spec.timeouts().worker().seconds(), 10);

  EXPECT_EQ(Submit(Spec(1)), "job-2");
  absl::StatusOr<v1::ListJobsResponse> list = c().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->jobs_size(), 2);
  EXPECT_EQ(list->jobs(0).id(), "job-2");  // newest first
  EXPECT_EQ(list->jobs(1).id(), "job-1");
  EXPECT_EQ(Get("job-1").spec().batch_size(), 64);
  EXPECT_THAT(Events("job-1"), Contains("job.submitted"));
}

TEST_F(CoordinatorTest, GetOfAnUnknownJobIsNotFound) {
  EXPECT_EQ(c().GetJob("job-9").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, JobWithoutWorkersStaysPendingSayingWhy) {
  const std::string id = Submit(Spec(2));
  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::PENDING);
  EXPECT_THAT(job.message(), HasSubstr("needs 2"));
  EXPECT_THAT(Events(id), ElementsAre("job.submitted", "job.waiting"));
  // Ticking does not repeat the same reason.
  c().Tick();
  c().Tick();
  EXPECT_THAT(Events(id), ElementsAre("job.submitted", "job.waiting"));
  EXPECT_EQ(Get(id).state(), Job::PENDING);
  EXPECT_EQ(Get(id).generation(), 0);
}

TEST_F(CoordinatorTest, RegisterWorkerValidatesAndAnswersTheIntervals) {
  v1::RegisterWorkerRequest request;
  for (const std::string& bad :
       std::vector<std::string>{"", "has space", "slash/y", std::string(64, 'a')}) {
    request.mutable_info()->set_id(bad);
    EXPECT_EQ(c().RegisterWorker(request).status().code(), absl::StatusCode::kInvalidArgument)
        << "\"" << bad << "\"";
  }
  request.mutable_info()->set_id("node-1.rack_2");
  request.mutable_info()->set_cpu_slots(-1);
  EXPECT_EQ(c().RegisterWorker(request).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c().ListWorkers().workers_size(), 0);

  request.mutable_info()->set_cpu_slots(4);
  absl::StatusOr<v1::RegisterWorkerResponse> r = c().RegisterWorker(request);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->worker_id(), "node-1.rack_2");
  EXPECT_EQ(r->heartbeat_interval().seconds(), 2);
  EXPECT_EQ(r->worker_timeout().seconds(), 10);
  v1::Worker w = WorkerNamed("node-1.rack_2");
  EXPECT_EQ(w.state(), v1::Worker::ALIVE);
  EXPECT_EQ(w.info().cpu_slots(), 4);
  EXPECT_THAT(Events(""), Contains("worker.registered"));
}

// One live worker per id: a registration under a live worker's id from
// another instance is refused, naming the holder, and changes nothing; the
// same instance (a restarted worker on its directory) comes back at once;
// once the holder is lost the id is free, and the lost instance's
// heartbeats are no longer taken (it must register, and is refused).
TEST_F(CoordinatorTest, ASecondInstanceUnderALiveWorkersIdIsRefused) {
  auto request = [](const std::string& instance, const std::string& host) {
    v1::RegisterWorkerRequest r;
    r.mutable_info()->set_id("w1");
    r.mutable_info()->set_hostname(host);
    r.mutable_info()->set_cpu_slots(2);
    r.mutable_info()->set_instance(instance);
    return r;
  };
  auto beat = [&](const std::string& instance) {
    v1::HeartbeatRequest r;
    r.set_worker_id("w1");
    r.set_instance(instance);
    Async<v1::HeartbeatResponse> answer;
    c().Heartbeat(r, answer.Callback());
    return answer.get().status();
  };
  const std::string a(32, 'a'), b(32, 'b');
  ASSERT_TRUE(c().RegisterWorker(request(a, "first")).ok());
  absl::StatusOr<v1::RegisterWorkerResponse> twin = c().RegisterWorker(request(b, "second"));
  ASSERT_EQ(twin.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(
      std::string(twin.status().message()),
      StartsWith("info.id: worker id \"w1\" belongs to a live worker (host first, instance " + a));
  EXPECT_THAT(std::string(twin.status().message()), HasSubstr("--worker-id"));
  EXPECT_EQ(WorkerNamed("w1").info().hostname(), "first");
  EXPECT_EQ(WorkerNamed("w1").info().instance(), a);
  EXPECT_THAT(Events(""), Contains("worker.refused"));
  // The first, restarted on its directory: the same instance.
  EXPECT_TRUE(c().RegisterWorker(request(a, "first")).ok());
  EXPECT_TRUE(beat(a).ok());
  // Silent past the worker timeout: lost, and its id is free.
  clock_.Advance(kWorkerTimeout + milliseconds(1));
  c().Tick();
  ASSERT_EQ(WorkerNamed("w1").state(), v1::Worker::LOST);
  ASSERT_TRUE(c().RegisterWorker(request(b, "second")).ok());
  EXPECT_EQ(WorkerNamed("w1").info().hostname(), "second");
  // The lost one wakes up: its heartbeat is not this worker's any more,
  // and its registration is refused while the second lives.
  EXPECT_EQ(beat(a).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c().RegisterWorker(request(a, "first")).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(beat(b).ok());
  // A worker that sends no instance is not checked.
  EXPECT_TRUE(c().RegisterWorker(request("", "old")).ok());
}

TEST_F(CoordinatorTest, HeartbeatFromAnUnknownWorkerIsNotFound) {
  EXPECT_EQ(Beat("ghost").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, TwoOneSlotWorkersGetATwoRankJobScheduled) {
  const std::string id = Submit(Spec(2));
  ASSERT_TRUE(Register("w1", 1).ok());
  EXPECT_EQ(Get(id).state(), Job::PENDING);
  ASSERT_TRUE(Register("w2", 1).ok());

  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_EQ(job.generation(), 1);
  ASSERT_EQ(job.placement_size(), 2);
  EXPECT_EQ(job.placement(0).rank(), 0);
  EXPECT_EQ(job.placement(1).rank(), 1);
  EXPECT_EQ(job.placement(0).slot(), 0);
  EXPECT_EQ(job.placement(1).slot(), 0);
  EXPECT_THAT(
      (std::vector<std::string>{job.placement(0).worker_id(), job.placement(1).worker_id()}),
      UnorderedElementsAre("w1", "w2"));
  EXPECT_TRUE(InOrder(Events(id), {"job.submitted", "job.waiting", "job.scheduled"}));

  v1::Worker w1 = WorkerNamed("w1");
  EXPECT_EQ(w1.cpu_slots_used(), 1);
  EXPECT_THAT(w1.job_ids(), ElementsAre(id));
}

TEST_F(CoordinatorTest, HeartbeatReturnsEveryAssignmentOfTheWorker) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  absl::StatusOr<v1::HeartbeatResponse> before = Beat("w1");
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->assignments_size(), 0);
  EXPECT_EQ(before->heartbeat_interval().seconds(), 2);

  const std::string id = Submit(Spec(2));
  const Job job = Get(id);
  std::set<int> ranks;
  for (const char* w : {"w1", "w2"}) {
    absl::StatusOr<v1::HeartbeatResponse> r = Beat(w);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_GT(r->assignments_version(), before->assignments_version());
    ASSERT_EQ(r->assignments_size(), 1) << w;
    const v1::TrainerAssignment& a = r->assignments(0);
    EXPECT_EQ(a.job_id(), id);
    EXPECT_EQ(a.generation(), 1);
    EXPECT_EQ(a.world_size(), 2);
    EXPECT_EQ(WorkerOf(id, a.rank()), w);
    EXPECT_EQ(a.slot(), 0);
    EXPECT_TRUE(MessageDifferencer::Equals(a.spec(), job.spec()));
    ranks.insert(a.rank());
    // The trainer token is known to the authenticator, scoped to this job.
    absl::StatusOr<Principal> p = auth_->Authenticate("Bearer " + a.trainer_token());
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->role, Role::kTrainer);
    EXPECT_EQ(p->job_id, id);
    // Complete each time: a second heartbeat lists it again.
    absl::StatusOr<v1::HeartbeatResponse> again = Beat(w);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->assignments_size(), 1);
  }
  EXPECT_THAT(ranks, ElementsAre(0, 1));
}

TEST_F(CoordinatorTest, MultiThreadRanksTakeConsecutiveSlots) {
  ASSERT_TRUE(Register("w1", 4).ok());
  v1::JobSpec spec = Spec(2);
  spec.set_threads_per_rank(2);
  const std::string id = Submit(spec);
  Job job = Get(id);
  ASSERT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_EQ(job.placement(0).slot(), 0);
  EXPECT_EQ(job.placement(1).slot(), 2);
  EXPECT_EQ(WorkerNamed("w1").cpu_slots_used(), 4);
  // Nothing is left for another rank.
  const std::string other = Submit(Spec(1));
  EXPECT_EQ(Get(other).state(), Job::PENDING);
}

TEST_F(CoordinatorTest, GpuJobsGoToWorkersWithGpus) {
  ASSERT_TRUE(Register("cpu-only", 8).ok());
  v1::JobSpec spec = Spec(1);
  spec.set_device(v1::JobSpec::GPU);
  const std::string id = Submit(spec);
  EXPECT_EQ(Get(id).state(), Job::PENDING);
  ASSERT_TRUE(Register("gpu-box", 0, /*gpus=*/2).ok());
  Job job = Get(id);
  ASSERT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_EQ(job.placement(0).worker_id(), "gpu-box");
  EXPECT_EQ(WorkerNamed("gpu-box").gpus_used(), 1);
}

TEST_F(CoordinatorTest, RendezvousOfAllRanksRunsTheJobAndAnswersEveryoneAlike) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));
  JoinAnswer r1 = Join(id, 1, 1);
  EXPECT_FALSE(r1.done());
  EXPECT_EQ(Get(id).state(), Job::SCHEDULED);
  JoinAnswer r0 = Join(id, 1, 0);
  ASSERT_TRUE(r0.done());
  ASSERT_TRUE(r1.done());
  ASSERT_TRUE(r0.get().ok()) << r0.get().status();
  ASSERT_TRUE(r1.get().ok()) << r1.get().status();
  EXPECT_EQ(r0.get()->rank(), 0);
  EXPECT_EQ(r1.get()->rank(), 1);
  for (const JoinAnswer* a : {&r0, &r1}) {
    const v1::JoinRendezvousResponse resp = *a->get();
    EXPECT_EQ(resp.world_size(), 2);
    EXPECT_EQ(resp.generation(), 1);
    EXPECT_FALSE(resp.has_resume_from());
    EXPECT_EQ(resp.spec().world_size(), 2);
    ASSERT_EQ(resp.peers_size(), 2);
    for (int p = 0; p < 2; ++p) {
      EXPECT_EQ(resp.peers(p).rank(), p);
      EXPECT_EQ(resp.peers(p).address(), Address(p));
      EXPECT_EQ(resp.peers(p).worker_id(), WorkerOf(id, p));
    }
  }
  v1::JoinRendezvousResponse r1_as_0 = *r1.get();
  r1_as_0.set_rank(0);
  EXPECT_TRUE(MessageDifferencer::Equals(r1_as_0, *r0.get()));

  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::RUNNING);
  EXPECT_TRUE(job.has_started_at());
  EXPECT_EQ(job.placement(0).address(), Address(0));
  EXPECT_THAT(Events(id), Contains("job.running"));
}

TEST_F(CoordinatorTest, RankThatJoinsAgainAfterCompletionGetsTheSameAnswer) {
  const std::string id = RunningJobOnTwoWorkers();
  JoinAnswer again = Join(id, 1, 1);
  ASSERT_TRUE(again.done());
  ASSERT_TRUE(again.get().ok()) << again.get().status();
  EXPECT_EQ(again.get()->rank(), 1);
  EXPECT_EQ(again.get()->peers_size(), 2);
  EXPECT_EQ(again.get()->peers(0).address(), Address(0));
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
}

TEST_F(CoordinatorTest, JoinWithARankOutOfRangeIsInvalid) {
  ASSERT_TRUE(Register("w1", 2).ok());
  const std::string id = Submit(Spec(2));
  v1::JoinRendezvousRequest request;
  request.set_job_id(id);
  request.set_generation(1);
  request.set_rank(2);
  JoinAnswer answer;
  c().JoinRendezvous(request, answer.Callback());
  ASSERT_TRUE(answer.done());
  EXPECT_EQ(answer.get().status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, TrainerCallsFromAnotherGenerationAreFencedOff) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  ASSERT_EQ(Get(id).generation(), 2);
  PassBackoff(id);
  ASSERT_EQ(Get(id).state(), Job::SCHEDULED);

  for (int64_t gen : {int64_t{1}, int64_t{3}}) {
    SCOPED_TRACE(absl::StrCat("generation ", gen));
    v1::KvSetRequest set;
    set.set_job_id(id);
    set.set_generation(gen);
    set.set_key("k");
    set.set_value("v");
    absl::Status s = c().KvSet(set);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    if (gen == 1) {
      EXPECT_THAT(s.message(), HasSubstr("generation 1 of job-1 is superseded by 2"));
    }

    v1::KvAddRequest add;
    add.set_job_id(id);
    add.set_generation(gen);
    add.set_key("n");
    add.set_delta(1);
    EXPECT_EQ(c().KvAdd(add).status().code(), absl::StatusCode::kFailedPrecondition);

    v1::KvCompareAndSetRequest cas;
    cas.set_job_id(id);
    cas.set_generation(gen);
    cas.set_key("k");
    cas.set_expect_absent(true);
    EXPECT_EQ(c().KvCompareAndSet(cas).status().code(), absl::StatusCode::kFailedPrecondition);

    v1::KvGetRequest get;
    get.set_job_id(id);
    get.set_generation(gen);
    get.set_key("k");
    Async<v1::KvGetResponse> got;
    c().KvGet(get, got.Callback());
    ASSERT_TRUE(got.done());
    EXPECT_EQ(got.get().status().code(), absl::StatusCode::kFailedPrecondition);

    v1::ReportProgressRequest progress;
    progress.set_job_id(id);
    progress.set_generation(gen);
    progress.set_rank(0);
    progress.set_step(10);
    EXPECT_EQ(c().ReportProgress(progress).status().code(), absl::StatusCode::kFailedPrecondition);

    v1::StreamMetricsRequest metrics;
    metrics.set_job_id(id);
    metrics.set_generation(gen);
    metrics.add_records()->set_step(1);
    EXPECT_EQ(c().AppendMetrics(metrics).code(), absl::StatusCode::kFailedPrecondition);

    v1::CommitCheckpointRequest commit;
    commit.set_job_id(id);
    commit.set_generation(gen);
    commit.set_rank(0);
    commit.set_step(10);
    commit.set_path("ckpt/10");
    commit.add_writer_ranks(0);
    EXPECT_EQ(c().CommitCheckpoint(commit).status().code(), absl::StatusCode::kFailedPrecondition);

    JoinAnswer join = Join(id, gen, 0);
    ASSERT_TRUE(join.done());
    EXPECT_EQ(join.get().status().code(), absl::StatusCode::kFailedPrecondition);
  }
  // The current generation is served.
  v1::KvSetRequest set;
  set.set_job_id(id);
  set.set_generation(2);
  set.set_key("k");
  EXPECT_TRUE(c().KvSet(set).ok());
  EXPECT_EQ(Get(id).generation(), 2);
  EXPECT_EQ(Get(id).state(), Job::SCHEDULED);
}

TEST_F(CoordinatorTest, TrainerCallsForUnknownOrEndedJobsAreRefused) {
  v1::KvSetRequest set;
  set.set_job_id("job-77");
  set.set_generation(1);
  set.set_key("k");
  EXPECT_EQ(c().KvSet(set).code(), absl::StatusCode::kNotFound);

  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(c().CancelJob(id, "").ok());
  set.set_job_id(id);
  EXPECT_EQ(c().KvSet(set).code(), absl::StatusCode::kFailedPrecondition);
  JoinAnswer join = Join(id, 1, 0);
  ASSERT_TRUE(join.done());
  EXPECT_EQ(join.get().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CoordinatorTest, NonZeroExitRestartsTheJobAsTheNextGeneration) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(Exit(id, 1, 1, 3).ok());
  Job job = Get(id);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.generation(), 2);
  // It waits out the restart backoff even though there is room.
  EXPECT_EQ(job.state(), Job::RESTARTING);
  EXPECT_THAT(job.message(), StartsWith("restart 1 of 3 in 1s: rank 1 on worker"));
  // Both workers get their stop orders with their next heartbeat (and are
  // heard from after the failure, which a restart placed on them needs).
  clock_.Advance(milliseconds(100));
  for (const char* w : {"w1", "w2"}) {
    absl::StatusOr<v1::HeartbeatResponse> r = Beat(w);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->assignments_size(), 0) << w;
    ASSERT_EQ(r->stops_size(), 1) << w;
    EXPECT_EQ(r->stops(0).generation(), 1);
  }
  clock_.Advance(milliseconds(899));
  c().Tick();
  EXPECT_EQ(Get(id).state(), Job::RESTARTING) << "placed before its backoff ran out";
  clock_.Advance(milliseconds(1));
  c().Tick();
  job = Get(id);
  EXPECT_EQ(job.state(), Job::SCHEDULED) << job.message();
  EXPECT_TRUE(
      InOrder(Events(id), {"job.running", "trainer.exited", "job.restarting", "job.scheduled"}));
  for (const char* w : {"w1", "w2"}) {
    absl::StatusOr<v1::HeartbeatResponse> r = Beat(w);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->assignments_size(), 1) << w;
    EXPECT_EQ(r->assignments(0).generation(), 2);
  }
  RunJob(id);
}

TEST_F(CoordinatorTest, ARestartAvoidsAWorkerOfTheFailedGenerationNotHeardFromSince) {
  ASSERT_TRUE(Register("w3", 1).ok());  // the spare
  const std::string id = RunningJobOnTwoWorkers();
  // w2 died with its trainer; the survivor on w1 fails the generation first.
  clock_.Advance(milliseconds(500));
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  clock_.Advance(milliseconds(100));
  ASSERT_TRUE(Beat("w1").ok());
  ASSERT_TRUE(Beat("w3").ok());
  clock_.Advance(BackoffOf(id));
  ASSERT_TRUE(Beat("w1").ok());
  ASSERT_TRUE(Beat("w3").ok());
  c().Tick();
  const Job job = Get(id);
  ASSERT_EQ(job.state(), Job::SCHEDULED) << job.message();
  std::set<std::string> on;
  for (const v1::RankPlacement& p : job.placement()) on.insert(p.worker_id());
  EXPECT_EQ(on, (std::set<std::string>{"w1", "w3"}));
}

TEST_F(CoordinatorTest, DeathBySignalCountsAsAFailure) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(Exit(id, 1, 0, 0, false, false, /*signal=*/9).ok());
  EXPECT_EQ(Get(id).generation(), 2);
  EXPECT_EQ(Get(id).restarts(), 1);
}

TEST_F(CoordinatorTest, ExitsOnAStopOrderOrFromAnOldGenerationChangeNothing) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(Exit(id, 1, 0, 143, false, /*stopped_by_order=*/true).ok());
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  EXPECT_EQ(Get(id).generation(), 1);

  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());  // a real failure: generation 2
  ASSERT_EQ(Get(id).generation(), 2);
  ASSERT_TRUE(Exit(id, 1, 1, 1).ok());  // late news of generation 1
  EXPECT_EQ(Get(id).generation(), 2);
  EXPECT_EQ(Get(id).restarts(), 1);
  PassBackoff(id);
  EXPECT_EQ(Get(id).state(), Job::SCHEDULED);
}

TEST_F(CoordinatorTest, JobFailsForGoodOnceMaxRestartsAreUsedUp) {
  v1::JobSpec spec = Spec(2);
  spec.set_max_restarts(1);
  const std::string id = RunningJobOnTwoWorkers(spec);
  const std::string token = Beat("w1")->assignments(0).trainer_token();
  ASSERT_TRUE(Exit(id, 1, 0, 3).ok());
  PassBackoff(id);
  ASSERT_EQ(Get(id).state(), Job::SCHEDULED);
  RunJob(id);
  ASSERT_TRUE(Exit(id, 2, 1, 4).ok());

  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::FAILED);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_THAT(job.message(), HasSubstr("max_restarts 1"));
  EXPECT_THAT(job.message(), HasSubstr("exited with code 4"));
  EXPECT_TRUE(job.has_finished_at());
  EXPECT_THAT(Events(id), Contains("job.failed"));
  // The job's token dies with it, and its slots are free again.
  EXPECT_EQ(auth_->Authenticate("Bearer " + token).status().code(),
            absl::StatusCode::kUnauthenticated);
  const std::string next = Submit(Spec(2));
  EXPECT_EQ(Get(next).state(), Job::SCHEDULED);
}

TEST_F(CoordinatorTest, MaxRestartsZeroFailsAtTheFirstFailure) {
  v1::JobSpec spec = Spec(2);
  spec.set_max_restarts(0);
  const std::string id = RunningJobOnTwoWorkers(spec);
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  EXPECT_EQ(Get(id).state(), Job::FAILED);
  EXPECT_EQ(Get(id).restarts(), 0);
}

TEST_F(CoordinatorTest, PermanentFailureFailsTheJobAtOnce) {
  const std::string id = RunningJobOnTwoWorkers();
  ASSERT_TRUE(Exit(id, 1, 0, 78, /*permanent=*/true).ok());
  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::FAILED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_THAT(job.message(), HasSubstr("permanent"));
  EXPECT_THAT(job.message(), HasSubstr("exited with code 78"));
  for (const char* w : {"w1", "w2"}) {
    absl::StatusOr<v1::HeartbeatResponse> r = Beat(w);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->assignments_size(), 0);
    EXPECT_EQ(r->stops_size(), 1);
  }
}

TEST_F(CoordinatorTest, AllRanksExitingZeroSucceedsTheJob) {
  const std::string id = RunningJobOnTwoWorkers();
  const std::string token = Beat("w1")->assignments(0).trainer_token();
  ASSERT_TRUE(Exit(id, 1, 0, 0).ok());
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  // The same rank reporting twice is not two ranks.
  ASSERT_TRUE(Exit(id, 1, 0, 0).ok());
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  ASSERT_TRUE(Exit(id, 1, 1, 0).ok());
  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::SUCCEEDED) << job.message();
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_TRUE(job.has_finished_at());
  EXPECT_THAT(Events(id), Contains("job.succeeded"));
  EXPECT_FALSE(auth_->Authenticate("Bearer " + token).ok());
  absl::StatusOr<v1::HeartbeatResponse> r = Beat("w1");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->assignments_size(), 0);
  EXPECT_EQ(WorkerNamed("w1").cpu_slots_used(), 0);
  // The late exit of an ended job changes nothing.
  ASSERT_TRUE(Exit(id, 1, 1, 1).ok());
  EXPECT_EQ(Get(id).state(), Job::SUCCEEDED);
}

TEST_F(CoordinatorTest, RanksThatAllExitZeroBeforeTheRendezvousEndedSucceedTheJob) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));
  ASSERT_EQ(Get(id).state(), Job::SCHEDULED);
  ASSERT_TRUE(Exit(id, 1, 0, 0).ok());
  ASSERT_TRUE(Exit(id, 1, 1, 0).ok());
  Job job = Get(id);
  EXPECT_EQ(job.state(), Job::SUCCEEDED) << job.message();
  EXPECT_EQ(WorkerNamed("w1").cpu_slots_used(), 0);
}

TEST_F(CoordinatorTest, ReportTrainerExitOfAnUnknownJobIsNotFound) {
  v1::ReportTrainerExitRequest request;
  request.set_job_id("job-5");
  EXPECT_EQ(c().ReportTrainerExit(request).code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, CancelOfARunningJobStopsItsTrainers) {
  const std::string id = RunningJobOnTwoWorkers();
  absl::StatusOr<Job> cancelled = c().CancelJob(id, "no longer needed");
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), Job::CANCELLED);
  EXPECT_THAT(cancelled->message(), HasSubstr("no longer needed"));
  EXPECT_EQ(Get(id).state(), Job::CANCELLED);
  EXPECT_THAT(Events(id), Contains("job.cancelled"));
  for (const char* w : {"w1", "w2"}) {
    absl::StatusOr<v1::HeartbeatResponse> r = Beat(w);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->assignments_size(), 0) << w;
    ASSERT_EQ(r->stops_size(), 1) << w;
    EXPECT_EQ(r->stops(0).job_id(), id);
    EXPECT_EQ(r->stops(0).generation(), 1);
    // A stop order is delivered once.
    EXPECT_EQ(Beat(w)->stops_size(), 0);
  }
}

TEST_F(CoordinatorTest, CancelOfAPendingJobNeedsNoStopOrders) {
  ASSERT_TRUE(Register("w1", 1).ok());
  const std::string id = Submit(Spec(2));
  ASSERT_EQ(Get(id).state(), Job::PENDING);
  ASSERT_TRUE(c().CancelJob(id, "").ok());
  EXPECT_EQ(Get(id).state(), Job::CANCELLED);
  EXPECT_EQ(Beat("w1")->stops_size(), 0);
}

TEST_F(CoordinatorTest, CancelOfAnEndedOrUnknownJobIsRefused) {
  const std::string id = Submit(Spec(1));
  ASSERT_TRUE(c().CancelJob(id, "").ok());
  absl::StatusOr<Job> again = c().CancelJob(id, "");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c().CancelJob("job-99", "").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, HigherPriorityJobsAreScheduledFirst) {
  ASSERT_TRUE(Register("w1", 2).ok());
  const std::string running = Submit(Spec(2));
  const std::string low = Submit(Spec(2));
  v1::JobSpec urgent_spec = Spec(2);
  urgent_spec.set_priority(5);
  const std::string urgent = Submit(urgent_spec);
  ASSERT_EQ(Get(running).state(), Job::SCHEDULED);
  EXPECT_EQ(Get(low).state(), Job::PENDING);
  EXPECT_EQ(Get(urgent).state(), Job::PENDING);

  ASSERT_TRUE(c().CancelJob(running, "").ok());
  EXPECT_EQ(Get(urgent).state(), Job::SCHEDULED);
  EXPECT_EQ(Get(low).state(), Job::PENDING);
  ASSERT_TRUE(c().CancelJob(urgent, "").ok());
  EXPECT_EQ(Get(low).state(), Job::SCHEDULED);
}

TEST_F(CoordinatorTest, JobBiggerThanTheClusterDoesNotBlockLaterJobs) {
  ASSERT_TRUE(Register("w1", 2).ok());
  const std::string huge = Submit(Spec(5));
  const std::string small = Submit(Spec(1));
  Job job = Get(huge);
  EXPECT_EQ(job.state(), Job::PENDING);
  EXPECT_THAT(job.message(), HasSubstr("needs 5"));
  EXPECT_THAT(job.message(), HasSubstr("has 2"));
  EXPECT_THAT(Events(huge), Contains("job.waiting"));
  EXPECT_EQ(Get(small).state(), Job::SCHEDULED);
}

TEST_F(CoordinatorTest, JobWaitingForRoomBlocksLaterJobsOfTheSamePriority) {
  ASSERT_TRUE(Register("w1", 3).ok());
  const std::string first = Submit(Spec(2));
  const std::string waiting = Submit(Spec(2));
  const std::string behind = Submit(Spec(1));  // would fit the free slot
  ASSERT_EQ(Get(first).state(), Job::SCHEDULED);
  EXPECT_EQ(Get(waiting).state(), Job::PENDING);
  EXPECT_THAT(Events(waiting), Contains("job.waiting"));
  EXPECT_EQ(Get(behind).state(), Job::PENDING) << "backfilled past a waiting job";
  c().Tick();
  EXPECT_EQ(Get(behind).state(), Job::PENDING);

  // A higher priority goes ahead of the waiting job.
  v1::JobSpec urgent_spec = Spec(1);
  urgent_spec.set_priority(1);
  const std::string urgent = Submit(urgent_spec);
  EXPECT_EQ(Get(urgent).state(), Job::SCHEDULED);

  // Room again: the waiting job first, in submission order.
  ASSERT_TRUE(c().CancelJob(first, "").ok());
  EXPECT_EQ(Get(waiting).state(), Job::SCHEDULED);
  EXPECT_EQ(Get(behind).state(), Job::PENDING);
}

TEST_F(CoordinatorTest, KvSetGetAddAndCompareAndSetWorkWithinAGeneration) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::KvSetRequest set;
  set.set_job_id(id);
  set.set_generation(1);
  set.set_key("nccl/unique_id");
  set.set_value(std::string("\x01\x00\x02", 3));
  ASSERT_TRUE(c().KvSet(set).ok());

  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("nccl/unique_id");
  Async<v1::KvGetResponse> got;
  c().KvGet(get, got.Callback());
  ASSERT_TRUE(got.done());
  ASSERT_TRUE(got.get().ok()) << got.get().status();
  EXPECT_TRUE(got.get()->found());
  EXPECT_EQ(got.get()->value(), std::string("\x01\x00\x02", 3));

  get.set_key("unset");
  Async<v1::KvGetResponse> missing;
  c().KvGet(get, missing.Callback());
  ASSERT_TRUE(missing.done());
  ASSERT_TRUE(missing.get().ok()) << missing.get().status();
  EXPECT_FALSE(missing.get()->found());

  v1::KvAddRequest add;
  add.set_job_id(id);
  add.set_generation(1);
  add.set_key("barrier");
  add.set_delta(1);
  EXPECT_EQ(c().KvAdd(add)->value(), 1);
  EXPECT_EQ(c().KvAdd(add)->value(), 2);

  v1::KvCompareAndSetRequest cas;
  cas.set_job_id(id);
  cas.set_generation(1);
  cas.set_key("leader");
  cas.set_expect_absent(true);
  cas.set_desired("rank0");
  absl::StatusOr<v1::KvCompareAndSetResponse> r = c().KvCompareAndSet(cas);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->swapped());
  cas.set_desired("rank1");
  r = c().KvCompareAndSet(cas);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->swapped());
  EXPECT_TRUE(r->found());
  EXPECT_EQ(r->current(), "rank0");

  set.set_key("");
  EXPECT_EQ(c().KvSet(set).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, KvGetWithWaitIsAnsweredByALaterKvSet) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("gloo/rank1");
  *get.mutable_wait() = Dur(milliseconds(5000));
  Async<v1::KvGetResponse> got;
  c().KvGet(get, got.Callback());
  EXPECT_FALSE(got.done());
  c().Tick();
  EXPECT_FALSE(got.done());

  v1::KvSetRequest set;
  set.set_job_id(id);
  set.set_generation(1);
  set.set_key("gloo/rank1");
  set.set_value("10.0.0.2:4000");
  ASSERT_TRUE(c().KvSet(set).ok());
  ASSERT_TRUE(got.done());
  ASSERT_TRUE(got.get().ok()) << got.get().status();
  EXPECT_TRUE(got.get()->found());
  EXPECT_EQ(got.get()->value(), "10.0.0.2:4000");
  EXPECT_EQ(got.calls(), 1);
}

TEST_F(CoordinatorTest, KvGetWaitRunsOutAfterItsTime) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("never");
  *get.mutable_wait() = Dur(milliseconds(1000));
  Async<v1::KvGetResponse> got;
  c().KvGet(get, got.Callback());
  clock_.Advance(milliseconds(500));
  c().Tick();
  EXPECT_FALSE(got.done());
  clock_.Advance(milliseconds(600));
  c().Tick();
  ASSERT_TRUE(got.done());
  EXPECT_EQ(got.get().status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(CoordinatorTest, KvStoreEndsWithItsGeneration) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::KvSetRequest set;
  set.set_job_id(id);
  set.set_generation(1);
  set.set_key("k");
  set.set_value("gen1");
  ASSERT_TRUE(c().KvSet(set).ok());
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("waited-for");
  *get.mutable_wait() = Dur(milliseconds(5000));
  Async<v1::KvGetResponse> waiting;
  c().KvGet(get, waiting.Callback());
  ASSERT_FALSE(waiting.done());

  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  ASSERT_TRUE(waiting.done()) << "a waiter of the failed generation was left hanging";
  EXPECT_FALSE(waiting.get().ok());
  PassBackoff(id);

  get.set_generation(2);
  get.set_key("k");
  get.clear_wait();
  Async<v1::KvGetResponse> fresh;
  c().KvGet(get, fresh.Callback());
  ASSERT_TRUE(fresh.done());
  ASSERT_TRUE(fresh.get().ok()) << fresh.get().status();
  EXPECT_FALSE(fresh.get()->found()) << "generation 2 sees generation 1's keys";
}

TEST_F(CoordinatorTest, ProgressCarriesTotalStepsAndEpochToTheJob) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::ReportProgressRequest progress;
  progress.set_job_id(id);
  progress.set_generation(1);
  progress.set_rank(0);
  progress.set_step(40);
  progress.set_epoch(2);
  progress.set_total_steps(300);
  v1::WatchJobRequest request;
  request.set_job_id(id);
  WatchCursor cursor;
  ASSERT_TRUE(c().PollWatch(request, &cursor).ok());
  ASSERT_TRUE(c().ReportProgress(progress).ok());
  const Job job = Get(id);
  EXPECT_EQ(job.total_steps(), 300);
  EXPECT_EQ(job.last_step(), 40);
  EXPECT_EQ(job.epoch(), 2);
  // Watchers see the new total.
  absl::StatusOr<WatchBatch> batch = c().PollWatch(request, &cursor);
  ASSERT_TRUE(batch.ok());
  ASSERT_FALSE(batch->items.empty());
  EXPECT_EQ(batch->items.front().job().total_steps(), 300);
  progress.set_total_steps(-1);
  EXPECT_EQ(c().ReportProgress(progress).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, ReportProgressRaisesLastStep) {
  const std::string id = RunningJobOnTwoWorkers();
  v1::ReportProgressRequest p;
  p.set_job_id(id);
  p.set_generation(1);
  p.set_rank(1);
  p.set_step(42);
  ASSERT_TRUE(c().ReportProgress(p).ok());
  EXPECT_EQ(Get(id).last_step(), 42);
  p.set_step(7);
  ASSERT_TRUE(c().ReportProgress(p).ok());
  EXPECT_EQ(Get(id).last_step(), 42);
  p.set_rank(2);
  EXPECT_EQ(c().ReportProgress(p).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, StateSurvivesARestartOnTheSameFile) {
  TempDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  Open(path);
  ASSERT_NE(coord_, nullptr);
  const std::string running = RunningJobOnTwoWorkers();
  const std::string token = Beat("w1")->assignments(0).trainer_token();
  const std::string waiting = Submit(Spec(5));
  const std::string cancelled = Submit(Spec(1));
  ASSERT_TRUE(c().CancelJob(cancelled, "").ok());
  const Job running_before = Get(running);
  const std::vector<v1::Event> events_before = EventList("");

  Open(path);
  ASSERT_NE(coord_, nullptr);
  Job job = Get(running);
  EXPECT_EQ(job.state(), Job::RUNNING);
  EXPECT_EQ(job.generation(), 1);
  EXPECT_TRUE(MessageDifferencer::Equals(job, running_before)) << job.DebugString() << "\nvs\n"
                                                               << running_before.DebugString();
  EXPECT_EQ(Get(waiting).state(), Job::PENDING);
  EXPECT_EQ(Get(cancelled).state(), Job::CANCELLED);

  const std::vector<v1::Event> events_after = EventList("");
  ASSERT_GE(events_after.size(), events_before.size());
  for (size_t i = 0; i < events_before.size(); ++i) {
    EXPECT_EQ(events_after[i].seq(), events_before[i].seq());
    EXPECT_EQ(events_after[i].type(), events_before[i].type());
  }

  // The running job's trainers can carry on: their token works and a retried
  // join gets the same peers.
  absl::StatusOr<Principal> p = auth_->Authenticate("Bearer " + token);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->role, Role::kTrainer);
  EXPECT_EQ(p->job_id, running);
  JoinAnswer rejoin = Join(running, 1, 1);
  ASSERT_TRUE(rejoin.done());
  ASSERT_TRUE(rejoin.get().ok()) << rejoin.get().status();
  ASSERT_EQ(rejoin.get()->peers_size(), 2);
  EXPECT_EQ(rejoin.get()->peers(0).address(), Address(0));
  EXPECT_EQ(rejoin.get()->rank(), 1);

  // Workers are known again, and numbering goes on.
  EXPECT_EQ(c().ListWorkers().workers_size(), 2);
  EXPECT_EQ(Submit(Spec(1)), "job-4");
  absl::StatusOr<v1::HeartbeatResponse> r = Beat("w1");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->assignments_size(), 1);
  EXPECT_EQ(r->assignments(0).job_id(), running);
  EXPECT_EQ(r->assignments(0).trainer_token(), token);
}

TEST_F(CoordinatorTest, RestartsWaitTwiceAsLongEachTimeAndSaySo) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_restart_backoff() = Dur(milliseconds(2000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  for (int restart = 1; restart <= 3; ++restart) {
    SCOPED_TRACE(absl::StrCat("restart ", restart));
    const milliseconds wait(2000 << (restart - 1));
    ASSERT_TRUE(Exit(id, restart, 0, 1).ok());
    Job job = Get(id);
    ASSERT_EQ(job.state(), Job::RESTARTING);
    const std::string expected =
        absl::StrCat("restart ", restart, " of 3 in ", wait.count() / 1000, "s: rank 0 on worker ");
    EXPECT_THAT(job.message(), StartsWith(expected));
    std::string event;
    for (const v1::Event& e : EventList(id)) {
      if (e.type() == "job.restarting") event = e.message();
    }
    EXPECT_THAT(event, StartsWith(expected));
    clock_.Advance(wait - milliseconds(1));
    for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
    c().Tick();
    EXPECT_EQ(Get(id).state(), Job::RESTARTING) << "placed before its backoff ran out";
    clock_.Advance(milliseconds(1));
    c().Tick();
    ASSERT_EQ(Get(id).state(), Job::SCHEDULED);
    RunJob(id);
  }
  // The fourth failure is one too many: it fails at once.
  ASSERT_TRUE(Exit(id, 4, 0, 1).ok());
  EXPECT_EQ(Get(id).state(), Job::FAILED);
}

TEST_F(CoordinatorTest, RestartBackoffStopsGrowingAtFiveMinutes) {
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_restart_backoff() = Dur(milliseconds(200'000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  ASSERT_TRUE(Exit(id, 1, 0, 1).ok());
  EXPECT_THAT(Get(id).message(), StartsWith("restart 1 of 3 in 200s:"));
  clock_.Advance(milliseconds(200'000));
  for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
  c().Tick();
  RunJob(id);
  ASSERT_TRUE(Exit(id, 2, 0, 1).ok());
  EXPECT_THAT(Get(id).message(), StartsWith("restart 2 of 3 in 300s:"));
}

TEST_F(CoordinatorTest, JobsBesideOneThatKeepsFailingRunUndisturbed) {
  // Three 1-slot workers: a 1-rank job that crashes, a 1-rank job beside it,
  // and a third waiting for room.
  for (const char* w : {"w1", "w2", "w3"}) ASSERT_TRUE(Register(w, 1).ok());
  v1::JobSpec crashing = Spec(1);
  crashing.set_max_restarts(1);
  crashing.set_priority(10);
  const std::string bad = Submit(crashing);
  const std::string good = Submit(Spec(1));
  RunJob(bad);
  RunJob(good);
  ASSERT_TRUE(Exit(bad, 1, 0, 1).ok());
  ASSERT_EQ(Get(bad).state(), Job::RESTARTING);
  // While it backs off, a job submitted later is placed at once.
  const std::string later = Submit(Spec(1));
  EXPECT_EQ(Get(later).state(), Job::SCHEDULED);
  PassBackoff(bad);
  RunJob(bad);
  // Its last failure ends it at once, with no wait.
  ASSERT_TRUE(Exit(bad, 2, 0, 1).ok());
  EXPECT_EQ(Get(bad).state(), Job::FAILED);
  const Job job = Get(good);
  EXPECT_EQ(job.state(), Job::RUNNING);
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.restarts(), 0);
  absl::StatusOr<v1::HeartbeatResponse> r = Beat(WorkerOf(good, 0));
  ASSERT_TRUE(r.ok());
  for (const v1::StopOrder& stop : r->stops()) EXPECT_NE(stop.job_id(), good);
}

TEST_F(CoordinatorTest, IncarnationIsFixedForAProcessAndNewAfterARestart) {
  TempDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  Open(path);
  const std::string id = RunningJobOnTwoWorkers();
  absl::StatusOr<v1::ReportProgressResponse> a = Progress(id, 1, 0, 1, 1);
  absl::StatusOr<v1::ReportProgressResponse> b = Progress(id, 1, 1, 1, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_FALSE(a->incarnation().empty());
  EXPECT_EQ(a->incarnation(), b->incarnation());
  EXPECT_EQ(a->incarnation(), c().incarnation());
  absl::StatusOr<v1::StreamMetricsResponse> receipt = c().MetricsReceipt(id);
  ASSERT_TRUE(receipt.ok()) << receipt.status();
  EXPECT_EQ(receipt->incarnation(), a->incarnation());
  Open(path);
  absl::StatusOr<v1::ReportProgressResponse> after = Progress(id, 1, 0, 2, 2);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_NE(after->incarnation(), a->incarnation());
  EXPECT_EQ(c().MetricsReceipt("job-404").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, ARunningJobGoesOnAcrossACoordinatorRestart) {
  TempDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  Open(path);
  v1::JobSpec spec = Spec(2);
  *spec.mutable_timeouts()->mutable_progress() = Dur(milliseconds(8000));
  const std::string id = RunningJobOnTwoWorkers(spec);
  // Written before its metrics came: it awaits them.
  absl::StatusOr<v1::CommitCheckpointResponse> early =
      c().CommitCheckpoint(Commit(id, 1, 0, 4, {0}));
  ASSERT_TRUE(early.ok()) << early.status();
  EXPECT_FALSE(early->committed());
  ASSERT_TRUE(SendSteps(id, 0, 1, 8).ok());
  ASSERT_TRUE(SendSteps(id, 1, 1, 5).ok());
  ASSERT_TRUE(Progress(id, 1, 0, 8, 80).ok());
  ASSERT_TRUE(Progress(id, 1, 1, 5, 50).ok());
  c().FlushSteps();
  absl::StatusOr<v1::StreamMetricsResponse> receipt = c().MetricsReceipt(id);
  ASSERT_TRUE(receipt.ok());
  ASSERT_EQ(receipt->durable_step(), 5);
  const std::string old_incarnation = receipt->incarnation();

  // Down for 6s: with the 8s progress timeout counted from before, the job
  // would hang 2s after the restart.
  clock_.Advance(milliseconds(6000));
  Open(path);
  ASSERT_NE(coord_, nullptr);
  c().Tick();
  ASSERT_EQ(Get(id).state(), Job::RUNNING);
  // Its metrics were stored before the restart: the new process commits it.
  EXPECT_EQ(Get(id).last_checkpoint_step(), 4);

  // The trainers carry on: each sends again what it was not told is durable
  // (rank 0 from step 1, as if it missed the last receipt), then new steps.
  ASSERT_TRUE(SendSteps(id, 0, 1, 10).ok());
  ASSERT_TRUE(SendSteps(id, 1, 6, 10).ok());
  absl::StatusOr<v1::ReportProgressResponse> beat = Progress(id, 1, 0, 10, 100);
  ASSERT_TRUE(beat.ok()) << beat.status();
  EXPECT_NE(beat->incarnation(), old_incarnation);
  ASSERT_TRUE(Progress(id, 1, 1, 10, 100).ok());
  c().FlushSteps();
  absl::StatusOr<v1::CommitCheckpointResponse> commit =
      c().CommitCheckpoint(Commit(id, 1, 0, 8, {0}));
  ASSERT_TRUE(commit.ok()) << commit.status();
  EXPECT_TRUE(commit->committed());
  for (int s = 0; s < 6; ++s) {
    clock_.Advance(milliseconds(1000));
    for (const char* w : {"w1", "w2"}) ASSERT_TRUE(Beat(w).ok());
    c().Tick();
  }

  const Job job = Get(id);
  EXPECT_EQ(job.state(), Job::RUNNING) << job.message();
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.last_checkpoint_step(), 8);
  c().FlushSteps();
  receipt = c().MetricsReceipt(id);
  ASSERT_TRUE(receipt.ok());
  EXPECT_EQ(receipt->durable_step(), 10);
  // Every step once, combined from both ranks.
  v1::GetMetricsRequest get;
  get.set_job_id(id);
  absl::StatusOr<v1::GetMetricsResponse> steps = c().GetMetrics(get);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->steps_size(), 10);
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(steps->steps(i).step(), i + 1);
    EXPECT_EQ(steps->steps(i).ranks_reported(), 2) << "step " << i + 1;
    EXPECT_DOUBLE_EQ(steps->steps(i).loss(), 1.0 / (i + 1) + 0.5);
  }
  EXPECT_THAT(c().registry()->Serialize(), HasSubstr("aidn_metric_records_dropped_total 0\n"));
  for (const std::string& type : Events(id)) {
    EXPECT_NE(type, "job.restarting");
    EXPECT_NE(type, "job.hang");
  }
}

TEST_F(CoordinatorTest, CallbacksRunOutsideTheLockSoTheyMayCallBackIn) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));

  // Rank 0's callback asks for the job, as a service handler might.
  std::optional<Job::State> seen_from_callback;
  v1::JoinRendezvousRequest request;
  request.set_job_id(id);
  request.set_generation(1);
  request.set_rank(0);
  c().JoinRendezvous(request, [&](absl::StatusOr<v1::JoinRendezvousResponse> r) {
    ASSERT_TRUE(r.ok()) << r.status();
    absl::StatusOr<Job> job = c().GetJob(id);
    ASSERT_TRUE(job.ok());
    seen_from_callback = job->state();
  });
  EXPECT_FALSE(seen_from_callback.has_value());
  JoinAnswer r1 = Join(id, 1, 1);
  EXPECT_TRUE(r1.done());
  ASSERT_TRUE(seen_from_callback.has_value()) << "rank 0 was not answered";
  EXPECT_EQ(*seen_from_callback, Job::RUNNING);

  // A KV waiter that writes another key when it wakes.
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("ping");
  *get.mutable_wait() = Dur(milliseconds(5000));
  bool woke = false;
  c().KvGet(get, [&](absl::StatusOr<v1::KvGetResponse> r) {
    ASSERT_TRUE(r.ok()) << r.status();
    v1::KvSetRequest pong;
    pong.set_job_id(id);
    pong.set_generation(1);
    pong.set_key("pong");
    pong.set_value(r->value());
    EXPECT_TRUE(c().KvSet(pong).ok());
    woke = true;
  });
  v1::KvSetRequest ping;
  ping.set_job_id(id);
  ping.set_generation(1);
  ping.set_key("ping");
  ping.set_value("hello");
  ASSERT_TRUE(c().KvSet(ping).ok());
  ASSERT_TRUE(woke);
  get.set_key("pong");
  get.clear_wait();
  Async<v1::KvGetResponse> pong;
  c().KvGet(get, pong.Callback());
  ASSERT_TRUE(pong.get().ok());
  EXPECT_EQ(pong.get()->value(), "hello");
}

TEST_F(CoordinatorTest, RanksJoiningFromManyThreadsAllGetTheSameAnswer) {
  constexpr int kRanks = 8;
  for (int w = 0; w < kRanks; ++w) ASSERT_TRUE(Register(absl::StrCat("w", w), 1).ok());
  const std::string id = Submit(Spec(kRanks));
  ASSERT_EQ(Get(id).state(), Job::SCHEDULED);
  std::vector<std::string> worker_of;
  for (int r = 0; r < kRanks; ++r) worker_of.push_back(WorkerOf(id, r));

  std::vector<JoinAnswer> answers(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      v1::KvAddRequest add;
      add.set_job_id(id);
      add.set_generation(1);
      add.set_key("arrived");
      add.set_delta(1);
      EXPECT_TRUE(c().KvAdd(add).ok());
      v1::JoinRendezvousRequest request;
      request.set_job_id(id);
      request.set_generation(1);
      request.set_rank(r);
      request.set_worker_id(worker_of[r]);
      request.set_address(Address(r));
      c().JoinRendezvous(request, answers[r].Callback());
    });
  }
  for (std::thread& t : threads) t.join();

  // The last join answered everyone before it returned.
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(answers[r].done()) << "rank " << r;
    ASSERT_TRUE(answers[r].get().ok()) << answers[r].get().status();
    EXPECT_EQ(answers[r].get()->rank(), r);
    v1::JoinRendezvousResponse as_rank0 = *answers[r].get();
    as_rank0.set_rank(0);
    EXPECT_TRUE(MessageDifferencer::Equals(as_rank0, *answers[0].get())) << "rank " << r;
    EXPECT_EQ(answers[r].calls(), 1);
  }
  EXPECT_EQ(Get(id).state(), Job::RUNNING);
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("arrived");
  Async<v1::KvGetResponse> arrived;
  c().KvGet(get, arrived.Callback());
  ASSERT_TRUE(arrived.get().ok());
  EXPECT_EQ(arrived.get()->value(), absl::StrCat(kRanks));
}

TEST_F(CoordinatorTest, ShutdownAnswersParkedCallsWithUnavailable) {
  ASSERT_TRUE(Register("w1", 1).ok());
  ASSERT_TRUE(Register("w2", 1).ok());
  const std::string id = Submit(Spec(2));
  JoinAnswer join = Join(id, 1, 0);
  v1::KvGetRequest get;
  get.set_job_id(id);
  get.set_generation(1);
  get.set_key("never");
  *get.mutable_wait() = Dur(milliseconds(5000));
  Async<v1::KvGetResponse> kv;
  c().KvGet(get, kv.Callback());
  absl::StatusOr<v1::HeartbeatResponse> first = Beat("w1");
  ASSERT_TRUE(first.ok());
  Async<v1::HeartbeatResponse> held =
      HeldBeat("w1", first->assignments_version(), milliseconds(1000));
  ASSERT_FALSE(join.done());
  ASSERT_FALSE(kv.done());
  ASSERT_FALSE(held.done());

  c().Shutdown();
  ASSERT_TRUE(join.done());
  ASSERT_TRUE(kv.done());
  ASSERT_TRUE(held.done());
  EXPECT_EQ(join.get().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(held.get().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(kv.get().status().code(), absl::StatusCode::kUnavailable) << kv.get().status();

  // New calls are refused.
  JoinAnswer late = Join(id, 1, 1);
  ASSERT_TRUE(late.done());
  EXPECT_EQ(late.get().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Beat("w2").status().code(), absl::StatusCode::kUnavailable);
  v1::WatchJobRequest watch;
  watch.set_job_id(id);
  WatchCursor cursor;
  EXPECT_EQ(c().PollWatch(watch, &cursor).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace aidn::coordinator
