#ifndef AIDN_COMMON_RPC_STATUS_CONVERT_H_
#define AIDN_COMMON_RPC_STATUS_CONVERT_H_

// absl::StatusCode and grpc::StatusCode share their numbering; these map one
// onto the other at the service edge.

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace aidn::rpc {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace aidn::rpc

#endif  // AIDN_COMMON_RPC_STATUS_CONVERT_H_
