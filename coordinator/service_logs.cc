// The gRPC edge of the ranks' output lines: ShipLogs (workers) and the
// ReadLogs stream (users).

#include <deque>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/rpc/status_convert.h"
#include "common/status.h"
#include "coordinator/service.h"

namespace aidn::coordinator {
namespace {

// ReadLogs: pulls from the coordinator whenever it says there is something
// new (followers subscribe; a plain read pulls until it has read all),
// writing one message at a time (gRPC allows one write in flight). The
// same shape as WatchJob's reactor.
class ReadLogsReactor final : public grpc::ServerWriteReactor<v1::ReadLogsResponse>,
                              public WatchSubscriber {
 public:
  ReadLogsReactor(Coordinator* coordinator, v1::ReadLogsRequest request)
      : coordinator_(coordinator), request_(std::move(request)) {}

  // `auth` is the outcome of authenticating the call.
  void Start(const absl::Status& auth) {
    absl::Status s = auth;
    if (s.ok() && request_.follow()) {
      s = coordinator_->SubscribeLogs(request_.job_id(), this);
      subscribed_ = s.ok();
    }
    if (!s.ok()) {
      RequestFinish(s);
      return;
    }
    Pump();
  }

  void Notify() override { Pump(); }

  void OnWriteDone(bool ok) override {
    absl::Status finish;
    bool must_finish = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      queue_.pop_front();
      if (!ok && !finish_requested_) {
        finish_requested_ = true;
        pending_finish_ = absl::CancelledError("reader went away");
      }
      must_finish = finish_requested_;
      finish = pending_finish_;
    }
    if (must_finish) {
      RequestFinish(finish);
    } else {
      Pump();
    }
  }

  void OnCancel() override { RequestFinish(absl::CancelledError("read cancelled")); }

  void OnDone() override {
    if (subscribed_) coordinator_->UnsubscribeLogs(request_.job_id(), this);
    delete this;
  }

 private:
  // Starts the next write, or finishes once everything was sent and the
  // coordinator says no more will come.
  void Pump() {
    const v1::ReadLogsResponse* next = nullptr;
    absl::Status finish;
    bool done = false;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || finish_requested_ || writing_) return;
      if (queue_.empty() && !drained_) {
        absl::StatusOr<LogBatch> batch = coordinator_->PollLogs(request_, &cursor_);
        if (!batch.ok()) {
          finish = batch.status();
          done = true;
        } else {
          for (auto& r : batch->responses) queue_.push_back(std::move(r));
          drained_ = batch->finished;
        }
      }
      if (!done && queue_.empty() && drained_) done = true;
      if (!done && !queue_.empty()) {
        writing_ = true;
        next = &queue_.front();
      }
    }
    if (done) {
      RequestFinish(finish);
    } else if (next != nullptr) {
      StartWrite(next);
    }
  }

  void RequestFinish(const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      if (writing_) {
        if (!finish_requested_) {
          finish_requested_ = true;
          pending_finish_ = status;
        }
        return;
      }
      finished_ = true;
    }
    Finish(rpc::ToGrpcStatus(status));
  }

  Coordinator* const coordinator_;
  const v1::ReadLogsRequest request_;
  bool subscribed_ = false;
  absl::Mutex mu_;
  LogCursor cursor_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::ReadLogsResponse> queue_ ABSL_GUARDED_BY(mu_);
  // The coordinator said nothing more will come.
  bool drained_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status pending_finish_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::ServerWriteReactor<v1::ReadLogsResponse>* CoordinatorServiceImpl::ReadLogs(
    grpc::CallbackServerContext* context, const v1::ReadLogsRequest* request) {
  auto* reactor = new ReadLogsReactor(coordinator_, *request);
  absl::StatusOr<Principal> p = AuthenticateCall(*auth_, context);
  absl::Status allowed = p.ok() ? RequireUser(*p) : p.status();
  if (allowed.ok()) allowed = RequireAccessTo(*p, request->job_id());
  // The reactor deletes itself in OnDone, also when it finishes at once.
  reactor->Start(allowed);
  return reactor;
}

grpc::ServerUnaryReactor* ClusterServiceImpl::ShipLogs(grpc::CallbackServerContext* context,
                                                       const v1::ShipLogsRequest* request,
                                                       v1::ShipLogsResponse*) {
  absl::Status s = [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, AuthenticateCall(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireWorker(p));
    return coordinator_->ShipLogs(*request);
  }();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(rpc::ToGrpcStatus(s));
  return reactor;
}

}  // namespace aidn::coordinator
