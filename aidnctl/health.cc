#include "aidnctl/health.h"

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "aidnctl/commands.h"
#include "common/rpc/status_convert.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace aidn::ctl {
namespace {

constexpr char kCheckMethod[] = "/grpc.health.v1.Health/Check";

// The messages of grpc/health/v1/health.proto, whose generated code Debian
// does not ship, as bare fields: HealthCheckRequest{string service = 1},
// HealthCheckResponse{ServingStatus status = 1}.
std::string EncodeRequest(const std::string& service) {
  google::protobuf::UnknownFieldSet request;
  if (!service.empty()) request.AddLengthDelimited(1, service);
  std::string bytes;
  request.SerializeToString(&bytes);
  return bytes;
}

// The answer's status (the last field 1 wins, as protobuf parsing has it).
absl::StatusOr<int64_t> DecodeStatus(const std::string& bytes) {
  google::protobuf::UnknownFieldSet response;
  if (!response.ParseFromString(bytes)) {
    return absl::DataLossError("a malformed health check answer");
  }
  int64_t status = 0;
  for (int i = 0; i < response.field_count(); ++i) {
    const google::protobuf::UnknownField& field = response.field(i);
    if (field.number() == 1 && field.type() == google::protobuf::UnknownField::TYPE_VARINT) {
      status = static_cast<int64_t>(field.varint());
    }
  }
  return status;
}

std::string StatusName(int64_t status) {
  switch (status) {
    case 1:
      return "SERVING";
    case 2:
      return "NOT_SERVING";
    case 3:
      return "SERVICE_UNKNOWN";
    default:
      return "UNKNOWN";
  }
}

}  // namespace

absl::StatusOr<std::string> CheckHealth(const ConnectionSettings& connection,
                                        const std::string& service,
                                        std::chrono::milliseconds timeout) {
  grpc::GenericStub stub(NewChannel(connection));

  const std::string request_bytes = EncodeRequest(service);
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::Status status;
  absl::Notification done;
  stub.UnaryCall(&context, kCheckMethod, grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) {
    if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
      return std::string("SERVICE_UNKNOWN");  // the protocol's answer for an unknown name
    }
    absl::Status error = rpc::FromGrpcStatus(status);
    return absl::Status(
        error.code(), absl::StrCat("health check of ", connection.address, ": ", error.message()));
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::DataLossError("an unreadable health answer");
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  absl::StatusOr<int64_t> code = DecodeStatus(bytes);
  if (!code.ok()) return code.status();
  return StatusName(*code);
}

absl::Status RunHealth(const ConnectionSettings& connection, const std::string& service,
                       std::chrono::milliseconds timeout, std::ostream* out) {
  absl::StatusOr<std::string> status = CheckHealth(connection, service, timeout);
  if (!status.ok()) return status.status();
  *out << *status << "\n";
  if (*status != "SERVING") {
    return absl::UnavailableError(
        absl::StrCat("the coordinator at ", connection.address, " is ", *status,
                     service.empty() ? "" : absl::StrCat(" for ", service)));
  }
  return absl::OkStatus();
}

}  // namespace aidn::ctl
