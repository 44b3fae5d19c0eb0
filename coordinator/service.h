#ifndef AIDN_COORDINATOR_SERVICE_H_
#define AIDN_COORDINATOR_SERVICE_H_

// The gRPC edge: thin callback-API services that authenticate the call,
// check the caller's role, call the Coordinator and map absl::Status onto
// grpc::Status one to one. Thread-safe (all state is in the Coordinator).

#include "aidn/v1/cluster.grpc.pb.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "coordinator/auth.h"
#include "coordinator/coordinator.h"

namespace aidn::coordinator {

class CoordinatorServiceImpl final : public v1::CoordinatorService::CallbackService {
 public:
  // Neither is owned; both must outlive the service.
  CoordinatorServiceImpl(Coordinator* coordinator, const Authenticator* auth)
      : coordinator_(coordinator), auth_(auth) {}

  grpc::ServerUnaryReactor* SubmitJob(grpc::CallbackServerContext* context,
                                      const v1::SubmitJobRequest* request,
                                      v1::SubmitJobResponse* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* context,
                                   const v1::GetJobRequest* request, v1::Job* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* context,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* context,
                                      const v1::CancelJobRequest* request,
                                      v1::Job* response) override;
  grpc::ServerUnaryReactor* PauseJob(grpc::CallbackServerContext* context,
                                     const v1::PauseJobRequest* request,
                                     v1::Job* response) override;
  grpc::ServerUnaryReactor* ResumeJob(grpc::CallbackServerContext* context,
                                      const v1::ResumeJobRequest* request,
                                      v1::Job* response) override;
  grpc::ServerWriteReactor<v1::WatchJobResponse>* WatchJob(
      grpc::CallbackServerContext* context, const v1::WatchJobRequest* request) override;
  grpc::ServerUnaryReactor* ListWorkers(grpc::CallbackServerContext* context,
                                        const v1::ListWorkersRequest* request,
                                        v1::ListWorkersResponse* response) override;
  grpc::ServerUnaryReactor* SetWorkerScheduling(grpc::CallbackServerContext* context,
                                                const v1::SetWorkerSchedulingRequest* request,
                                                v1::Worker* response) override;
  grpc::ServerUnaryReactor* RemoveWorker(grpc::CallbackServerContext* context,
                                         const v1::RemoveWorkerRequest* request,
                                         v1::RemoveWorkerResponse* response) override;
  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* context,
                                            const v1::ListCheckpointsRequest* request,
                                            v1::ListCheckpointsResponse* response) override;
  grpc::ServerUnaryReactor* ListEvents(grpc::CallbackServerContext* context,
                                       const v1::ListEventsRequest* request,
                                       v1::ListEventsResponse* response) override;
  grpc::ServerUnaryReactor* GetMetrics(grpc::CallbackServerContext* context,
                                       const v1::GetMetricsRequest* request,
                                       v1::GetMetricsResponse* response) override;
  // In service_logs.cc.
  grpc::ServerWriteReactor<v1::ReadLogsResponse>* ReadLogs(
      grpc::CallbackServerContext* context, const v1::ReadLogsRequest* request) override;

 private:
  // Admins any job; a user the jobs MayAccess lets it (NOT_FOUND for no such
  // job, PERMISSION_DENIED naming the owner for another's).
  absl::Status RequireAccessTo(const Principal& p, const std::string& job_id) const;

  Coordinator* const coordinator_;
  const Authenticator* const auth_;
};

// The call's principal, from its bearer token. With worker certificates
// required (Authenticator), a worker token only over a connection whose
// client certificate the server verified: PERMISSION_DENIED saying so.
absl::StatusOr<Principal> AuthenticateCall(const Authenticator& auth,
                                           grpc::CallbackServerContext* context);

class ClusterServiceImpl final : public v1::ClusterService::CallbackService {
 public:
  ClusterServiceImpl(Coordinator* coordinator, const Authenticator* auth)
      : coordinator_(coordinator), auth_(auth) {}

  grpc::ServerUnaryReactor* RegisterWorker(grpc::CallbackServerContext* context,
                                           const v1::RegisterWorkerRequest* request,
                                           v1::RegisterWorkerResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* ReportTrainerExit(grpc::CallbackServerContext* context,
                                              const v1::ReportTrainerExitRequest* request,
                                              v1::ReportTrainerExitResponse* response) override;
  grpc::ServerUnaryReactor* JoinRendezvous(grpc::CallbackServerContext* context,
                                           const v1::JoinRendezvousRequest* request,
                                           v1::JoinRendezvousResponse* response) override;
  grpc::ServerUnaryReactor* KvSet(grpc::CallbackServerContext* context,
                                  const v1::KvSetRequest* request,
                                  v1::KvSetResponse* response) override;
  grpc::ServerUnaryReactor* KvGet(grpc::CallbackServerContext* context,
                                  const v1::KvGetRequest* request,
                                  v1::KvGetResponse* response) override;
  grpc::ServerUnaryReactor* KvAdd(grpc::CallbackServerContext* context,
                                  const v1::KvAddRequest* request,
                                  v1::KvAddResponse* response) override;
  grpc::ServerUnaryReactor* KvCompareAndSet(grpc::CallbackServerContext* context,
                                            const v1::KvCompareAndSetRequest* request,
                                            v1::KvCompareAndSetResponse* response) override;
  grpc::ServerUnaryReactor* ReportProgress(grpc::CallbackServerContext* context,
                                           const v1::ReportProgressRequest* request,
                                           v1::ReportProgressResponse* response) override;
  grpc::ServerReadReactor<v1::StreamMetricsRequest>* StreamMetrics(
      grpc::CallbackServerContext* context, v1::StreamMetricsResponse* response) override;
  grpc::ServerUnaryReactor* CommitCheckpoint(grpc::CallbackServerContext* context,
                                             const v1::CommitCheckpointRequest* request,
                                             v1::CommitCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* ReportCheckpointInvalid(
      grpc::CallbackServerContext* context, const v1::ReportCheckpointInvalidRequest* request,
      v1::ReportCheckpointInvalidResponse* response) override;
  // In service_logs.cc.
  grpc::ServerUnaryReactor* ShipLogs(grpc::CallbackServerContext* context,
                                     const v1::ShipLogsRequest* request,
                                     v1::ShipLogsResponse* response) override;

 private:
  Coordinator* const coordinator_;
  const Authenticator* const auth_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_SERVICE_H_
