#include "tests/integration/cluster_fixture.h"

#include <signal.h>
#include <sys/stat.h>

#include <filesystem>
#include <future>
#include <iostream>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "aidn/v1/job.pb.h"
#include "common/rpc/client.h"
#include "common/status.h"
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
  const bool insecure = std::find(argv.begin(), argv.end(), "--insecure") != argv.end();
  handle.ca_file = insecure ? "" : state_dir + "/tls/ca.pem";
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

  RememberCaFile(handle.address, handle.ca_file);
  grpc::GenericStub stub(rpc::MakeChannel(ChannelTo(handle.address)));
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

namespace {

std::vector<std::string> AidnctlArgv(const CoordinatorHandle& coordinator, const std::string& token,
                                     const std::vector<std::string>& args) {
  std::vector<std::string> argv = {AIDNCTL_BIN, "--addr=" + coordinator.address};
  argv.push_back(coordinator.ca_file.empty() ? "--insecure" : "--tls-ca=" + coordinator.ca_file);
  if (!token.empty()) argv.push_back("--token=" + token);
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

// An empty home, so that no user config is read, and no address or token
// from the environment either.
std::vector<std::string> AidnctlEnv(const std::string& home) {
  return {"HOME=" + home, "AIDN_ADDR=", "AIDN_TOKEN="};
}

}  // namespace

CommandResult Aidnctl(const CoordinatorHandle& coordinator, const std::string& token,
                      const std::vector<std::string>& args, std::chrono::milliseconds timeout) {
  const std::string home = MakeTempDir("aidnctl-home");
  CommandResult result =
      RunCommand(AidnctlArgv(coordinator, token, args), AidnctlEnv(home), timeout);
  RemoveTree(home);
  return result;
}

absl::StatusOr<std::unique_ptr<Process>> StartAidnctl(const CoordinatorHandle& coordinator,
                                                      const std::string& token,
                                                      const std::vector<std::string>& args,
                                                      const std::string& home,
                                                      const std::string& stdout_path,
                                                      const std::string& stderr_path) {
  return Process::Start(AidnctlArgv(coordinator, token, args), AidnctlEnv(home), stdout_path,
                        stderr_path);
}

std::unique_ptr<v1::CoordinatorService::Stub> CoordinatorStub(const std::string& address) {
  return v1::CoordinatorService::NewStub(rpc::MakeChannel(ChannelTo(address)));
}

std::unique_ptr<v1::ClusterService::Stub> ClusterStub(const std::string& address) {
  return v1::ClusterService::NewStub(rpc::MakeChannel(ChannelTo(address)));
}

namespace {
absl::Mutex ca_mu;
std::map<std::string, std::string>& CaFiles() {
  static auto* files = new std::map<std::string, std::string>();
  return *files;
}
}  // namespace

void RememberCaFile(const std::string& address, const std::string& ca_file) {
  absl::MutexLock lock(&ca_mu);
  CaFiles()[address] = ca_file;
}

rpc::ChannelOptions ChannelTo(const std::string& address) {
  absl::MutexLock lock(&ca_mu);
  auto it = CaFiles().find(address);
  // A coordinator these helpers did not start: TLS with the system's roots.
  rpc::ChannelOptions options;
  options.address = address;
  if (it == CaFiles().end()) return options;
  options.tls_ca_file = it->second;
  options.insecure = it->second.empty();
  return options;
}

std::unique_ptr<grpc::ClientContext> Context(const std::string& token,
                                             std::chrono::milliseconds timeout) {
  auto context = std::make_unique<grpc::ClientContext>();
  rpc::PrepareContext(context.get(), token, timeout);
  return context;
}

bool JobEnded(const v1::Job& job) {
  return job.state() == v1::Job::SUCCEEDED || job.state() == v1::Job::FAILED ||
         job.state() == v1::Job::CANCELLED;
}

absl::StatusOr<std::string> SubmitJob(v1::CoordinatorService::Stub* stub, const std::string& token,
                                      const v1::JobSpec& spec) {
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::SubmitJobResponse response;
  const grpc::Status s = stub->SubmitJob(Context(token).get(), request, &response);
  if (!s.ok()) return absl::UnknownError(absl::StrCat("SubmitJob: ", Describe(s)));
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

std::string Describe(const grpc::Status& status) {
  return absl::StrCat("code ", static_cast<int>(status.error_code()), ": ", status.error_message());
}

std::string Describe(const CommandResult& result) {
  return absl::StrCat("exit ", result.exit_code, "\n--- stdout:\n", result.out, "\n--- stderr:\n",
                      result.err);
}

bool FashionMnistInstalled() {
  return std::filesystem::exists(std::string(kFashionMnist) + "/train-images-idx3-ubyte.gz") &&
         std::filesystem::exists(std::string(kFashionMnist) + "/t10k-images-idx3-ubyte.gz");
}

TestCluster::TestCluster(const std::string& name) : dir_(name) {}

TestCluster::~TestCluster() { StopAll(); }

void TestCluster::StopAll() {
  // The ids stay, for PrintLogTails.
  for (auto& [id, process] : workers_) process.reset();
  coordinator_.process.reset();
}

absl::Status TestCluster::StartCoordinator(const std::vector<std::string>& args,
                                           const std::string& state_name) {
  coordinator_args_ = args;
  state_name_ = state_name;
  absl::StatusOr<CoordinatorHandle> handle =
      aidn::testing::StartCoordinator(Path(state_name), args);
  if (!handle.ok()) return handle.status();
  coordinator_ = *std::move(handle);
  if (coordinator_.admin_token.empty() || coordinator_.worker_token.empty()) {
    return absl::InternalError("the coordinator wrote no admin or worker token");
  }
  coord_ = CoordinatorStub(coordinator_.address);
  cluster_ = ClusterStub(coordinator_.address);
  return absl::OkStatus();
}

absl::StatusOr<int> TestCluster::KillCoordinator() {
  if (coordinator_.process == nullptr) return absl::FailedPreconditionError("no coordinator");
  coordinator_.process->Signal(SIGKILL);
  absl::StatusOr<int> code = coordinator_.process->Wait(kStartTimeout);
  if (code.ok()) coordinator_.process.reset();
  return code;
}

absl::Status TestCluster::RestartCoordinator(bool same_address) {
  if (coordinator_.process != nullptr) {
    absl::StatusOr<int> killed = KillCoordinator();
    if (!killed.ok()) return killed.status();
  }
  const std::vector<std::string> args = coordinator_args_;
  const std::string address = coordinator_.address;
  std::vector<std::string> restart_args = args;
  if (same_address) restart_args.push_back("--listen=" + address);
  const absl::Status started = StartCoordinator(restart_args, state_name_);
  coordinator_args_ = args;  // a later restart picks its own address
  AIDN_RETURN_IF_ERROR(started);
  if (same_address && coordinator_.address != address) {
    return absl::InternalError(
        absl::StrCat("restarted on ", coordinator_.address, ", not on ", address));
  }
  return absl::OkStatus();
}

absl::Status TestCluster::StartWorker(const std::string& id, const WorkerOptions& options) {
  if (worker(id) != nullptr) return absl::AlreadyExistsError("worker " + id);
  const std::string work_dir = WorkDir(id);
  std::error_code error;
  std::filesystem::create_directories(work_dir, error);
  if (error) return absl::InternalError(absl::StrCat("mkdir ", work_dir, ": ", error.message()));
  std::vector<std::string> argv = {
      options.binary, "--coordinator=" + coordinator_.address,
      "--token-file=" + coordinator_.state_dir + "/worker.token", "--worker-id=" + id,
      absl::StrCat("--cpu-slots=", options.cpu_slots), "--work-dir=" + work_dir, "--metrics-addr=",
      // Corpora and checkpoints the tests make live here.
      "--allowed-paths=/usr/share," + dir(),
      coordinator_.ca_file.empty() ? std::string("--insecure")
                                   : "--tls-ca=" + coordinator_.ca_file};
  argv.insert(argv.end(), options.args.begin(), options.args.end());
  argv.insert(argv.begin(), options.wrapper.begin(), options.wrapper.end());
  const std::string log = work_dir + "/worker.log";
  absl::StatusOr<std::unique_ptr<Process>> process = Process::Start(argv, {}, log, log);
  if (!process.ok()) return process.status();
  workers_[id] = *std::move(process);
  return absl::OkStatus();
}

::testing::AssertionResult TestCluster::StartWorkers(const std::vector<std::string>& ids,
                                                     const WorkerOptions& options) {
  for (const std::string& id : ids) {
    absl::Status started = StartWorker(id, options);
    if (!started.ok()) return ::testing::AssertionFailure() << started;
  }
  int running = 0;
  for (const auto& [id, process] : workers_) running += process != nullptr;
  return WaitForAliveWorkers(running);
}

Process* TestCluster::worker(const std::string& id) {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : it->second.get();
}

std::string TestCluster::WorkerLog(const std::string& id) const {
  return ReadFileOrEmpty(WorkDir(id) + "/worker.log");
}

std::vector<std::string> TestCluster::worker_ids() const {
  std::vector<std::string> ids;
  for (const auto& [id, process] : workers_) ids.push_back(id);
  return ids;
}

void TestCluster::RemoveWorker(const std::string& id) { workers_.erase(id); }

CommandResult TestCluster::Aidnctl(const std::vector<std::string>& args,
                                   std::chrono::milliseconds timeout) const {
  return aidn::testing::Aidnctl(coordinator_, admin_token(), args, timeout);
}

CommandResult TestCluster::AidnctlAs(const std::string& token,
                                     const std::vector<std::string>& args) const {
  return aidn::testing::Aidnctl(coordinator_, token, args);
}

std::map<std::string, v1::Worker> TestCluster::Workers() {
  v1::ListWorkersResponse response;
  const grpc::Status status =
      coord_->ListWorkers(Context(admin_token()).get(), v1::ListWorkersRequest(), &response);
  EXPECT_TRUE(status.ok()) << "ListWorkers: " << Describe(status);
  std::map<std::string, v1::Worker> workers;
  for (const v1::Worker& w : response.workers()) workers[w.info().id()] = w;
  return workers;
}

bool TestCluster::WorkerIs(const std::string& id, v1::Worker::State state) {
  const std::map<std::string, v1::Worker> workers = Workers();
  auto it = workers.find(id);
  return it != workers.end() && it->second.state() == state;
}

::testing::AssertionResult TestCluster::WaitForAliveWorkers(int count,
                                                            std::chrono::milliseconds timeout) {
  auto alive = [&] {
    v1::ListWorkersResponse r;
    if (!coord_->ListWorkers(Context(admin_token()).get(), {}, &r).ok()) return -1;
    int n = 0;
    for (const v1::Worker& w : r.workers()) n += w.state() == v1::Worker::ALIVE;
    return n;
  };
  return WaitFor([&] { return alive() >= count; }, timeout, absl::StrCat(count, " workers ALIVE"),
                 [&] { return absl::StrCat(alive(), " are"); });
}

absl::StatusOr<std::string> TestCluster::Submit(const v1::JobSpec& spec) {
  return SubmitJob(coord(), admin_token(), spec);
}

v1::Job TestCluster::GetJob(const std::string& job_id) {
  return aidn::testing::GetJob(coord(), admin_token(), job_id);
}

absl::Status TestCluster::Cancel(const std::string& job_id, const std::string& reason) {
  v1::CancelJobRequest request;
  request.set_job_id(job_id);
  request.set_reason(reason);
  v1::Job job;
  const grpc::Status s = coord_->CancelJob(Context(admin_token()).get(), request, &job);
  if (!s.ok()) return absl::UnknownError(absl::StrCat("CancelJob: ", Describe(s)));
  return absl::OkStatus();
}

::testing::AssertionResult TestCluster::WaitForJob(
    const std::string& job_id, const std::function<bool(const v1::Job&)>& predicate,
    const std::string& what, std::chrono::milliseconds timeout, v1::Job* last) {
  v1::Job job;
  const ::testing::AssertionResult result = WaitFor(
      [&] {
        job = GetJob(job_id);
        return predicate(job);
      },
      timeout, absl::StrCat(job_id, " ", what),
      [&] {
        return absl::StrCat("last seen: ", job.ShortDebugString(), "\nevents:\n",
                            EventText(job_id));
      });
  if (last != nullptr) *last = job;
  return result;
}

::testing::AssertionResult TestCluster::WaitForState(const std::string& job_id,
                                                     v1::Job::State state,
                                                     std::chrono::milliseconds timeout,
                                                     v1::Job* last) {
  return WaitForJob(
      job_id, [state](const v1::Job& job) { return job.state() == state; },
      "becoming " + v1::Job::State_Name(state), timeout, last);
}

v1::Job TestCluster::WaitForEnd(const std::string& job_id, std::chrono::milliseconds timeout) {
  return WaitForJobEnd(coord(), admin_token(), job_id, timeout);
}

std::vector<v1::Event> TestCluster::Events(const std::string& job_id) {
  v1::ListEventsRequest request;
  request.set_job_id(job_id);
  request.set_limit(10000);
  v1::ListEventsResponse response;
  const grpc::Status status = coord_->ListEvents(Context(admin_token()).get(), request, &response);
  EXPECT_TRUE(status.ok()) << "ListEvents: " << Describe(status);
  return {response.events().begin(), response.events().end()};
}

std::string TestCluster::EventText(const std::string& job_id) {
  std::string text;
  for (const v1::Event& e : Events(job_id)) {
    absl::StrAppend(&text, e.seq(), " ", e.type(), " job=", e.job_id(), " gen=", e.generation(),
                    " worker=", e.worker_id(), ": ", e.message(), "\n");
  }
  return text;
}

std::vector<std::string> TestCluster::EventMessages(const std::string& job_id,
                                                    const std::string& type) {
  std::vector<std::string> messages;
  for (const v1::Event& e : Events(job_id)) {
    if (e.type() == type) messages.push_back(e.message());
  }
  return messages;
}

bool TestCluster::HasEvent(const std::string& type, const std::string& job_id,
                           const std::string& worker_id) {
  for (const v1::Event& e : Events(job_id)) {
    if (e.type() != type) continue;
    if (!job_id.empty() && e.job_id() != job_id) continue;
    if (!worker_id.empty() && e.worker_id() != worker_id) continue;
    return true;
  }
  return false;
}

::testing::AssertionResult TestCluster::WaitForEvent(const std::string& type,
                                                     const std::string& job_id,
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& worker_id) {
  return WaitFor([&] { return HasEvent(type, job_id, worker_id); }, timeout,
                 absl::StrCat("event ", type, " (job ", job_id, ", worker ", worker_id, ")"),
                 [&] { return "events:\n" + EventText(); });
}

std::vector<v1::StepMetrics> TestCluster::Metrics(const std::string& job_id, int64_t from,
                                                  int64_t to) {
  v1::GetMetricsRequest request;
  request.set_job_id(job_id);
  request.set_from_step(from);
  request.set_to_step(to);
  request.set_limit(100000);
  v1::GetMetricsResponse response;
  const grpc::Status s = coord_->GetMetrics(Context(admin_token()).get(), request, &response);
  EXPECT_TRUE(s.ok()) << "GetMetrics: " << Describe(s);
  return {response.steps().begin(), response.steps().end()};
}

std::vector<v1::Checkpoint> TestCluster::Checkpoints(const std::string& job_id) {
  v1::ListCheckpointsRequest request;
  request.set_job_id(job_id);
  v1::ListCheckpointsResponse response;
  const grpc::Status s = coord_->ListCheckpoints(Context(admin_token()).get(), request, &response);
  EXPECT_TRUE(s.ok()) << "ListCheckpoints: " << Describe(s);
  return {response.checkpoints().begin(), response.checkpoints().end()};
}

void TestCluster::PrintLogTails() const {
  auto tail = [](const std::string& text) {
    return text.size() > 6000 ? "..." + text.substr(text.size() - 6000) : text;
  };
  for (const auto& [id, process] : workers_) {
    std::cerr << "---- worker " << id << " log (tail) ----\n" << tail(WorkerLog(id)) << "\n";
  }
  if (coordinator_.process != nullptr) {
    std::cerr << "---- coordinator log (tail) ----\n"
              << tail(coordinator_.process->Stderr()) << "\n";
  }
  std::cerr << "---- cluster directory " << dir() << " ----\n";
}

void ClusterFixture::StopAllAndExpectNoProcesses() {
  if (cluster_ == nullptr) return;
  cluster_->StopAll();
  EXPECT_TRUE(
      WaitFor([&] { return ProcessesWith({cluster_->dir()}).empty(); }, std::chrono::seconds(15),
              "every process of the test gone",
              [&] { return absl::StrCat(ProcessesWith({cluster_->dir()}).size(), " left"); }));
}

}  // namespace aidn::testing
