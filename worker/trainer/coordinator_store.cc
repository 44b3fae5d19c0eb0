#include "worker/trainer/coordinator_store.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/rpc/client.h"
#include "common/rpc/status_convert.h"
#include "google/protobuf/duration.pb.h"
#include "grpcpp/client_context.h"
#include "worker/engine/comm/gloo_communicator.h"

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
constexpr milliseconds kFirstBackoff{50};
constexpr milliseconds kMaxBackoff{1'000};

milliseconds Remaining(SteadyClock::time_point deadline) {
  return std::chrono::duration_cast<milliseconds>(deadline - SteadyClock::now());
}

google::protobuf::Duration ToProto(milliseconds d) {
  google::protobuf::Duration proto;
  proto.set_seconds(d.count() / 1000);
  proto.set_nanos(static_cast<int32_t>((d.count() % 1000) * 1'000'000));
  return proto;
}

// Worth another try before the deadline: the coordinator is restarting or
// the connection dropped.
bool Transient(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE;
}

// Sleeps for the backoff (never past the deadline) and doubles it.
void Backoff(milliseconds* backoff, SteadyClock::time_point deadline) {
  std::this_thread::sleep_for(std::min(*backoff, std::max(Remaining(deadline), milliseconds(0))));
  *backoff = std::min(*backoff * 2, kMaxBackoff);
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

void CoordinatorStore::set(const std::string& key, const std::vector<char>& data) {
  v1::KvSetRequest request;
  request.set_job_id(job_id_);
  request.set_generation(generation_);
  request.set_key(key);
  request.set_value(std::string(data.begin(), data.end()));
  const SteadyClock::time_point deadline = SteadyClock::now() + timeout_;
  milliseconds backoff = kFirstBackoff;
  while (true) {
    grpc::ClientContext context;
    rpc::PrepareContext(&context, token_,
                        std::max(milliseconds(1), std::min(kSetRpcTimeout, Remaining(deadline))));
    v1::KvSetResponse response;
    const grpc::Status status = stub_->KvSet(&context, request, &response);
    if (status.ok()) return;
    // A set is idempotent: retrying one that did land is harmless.
    if (Transient(status) && Remaining(deadline) > milliseconds(0)) {
      Backoff(&backoff, deadline);
      continue;
    }
    const absl::Status error = rpc::FromGrpcStatus(status);
    throw engine::StoreStatusError(absl::Status(
        error.code(), absl::StrCat("coordinator KV set \"", key, "\" (", job_id_, " generation ",
                                   generation_, "): ", error.message())));
  }
}

std::vector<char> CoordinatorStore::get(const std::string& key) {
  const std::string value = WaitForKey(key, SteadyClock::now() + timeout_, "get");
  return std::vector<char>(value.begin(), value.end());
}

void CoordinatorStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void CoordinatorStore::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  const SteadyClock::time_point deadline =
      SteadyClock::now() + (timeout > milliseconds(0) ? timeout : timeout_);
  for (const std::string& key : keys) WaitForKey(key, deadline, "wait for");
}

std::string CoordinatorStore::WaitForKey(const std::string& key, Deadline deadline,
                                         const char* operation) {
  const SteadyClock::time_point start = SteadyClock::now();
  auto fail = [&](absl::StatusCode code, absl::string_view message) {
    throw engine::StoreStatusError(
        absl::Status(code, absl::StrCat("coordinator KV ", operation, " \"", key, "\" (", job_id_,
                                        " generation ", generation_, "): ", message)));
  };
  v1::KvGetRequest request;
  request.set_job_id(job_id_);
  request.set_generation(generation_);
  request.set_key(key);
  milliseconds backoff = kFirstBackoff;
  std::string last_error;
  while (true) {
    const milliseconds remaining = Remaining(deadline);
    if (remaining <= milliseconds(0)) {
      const auto waited = std::chrono::duration_cast<milliseconds>(SteadyClock::now() - start);
      fail(absl::StatusCode::kDeadlineExceeded,
           absl::StrCat("timed out after ", waited.count(), " ms waiting for the key",
                        last_error.empty() ? "" : " (last error: ", last_error,
                        last_error.empty() ? "" : ")"));
    }
    const milliseconds slice = std::min(remaining, kWaitSlice);
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
    if (Transient(status)) {
      last_error = rpc::FromGrpcStatus(status).ToString();
      Backoff(&backoff, deadline);
      continue;
    }
    const absl::Status error = rpc::FromGrpcStatus(status);
    fail(error.code(), error.message());
  }
}

absl::Status CoordinatorKeyValueStore::Set(const std::string& key, const std::string& value) {
  try {
    store_->set(key, std::vector<char>(value.begin(), value.end()));
  } catch (const engine::StoreStatusError& e) {
    return e.status();
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CoordinatorKeyValueStore::Get(const std::string& key,
                                                          std::chrono::milliseconds timeout) {
  try {
    store_->wait({key}, timeout);
    const std::vector<char> value = store_->get(key);
    return std::string(value.begin(), value.end());
  } catch (const engine::StoreStatusError& e) {
    return e.status();
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  }
}

}  // namespace aidn::trainer
