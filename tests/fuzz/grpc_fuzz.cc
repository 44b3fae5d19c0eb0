// The coordinator's gRPC services as any client may call them: a method, a
// bearer token and request bytes, all from the fuzz input, through a real
// gRPC server (an in-process channel, so no socket) into the real service
// and coordinator code. The coordinator holds a small cluster
// (fuzz_cluster.h).
//
// After every call the service refused (any status but OK, and not our own
// cancellation of a call that waits), the coordinator's state must be
// exactly as it was: its jobs, workers, events and checkpoints. The one
// thing a refusal may add is its own audit record: new events whose type
// ends in ".refused" (a second worker asking for a live worker's id).
//
// Input: byte 0 picks the method, byte 1 the token, the rest is the request
// message (serialized protobuf, for streaming calls the one message sent).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "tests/fuzz/fuzz_cluster.h"

namespace {

using aidn::fuzz::Compare;
using aidn::fuzz::Die;
using aidn::fuzz::kTokenCount;
using aidn::fuzz::kTokens;
using aidn::fuzz::Snapshot;
using aidn::fuzz::State;

constexpr const char* kMethods[] = {
    "/aidn.v1.CoordinatorService/SubmitJob",
    "/aidn.v1.CoordinatorService/GetJob",
    "/aidn.v1.CoordinatorService/ListJobs",
    "/aidn.v1.CoordinatorService/CancelJob",
    "/aidn.v1.CoordinatorService/WatchJob",
    "/aidn.v1.CoordinatorService/ListWorkers",
    "/aidn.v1.CoordinatorService/ListCheckpoints",
    "/aidn.v1.CoordinatorService/ListEvents",
    "/aidn.v1.CoordinatorService/GetMetrics",
    "/aidn.v1.CoordinatorService/ReadLogs",
    "/aidn.v1.ClusterService/RegisterWorker",
    "/aidn.v1.ClusterService/Heartbeat",
    "/aidn.v1.ClusterService/ReportTrainerExit",
    "/aidn.v1.ClusterService/JoinRendezvous",
    "/aidn.v1.ClusterService/KvSet",
    "/aidn.v1.ClusterService/KvGet",
    "/aidn.v1.ClusterService/KvAdd",
    "/aidn.v1.ClusterService/KvCompareAndSet",
    "/aidn.v1.ClusterService/ReportProgress",
    "/aidn.v1.ClusterService/StreamMetrics",
    "/aidn.v1.ClusterService/CommitCheckpoint",
    "/aidn.v1.ClusterService/ReportCheckpointInvalid",
    "/aidn.v1.ClusterService/ShipLogs",
    "/aidn.v1.CoordinatorService/SetWorkerScheduling",
    "/aidn.v1.CoordinatorService/RemoveWorker",
    "/aidn.v1.CoordinatorService/PauseJob",
    "/aidn.v1.CoordinatorService/ResumeJob",
};
constexpr size_t kMethodCount = sizeof(kMethods) / sizeof(kMethods[0]);

// A call that has not finished after this long is waiting for something
// (a held heartbeat, a rendezvous, a key, a watch): it is cancelled.
constexpr std::chrono::milliseconds kWait{50};
// Rebuilt once the fuzzer has made this many jobs, so calls stay cheap.
constexpr int kMaxJobs = 64;

// One call over the generic stub: one request message, every answer read.
class Call final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Call(grpc::GenericStub* stub, const char* method, const char* token, const uint8_t* data,
       size_t size) {
    if (token[0] != '\0') context_.AddMetadata("authorization", token);
    grpc::Slice slice(data, size);
    request_ = grpc::ByteBuffer(&slice, 1);
    stub->PrepareBidiStreamingCall(&context_, method, grpc::StubOptions(), this);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartRead(&response_);
    StartCall();
  }

  // The call's status; `waited` when it had to be cancelled.
  grpc::Status Finish(bool* waited) {
    std::future<void> done = done_.get_future();
    *waited = done.wait_for(kWait) != std::future_status::ready;
    if (*waited) context_.TryCancel();
    done.wait();
    return status_;
  }

  void OnReadDone(bool ok) override {
    if (ok) StartRead(&response_);
  }
  void OnDone(const grpc::Status& status) override {
    status_ = status;
    done_.set_value();
  }

 private:
  grpc::ClientContext context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  grpc::Status status_;
  std::promise<void> done_;
};

// The shared cluster and a generic stub to its server.
class Cluster {
 public:
  Cluster() : stub_(std::make_unique<grpc::GenericStub>(cluster_.server()->InProcessChannel())) {}

  void RunOne(const uint8_t* data, size_t size) {
    const char* method = kMethods[data[0] % kMethodCount];
    const char* token = kTokens[data[1] % kTokenCount];
    const State before = Snapshot(cluster_.coordinator());
    jobs_ = before.jobs.jobs_size();
    bool waited = false;
    grpc::Status status;
    {
      Call call(stub_.get(), method, token, data + 2, size - 2);
      status = call.Finish(&waited);
    }
    // A call that waited says nothing about refusal, and may still act after
    // its cancellation: the call after it is not judged either.
    const bool judge = !status.ok() && !waited && !after_wait_;
    after_wait_ = waited;
    if (!judge) return;
    const State after = Snapshot(cluster_.coordinator());
    if (std::string diff = Compare(before, after); !diff.empty()) {
      Die(std::string("a refused call changed the coordinator's state: ") + method + " with " +
          (token[0] == '\0' ? "no token" : token) + " refused (" +
          std::to_string(status.error_code()) + ": " + status.error_message() + ") but " + diff);
    }
  }

  // How many jobs the coordinator held before the last call.
  int jobs() const { return jobs_; }

 private:
  aidn::fuzz::FuzzCluster cluster_;
  std::unique_ptr<grpc::GenericStub> stub_;
  int jobs_ = 0;
  bool after_wait_ = false;
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  aidn::fuzz::QuietLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Cluster* cluster = new Cluster();  // lives for the process
  if (size < 2) return 0;
  cluster->RunOne(data, size);
  if (cluster->jobs() > kMaxJobs) {
    delete cluster;
    cluster = new Cluster();
  }
  return 0;
}
