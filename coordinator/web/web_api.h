#ifndef AIDN_COORDINATOR_WEB_WEB_API_H_
#define AIDN_COORDINATOR_WEB_WEB_API_H_

// The web UI's JSON API: each path one call of CoordinatorService over a
// channel to the coordinator's own gRPC server (in-process), with the
// browser's bearer token passed on as the call's. So the API answers what
// aidnctl would be answered, under the same tokens and roles: no second
// source of truth and no second set of rules.
//
//   GET  /api/v1/workers                         ListWorkers
//   GET  /api/v1/jobs[?state=RUNNING,PENDING][&label=k=v]   ListJobs, all pages
//   GET  /api/v1/jobs/ID                         GetJob
//   GET  /api/v1/jobs/ID/metrics?from_step=N[&to_step=M][&limit=L]   GetMetrics
//   GET  /api/v1/jobs/ID/events?after_seq=N[&limit=L]                ListEvents
//   GET  /api/v1/jobs/ID/checkpoints             ListCheckpoints
//   GET  /api/v1/jobs/ID/checkpoints/STEP/model.safetensors
//        the checkpoint's whole-model weights, opened and verified by
//        OpenCommittedWeights (no symbolic links, the recorded MANIFEST
//        digest, size and CRC-32C), where the coordinator's machine
//        reaches them
//   GET  /api/v1/jobs/ID/logs?tail=N[&rank=R][&generation=G]         ReadLogs
//   POST /api/v1/jobs/ID/cancel   {"reason": "..."}                  CancelJob
//   POST /api/v1/jobs/ID/pause    {"reason": "..."}                  PauseJob
//   POST /api/v1/jobs/ID/resume                                      ResumeJob
//
// Answers are protobuf's JSON mapping of the responses (snake_case names,
// default values printed, int64 as strings); the logs' lines are text
// (invalid UTF-8 replaced). Errors are {"error": message, "code": name}
// with the HTTP status of the gRPC code (401 UNAUTHENTICATED, 403
// PERMISSION_DENIED, 404 NOT_FOUND, 400 INVALID_ARGUMENT and OUT_OF_RANGE,
// 409 FAILED_PRECONDITION and ALREADY_EXISTS, 503 UNAVAILABLE, 504
// DEADLINE_EXCEEDED, 500 otherwise); a bad query parameter is 400 naming it.
//
// Thread-safe (the stub is).

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "aidn/v1/coordinator.grpc.pb.h"
#include "common/file.h"
#include "grpcpp/channel.h"

namespace aidn::coordinator::web {

struct WebRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // "/api/v1/jobs/j-1", percent-decoded
  // Query parameters (the last value of a repeated one).
  std::map<std::string, std::string> query;
  std::string body;
  // The Authorization header as the browser sent it ("Bearer <token>").
  std::string authorization;
};

struct WebResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  // Set: the answer is this open file's file_bytes bytes (verified
  // checkpoint weights, checkpoint_check.h), which the server streams,
  // checking their CRC-32C against file_crc32c again as a whole download
  // passes (the connection is cut on a mismatch), as download_name.
  std::shared_ptr<ScopedFd> file;
  int64_t file_bytes = 0;
  uint32_t file_crc32c = 0;
  std::string download_name;
  // 405: the methods the path answers (the Allow header).
  std::string allow;
};

class WebApi {
 public:
  // Each call gets `timeout` (ReadLogs and ListJobs' pages each theirs).
  WebApi(std::shared_ptr<grpc::Channel> channel, std::chrono::milliseconds timeout);

  // Any path under /api/v1/; 404 for the others, 405 for a known path
  // with another method.
  WebResponse Handle(const WebRequest& request) const;

 private:
  std::unique_ptr<v1::CoordinatorService::Stub> stub_;
  std::chrono::milliseconds timeout_;
};

}  // namespace aidn::coordinator::web

#endif  // AIDN_COORDINATOR_WEB_WEB_API_H_
