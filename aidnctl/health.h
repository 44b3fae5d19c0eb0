#ifndef AIDN_AIDNCTL_HEALTH_H_
#define AIDN_AIDNCTL_HEALTH_H_

// `aidnctl health`: the coordinator's answer to the standard gRPC health
// check (grpc.health.v1.Health/Check), for people, scripts and Kubernetes
// probes (whose own gRPC probe cannot speak TLS). No token needed.

#include <chrono>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "aidnctl/config.h"

namespace aidn::ctl {

// The serving status of `service` ("" for the server as a whole), as the
// health protocol names it: SERVING, NOT_SERVING, SERVICE_UNKNOWN or
// UNKNOWN; the call's error if there was no answer.
absl::StatusOr<std::string> CheckHealth(const ConnectionSettings& connection,
                                        const std::string& service,
                                        std::chrono::milliseconds timeout);

// Prints the status; OK only when it is SERVING.
absl::Status RunHealth(const ConnectionSettings& connection, const std::string& service,
                       std::chrono::milliseconds timeout, std::ostream* out);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_HEALTH_H_
