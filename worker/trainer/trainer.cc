#include "worker/trainer/trainer.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "common/digest.h"
#include "common/log.h"
#include "common/rpc/client.h"
#include "common/rpc/status_convert.h"
#include "common/status.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/comm/cpu_communicator.h"
#include "worker/engine/cpu.h"
#include "worker/engine/data.h"
#include "worker/engine/ddp.h"
#include "worker/engine/device.h"
#include "worker/engine/gpu_session.h"
#include "worker/engine/loss.h"
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

bool Retryable(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
         status.error_code() == grpc::StatusCode::CANCELLED;
}

// Sends metric records (batched), checkpoint commits and progress beats from
// a thread of its own, so training never waits on the coordinator. What
// cannot be sent is kept (records bounded: the oldest are dropped and
// counted) and retried with the coordinator's return. Records stay held
// until the coordinator says they are in its database (durable_step), and
// all those not yet there are sent again when it restarted (a new
// incarnation), so a coordinator crash loses no step.
class Reporter {
 public:
  // Called (on the reporter's thread) with the steps whose checkpoint
  // directories retention dropped.
  using RetireFn = std::function<void(int64_t step)>;

  Reporter(std::shared_ptr<grpc::Channel> channel, std::shared_ptr<Stub> stub,
           const TrainerOptions& options, RetireFn retire)
      : channel_(std::move(channel)),
        stub_(std::move(stub)),
        options_(options),
        retire_(std::move(retire)),
        thread_([this] { Loop(); }) {}

  ~Reporter() { Close(milliseconds(5000)); }

  void Record(v1::MetricRecord record) {
    std::lock_guard<std::mutex> lock(mu_);
    if (records_.size() + unacked_.size() >= kMaxBuffered) {
      // Sent but unconfirmed ones go first: they most likely arrived.
      if (!unacked_.empty()) {
        unacked_.pop_front();
      } else {
        records_.pop_front();
        ++dropped_;
      }
    }
    records_.push_back(std::move(record));
  }

  // Queues a commit; commits are sent in order and retried until the
  // coordinator answers. Bounded like the records: while the coordinator is
  // away only the newest commits matter (a resume takes the newest).
  void Commit(v1::CommitCheckpointRequest request) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (commits_.size() >= kMaxCommits) {
        commits_.pop_front();
        ++dropped_commits_;
      }
      commits_.push_back(std::move(request));
    }
    cv_.notify_all();
  }

  void Progress(int64_t step, int32_t epoch, int64_t collective_seq, int64_t total_steps) {
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      first = progress_step_ < 0;
      total_steps_ = total_steps;
      progress_step_ = step;
      progress_epoch_ = epoch;
      collective_seq_ = collective_seq;
      if (first) first_beat_ = true;
    }
    // The first beat goes at once: until every rank has sent one the
    // coordinator counts the generation as still setting up.
    if (first) cv_.notify_all();
  }

  // The coordinator said this generation is over.
  bool superseded() const { return superseded_.load(); }

  // Sends what is left (records and commits, within `timeout`) and stops
  // the thread.
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
    if (dropped_commits_ > 0) {
      AIDN_LOG(WARNING) << "checkpoint commits dropped while the coordinator was away"
                        << Kv("dropped", dropped_commits_);
    }
  }

 private:
  static constexpr size_t kMaxBuffered = 100'000;
  // Records go once a second, on one StreamMetrics call of messages of up
  // to kBatch records each, at most kMaxPerCall records a call. Once a
  // second rather than more often: each call costs the coordinator far more
  // than its records do (at 1,000 ranks, five calls a second each took
  // half of its CPU), a live view refreshes once a second anyway, and
  // progress beats, which drive failure detection, go on their own.
  static constexpr milliseconds kReportPeriod{1000};
  static constexpr size_t kBatch = 512;
  static constexpr size_t kMaxPerCall = 16 * kBatch;
  static constexpr size_t kMaxCommits = 1024;

  void Loop() {
    SteadyClock::time_point next_beat = SteadyClock::now();
    SteadyClock::time_point next_send = SteadyClock::now() + kReportPeriod;
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      // Until the first beat (Progress wakes us for it) only records are due.
      const SteadyClock::time_point due =
          progress_step_ >= 0 ? std::min(next_send, next_beat) : next_send;
      cv_.wait_until(lock, due, [this] { return closing_ || !commits_.empty() || first_beat_; });
      first_beat_ = false;
      const bool closing = closing_;
      if (closing &&
          ((records_.empty() && commits_.empty()) || SteadyClock::now() > close_deadline_)) {
        break;
      }
      std::optional<v1::CommitCheckpointRequest> commit;
      if (!commits_.empty()) commit = commits_.front();
      std::vector<v1::MetricRecord> batch;
      const SteadyClock::time_point now = SteadyClock::now();
      if (closing || now >= next_send) {
        while (!records_.empty() && batch.size() < kMaxPerCall) {
          batch.push_back(std::move(records_.front()));
          records_.pop_front();
        }
        // A backlog (after an outage) goes call after call.
        next_send = records_.empty() ? now + kReportPeriod : now;
      }
      const bool beat = now >= next_beat && progress_step_ >= 0;
      const int64_t step = progress_step_;
      const int32_t epoch = progress_epoch_;
      const int64_t seq = collective_seq_;
      const int64_t total = total_steps_;
      lock.unlock();
      bool failed = false;
      if (commit.has_value()) {
        if (SendCommit(*commit)) {
          std::lock_guard<std::mutex> relock(mu_);
          commits_.pop_front();
        } else {
          failed = true;
        }
      }
      if (!batch.empty() && !Send(batch)) {
        lock.lock();
        // Put them back in front, in order, for the next try.
        for (auto it = batch.rbegin(); it != batch.rend(); ++it) records_.push_front(*it);
        lock.unlock();
        failed = true;
      }
      if (failed) std::this_thread::sleep_for(milliseconds(200));
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
    for (size_t first = 0; first < batch.size(); first += kBatch) {
      v1::StreamMetricsRequest request;
      request.set_job_id(options_.job_id);
      request.set_generation(options_.generation);
      request.set_rank(options_.rank);
      const size_t end = std::min(batch.size(), first + kBatch);
      for (size_t i = first; i < end; ++i) *request.add_records() = batch[i];
      if (!writer->Write(request)) break;  // the call failed; Finish says why
    }
    writer->WritesDone();
    grpc::Status status = writer->Finish();
    rpc::ResetBackoffAfter(status, channel_.get());
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      superseded_ = true;
      return true;  // nobody wants them any more
    }
    if (!status.ok()) return false;
    std::lock_guard<std::mutex> lock(mu_);
    for (const v1::MetricRecord& r : batch) unacked_.push_back(r);
    SeenIncarnationLocked(response.incarnation());
    const int64_t durable = response.durable_step();
    unacked_.erase(
        std::remove_if(unacked_.begin(), unacked_.end(),
                       [durable](const v1::MetricRecord& r) { return r.step() <= durable; }),
        unacked_.end());
    return true;
  }

  // A new incarnation is a restarted coordinator: whatever it had not
  // stored is gone, so every unconfirmed record goes again (it ignores the
  // ones it has).
  void SeenIncarnationLocked(const std::string& incarnation) {
    if (incarnation.empty()) return;
    if (!incarnation_.empty() && incarnation != incarnation_) {
      AIDN_LOG(INFO) << "the coordinator restarted; sending unconfirmed metric records again"
                     << Kv("records", unacked_.size());
      records_.insert(records_.begin(), unacked_.begin(), unacked_.end());
      unacked_.clear();
    }
    incarnation_ = incarnation;
  }

  // True when done with (answered, or never to be answered).
  bool SendCommit(const v1::CommitCheckpointRequest& request) {
    grpc::ClientContext context;
    rpc::PrepareContext(&context, options_.token, kRpcTimeout);
    v1::CommitCheckpointResponse response;
    grpc::Status status = stub_->CommitCheckpoint(&context, request, &response);
    rpc::ResetBackoffAfter(status, channel_.get());
    if (Retryable(status)) return false;
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      superseded_ = true;
      return true;
    }
    if (!status.ok()) {
      AIDN_LOG(ERROR) << "checkpoint commit refused: " << status.error_message()
                      << Kv("step", request.step());
      return true;
    }
    AIDN_LOG(INFO) << "checkpoint reported" << Kv("step", request.step())
                   << Kv("committed", response.committed() ? "yes" : "no");
    for (int64_t step : response.retired_steps()) {
      if (retire_) retire_(step);
    }
    return true;
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
    rpc::ResetBackoffAfter(status, channel_.get());
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION || response.stop()) {
      superseded_ = true;
    }
    if (status.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      SeenIncarnationLocked(response.incarnation());
    }
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<Stub> stub_;
  const TrainerOptions options_;
  const RetireFn retire_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::MetricRecord> records_;
  // Sent, but not yet reported stored by the coordinator.
  std::deque<v1::MetricRecord> unacked_;
  std::deque<v1::CommitCheckpointRequest> commits_;
  std::string incarnation_;
  int64_t dropped_ = 0;
  int64_t dropped_commits_ = 0;
  bool first_beat_ = false;
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
absl::StatusOr<v1::JoinRendezvousResponse> Join(grpc::Channel* channel, Stub* stub,
                                                const TrainerOptions& options) {
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
    rpc::ResetBackoffAfter(status, channel);
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
absl::Status LoadData(const v1::DatasetSpec& spec, const std::string& cache_dir,
                      engine::Dataset* train, engine::Dataset* test) {
  // Through the worker's cache of inflated files when there is one; an
  // error is reported from the files the spec names.
  auto load = [&cache_dir](const std::string& images, const std::string& labels) {
    if (!cache_dir.empty()) {
      absl::StatusOr<engine::Dataset> cached = engine::LoadIdx(
          engine::DecompressedPath(images, cache_dir), engine::DecompressedPath(labels, cache_dir),
          engine::kFashionMnistMean, engine::kFashionMnistStd);
      if (cached.ok()) return cached;
    }
    return engine::LoadIdx(images, labels, engine::kFashionMnistMean, engine::kFashionMnistStd);
  };
  absl::StatusOr<engine::Dataset> tr, te;
  if (spec.kind() == "idx") {
    tr = load(spec.train_images(), spec.train_labels());
    if (tr.ok()) te = load(spec.test_images(), spec.test_labels());
  } else {
    tr = engine::LoadFashionMnist(spec.dir(), /*train=*/true, cache_dir);
    if (tr.ok()) te = engine::LoadFashionMnist(spec.dir(), /*train=*/false, cache_dir);
  }
  if (!tr.ok()) return tr.status();
  if (!te.ok()) return te.status();
  *train = *std::move(tr);
  *test = *std::move(te);
  return absl::OkStatus();
}

// Where this job's checkpoints go on this worker: <checkpoint.dir>/<job>,
// a relative checkpoint.dir taken under the worker's checkpoint root. Empty
// when the spec asks for none.
std::string CheckpointDirOf(const v1::JobSpec& spec, const TrainerOptions& options) {
  const std::string& dir = spec.checkpoint().dir();
  if (dir.empty()) return "";
  std::filesystem::path path(dir);
  if (path.is_relative()) {
    path = std::filesystem::path(options.checkpoint_root.empty() ? options.work_dir
                                                                 : options.checkpoint_root) /
           path;
  }
  return (path / options.job_id).lexically_normal().string();
}

// int64 values through a float collective: the bits travel unchanged
// (broadcast copies, it never adds).
absl::Status BroadcastInts(engine::Communicator* comm, int64_t* values, size_t count) {
  std::vector<float> buffer(count * 2);
  std::memcpy(buffer.data(), values, count * sizeof(int64_t));
  AIDN_RETURN_IF_ERROR(comm->Broadcast(buffer.data(), buffer.size(), 0));
  std::memcpy(values, buffer.data(), count * sizeof(int64_t));
  return absl::OkStatus();
}

class Run {
 public:
  Run(const TrainerOptions& options, std::shared_ptr<grpc::Channel> channel)
      : options_(options), channel_(channel), stub_(v1::ClusterService::NewStub(channel)) {}

  // 0 on success, else the failure.
  std::optional<Failure> Execute();

 private:
  std::optional<Failure> Setup();
  // Rank 0 loads the newest candidate checkpoint that verifies (reporting
  // each one that does not); every rank then gets its step, weights and
  // optimizer state from rank 0, so only rank 0's node needs the files.
  std::optional<Failure> Resume(int64_t steps_per_epoch);
  // DDP: rank 0 writes the state after `step`, and commits it in the
  // background.
  std::optional<Failure> Checkpoint(int64_t step, int64_t steps_per_epoch, int64_t total_steps);
  void ReportInvalid(const v1::Checkpoint& checkpoint, const std::string& path,
                     const absl::Status& why);
  std::optional<Failure> Evaluate(int32_t epoch, int64_t step);
  // device: gpu: mirrors the CPU model (weights after the broadcast or the
  // resume) and the resumed optimizer state onto the GPU.
  std::optional<Failure> SetupGpu();
  // device: gpu: the GPU's weights (and optimizer state) into the CPU copies.
  std::optional<Failure> SyncFromGpu(bool optimizer_state);
  // Collectives completed, CPU and GPU ones together.
  int64_t CollectiveSequence() const {
    return comm_->sequence() + (gpu_ != nullptr ? gpu_->collective_sequence() : 0);
  }

  const TrainerOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<Stub> stub_;
  v1::JoinRendezvousResponse rendezvous_;
  v1::JobSpec spec_;
  engine::Dataset train_, test_;
  std::unique_ptr<engine::Sequential> model_;
  std::unique_ptr<engine::Communicator> comm_;
  std::unique_ptr<engine::Optimizer> optimizer_;
  std::unique_ptr<engine::DdpReducer> reducer_;
  std::unique_ptr<Reporter> reporter_;
  // device: gpu: the step runs here; model_ and optimizer_ stay the CPU
  // copies that checkpoints, resumes and evaluation use (SyncFromGpu).
  std::shared_ptr<CoordinatorStore> kv_;
  std::unique_ptr<engine::GpuSession> gpu_;
  std::string checkpoint_dir_;
  // The step training starts after: 0, or the resumed checkpoint's.
  int64_t start_step_ = 0;
  // Loaded by rank 0 in Setup, handed to the optimizer in Resume.
  std::optional<engine::LoadedCheckpoint> loaded_;
  // fp16: the resumed checkpoint's loss scaler, for SetupGpu.
  std::optional<engine::LossScaleState> resumed_loss_scale_;
};

std::optional<Failure> Run::Setup() {
  absl::StatusOr<v1::JoinRendezvousResponse> joined = Join(channel_.get(), stub_.get(), options_);
  if (!joined.ok()) return FailureFor(joined.status(), "rendezvous");
  rendezvous_ = *std::move(joined);
  spec_ = rendezvous_.spec();
  AIDN_LOG(INFO) << "joined the rendezvous" << Kv("job", options_.job_id)
                 << Kv("generation", options_.generation) << Kv("rank", rendezvous_.rank())
                 << Kv("world_size", rendezvous_.world_size());
  checkpoint_dir_ = CheckpointDirOf(spec_, options_);
  if (!checkpoint_dir_.empty() && rendezvous_.rank() == 0) {
    // A directory that cannot be made is no passing trouble: fail for good.
    std::error_code error;
    std::filesystem::create_directories(checkpoint_dir_, error);
    if (error) {
      return Failure{kExitPermanent, absl::FailedPreconditionError(
                                         absl::StrCat("checkpoint.dir: cannot create ",
                                                      checkpoint_dir_, ": ", error.message()))};
    }
    // Left by a writer killed half way; no writer runs now.
    if (absl::Status s = engine::RemoveTemporaries(checkpoint_dir_); !s.ok()) {
      AIDN_LOG(WARNING) << "could not clear unfinished checkpoints: " << s;
    }
  }
  const std::string dir = checkpoint_dir_;
  reporter_ = std::make_unique<Reporter>(channel_, stub_, options_, [dir](int64_t step) {
    if (absl::Status s = engine::RemoveCheckpoint(dir, step); !s.ok()) {
      AIDN_LOG(WARNING) << "retention: " << s;
    } else {
      AIDN_LOG(INFO) << "retention removed a checkpoint" << Kv("step", step);
    }
  });

  if (spec_.device() == v1::JobSpec::GPU) {
    engine::DeviceInventory devices = engine::DiscoverDevices();
    if (devices.gpus.empty()) {
      return Failure{kExitPermanent,
                     absl::FailedPreconditionError(absl::StrCat(
                         "device: gpu: this trainer sees no GPU (", devices.gpu_note, ")"))};
    }
  }
  engine::ConfigureCpu(std::max(1, options_.threads));
  if (absl::Status s = LoadData(spec_.dataset(), options_.cache_dir, &train_, &test_); !s.ok()) {
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
  kv_ = store;
  engine::CpuCommunicatorOptions comm_options;
  engine::GlooOptions& gloo = comm_options.gloo;
  gloo.rank = rendezvous_.rank();
  gloo.world_size = rendezvous_.world_size();
  gloo.host = options_.host;
  gloo.timeout = timeout;
  gloo.prefix = "gloo";
  switch (spec_.comm_backend()) {
    case v1::JobSpec::GLOO:
      comm_options.transport = engine::CpuTransport::kGloo;
      break;
    case v1::JobSpec::SHM:
      comm_options.transport = engine::CpuTransport::kShm;
      break;
    default:
      comm_options.transport = engine::CpuTransport::kAuto;
  }
  absl::StatusOr<engine::CpuCommunicator> comm =
      engine::CreateCpuCommunicator(comm_options, store.get());
  if (!comm.ok()) return FailureFor(comm.status(), "communicator");
  AIDN_LOG(INFO) << "communicator ready" << Kv("transport", comm->transport)
                 << Kv("why", comm->description);
  comm_ = std::move(comm->communicator);

  if (rendezvous_.rank() == 0 && !checkpoint_dir_.empty()) {
    for (const v1::Checkpoint& candidate : rendezvous_.resume_candidates()) {
      const std::string path =
          absl::StrCat(checkpoint_dir_, "/", engine::CheckpointDirName(candidate.step()));
      absl::StatusOr<engine::LoadedCheckpoint> loaded =
          engine::LoadCheckpoint(path, model_->Parameters());
      if (loaded.ok() && loaded->step != candidate.step()) {
        loaded = absl::DataLossError(absl::StrCat("MANIFEST: says step ", loaded->step));
      }
      if (loaded.ok()) {
        AIDN_LOG(INFO) << "resuming from a checkpoint" << Kv("step", candidate.step())
                       << Kv("path", path);
        loaded_ = *std::move(loaded);
        break;
      }
      ReportInvalid(candidate, path, loaded.status());
    }
  }
  // Rank 0's weights, loaded or fresh, become everyone's.
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

void Run::ReportInvalid(const v1::Checkpoint& checkpoint, const std::string& path,
                        const absl::Status& why) {
  const std::string reason = absl::StrCat(path, ": ", why.message());
  AIDN_LOG(WARNING) << "skipping a checkpoint that fails verification: " << reason;
  v1::ReportCheckpointInvalidRequest request;
  request.set_job_id(options_.job_id);
  request.set_generation(options_.generation);
  request.set_rank(rendezvous_.rank());
  request.set_step(checkpoint.step());
  request.set_reason(reason);
  milliseconds backoff{100};
  for (int attempt = 0; attempt < 8; ++attempt) {
    grpc::ClientContext context;
    rpc::PrepareContext(&context, options_.token, kRpcTimeout);
    v1::ReportCheckpointInvalidResponse response;
    grpc::Status status = stub_->ReportCheckpointInvalid(&context, request, &response);
    rpc::ResetBackoffAfter(status, channel_.get());
    if (!Retryable(status)) {
      if (!status.ok()) {
        AIDN_LOG(WARNING) << "could not report the bad checkpoint: " << status.error_message();
      }
      return;
    }
    std::this_thread::sleep_for(backoff);
    backoff *= 2;
  }
}

std::optional<Failure> Run::Resume(int64_t steps_per_epoch) {
  // [resume step, optimizer steps, steps per epoch, world size, fp16 loss
  // scale's bits (0: none), its growth tracker] from rank 0.
  int64_t header[6] = {0, 0, steps_per_epoch, rendezvous_.world_size(), 0, 0};
  if (loaded_.has_value()) {
    header[0] = loaded_->step;
    auto get = [this](const char* key, int64_t* out) {
      auto it = loaded_->state.find(key);
      return it != loaded_->state.end() && absl::SimpleAtoi(it->second, out);
    };
    if (!get("optimizer_steps", &header[1]) || !get("steps_per_epoch", &header[2]) ||
        !get("world_size", &header[3])) {
      return Failure{kExitFailure, absl::DataLossError("checkpoint state.txt lacks a key")};
    }
    // Only fp16 checkpoints have a loss scale (older ones none: it then
    // starts again at its initial value).
    if (auto it = loaded_->state.find("loss_scale"); it != loaded_->state.end()) {
      double scale = 0;
      if (!absl::SimpleAtod(it->second, &scale) || !(scale > 0) ||
          !get("loss_scale_growth_tracker", &header[5])) {
        return Failure{kExitFailure,
                       absl::DataLossError(absl::StrCat(
                           "checkpoint state.txt: loss_scale \"", it->second,
                           "\" is not a number > 0, or loss_scale_growth_tracker is missing"))};
      }
      header[4] = std::bit_cast<int64_t>(scale);
    }
  }
  if (absl::Status s = BroadcastInts(comm_.get(), header, 6); !s.ok()) {
    return FailureFor(s, "resume");
  }
  if (header[0] == 0) return std::nullopt;
  if (header[4] != 0) {
    resumed_loss_scale_ =
        engine::LossScaleState{std::bit_cast<double>(header[4]), static_cast<int>(header[5])};
  }
  if (header[2] != steps_per_epoch || header[3] != rendezvous_.world_size()) {
    return Failure{kExitPermanent,
                   absl::FailedPreconditionError(absl::StrCat(
                       "the checkpoint of step ", header[0], " was made with ", header[3],
                       " ranks and ", header[2], " steps per epoch; this job has ",
                       rendezvous_.world_size(), " and ", steps_per_epoch))};
  }
  // Optimizer state: rank 0's loaded buffers, broadcast entry by entry in
  // the order State() lists them (the same on every rank).
  std::vector<engine::Tensor> buffers;
  std::vector<engine::Optimizer::StateEntry> entries;
  for (const engine::Optimizer::StateEntry& e : optimizer_->State()) {
    engine::Tensor t = e.second->Clone();
    if (loaded_.has_value()) {
      auto it = loaded_->optimizer_state.find(e.first);
      if (it == loaded_->optimizer_state.end() || it->second.numel() != t.numel()) {
        return Failure{kExitFailure, absl::DataLossError(absl::StrCat(
                                         "checkpoint of step ", header[0], ": optimizer state \"",
                                         e.first, "\" is missing or has the wrong size"))};
      }
      std::memcpy(t.data(), it->second.data(), static_cast<size_t>(t.numel()) * sizeof(float));
    }
    if (absl::Status s = comm_->Broadcast(t.data(), static_cast<size_t>(t.numel()), 0); !s.ok()) {
      return FailureFor(s, "resume");
    }
    buffers.push_back(std::move(t));
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    entries.emplace_back(optimizer_->State()[i].first, &buffers[i]);
  }
  if (absl::Status s = optimizer_->LoadState(entries, header[1]); !s.ok()) {
    return Failure{kExitFailure, s};
  }
  start_step_ = header[0];
  loaded_.reset();
  return std::nullopt;
}

std::optional<Failure> Run::Checkpoint(int64_t step, int64_t steps_per_epoch, int64_t total_steps) {
  if (rendezvous_.rank() != 0) return std::nullopt;  // DDP: rank 0 owns the state
  const SteadyClock::time_point start = SteadyClock::now();
  if (std::optional<Failure> f = SyncFromGpu(/*optimizer_state=*/true); f.has_value()) return f;
  engine::CheckpointContents contents;
  for (const engine::Parameter* p : model_->Parameters()) contents.model.push_back(p);
  contents.model_metadata = {{"aidn.job", options_.job_id},
                             {"aidn.step", absl::StrCat(step)},
                             {"aidn.model", spec_.model().name()}};
  for (const engine::Optimizer::StateEntry& e : optimizer_->State()) {
    contents.optimizer_state.emplace_back(e.first, e.second);
  }
  const int64_t accum = std::max(1, spec_.grad_accum_steps());
  contents.state = {
      {"step", absl::StrCat(step)},
      {"epoch", absl::StrCat(step / steps_per_epoch)},
      {"total_steps", absl::StrCat(total_steps)},
      {"steps_per_epoch", absl::StrCat(steps_per_epoch)},
      // DistributedSampler position: the epoch's permutation comes from
      // seed + epoch; this rank has used this many of its samples.
      {"sampler_epoch", absl::StrCat(step / steps_per_epoch)},
      {"sampler_offset", absl::StrCat((step % steps_per_epoch) * spec_.batch_size() * accum)},
      {"seed", absl::StrCat(spec_.seed())},
      // Dropout's generator is reseeded every micro-step from this rule, so
      // the step number is its whole state.
      {"rng", "dropout seed = seed * 1000003 + (step * accum + micro) * world_size + rank"},
      {"world_size", absl::StrCat(rendezvous_.world_size())},
      {"optimizer", spec_.optimizer().name()},
      {"optimizer_steps", absl::StrCat(optimizer_->steps())},
      {"model", spec_.model().name()},
      {"job", options_.job_id},
      {"generation", absl::StrCat(options_.generation)},
  };
  if (gpu_ != nullptr) {
    // fp16: the scale the next step would use, so that a resume does not
    // start again at 2^16 and overflow its way back down.
    if (std::optional<engine::LossScaleState> ls = gpu_->loss_scale_state(); ls.has_value()) {
      contents.state["loss_scale"] = absl::StrFormat("%.17g", ls->scale);
      contents.state["loss_scale_growth_tracker"] = absl::StrCat(ls->growth_tracker);
    }
  }
  absl::StatusOr<engine::WrittenCheckpoint> written =
      engine::WriteCheckpoint(checkpoint_dir_, step, contents);
  if (!written.ok()) return FailureFor(written.status(), "checkpoint");
  AIDN_LOG(INFO) << "checkpoint written" << Kv("step", step) << Kv("path", written->path)
                 << Kv("bytes", written->bytes)
                 << Kv("ms", static_cast<int64_t>(SecondsSince(start) * 1e3));
  v1::CommitCheckpointRequest request;
  request.set_job_id(options_.job_id);
  request.set_generation(options_.generation);
  request.set_rank(rendezvous_.rank());
  request.set_step(step);
  request.set_path(written->path);
  request.set_bytes(written->bytes);
  request.set_manifest_sha256(Sha256Hex(written->manifest));
  request.add_writer_ranks(0);
  reporter_->Commit(std::move(request));
  return std::nullopt;
}

std::optional<Failure> Run::SetupGpu() {
  engine::GpuSessionOptions o;
  o.rank = rendezvous_.rank();
  o.world_size = rendezvous_.world_size();
  o.allow_tf32 = spec_.allow_tf32();
  o.fast_convolutions = spec_.fast_convolutions();
  o.timeout = std::max(milliseconds(30'000), ToMillis(spec_.timeouts().rendezvous()));
  o.bucket_mb = spec_.has_bucket_mb() ? spec_.bucket_mb() : 25.0;
  o.cuda_graphs = spec_.cuda_graphs();
  switch (spec_.precision()) {
    case v1::JobSpec::BF16:
      o.precision = "bf16";
      break;
    case v1::JobSpec::FP16:
      o.precision = "fp16";
      break;
    default:
      o.precision = "fp32";
      break;
  }
  if (o.world_size > 1) {
    // NCCL's unique id goes through the same fenced KV as Gloo's addresses.
    o.store = kv_.get();
  }
  absl::StatusOr<std::unique_ptr<engine::GpuSession>> session =
      engine::GpuSession::Create(o, *model_, OptimizerConfigOf(spec_));
  if (!session.ok()) {
    if (session.status().code() == absl::StatusCode::kUnimplemented ||
        session.status().code() == absl::StatusCode::kInvalidArgument) {
      return Failure{kExitPermanent, session.status()};
    }
    return FailureFor(session.status(), "gpu");
  }
  gpu_ = *std::move(session);
  if (optimizer_->steps() > 0) {
    // Resumed: the CPU optimizer holds the checkpoint's state (Resume).
    std::vector<std::pair<std::string, const engine::Tensor*>> state;
    for (const engine::Optimizer::StateEntry& e : optimizer_->State()) state.push_back(e);
    if (absl::Status s = gpu_->LoadOptimizerState(state, optimizer_->steps()); !s.ok()) {
      return Failure{kExitFailure, s};
    }
  }
  if (resumed_loss_scale_.has_value() && gpu_->loss_scale_state().has_value()) {
    if (absl::Status s = gpu_->RestoreLossScale(*resumed_loss_scale_); !s.ok()) {
      return Failure{kExitFailure,
                     absl::DataLossError(absl::StrCat("resumed checkpoint: ", s.message()))};
    }
    AIDN_LOG(INFO) << "fp16 loss scale restored" << Kv("loss_scale", resumed_loss_scale_->scale)
                   << Kv("growth_tracker", resumed_loss_scale_->growth_tracker);
  }
  AIDN_LOG(INFO) << "training on the GPU" << Kv("device", gpu_->Describe());
  return std::nullopt;
}

std::optional<Failure> Run::SyncFromGpu(bool optimizer_state) {
  if (gpu_ == nullptr) return std::nullopt;
  if (absl::Status s = gpu_->CopyParametersTo(model_->Parameters()); !s.ok()) {
    return Failure{kExitFailure, s};
  }
  if (!optimizer_state) return std::nullopt;
  absl::StatusOr<std::vector<std::pair<std::string, engine::Tensor>>> state =
      gpu_->OptimizerState();
  if (!state.ok()) return Failure{kExitFailure, state.status()};
  std::vector<engine::Optimizer::StateEntry> entries;
  for (const auto& [name, tensor] : *state) entries.emplace_back(name, &tensor);
  if (absl::Status s = optimizer_->LoadState(entries, gpu_->optimizer_steps()); !s.ok()) {
    return Failure{kExitFailure, s};
  }
  return std::nullopt;
}

std::optional<Failure> Run::Evaluate(int32_t epoch, int64_t step) {
  if (std::optional<Failure> f = SyncFromGpu(/*optimizer_state=*/false); f.has_value()) return f;
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
  // Dropout's seed for micro-step `micro` of `step` (the rule state.txt's
  // "rng" line names), on either device.
  auto dropout_seed = [&](int64_t step, int64_t micro) {
    return spec_.seed() * 1'000'003 +
           static_cast<uint64_t>(step * accum + micro) * static_cast<uint64_t>(world) +
           static_cast<uint64_t>(rank);
  };
  if (std::optional<Failure> f = Resume(steps_per_epoch); f.has_value()) return f;
  if (spec_.device() == v1::JobSpec::GPU) {
    if (std::optional<Failure> f = SetupGpu(); f.has_value()) return f;
  }
  const int64_t every = spec_.checkpoint().every_steps();

  engine::Tensor images, logits, grad_logits;
  std::vector<int32_t> labels;
  // device: gpu: a step's micro-batches, all gathered before it runs.
  std::vector<engine::Tensor> gpu_images;
  std::vector<std::vector<int32_t>> gpu_labels;
  std::vector<int64_t> indices;
  int32_t epoch = -1;
  // Tells the coordinator how long the job is before the first step ends.
  reporter_->Progress(start_step_, static_cast<int32_t>(start_step_ / steps_per_epoch),
                      CollectiveSequence(), total_steps);
  for (int64_t step = start_step_; step < total_steps; ++step) {
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
    double loss = 0;
    double wait_s = 0, allreduce_s = 0;
    double mean_loss = 0;
    const double lr = engine::LearningRate(schedule, base_lr, step, total_steps);
    const int64_t first = (step % steps_per_epoch) * batch * accum;
    if (gpu_ != nullptr) {
      // The same micro-batches and dropout seeds as the CPU path below.
      gpu_images.resize(static_cast<size_t>(accum));
      gpu_labels.resize(static_cast<size_t>(accum));
      std::vector<engine::MicroBatch> micro;
      for (int64_t m = 0; m < accum; ++m) {
        const size_t at = static_cast<size_t>(m);
        engine::GatherBatch(train_, indices, static_cast<size_t>(first + m * batch),
                            static_cast<size_t>(batch), &gpu_images[at], &gpu_labels[at]);
        micro.push_back(
            engine::MicroBatch{&gpu_images[at], &gpu_labels[at], dropout_seed(step, m)});
      }
      absl::StatusOr<double> gpu_loss = gpu_->Step(micro, lr);
      if (!gpu_loss.ok()) return FailureFor(gpu_loss.status(), "gpu step");
      // This rank's loss; the coordinator averages the ranks' records.
      mean_loss = *gpu_loss;
      if (gpu_->last_step_skipped()) {
        AIDN_LOG(INFO) << "fp16: gradients overflowed, update skipped" << Kv("step", step + 1)
                       << Kv("next_loss_scale", gpu_->loss_scale_state()->scale);
      }
      allreduce_s = gpu_->last_allreduce_seconds();
      wait_s = gpu_->last_allreduce_wait_seconds();
    } else {
      model_->ZeroGrad();
      for (int64_t micro = 0; micro < accum; ++micro) {
        engine::GatherBatch(train_, indices, static_cast<size_t>(first + micro * batch),
                            static_cast<size_t>(batch), &images, &labels);
        model_->SetSeed(dropout_seed(step, micro));
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
      mean_loss = reducer_->averaged_extra();
      // Clipping (optimizer.grad_clip_norm) happens inside Step, fused with
      // the update.
      if (absl::Status s = optimizer_->Step(lr); !s.ok()) return FailureFor(s, "optimizer");
    }
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
    record.set_compute_seconds(std::max(0.0, step_s - wait_s));
    record.set_lr(lr);
    *record.mutable_time() = Now();
    reporter_->Record(std::move(record));
    reporter_->Progress(step + 1, epoch + 1, CollectiveSequence(), total_steps);
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
    if (!checkpoint_dir_.empty() &&
        ((every > 0 && (step + 1) % every == 0) || step + 1 == total_steps)) {
      if (std::optional<Failure> f = Checkpoint(step + 1, steps_per_epoch, total_steps);
          f.has_value()) {
        return f;
      }
    }
  }
  // The last commit must reach the coordinator before the exit does.
  reporter_->Close(milliseconds(60'000));
  return std::nullopt;
}

}  // namespace

int RunTrainer(const TrainerOptions& options) {
  rpc::ChannelOptions channel;
  channel.address = options.coordinator;
  Run run(options, rpc::MakeChannel(channel));
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
