#include "worker/trainer/coordinator_store.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/rpc/client.h"
#include "common/rpc/retry.h"
#include "common/rpc/status_convert.h"
#include "google/protobuf/duration.pb.h"
#include "grpcpp/client_context.h"

namespace aidn::trainer {
namespace {

using std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

// A long wait is split into KvGet calls of at most this much, so no single
// call outlives the coordinator's own cap or hides a dead connection.
constexpr milliseconds kWaitSlice{5'000};
// gRPC deadline beyond the server-side wait of a KvGet.
constexpr milliseconds kRpcGrace{5'000};
// Longest single KvSet call.
constexpr milliseconds kSetRpcTimeout{10'000};
// Retries start at 50 ms and back off to 1 s.
constexpr rpc::BackoffOptions kBackoff{milliseconds(50), milliseconds(1'000)};

milliseconds Remaining(SteadyClock::time_point deadline) {
  return std::chrono::duration_cast<milliseconds>(deadline - SteadyClock::now());
}

google::protobuf::Duration ToProto(milliseconds d) {
  google::protobuf::Duration proto;
  proto.set_seconds(d.count() / 1000);
  proto.set_nanos(static_cast<int32_t>((d.count() % 1000) * 1'000'000));
  return proto;
}

}  // namespace

CoordinatorStore::CoordinatorStore(std::shared_ptr<v1::ClusterService::Stub> stub,
                                   std::string token, std::string job_id, int64_t generation,
                                   std::chrono::milliseconds timeout)
    : stub_(std::move(stub)),
      token_(std::move(token)),
      job_id_(std::move(job_id)),
      generation_(generation),
      timeout_(timeout) {}

absl::Status CoordinatorStore::Set(const std::string& key, const std::string& value) {
  v1::KvSetRequest request;
  request.set_job_id(job_id_);
  request.set_generation(generation_);
  request.set_key(key);
  request.set_value(value);
  const SteadyClock::time_point deadline = SteadyClock::now() + timeout_;
  rpc::Backoff backoff(kBackoff);
  while (true) {
    grpc::ClientContext context;
    rpc::PrepareContext(&context, token_,
                        std::max(milliseconds(1), std::min(kSetRpcTimeout, Remaining(deadline))));
    v1::KvSetResponse response;
    const grpc::Status status = stub_->KvSet(&context, request, &response);
    if (status.ok()) return absl::OkStatus();
    // A set is idempotent: retrying one that did land is harmless.
    if (rpc::Transient(status) && Remaining(deadline) > milliseconds(0)) {
      backoff.Sleep(deadline);
      continue;
    }
    const absl::Status error = rpc::FromGrpcStatus(status);
    return absl::Status(error.code(),
                        absl::StrCat("coordinator KV set \"", key, "\" (", job_id_, " generation ",
                                     generation_, "): ", error.message()));
  }
}

absl::StatusOr<std::string> CoordinatorStore::Get(const std::string& key,
                                                  std::chrono::milliseconds timeout) {
  const SteadyClock::time_point start = SteadyClock::now();
  const SteadyClock::time_point deadline = start + std::max(timeout, milliseconds(0));
  auto fail = [&](absl::StatusCode code, absl::string_view message) {
    return absl::Status(code, absl::StrCat("coordinator KV get \"", key, "\" (", job_id_,
                                           " generation ", generation_, "): ", message));
  };
  v1::KvGetRequest request;
  request.set_job_id(job_id_);
  request.set_generation(generation_);
  request.set_key(key);
  rpc::Backoff backoff(kBackoff);
  std::string last_error;
  // At least one call, so a zero timeout still looks once.
  for (bool first = true;; first = false) {
    const milliseconds remaining = Remaining(deadline);
    if (!first && remaining <= milliseconds(0)) {
      const auto waited = std::chrono::duration_cast<milliseconds>(SteadyClock::now() - start);
      return fail(absl::StatusCode::kDeadlineExceeded,
                  absl::StrCat("timed out after ", waited.count(), " ms waiting for the key",
                               last_error.empty() ? "" : " (last error: ", last_error,
                               last_error.empty() ? "" : ")"));
    }
    const milliseconds slice = std::clamp(remaining, milliseconds(0), kWaitSlice);
    *request.mutable_wait() = ToProto(slice);
    grpc::ClientContext context;
    rpc::PrepareContext(&context, token_, slice + kRpcGrace);
    v1::KvGetResponse response;
    const grpc::Status status = stub_->KvGet(&context, request, &response);
    if (status.ok()) {
      if (response.found()) return std::move(*response.mutable_value());
      continue;  // Not set within the slice: wait again.
    }
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) continue;
    if (rpc::Transient(status)) {
      last_error = rpc::FromGrpcStatus(status).ToString();
      backoff.Sleep(deadline);
      continue;
    }
    const absl::Status error = rpc::FromGrpcStatus(status);
    return fail(error.code(), error.message());
  }
}

}  // namespace aidn::trainer
