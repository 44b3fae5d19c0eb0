#include "worker/trainer/trainer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "common/log.h"
#include "common/rpc/client.h"
#include "common/rpc/status_convert.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/data.h"
#include "worker/engine/ddp.h"
#include "worker/engine/lr_schedule.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/trainer/coordinator_store.h"

namespace aidn::trainer {
namespace {

using std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;
using Stub = v1::ClusterService::Stub;

constexpr milliseconds kRpcTimeout{10'000};

double SecondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

milliseconds ToMillis(const google::protobuf::Duration& d) {
  return milliseconds(d.seconds() * 1000 + d.nanos() / 1'000'000);
}

google::protobuf::Timestamp Now() {
  google::protobuf::Timestamp ts;
  const int64_t nanos = absl::ToUnixNanos(absl::Now());
  ts.set_seconds(nanos / 1'000'000'000);
  ts.set_nanos(static_cast<int32_t>(nanos % 1'000'000'000));
  return ts;
}

// A failure that decides the exit code.
struct Failure {
  int exit_code;
  absl::Status status;
};

Failure FailureFor(const absl::Status& status, const char* what) {
  const absl::Status annotated(status.code(), absl::StrCat(what, ": ", status.message()));
  if (status.code() == absl::StatusCode::kFailedPrecondition) {
    return {kExitSuperseded, annotated};
  }
  return {kExitFailure, annotated};
}

// Sends metric records (batched) and progress beats from a thread of its
// own, so training never waits on the coordinator. Records that cannot be
// sent are kept (bounded: the oldest are dropped and counted) and retried.
class Reporter {
 public:
  Reporter(std::shared_ptr<Stub> stub, const TrainerOptions& options)
      : stub_(std::move(stub)), options_(options), thread_([this] { Loop(); }) {}

  ~Reporter() { Close(milliseconds(5000)); }

  void Record(v1::MetricRecord record) {
    std::lock_guard<std::mutex> lock(mu_);
    if (records_.size() >= kMaxBuffered) {
      records_.pop_front();
      ++dropped_;
    }
    records_.push_back(std::move(record));
  }

  void Progress(int64_t step, int32_t epoch, int64_t collective_seq, int64_t total_steps) {
    std::lock_guard<std::mutex> lock(mu_);
    total_steps_ = total_steps;
    progress_step_ = step;
    progress_epoch_ = epoch;
    collective_seq_ = collective_seq;
  }

  // The coordinator said this generation is over.
  bool superseded() const { return superseded_.load(); }

  // Sends what is left (within `timeout`) and stops the thread.
  void Close(milliseconds timeout) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_) return;
      closing_ = true;
      close_deadline_ = SteadyClock::now() + timeout;
    }
    cv_.notify_all();
    thread_.join();
    if (dropped_ > 0) {
      AIDN_LOG(WARNING) << "metric records dropped while the coordinator was away"
                        << Kv("dropped", dropped_);
    }
  }

 private:
  static constexpr size_t kMaxBuffered = 100'000;
  static constexpr size_t kBatch = 512;

  void Loop() {
    SteadyClock::time_point next_beat = SteadyClock::now();
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait_for(lock, milliseconds(200), [this] { return closing_; });
      const bool closing = closing_;
      if (closing && (records_.empty() || SteadyClock::now() > close_deadline_)) break;
      std::vector<v1::MetricRecord> batch;
      while (!records_.empty() && batch.size() < kBatch) {
        batch.push_back(std::move(records_.front()));
        records_.pop_front();
      }
      const bool beat = SteadyClock::now() >= next_beat && progress_step_ >= 0;
      const int64_t step = progress_step_;
      const int32_t epoch = progress_epoch_;
      const int64_t seq = collective_seq_;
      const int64_t total = total_steps_;
      lock.unlock();
      if (!batch.empty() && !Send(batch)) {
        lock.lock();
        // Put them back in front, in order, for the next try.
        for (auto it = batch.rbegin(); it != batch.rend(); ++it) records_.push_front(*it);
        lock.unlock();
        std::this_thread::sleep_for(milliseconds(200));
      }
      if (beat) {
        SendProgress(step, epoch, seq, total);
        next_beat = SteadyClock::now() + milliseconds(1000);
      }
      lock.lock();
    }
  }

  bool Send(const std::vector<v1::MetricRecord>& batch) {
    grpc::ClientContext context;
    rpc::PrepareContext(&context, options_.token, kRpcTimeout);
    v1::StreamMetricsResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::StreamMetricsRequest>> writer =
        stub_->StreamMetrics(&context, &response);
    v1::StreamMetricsRequest request;
    request.set_job_id(options_.job_id);
    request.set_generation(options_.generation);
    request.set_rank(options_.rank);
    for (const v1::MetricRecord& r : batch) *request.add_records() = r;
    writer->Write(request);
    writer->WritesDone();
    grpc::Status status = writer->Finish();
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      superseded_ = true;
      return true;  // nobody wants them any more
    }
    return status.ok();
  }

  void SendProgress(int64_t step, int32_t epoch, int64_t seq, int64_t total) {
    grpc::ClientContext context;
    rpc::PrepareContext(&context, options_.token, kRpcTimeout);
    v1::ReportProgressRequest request;
    request.set_job_id(options_.job_id);
    request.set_generation(options_.generation);
    request.set_rank(options_.rank);
    request.set_step(step);
    request.set_epoch(epoch);
    request.set_collective_seq(seq);
    request.set_total_steps(total);
    v1::ReportProgressResponse response;
    grpc::Status status = stub_->ReportProgress(&context, request, &response);
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION || response.stop()) {
      superseded_ = true;
    }
  }

  std::shared_ptr<Stub> stub_;
  const TrainerOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::MetricRecord> records_;
  int64_t dropped_ = 0;
  int64_t progress_step_ = -1;
  int32_t progress_epoch_ = 0;
  int64_t collective_seq_ = 0;
  int64_t total_steps_ = 0;
  bool closing_ = false;
  SteadyClock::time_point close_deadline_;
  std::atomic<bool> superseded_{false};
  std::thread thread_;
};

// Joins the rendezvous, retrying while the coordinator is unreachable.
absl::StatusOr<v1::JoinRendezvousResponse> Join(Stub* stub, const TrainerOptions& options) {
  const SteadyClock::time_point deadline = SteadyClock::now() + std::chrono::minutes(30);
  milliseconds backoff{100};
  while (true) {
    grpc::ClientContext context;
    // The coordinator answers at the job's rendezvous timeout at the latest.
    rpc::PrepareContext(&context, options.token, std::chrono::hours(24));
    v1::JoinRendezvousRequest request;
    request.set_job_id(options.job_id);
    request.set_generation(options.generation);
    request.set_rank(options.rank);
    request.set_worker_id(options.worker_id);
    request.set_address(options.host);
    v1::JoinRendezvousResponse response;
    grpc::Status status = stub->JoinRendezvous(&context, request, &response);
    if (status.ok()) return response;
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE ||
        SteadyClock::now() + backoff > deadline) {
      return rpc::FromGrpcStatus(status);
    }
    AIDN_LOG(WARNING) << "coordinator unreachable, retrying the rendezvous: "
                      << status.error_message();
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, milliseconds(2000));
  }
}

engine::ModelConfig ModelConfigOf(const v1::JobSpec& spec) {
  engine::ModelConfig config;
  config.name = spec.model().name();
  config.hidden_sizes.assign(spec.model().hidden_sizes().begin(),
                             spec.model().hidden_sizes().end());
  config.dropout = spec.model().dropout();
  return config;
}

engine::OptimizerConfig OptimizerConfigOf(const v1::JobSpec& spec) {
  const v1::OptimizerSpec& o = spec.optimizer();
  engine::OptimizerConfig config;
  config.name = o.name();
  config.lr = o.lr();
  config.momentum = o.momentum();
  config.nesterov = o.nesterov();
  config.weight_decay = o.weight_decay();
  config.beta1 = o.beta1();
  config.beta2 = o.beta2();
  config.eps = o.eps();
  config.grad_clip_norm = o.grad_clip_norm();
  return config;
}

engine::LrScheduleConfig ScheduleOf(const v1::JobSpec& spec) {
  const v1::LrScheduleSpec& s = spec.lr_schedule();
  engine::LrScheduleConfig config;
  switch (s.kind()) {
    case v1::LrScheduleSpec::STEP:
      config.kind = engine::LrScheduleConfig::Kind::kStep;
      break;
    case v1::LrScheduleSpec::COSINE:
      config.kind = engine::LrScheduleConfig::Kind::kCosine;
      break;
    default:
      config.kind = engine::LrScheduleConfig::Kind::kConstant;
  }
  config.warmup_steps = s.warmup_steps();
  config.step_size = s.step_size();
  config.gamma = s.gamma();
  config.min_lr = s.min_lr();
  return config;
}

// Loads the train and test sets named by the spec. Every error here is
// permanent: no restart makes a missing or corrupt file appear.
absl::Status LoadData(const v1::DatasetSpec& spec, engine::Dataset* train, engine::Dataset* test) {
  absl::StatusOr<engine::Dataset> tr, te;
  if (spec.kind() == "idx") {
    tr = engine::LoadIdx(spec.train_images(), spec.train_labels(), engine::kFashionMnistMean,
                         engine::kFashionMnistStd);
    if (tr.ok()) {
      te = engine::LoadIdx(spec.test_images(), spec.test_labels(), engine::kFashionMnistMean,
                           engine::kFashionMnistStd);
    }
  } else {
    tr = engine::LoadFashionMnist(spec.dir(), /*train=*/true);
    if (tr.ok()) te = engine::LoadFashionMnist(spec.dir(), /*train=*/false);
  }
  if (!tr.ok()) return tr.status();
  if (!te.ok()) return te.status();
  *train = *std::move(tr);
  *test = *std::move(te);
  return absl::OkStatus();
}

class Run {
 public:
  Run(const TrainerOptions& options, std::shared_ptr<Stub> stub)
      : options_(options), stub_(std::move(stub)) {}

  // 0 on success, else the failure.
  std::optional<Failure> Execute();

 private:
  std::optional<Failure> Setup();
  std::optional<Failure> Evaluate(int32_t epoch, int64_t step);

  const TrainerOptions options_;
  std::shared_ptr<Stub> stub_;
  v1::JoinRendezvousResponse rendezvous_;
  v1::JobSpec spec_;
  engine::Dataset train_, test_;
  std::unique_ptr<engine::Sequential> model_;
  std::unique_ptr<engine::Communicator> comm_;
  std::unique_ptr<engine::Optimizer> optimizer_;
  std::unique_ptr<engine::DdpReducer> reducer_;
  std::unique_ptr<Reporter> reporter_;
};

std::optional<Failure> Run::Setup() {
  absl::StatusOr<v1::JoinRendezvousResponse> joined = Join(stub_.get(), options_);
  if (!joined.ok()) return FailureFor(joined.status(), "rendezvous");
  rendezvous_ = *std::move(joined);
  spec_ = rendezvous_.spec();
  AIDN_LOG(INFO) << "joined the rendezvous" << Kv("job", options_.job_id)
                 << Kv("generation", options_.generation) << Kv("rank", rendezvous_.rank())
                 << Kv("world_size", rendezvous_.world_size());
  reporter_ = std::make_unique<Reporter>(stub_, options_);

  engine::ConfigureCpu(std::max(1, options_.threads));
  if (absl::Status s = LoadData(spec_.dataset(), &train_, &test_); !s.ok()) {
    return Failure{kExitPermanent, absl::Status(s.code(), absl::StrCat("dataset: ", s.message()))};
  }
  absl::StatusOr<std::unique_ptr<engine::Sequential>> model =
      engine::BuildModel(ModelConfigOf(spec_), spec_.seed());
  if (!model.ok()) return Failure{kExitPermanent, model.status()};
  model_ = *std::move(model);

  // Gloo's rendezvous goes through the coordinator's KV store for this
  // generation; a stale generation is refused there.
  const milliseconds timeout =
      std::max(milliseconds(30'000), ToMillis(spec_.timeouts().rendezvous()));
  auto store = std::make_shared<CoordinatorStore>(stub_, options_.token, options_.job_id,
                                                  options_.generation, timeout);
  engine::GlooOptions gloo;
  gloo.rank = rendezvous_.rank();
  gloo.world_size = rendezvous_.world_size();
  gloo.host = options_.host;
  gloo.timeout = timeout;
  gloo.prefix = "gloo";
  absl::StatusOr<std::unique_ptr<engine::Communicator>> comm =
      engine::CreateGlooCommunicator(gloo, store);
  if (!comm.ok()) return FailureFor(comm.status(), "communicator");
  comm_ = *std::move(comm);

  if (absl::Status s = engine::DdpReducer::BroadcastParameters(model_->Parameters(), comm_.get());
      !s.ok()) {
    return FailureFor(s, "initial weights");
  }
  absl::StatusOr<std::unique_ptr<engine::Optimizer>> optimizer =
      engine::Optimizer::Create(OptimizerConfigOf(spec_), model_->Parameters());
  if (!optimizer.ok()) return Failure{kExitPermanent, optimizer.status()};
  optimizer_ = *std::move(optimizer);
  absl::StatusOr<std::unique_ptr<engine::DdpReducer>> reducer =
      engine::DdpReducer::Create({.bucket_mb = spec_.has_bucket_mb() ? spec_.bucket_mb() : 25.0},
                                 model_->Parameters(), comm_.get());
  if (!reducer.ok()) return Failure{kExitPermanent, reducer.status()};
  reducer_ = *std::move(reducer);
  engine::DdpReducer* r = reducer_.get();
  model_->SetGradReadyCallback([r](engine::Parameter* p) { r->OnGradReady(p); });
  return std::nullopt;
}

std::optional<Failure> Run::Evaluate(int32_t epoch, int64_t step) {
  // Each rank takes every world_size-th test sample; the sums are combined.
  const int world = rendezvous_.world_size();
  std::vector<int64_t> mine;
  for (int64_t i = rendezvous_.rank(); i < test_.size; i += world) mine.push_back(i);
  engine::Tensor images, logits, grad;
  std::vector<int32_t> labels;
  double loss_sum = 0;
  int64_t correct = 0;
  constexpr size_t kEvalBatch = 256;  // bounds the CNN's im2col buffers
  for (size_t begin = 0; begin < mine.size(); begin += kEvalBatch) {
    const size_t count = std::min(kEvalBatch, mine.size() - begin);
    engine::GatherBatch(test_, mine, begin, count, &images, &labels);
    model_->Forward(images, &logits, /*training=*/false);
    loss_sum += engine::SoftmaxCrossEntropy(logits, labels, &grad) * static_cast<double>(count);
    correct += engine::CountCorrect(logits, labels);
  }
  float sums[3] = {static_cast<float>(loss_sum), static_cast<float>(correct),
                   static_cast<float>(mine.size())};
  if (absl::Status s = comm_->AllReduce(sums, 3, engine::ReduceOp::kSum); !s.ok()) {
    return FailureFor(s, "evaluation");
  }
  v1::MetricRecord record;
  record.set_kind(v1::MetricRecord::EVAL);
  record.set_step(step);
  record.set_epoch(epoch);
  record.set_test_loss(sums[0] / sums[2]);
  record.set_test_accuracy(sums[1] / sums[2]);
  *record.mutable_time() = Now();
  if (rendezvous_.rank() == 0) {
    std::printf("epoch %d | test loss %.4f | test accuracy %.4f\n", epoch, sums[0] / sums[2],
                sums[1] / sums[2]);
    std::fflush(stdout);
  }
  reporter_->Record(std::move(record));
  return std::nullopt;
}

std::optional<Failure> Run::Execute() {
  if (std::optional<Failure> f = Setup(); f.has_value()) return f;
  const int world = rendezvous_.world_size();
  const int rank = rendezvous_.rank();
  const int64_t batch = spec_.batch_size();
  const int64_t accum = std::max(1, spec_.grad_accum_steps());
  engine::DistributedSampler sampler(train_.size, world, rank, spec_.dataset().shuffle(),
                                     spec_.seed(), spec_.dataset().drop_last());
  // Whole optimizer steps per epoch; the tail that does not fill one is
  // left out (every rank runs the same number of steps).
  const int64_t steps_per_epoch = sampler.num_samples() / (batch * accum);
  if (steps_per_epoch <= 0) {
    return Failure{kExitPermanent, absl::InvalidArgumentError(absl::StrCat(
                                       "batch_size x grad_accum_steps (", batch * accum,
                                       ") is larger than this rank's share of the data (",
                                       sampler.num_samples(), ")"))};
  }
  int64_t total_steps = spec_.epochs() > 0 ? spec_.epochs() * steps_per_epoch : INT64_MAX;
  if (spec_.max_steps() > 0) total_steps = std::min(total_steps, spec_.max_steps());
  const engine::LrScheduleConfig schedule = ScheduleOf(spec_);
  const double base_lr = spec_.optimizer().lr();
  const int64_t log_every = std::max<int64_t>(1, std::min<int64_t>(100, total_steps / 20));

  engine::Tensor images, logits, grad_logits;
  std::vector<int32_t> labels;
  std::vector<int64_t> indices;
  int32_t epoch = -1;
  // Tells the coordinator how long the job is before the first step ends.
  reporter_->Progress(0, 0, comm_->sequence(), total_steps);
  for (int64_t step = 0; step < total_steps; ++step) {
    if (reporter_->superseded()) {
      return Failure{kExitSuperseded,
                     absl::FailedPreconditionError("the coordinator ended this generation")};
    }
    const int32_t step_epoch = static_cast<int32_t>(step / steps_per_epoch);
    if (step_epoch != epoch) {
      epoch = step_epoch;
      indices = sampler.EpochIndices(epoch);
    }
    const SteadyClock::time_point start = SteadyClock::now();
    model_->ZeroGrad();
    double loss = 0;
    double wait_s = 0, allreduce_s = 0;
    const int64_t first = (step % steps_per_epoch) * batch * accum;
    for (int64_t micro = 0; micro < accum; ++micro) {
      engine::GatherBatch(train_, indices, static_cast<size_t>(first + micro * batch),
                          static_cast<size_t>(batch), &images, &labels);
      model_->SetSeed(spec_.seed() * 1'000'003 +
                      static_cast<uint64_t>(step * accum + micro) * static_cast<uint64_t>(world) +
                      static_cast<uint64_t>(rank));
      model_->Forward(images, &logits, /*training=*/true);
      const double micro_loss = engine::SoftmaxCrossEntropy(logits, labels, &grad_logits,
                                                            1.0 / static_cast<double>(accum));
      loss += micro_loss / static_cast<double>(accum);
      const bool last = micro == accum - 1;
      reducer_->BeginBackward(last, last ? static_cast<float>(loss) : 0.0f);
      model_->Backward(grad_logits);
    }
    if (absl::Status s = reducer_->Finish(&wait_s, &allreduce_s); !s.ok()) {
      return FailureFor(s, "gradient allreduce");
    }
    const double mean_loss = reducer_->averaged_extra();
    // Clipping (optimizer.grad_clip_norm) happens inside Step, fused with
    // the update.
    const double lr = engine::LearningRate(schedule, base_lr, step, total_steps);
    if (absl::Status s = optimizer_->Step(lr); !s.ok()) return FailureFor(s, "optimizer");
    const double step_s = SecondsSince(start);

    v1::MetricRecord record;
    record.set_kind(v1::MetricRecord::TRAIN);
    record.set_step(step + 1);
    // Epochs are counted from 1 in records and progress, as people count
    // them: steps of the first epoch and its evaluation both say 1.
    record.set_epoch(epoch + 1);
    record.set_loss(mean_loss);
    record.set_samples(batch * accum);
    record.set_step_seconds(step_s);
    record.set_allreduce_seconds(allreduce_s);
    record.set_lr(lr);
    *record.mutable_time() = Now();
    reporter_->Record(std::move(record));
    reporter_->Progress(step + 1, epoch + 1, comm_->sequence(), total_steps);
    if (rank == 0 && ((step + 1) % log_every == 0 || step + 1 == total_steps)) {
      std::printf("step %lld/%lld | loss %.4f | %.1f ms | %.0f samples/s | allreduce %.1f ms\n",
                  static_cast<long long>(step + 1), static_cast<long long>(total_steps), mean_loss,
                  step_s * 1e3, static_cast<double>(batch * accum * world) / std::max(step_s, 1e-9),
                  allreduce_s * 1e3);
      std::fflush(stdout);
    }
    const bool epoch_done = (step + 1) % steps_per_epoch == 0;
    if (epoch_done || step + 1 == total_steps) {
      if (std::optional<Failure> f = Evaluate(epoch + 1, step + 1); f.has_value()) return f;
    }
  }
  reporter_->Close(milliseconds(10'000));
  return std::nullopt;
}

}  // namespace

int RunTrainer(const TrainerOptions& options) {
  rpc::ChannelOptions channel;
  channel.address = options.coordinator;
  std::shared_ptr<Stub> stub = v1::ClusterService::NewStub(rpc::MakeChannel(channel));
  Run run(options, std::move(stub));
  std::optional<Failure> failure = run.Execute();
  if (!failure.has_value()) {
    AIDN_LOG(INFO) << "training finished" << Kv("job", options.job_id) << Kv("rank", options.rank);
    return kExitOk;
  }
  // The last stderr line is what the coordinator shows as the reason.
  AIDN_LOG(ERROR) << "trainer failed: " << failure->status;
  return failure->exit_code;
}

}  // namespace aidn::trainer
