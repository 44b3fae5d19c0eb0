#include "tests/integration/harness.h"

#include <sys/stat.h>

#include <filesystem>
#include <future>
#include <iostream>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/rpc/client.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

#ifndef AIDN_COORDINATOR_BIN
#error "AIDN_COORDINATOR_BIN must name the coordinator binary"
#endif
#ifndef AIDNCTL_BIN
#error "AIDNCTL_BIN must name the aidnctl binary"
#endif

namespace aidn::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kStartTimeout = std::chrono::seconds(30);

std::string Tail(const std::string& text, size_t bytes = 4000) {
  return text.size() <= bytes ? text : "..." + text.substr(text.size() - bytes);
}

std::string ByteBufferToString(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return "";
  std::string out;
  for (const grpc::Slice& slice : slices) {
    out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return out;
}

// One grpc.health.v1.Health/Check call for service "" through the generic
// stub (Debian's gRPC ships no generated health stub). OK only if the server
// answered SERVING.
absl::Status CheckHealth(grpc::GenericStub& stub, const std::string& token) {
  auto context = Context(token, std::chrono::seconds(2));
  // HealthCheckRequest{service: ""} serializes to zero bytes (one empty
  // slice: a default ByteBuffer holds no buffer at all and is refused).
  grpc::Slice empty;
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(context.get(), "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                 &response, [&done](grpc::Status status) { done.set_value(std::move(status)); });
  const grpc::Status status = done.get_future().get();
  if (!status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("health check: ", status.error_code(), " ", status.error_message()));
  }
  // HealthCheckResponse{status: SERVING (1)} is field 1, varint 1.
  const std::string bytes = ByteBufferToString(response);
  if (bytes != std::string("\x08\x01", 2)) {
    return absl::UnavailableError(
        absl::StrCat("health check: not SERVING (response of ", bytes.size(), " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CoordinatorHandle> StartCoordinator(const std::string& state_dir,
                                                   const std::vector<std::string>& extra_args) {
  std::error_code error;
  std::filesystem::create_directories(state_dir, error);
  if (error) return absl::InternalError(absl::StrCat(state_dir, ": ", error.message()));
  const std::string addr_file = state_dir + "/coordinator.addr";
  std::filesystem::remove(addr_file, error);

  std::string log_path;
  for (int n = 1;; ++n) {
    log_path = absl::StrCat(state_dir, "/coordinator.", n, ".log");
    if (!std::filesystem::exists(log_path)) break;
  }

  // /metrics on a free port too (it is written before the address file);
  // `extra_args` may override both flags.
  const std::string metrics_addr_file = state_dir + "/metrics.addr";
  std::filesystem::remove(metrics_addr_file, error);
  std::vector<std::string> argv = {
      AIDN_COORDINATOR_BIN,         "--listen=127.0.0.1:0",
      "--state-dir=" + state_dir,   "--addr-file=" + addr_file,
      "--metrics-addr=127.0.0.1:0", "--metrics-addr-file=" + metrics_addr_file};
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  CoordinatorHandle handle;
  handle.state_dir = state_dir;
  {
    auto process = Process::Start(argv, {}, log_path, log_path);
    if (!process.ok()) return process.status();
    handle.process = *std::move(process);
  }
  auto failure = [&](const std::string& what) {
    return absl::UnavailableError(absl::StrCat("coordinator (", absl::StrJoin(argv, " "), ") ",
                                               what, "; its log:\n",
                                               Tail(ReadFileOrEmpty(log_path))));
  };

  const Clock::time_point deadline = Clock::now() + kStartTimeout;
  auto remaining = [&] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  };
  bool exited = false;
  const bool ready = WaitFor(
      [&] {
        if (!handle.process->Running()) {
          exited = true;
          return true;
        }
        // The file is written whole (tmp + rename), so a final newline
        // means it is complete.
        const std::string addr = ReadFileOrEmpty(addr_file);
        if (addr.empty() || addr.back() != '\n') return false;
        handle.address = std::string(absl::StripAsciiWhitespace(addr));
        handle.metrics_address =
            std::string(absl::StripAsciiWhitespace(ReadFileOrEmpty(metrics_addr_file)));
        handle.admin_token =
            std::string(absl::StripAsciiWhitespace(ReadFileOrEmpty(state_dir + "/admin.token")));
        handle.worker_token =
            std::string(absl::StripAsciiWhitespace(ReadFileOrEmpty(state_dir + "/worker.token")));
        return !handle.admin_token.empty() && !handle.worker_token.empty();
      },
      remaining());
  if (exited) {
    absl::StatusOr<int> code = handle.process->Wait(std::chrono::seconds(0));
    return failure(absl::StrCat("exited with code ", code.ok() ? *code : -1, " while starting"));
  }
  if (!ready) {
    return failure(absl::StrCat("wrote no address file ", addr_file, " and tokens within ",
                                kStartTimeout.count(), " ms"));
  }

  grpc::GenericStub stub(rpc::MakeChannel({.address = handle.address}));
  absl::Status health = absl::UnavailableError("not checked");
  WaitFor(
      [&] {
        if (!handle.process->Running()) return true;
        health = CheckHealth(stub, handle.admin_token);
        return health.ok();
      },
      std::max(remaining(), std::chrono::milliseconds(2000)));
  if (!handle.process->Running()) return failure("exited while starting");
  if (!health.ok()) {
    return failure(absl::StrCat("is not healthy at ", handle.address, ": ", health.ToString()));
  }
  return handle;
}

CommandResult Aidnctl(const CoordinatorHandle& coordinator, const std::string& token,
                      const std::vector<std::string>& args) {
  // An empty home, so that no user config is read, and no address or token
  // from the environment either.
  const std::string home = MakeTempDir("aidnctl-home");
  std::vector<std::string> argv = {AIDNCTL_BIN, "--addr=" + coordinator.address};
  if (!token.empty()) argv.push_back("--token=" + token);
  argv.insert(argv.end(), args.begin(), args.end());
  CommandResult result =
      RunCommand(argv, {"HOME=" + home, "AIDN_ADDR=", "AIDN_TOKEN="}, std::chrono::seconds(30));
  RemoveTree(home);
  return result;
}

std::unique_ptr<v1::CoordinatorService::Stub> CoordinatorStub(const std::string& address) {
  return v1::CoordinatorService::NewStub(rpc::MakeChannel({.address = address}));
}

std::unique_ptr<v1::ClusterService::Stub> ClusterStub(const std::string& address) {
  return v1::ClusterService::NewStub(rpc::MakeChannel({.address = address}));
}

std::unique_ptr<grpc::ClientContext> Context(const std::string& token,
                                             std::chrono::milliseconds timeout) {
  auto context = std::make_unique<grpc::ClientContext>();
  rpc::PrepareContext(context.get(), token, timeout);
  return context;
}

absl::StatusOr<std::unique_ptr<Process>> StartWorker(const CoordinatorHandle& coordinator,
                                                     const std::string& id,
                                                     const std::string& work_dir,
                                                     const std::vector<std::string>& extra_args,
                                                     const std::string& binary) {
  std::error_code error;
  std::filesystem::create_directories(work_dir, error);
  if (error) return absl::InternalError(absl::StrCat("mkdir ", work_dir, ": ", error.message()));
  std::vector<std::string> argv = {binary,
                                   "--coordinator=" + coordinator.address,
                                   "--token-file=" + coordinator.state_dir + "/worker.token",
                                   "--worker-id=" + id,
                                   "--cpu-slots=1",
                                   "--work-dir=" + work_dir,
                                   "--metrics-addr="};
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  return Process::Start(argv, {}, work_dir + "/worker.out", work_dir + "/worker.err");
}

void PrintStderrTails(const std::string& dir, const std::vector<std::string>& worker_ids,
                      const CoordinatorHandle& coordinator) {
  auto tail = [](const std::string& text) {
    return text.size() > 6000 ? text.substr(text.size() - 6000) : text;
  };
  for (const std::string& id : worker_ids) {
    std::cerr << "---- worker " << id << " stderr (tail) ----\n"
              << tail(ReadFileOrEmpty(absl::StrCat(dir, "/", id, "/worker.err"))) << "\n";
  }
  if (coordinator.process != nullptr) {
    std::cerr << "---- coordinator stderr (tail) ----\n"
              << tail(coordinator.process->Stderr()) << "\n";
  }
}

bool WaitForAliveWorkers(v1::CoordinatorService::Stub* stub, const std::string& token, int count,
                         std::chrono::milliseconds timeout) {
  return WaitFor(
      [&] {
        v1::ListWorkersResponse r;
        if (!stub->ListWorkers(Context(token).get(), {}, &r).ok()) return false;
        int alive = 0;
        for (const v1::Worker& w : r.workers()) alive += w.state() == v1::Worker::ALIVE;
        return alive >= count;
      },
      timeout);
}

absl::StatusOr<std::string> SubmitJob(v1::CoordinatorService::Stub* stub, const std::string& token,
                                      const v1::JobSpec& spec) {
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::SubmitJobResponse response;
  grpc::Status s = stub->SubmitJob(Context(token).get(), request, &response);
  if (!s.ok()) return absl::UnknownError(absl::StrCat("SubmitJob: ", s.error_message()));
  return response.job().id();
}

v1::Job GetJob(v1::CoordinatorService::Stub* stub, const std::string& token,
               const std::string& job_id) {
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  if (!stub->GetJob(Context(token).get(), request, &job).ok()) return v1::Job();
  return job;
}

bool JobEnded(const v1::Job& job) {
  return job.state() == v1::Job::SUCCEEDED || job.state() == v1::Job::FAILED ||
         job.state() == v1::Job::CANCELLED;
}

v1::Job WaitForJobEnd(v1::CoordinatorService::Stub* stub, const std::string& token,
                      const std::string& job_id, std::chrono::milliseconds timeout) {
  v1::Job job;
  WaitFor(
      [&] {
        job = GetJob(stub, token, job_id);
        return JobEnded(job);
      },
      timeout);
  return job;
}

}  // namespace aidn::testing
