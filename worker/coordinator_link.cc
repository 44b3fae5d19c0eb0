#include "worker/coordinator_link.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/rpc/client.h"
#include "google/protobuf/util/time_util.h"
#include "grpcpp/client_context.h"

namespace aidn::worker {
namespace {

using google::protobuf::util::TimeUtil;
using std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

milliseconds FromProto(const google::protobuf::Duration& d) {
  return milliseconds(TimeUtil::DurationToMilliseconds(d));
}

std::string Describe(const grpc::Status& status) {
  return absl::StrCat("code ", static_cast<int>(status.error_code()), ": ", status.error_message());
}

std::string TrainerName(const v1::ReportTrainerExitRequest& r) {
  return absl::StrCat(r.job_id(), "/gen-", r.generation(), "/rank-", r.rank());
}

}  // namespace

bool ExitReportRetryable(grpc::StatusCode code) {
  return rpc::Transient(code) || code == grpc::StatusCode::INTERNAL ||
         code == grpc::StatusCode::UNKNOWN;
}

CoordinatorLink::CoordinatorLink(CoordinatorLinkOptions options, CoordinatorLinkCallbacks callbacks)
    : options_(std::move(options)),
      callbacks_(std::move(callbacks)),
      channel_(rpc::MakeChannel([this] {
        rpc::ChannelOptions channel = options_.coordinator;
        channel.max_message_bytes = options_.max_message_bytes;
        return channel;
      }())),
      stub_(v1::ClusterService::NewStub(channel_)),
      heartbeat_backoff_(options_.backoff) {}

CoordinatorLink::~CoordinatorLink() {
  StopHeartbeats();
  FinishReports(milliseconds(0));
}

void CoordinatorLink::Start() {
  absl::MutexLock lifecycle(&lifecycle_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (started_ || heartbeats_stopping_) return;
    started_ = true;
  }
  report_thread_ = std::thread([this] { ReportLoop(); });
  heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
}

void CoordinatorLink::QueueReport(v1::ReportTrainerExitRequest report) {
  absl::MutexLock lock(&mu_);
  if (reports_.size() >= options_.max_pending_reports) {
    AIDN_LOG(ERROR) << "too many undelivered exit reports; dropping the oldest"
                    << Kv("trainer", TrainerName(reports_.front().second));
    reports_.pop_front();
  }
  reports_.emplace_back(next_report_seq_++, std::move(report));
}

void CoordinatorLink::StopHeartbeats() {
  absl::MutexLock lifecycle(&lifecycle_mu_);
  {
    absl::MutexLock lock(&mu_);
    heartbeats_stopping_ = true;
    if (heartbeat_call_ != nullptr) heartbeat_call_->TryCancel();
  }
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

void CoordinatorLink::FinishReports(milliseconds timeout) {
  absl::MutexLock lifecycle(&lifecycle_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (!give_up_at_.has_value()) give_up_at_ = SteadyClock::now() + timeout;
    if (!started_ && !reports_.empty()) {
      AIDN_LOG(ERROR) << "shutting down with undelivered exit reports"
                      << Kv("count", reports_.size());
    }
  }
  if (report_thread_.joinable()) report_thread_.join();
}

// ---------------------------------------------------------------------------
// Heartbeat thread.

bool CoordinatorLink::HeartbeatsStopping() const {
  absl::MutexLock lock(&mu_);
  return heartbeats_stopping_;
}

bool CoordinatorLink::SleepUnlessStopping(milliseconds delay) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&heartbeats_stopping_), absl::FromChrono(delay));
  return !heartbeats_stopping_;
}

grpc::Status CoordinatorLink::CallCancellable(
    milliseconds timeout, const std::function<grpc::Status(grpc::ClientContext*)>& fn) {
  grpc::ClientContext context;
  rpc::PrepareContext(&context, options_.token, timeout);
  {
    absl::MutexLock lock(&mu_);
    if (heartbeats_stopping_) return grpc::Status(grpc::StatusCode::CANCELLED, "shutting down");
    heartbeat_call_ = &context;
  }
  grpc::Status status = fn(&context);
  absl::MutexLock lock(&mu_);
  heartbeat_call_ = nullptr;
  return status;
}

bool CoordinatorLink::RetryAfter(const char* call, const grpc::Status& status) {
  if (HeartbeatsStopping()) return false;  // cancelled by StopHeartbeats(): nothing to log
  if (options_.metrics != nullptr) {
    options_.metrics->coordinator_up.Set(0);
    options_.metrics->coordinator_call_failures.Add({{"call", call}}).Increment();
  }
  // A refused registration (another live worker holds this id) says how
  // long ago that worker was heard: logged once, not at every try.
  const bool taken = status.error_code() == grpc::StatusCode::ALREADY_EXISTS;
  const std::string problem =
      taken ? absl::StrCat(call, " ALREADY_EXISTS") : absl::StrCat(call, " ", Describe(status));
  if (problem != heartbeat_problem_ && taken) {
    AIDN_LOG(ERROR) << "the coordinator refused this worker: its id is taken; retrying until it "
                       "is free"
                    << Kv("worker_id", options_.info.id()) << Kv("error", status.error_message());
    heartbeat_problem_ = problem;
  } else if (problem != heartbeat_problem_) {
    AIDN_LOG(WARNING) << "coordinator call failed; retrying with backoff" << Kv("call", call)
                      << Kv("coordinator", options_.coordinator.address)
                      << Kv("code", static_cast<int>(status.error_code()))
                      << Kv("error", status.error_message());
    heartbeat_problem_ = problem;
  }
  rpc::ResetBackoffAfter(status, channel_.get());
  return SleepUnlessStopping(heartbeat_backoff_.Next());
}

void CoordinatorLink::Succeeded() {
  if (options_.metrics != nullptr) options_.metrics->coordinator_up.Set(1);
  if (!heartbeat_problem_.empty()) {
    AIDN_LOG(INFO) << "coordinator reachable again"
                   << Kv("coordinator", options_.coordinator.address);
    heartbeat_problem_.clear();
  }
  heartbeat_backoff_.Reset();
}

grpc::Status CoordinatorLink::Register(milliseconds* interval) {
  {
    absl::MutexLock lock(&mu_);
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return reports_.empty() || heartbeats_stopping_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&drained), absl::FromChrono(options_.rpc_timeout));
  }
  v1::RegisterWorkerRequest request;
  *request.mutable_info() = options_.info;
  for (v1::TrainerStatus& t : callbacks_.trainers()) *request.add_trainers() = std::move(t);
  v1::RegisterWorkerResponse response;
  grpc::Status status = CallCancellable(options_.rpc_timeout, [&](grpc::ClientContext* c) {
    return stub_->RegisterWorker(c, request, &response);
  });
  if (!status.ok()) return status;
  if (FromProto(response.heartbeat_interval()).count() > 0) {
    *interval = FromProto(response.heartbeat_interval());
  }
  AIDN_LOG(INFO) << "registered with the coordinator" << Kv("worker_id", response.worker_id())
                 << Kv("coordinator", options_.coordinator.address)
                 << Kv("heartbeat_interval_ms", interval->count())
                 << Kv("worker_timeout_ms", FromProto(response.worker_timeout()).count())
                 << Kv("trainers", request.trainers_size());
  return status;
}

grpc::Status CoordinatorLink::Heartbeat(milliseconds interval, int64_t* version,
                                        milliseconds* next_interval) {
  v1::HeartbeatRequest request;
  request.set_worker_id(options_.info.id());
  request.set_instance(options_.info.instance());
  for (v1::TrainerStatus& t : callbacks_.trainers()) *request.add_trainers() = std::move(t);
  *request.mutable_max_wait() = TimeUtil::MillisecondsToDuration(interval.count());
  request.set_assignments_version(*version);
  v1::HeartbeatResponse response;
  grpc::Status status = CallCancellable(
      interval + options_.rpc_timeout,
      [&](grpc::ClientContext* c) { return stub_->Heartbeat(c, request, &response); });
  if (!status.ok()) return status;
  const bool changed = response.assignments_version() != *version;
  *version = response.assignments_version();
  if (FromProto(response.heartbeat_interval()).count() > 0) {
    *next_interval = FromProto(response.heartbeat_interval());
  }
  if (changed) {
    AIDN_LOG(DEBUG) << "assignments" << Kv("version", *version)
                    << Kv("trainers", response.assignments_size())
                    << Kv("stops", response.stops_size());
  }
  callbacks_.on_assignments(
      std::vector<v1::TrainerAssignment>(response.assignments().begin(),
                                         response.assignments().end()),
      std::vector<v1::StopOrder>(response.stops().begin(), response.stops().end()));
  return status;
}

void CoordinatorLink::HeartbeatLoop() {
  milliseconds interval = options_.heartbeat_interval;
  bool registered = false;
  int64_t version = 0;
  while (!HeartbeatsStopping()) {
    if (!registered) {
      const grpc::Status status = Register(&interval);
      if (!status.ok()) {
        if (!RetryAfter("RegisterWorker", status)) return;
        continue;
      }
      Succeeded();
      registered = true;
      version = 0;
      continue;
    }
    const int64_t before = version;
    const SteadyClock::time_point sent = SteadyClock::now();
    const grpc::Status status = Heartbeat(interval, &version, &interval);
    if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
      AIDN_LOG(WARNING) << "the coordinator does not know this worker; registering again"
                        << Kv("worker_id", options_.info.id());
      registered = false;
      continue;
    }
    if (!status.ok()) {
      if (!RetryAfter("Heartbeat", status)) return;
      continue;
    }
    Succeeded();
    if (version != before) continue;
    // The coordinator answered early without news (it did not hold the
    // call): keep to the heartbeat interval rather than spin.
    const auto elapsed = std::chrono::duration_cast<milliseconds>(SteadyClock::now() - sent);
    if (elapsed < interval / 2 && !SleepUnlessStopping(interval - elapsed)) return;
  }
}

// ---------------------------------------------------------------------------
// Report thread.

void CoordinatorLink::ReportLoop() {
  rpc::Backoff backoff(options_.backoff);
  // The last failure logged, so that an outage is logged once.
  std::string problem;
  while (true) {
    uint64_t seq = 0;
    v1::ReportTrainerExitRequest report;
    std::optional<SteadyClock::time_point> give_up_at;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !reports_.empty() || give_up_at_.has_value();
      };
      mu_.Await(absl::Condition(&ready));
      if (reports_.empty()) return;  // finished, all delivered
      give_up_at = give_up_at_;
      seq = reports_.front().first;
      report = reports_.front().second;
    }
    milliseconds timeout = options_.rpc_timeout;
    if (give_up_at.has_value()) {
      const auto left = std::chrono::duration_cast<milliseconds>(*give_up_at - SteadyClock::now());
      if (left.count() <= 0) {
        absl::MutexLock lock(&mu_);
        AIDN_LOG(ERROR) << "shutting down with undelivered exit reports"
                        << Kv("count", reports_.size());
        return;
      }
      timeout = std::min(timeout, left);
    }
    grpc::ClientContext context;
    rpc::PrepareContext(&context, options_.token, timeout);
    v1::ReportTrainerExitResponse response;
    const grpc::Status status = stub_->ReportTrainerExit(&context, report, &response);
    if (status.ok() || !ExitReportRetryable(status.error_code())) {
      if (status.ok()) {
        AIDN_LOG(DEBUG) << "exit reported" << Kv("trainer", TrainerName(report));
        if (!problem.empty()) AIDN_LOG(INFO) << "exit reports are delivered again";
        problem.clear();
      } else {
        AIDN_LOG(WARNING) << "the coordinator refused an exit report; dropping it"
                          << Kv("trainer", TrainerName(report))
                          << Kv("code", static_cast<int>(status.error_code()))
                          << Kv("error", status.error_message());
      }
      backoff.Reset();
      absl::MutexLock lock(&mu_);
      if (!reports_.empty() && reports_.front().first == seq) reports_.pop_front();
      continue;
    }
    if (Describe(status) != problem) {
      problem = Describe(status);
      AIDN_LOG(WARNING) << "could not deliver an exit report; retrying with backoff"
                        << Kv("trainer", TrainerName(report))
                        << Kv("code", static_cast<int>(status.error_code()))
                        << Kv("error", status.error_message());
    }
    rpc::ResetBackoffAfter(status, channel_.get());
    backoff.Sleep(give_up_at.value_or(SteadyClock::time_point::max()));
  }
}

}  // namespace aidn::worker
