#include "coordinator/service.h"

#include <deque>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/rpc/status_convert.h"
#include "common/status.h"

namespace aidn::coordinator {
namespace {

absl::StatusOr<Principal> Authenticate(const Authenticator& auth,
                                       grpc::CallbackServerContext* context) {
  return AuthenticateCall(auth, context);
}

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(rpc::ToGrpcStatus(status));
  return reactor;
}

// Runs `body` and finishes the call with its status.
template <typename Body>
grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context, Body body) {
  return Finish(context, body());
}

// For calls answered later: a callback that fills `response` and finishes.
template <typename Response>
std::function<void(absl::StatusOr<Response>)> Completer(grpc::ServerUnaryReactor* reactor,
                                                        Response* response) {
  return [reactor, response](absl::StatusOr<Response> result) {
    if (result.ok()) *response = *std::move(result);
    reactor->Finish(rpc::ToGrpcStatus(result.status()));
  };
}

// WatchJob: pulls from the coordinator whenever it says there is something
// new, writing one message at a time (gRPC allows one write in flight).
class WatchJobReactor final : public grpc::ServerWriteReactor<v1::WatchJobResponse>,
                              public WatchSubscriber {
 public:
  WatchJobReactor(Coordinator* coordinator, v1::WatchJobRequest request)
      : coordinator_(coordinator), request_(std::move(request)) {
    cursor_.last_event_seq = request_.after_event_seq();
  }

  // `auth` is the outcome of authenticating the call.
  void Start(const absl::Status& auth) {
    absl::Status s = auth.ok() ? coordinator_->Subscribe(request_.job_id(), this) : auth;
    if (!s.ok()) {
      RequestFinish(s);
      return;
    }
    subscribed_ = true;
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
        pending_finish_ = absl::CancelledError("watcher went away");
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

  void OnCancel() override { RequestFinish(absl::CancelledError("watch cancelled")); }

  void OnDone() override {
    if (subscribed_) coordinator_->Unsubscribe(request_.job_id(), this);
    delete this;
  }

 private:
  // Starts the next write, or finishes when the job ended and all was sent.
  // gRPC calls are made outside mu_ so a reaction run inline cannot deadlock;
  // writing_ makes sure only one write is in flight.
  void Pump() {
    const v1::WatchJobResponse* next = nullptr;
    absl::Status finish;
    bool done = false;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || finish_requested_ || writing_) return;
      if (queue_.empty()) {
        absl::StatusOr<WatchBatch> batch = coordinator_->PollWatch(request_, &cursor_);
        if (!batch.ok()) {
          finish = batch.status();
          done = true;
        } else {
          for (auto& item : batch->items) queue_.push_back(std::move(item));
          if (queue_.empty() && batch->finished) done = true;
        }
      }
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

  // Finishes now, or after the write in flight completes: gRPC forbids
  // Finish while a write is outstanding from our side's point of view of
  // ordering, and any StartWrite after Finish.
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
  const v1::WatchJobRequest request_;
  bool subscribed_ = false;
  absl::Mutex mu_;
  WatchCursor cursor_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::WatchJobResponse> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status pending_finish_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// StreamMetrics: each message is fenced and stored as it arrives.
class MetricsReader final : public grpc::ServerReadReactor<v1::StreamMetricsRequest> {
 public:
  MetricsReader(Coordinator* coordinator, Principal principal, v1::StreamMetricsResponse* response)
      : coordinator_(coordinator), principal_(std::move(principal)), response_(response) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The sender closed the stream: tell it how far its records are
      // durable. Without a job (no message came) that is nothing.
      response_->set_incarnation(coordinator_->incarnation());
      if (!job_id_.empty()) {
        absl::StatusOr<v1::StreamMetricsResponse> receipt = coordinator_->MetricsReceipt(job_id_);
        if (receipt.ok()) {
          response_->set_durable_step(receipt->durable_step());
        } else {
          AIDN_LOG(WARNING) << "no metrics receipt: " << receipt.status() << Kv("job", job_id_);
        }
      }
      Finish(grpc::Status::OK);
      return;
    }
    absl::Status s = RequireTrainerOf(principal_, request_.job_id());
    if (s.ok()) s = coordinator_->AppendMetrics(request_);
    if (!s.ok()) {
      Finish(rpc::ToGrpcStatus(s));
      return;
    }
    job_id_ = request_.job_id();
    response_->set_accepted(response_->accepted() + request_.records_size());
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  Coordinator* const coordinator_;
  const Principal principal_;
  v1::StreamMetricsResponse* const response_;
  v1::StreamMetricsRequest request_;
  std::string job_id_;
};

}  // namespace

absl::StatusOr<Principal> AuthenticateCall(const Authenticator& auth,
                                           grpc::CallbackServerContext* context) {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  absl::StatusOr<Principal> p =
      it == metadata.end()
          ? auth.Authenticate("")
          : auth.Authenticate(absl::string_view(it->second.data(), it->second.size()));
  if (p.ok() && p->role == Role::kWorker && auth.worker_certificates_required()) {
    const std::shared_ptr<const grpc::AuthContext> tls = context->auth_context();
    if (tls == nullptr || !tls->IsPeerAuthenticated()) {
      return absl::PermissionDeniedError(
          "a worker must present a client certificate signed by the coordinator's "
          "--tls-client-ca (the worker's --tls-cert and --tls-key)");
    }
  }
  return p;
}

// ---------------------------------------------------------------------------
// CoordinatorService

absl::Status CoordinatorServiceImpl::RequireAccessTo(const Principal& p,
                                                     const std::string& job_id) const {
  if (p.role == Role::kAdmin) return absl::OkStatus();
  AIDN_ASSIGN_OR_RETURN(const v1::Job job, coordinator_->GetJob(job_id));
  return RequireAccess(p, job);
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::SubmitJob(grpc::CallbackServerContext* context,
                                                            const v1::SubmitJobRequest* request,
                                                            v1::SubmitJobResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireUser(p));
    // Another job's checkpoint only where its owner's jobs may be used.
    if (const std::string& source = request->spec().checkpoint().resume_from().job();
        !source.empty()) {
      if (absl::StatusOr<v1::Job> theirs = coordinator_->GetJob(source); theirs.ok()) {
        if (absl::Status s = RequireAccess(p, *theirs); !s.ok()) {
          return absl::PermissionDeniedError(absl::StrCat("checkpoint.resume_from: ", s.message()));
        }
      }
    }
    AIDN_ASSIGN_OR_RETURN(*response->mutable_job(),
                          coordinator_->SubmitJob(request->spec(), p.name));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::GetJob(grpc::CallbackServerContext* context,
                                                         const v1::GetJobRequest* request,
                                                         v1::Job* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireUser(p));
    AIDN_ASSIGN_OR_RETURN(*response, coordinator_->GetJob(request->job_id()));
    AIDN_RETURN_IF_ERROR(RequireAccess(p, *response));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ListJobs(grpc::CallbackServerContext* context,
                                                           const v1::ListJobsRequest* request,
                                                           v1::ListJobsResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireUser(p));
    AIDN_ASSIGN_OR_RETURN(*response, coordinator_->ListJobs(*request, [&p](const v1::Job& job) {
      return MayAccess(p, job);
    }));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::CancelJob(grpc::CallbackServerContext* context,
                                                            const v1::CancelJobRequest* request,
                                                            v1::Job* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireUser(p));
    AIDN_RETURN_IF_ERROR(RequireAccessTo(p, request->job_id()));
    AIDN_ASSIGN_OR_RETURN(*response,
                          coordinator_->CancelJob(request->job_id(), request->reason(), p.name));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::PauseJob(grpc::CallbackServerContext* context,
                                                           const v1::PauseJobRequest* request,
                                                           v1::Job* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireUser(p));
    AIDN_RETURN_IF_ERROR(RequireAccessTo(p, request->job_id()));
    AIDN_ASSIGN_OR_RETURN(*response,
                          coordinator_->PauseJob(request->job_id(), request->reason(), p.name));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ResumeJob(grpc::CallbackServerContext* context,
                                                            const v1::ResumeJobRequest* request,
                                                            v1::Job* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireUser(p));
    AIDN_RETURN_IF_ERROR(RequireAccessTo(p, request->job_id()));
    AIDN_ASSIGN_OR_RETURN(*response, coordinator_->ResumeJob(request->job_id(), p.name));
    return absl::OkStatus();
  });
}

grpc::ServerWriteReactor<v1::WatchJobResponse>* CoordinatorServiceImpl::WatchJob(
    grpc::CallbackServerContext* context, const v1::WatchJobRequest* request) {
  auto* reactor = new WatchJobReactor(coordinator_, *request);
  absl::StatusOr<Principal> p = Authenticate(*auth_, context);
  absl::Status allowed = p.ok() ? RequireUser(*p) : p.status();
  if (allowed.ok()) allowed = RequireAccessTo(*p, request->job_id());
  // The reactor deletes itself in OnDone, also when it finishes at once.
  reactor->Start(allowed);
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ListWorkers(grpc::CallbackServerContext* context,
                                                              const v1::ListWorkersRequest*,
                                                              v1::ListWorkersResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireUser(p));
    *response = coordinator_->ListWorkers();
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::SetWorkerScheduling(
    grpc::CallbackServerContext* context, const v1::SetWorkerSchedulingRequest* request,
    v1::Worker* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireAdmin(p));
    AIDN_ASSIGN_OR_RETURN(
        *response, coordinator_->SetWorkerScheduling(request->worker_id(), request->scheduling(),
                                                     request->reason(), p.name));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::RemoveWorker(
    grpc::CallbackServerContext* context, const v1::RemoveWorkerRequest* request,
    v1::RemoveWorkerResponse*) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireAdmin(p));
    return coordinator_->RemoveWorker(request->worker_id(), p.name);
  });
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ListCheckpoints(
    grpc::CallbackServerContext* context, const v1::ListCheckpointsRequest* request,
    v1::ListCheckpointsResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireUser(p));
    AIDN_RETURN_IF_ERROR(RequireAccessTo(p, request->job_id()));
    AIDN_ASSIGN_OR_RETURN(*response, coordinator_->ListCheckpoints(request->job_id()));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ListEvents(grpc::CallbackServerContext* context,
                                                             const v1::ListEventsRequest* request,
                                                             v1::ListEventsResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireUser(p));
    if (!request->job_id().empty()) AIDN_RETURN_IF_ERROR(RequireAccessTo(p, request->job_id()));
    AIDN_ASSIGN_OR_RETURN(*response, coordinator_->ListEvents(*request));
    if (p.role != Role::kAdmin && request->job_id().empty()) {
      // The cluster's own events, and those of the jobs this user may use.
      std::map<std::string, bool> may;
      auto* events = response->mutable_events();
      events->erase(std::remove_if(events->begin(), events->end(),
                                   [&](const v1::Event& e) {
                                     if (e.job_id().empty()) return false;
                                     auto [it, added] = may.try_emplace(e.job_id(), false);
                                     if (added) it->second = RequireAccessTo(p, e.job_id()).ok();
                                     return !it->second;
                                   }),
                    events->end());
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::GetMetrics(grpc::CallbackServerContext* context,
                                                             const v1::GetMetricsRequest* request,
                                                             v1::GetMetricsResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireUser(p));
    AIDN_RETURN_IF_ERROR(RequireAccessTo(p, request->job_id()));
    AIDN_ASSIGN_OR_RETURN(*response, coordinator_->GetMetrics(*request));
    return absl::OkStatus();
  });
}

// ---------------------------------------------------------------------------
// ClusterService

grpc::ServerUnaryReactor* ClusterServiceImpl::RegisterWorker(
    grpc::CallbackServerContext* context, const v1::RegisterWorkerRequest* request,
    v1::RegisterWorkerResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireWorker(p));
    AIDN_ASSIGN_OR_RETURN(*response, coordinator_->RegisterWorker(*request));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ClusterServiceImpl::Heartbeat(grpc::CallbackServerContext* context,
                                                        const v1::HeartbeatRequest* request,
                                                        v1::HeartbeatResponse* response) {
  absl::StatusOr<Principal> p = Authenticate(*auth_, context);
  absl::Status s = p.ok() ? RequireWorker(*p) : p.status();
  if (!s.ok()) return Finish(context, s);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  coordinator_->Heartbeat(*request, Completer(reactor, response));
  return reactor;
}

grpc::ServerUnaryReactor* ClusterServiceImpl::ReportTrainerExit(
    grpc::CallbackServerContext* context, const v1::ReportTrainerExitRequest* request,
    v1::ReportTrainerExitResponse*) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireWorker(p));
    return coordinator_->ReportTrainerExit(*request);
  });
}

grpc::ServerUnaryReactor* ClusterServiceImpl::JoinRendezvous(
    grpc::CallbackServerContext* context, const v1::JoinRendezvousRequest* request,
    v1::JoinRendezvousResponse* response) {
  absl::StatusOr<Principal> p = Authenticate(*auth_, context);
  absl::Status s = p.ok() ? RequireTrainerOf(*p, request->job_id()) : p.status();
  if (!s.ok()) return Finish(context, s);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  coordinator_->JoinRendezvous(*request, Completer(reactor, response));
  return reactor;
}

grpc::ServerUnaryReactor* ClusterServiceImpl::KvSet(grpc::CallbackServerContext* context,
                                                    const v1::KvSetRequest* request,
                                                    v1::KvSetResponse*) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireTrainerOf(p, request->job_id()));
    return coordinator_->KvSet(*request);
  });
}

grpc::ServerUnaryReactor* ClusterServiceImpl::KvGet(grpc::CallbackServerContext* context,
                                                    const v1::KvGetRequest* request,
                                                    v1::KvGetResponse* response) {
  absl::StatusOr<Principal> p = Authenticate(*auth_, context);
  absl::Status s = p.ok() ? RequireTrainerOf(*p, request->job_id()) : p.status();
  if (!s.ok()) return Finish(context, s);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  coordinator_->KvGet(*request, Completer(reactor, response));
  return reactor;
}

grpc::ServerUnaryReactor* ClusterServiceImpl::KvAdd(grpc::CallbackServerContext* context,
                                                    const v1::KvAddRequest* request,
                                                    v1::KvAddResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireTrainerOf(p, request->job_id()));
    AIDN_ASSIGN_OR_RETURN(*response, coordinator_->KvAdd(*request));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ClusterServiceImpl::KvCompareAndSet(
    grpc::CallbackServerContext* context, const v1::KvCompareAndSetRequest* request,
    v1::KvCompareAndSetResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireTrainerOf(p, request->job_id()));
    AIDN_ASSIGN_OR_RETURN(*response, coordinator_->KvCompareAndSet(*request));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ClusterServiceImpl::ReportProgress(
    grpc::CallbackServerContext* context, const v1::ReportProgressRequest* request,
    v1::ReportProgressResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireTrainerOf(p, request->job_id()));
    AIDN_ASSIGN_OR_RETURN(*response, coordinator_->ReportProgress(*request));
    return absl::OkStatus();
  });
}

grpc::ServerReadReactor<v1::StreamMetricsRequest>* ClusterServiceImpl::StreamMetrics(
    grpc::CallbackServerContext* context, v1::StreamMetricsResponse* response) {
  absl::StatusOr<Principal> p = Authenticate(*auth_, context);
  if (!p.ok()) {
    // A reader that finishes at once.
    class Refuse final : public grpc::ServerReadReactor<v1::StreamMetricsRequest> {
     public:
      explicit Refuse(const absl::Status& s) { Finish(rpc::ToGrpcStatus(s)); }
      void OnDone() override { delete this; }
    };
    return new Refuse(p.status());
  }
  return new MetricsReader(coordinator_, *std::move(p), response);
}

grpc::ServerUnaryReactor* ClusterServiceImpl::CommitCheckpoint(
    grpc::CallbackServerContext* context, const v1::CommitCheckpointRequest* request,
    v1::CommitCheckpointResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireTrainerOf(p, request->job_id()));
    AIDN_ASSIGN_OR_RETURN(*response, coordinator_->CommitCheckpoint(*request));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ClusterServiceImpl::ReportCheckpointInvalid(
    grpc::CallbackServerContext* context, const v1::ReportCheckpointInvalidRequest* request,
    v1::ReportCheckpointInvalidResponse*) {
  return Unary(context, [&]() -> absl::Status {
    AIDN_ASSIGN_OR_RETURN(Principal p, Authenticate(*auth_, context));
    AIDN_RETURN_IF_ERROR(RequireTrainerOf(p, request->job_id()));
    return coordinator_->ReportCheckpointInvalid(*request);
  });
}

}  // namespace aidn::coordinator
