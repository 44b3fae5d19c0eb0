#include "worker/command_agent.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/rpc/client.h"
#include "common/rpc/retry.h"
#include "common/rpc/status_convert.h"
#include "common/status.h"

namespace aidn::worker {
namespace {

using SteadyClock = std::chrono::steady_clock;

std::string HostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

}  // namespace

absl::StatusOr<int> FindFreePort(const std::string& address) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(address.c_str(), "0", &hints, &found); rc != 0) {
    return absl::InternalError(absl::StrCat("resolving ", address, ": ", gai_strerror(rc)));
  }
  absl::Status error = absl::InternalError(absl::StrCat("no address to bind for ", address));
  int port = 0;
  for (addrinfo* ai = found; ai != nullptr && port == 0; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage bound = {};
    socklen_t length = sizeof(bound);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) == 0) {
      port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    } else {
      error = PosixError(absl::StrCat("bind ", address), errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  if (port == 0) return error;
  return port;
}

CommandAgent::CommandAgent(CommandAgentOptions options, grpc::Channel* channel,
                           v1::ClusterService::StubInterface* stub)
    : options_(std::move(options)), channel_(channel), stub_(stub) {}

CommandAgent::~CommandAgent() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, join] : joins_) {
      join.cancelled->store(true);
      threads.push_back(std::move(join.thread));
    }
    for (auto& [key, context] : calls_) context->TryCancel();
  }
  for (std::thread& t : threads) {
    if (t.joinable()) t.join();
  }
}

void CommandAgent::Begin(const v1::TrainerAssignment& assignment) {
  absl::MutexLock lock(&mu_);
  const Key key{assignment.job_id(), assignment.generation(), assignment.rank()};
  if (joins_.contains(key)) return;
  Join& join = joins_[key];
  join.cancelled = std::make_shared<std::atomic<bool>>(false);
  join.thread =
      std::thread([this, assignment, cancelled = join.cancelled] { Run(assignment, cancelled); });
}

void CommandAgent::Run(v1::TrainerAssignment assignment,
                       std::shared_ptr<std::atomic<bool>> cancelled) {
  absl::StatusOr<CommandPlacement> placement;
  absl::StatusOr<std::string> address =
      assignment.rank() == 0 ? StoreAddress(assignment) : std::string();
  if (!address.ok()) {
    placement = Annotate(address.status(), "c10d store");
  } else {
    absl::StatusOr<v1::JoinRendezvousResponse> joined =
        JoinRendezvous(assignment, *address, *cancelled);
    placement = joined.ok() ? CommandPlacementOf(*joined, assignment.rank()) : joined.status();
    if (joined.ok()) RestrictStore(assignment, *joined);
  }
  if (cancelled->load()) placement = absl::CancelledError("the rank is no longer assigned");
  {
    absl::MutexLock lock(&mu_);
    const Key key{assignment.job_id(), assignment.generation(), assignment.rank()};
    joins_[key].done = true;
    ready_.push_back({std::move(assignment), std::move(placement)});
  }
  if (options_.on_ready) options_.on_ready();
}

void CommandAgent::RestrictStore(const v1::TrainerAssignment& a,
                                 const v1::JoinRendezvousResponse& joined) {
  std::set<std::string> hosts;
  for (const v1::Peer& peer : joined.peers()) {
    // "host:port" or "[v6]:port"; the host as the kernel will name it.
    std::string host = peer.address().substr(0, peer.address().rfind(':'));
    if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
    addrinfo hints = {};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) continue;
    for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
      char numeric[NI_MAXHOST];
      if (getnameinfo(ai->ai_addr, ai->ai_addrlen, numeric, sizeof(numeric), nullptr, 0,
                      NI_NUMERICHOST) == 0) {
        hosts.insert(numeric);
      }
    }
    freeaddrinfo(found);
  }
  absl::MutexLock lock(&mu_);
  auto it = stores_.find({a.job_id(), a.generation()});
  if (it == stores_.end()) return;
  it->second->AllowPeers(hosts, options_.local_users);
  AIDN_LOG(INFO) << "c10d store open to the generation's hosts" << Kv("job", a.job_id())
                 << Kv("generation", a.generation()) << Kv("hosts", absl::StrJoin(hosts, ","));
}

absl::StatusOr<std::string> CommandAgent::StoreAddress(const v1::TrainerAssignment& a) {
  if (a.spec().command().store() == v1::CommandSpec::RANK0) {
    AIDN_ASSIGN_OR_RETURN(const int port, FindFreePort(options_.address));
    return HostPort(options_.address, port);
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = stores_.find({a.job_id(), a.generation()});
    if (it != stores_.end()) return HostPort(options_.address, it->second->port());
  }
  if (!options_.start_store) return absl::UnimplementedError("this worker serves no c10d store");
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<GenerationStore> store,
                        options_.start_store(options_.address));
  const int port = store->port();
  AIDN_LOG(INFO) << "c10d store serving" << Kv("job", a.job_id())
                 << Kv("generation", a.generation())
                 << Kv("address", HostPort(options_.address, port));
  absl::MutexLock lock(&mu_);
  stores_[{a.job_id(), a.generation()}] = std::move(store);
  return HostPort(options_.address, port);
}

absl::StatusOr<v1::JoinRendezvousResponse> CommandAgent::JoinRendezvous(
    const v1::TrainerAssignment& a, const std::string& address,
    const std::atomic<bool>& cancelled) {
  const SteadyClock::time_point deadline = SteadyClock::now() + options_.join_deadline;
  const Key key{a.job_id(), a.generation(), a.rank()};
  rpc::Backoff backoff;
  while (true) {
    grpc::ClientContext context;
    // The coordinator answers at the job's rendezvous timeout at the latest.
    rpc::PrepareContext(&context, a.trainer_token(), std::chrono::hours(24));
    v1::JoinRendezvousRequest request;
    request.set_job_id(a.job_id());
    request.set_generation(a.generation());
    request.set_rank(a.rank());
    request.set_worker_id(options_.worker_id);
    request.set_address(address);
    v1::JoinRendezvousResponse response;
    {
      absl::MutexLock lock(&mu_);
      if (cancelled.load()) return absl::CancelledError("the rank is no longer assigned");
      calls_[key] = &context;
    }
    grpc::Status status = stub_->JoinRendezvous(&context, request, &response);
    {
      absl::MutexLock lock(&mu_);
      calls_.erase(key);
    }
    if (status.ok()) return response;
    // As the built-in trainer: only an unreachable coordinator is worth
    // another join (DEADLINE_EXCEEDED is the rendezvous timing out, ABORTED a
    // newer join of the rank replacing this one).
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE || cancelled.load() ||
        !backoff.FitsBefore(deadline)) {
      return rpc::FromGrpcStatus(status);
    }
    rpc::ResetBackoffAfter(status, channel_);
    AIDN_LOG(WARNING) << "coordinator unreachable, retrying the rendezvous" << Kv("job", a.job_id())
                      << Kv("rank", a.rank()) << Kv("error", status.error_message());
    backoff.Sleep(deadline);
  }
}

std::vector<CommandAgent::Ready> CommandAgent::TakeReady() {
  std::vector<Ready> ready;
  std::vector<std::thread> finished;
  {
    absl::MutexLock lock(&mu_);
    ready.swap(ready_);
    for (auto it = joins_.begin(); it != joins_.end();) {
      if (!it->second.done) {
        ++it;
        continue;
      }
      finished.push_back(std::move(it->second.thread));
      it = joins_.erase(it);
    }
  }
  for (std::thread& t : finished) t.join();
  return ready;
}

void CommandAgent::Cancel(const std::string& job_id, int64_t generation, int rank) {
  absl::MutexLock lock(&mu_);
  const Key key{job_id, generation, rank};
  auto it = joins_.find(key);
  if (it == joins_.end()) return;
  it->second.cancelled->store(true);
  if (auto call = calls_.find(key); call != calls_.end()) call->second->TryCancel();
}

bool CommandAgent::Pending(const std::string& job_id, int64_t generation, int rank) const {
  absl::MutexLock lock(&mu_);
  auto it = joins_.find({job_id, generation, rank});
  return it != joins_.end() && !it->second.done;
}

void CommandAgent::EndGeneration(const std::string& job_id, int64_t generation) {
  std::unique_ptr<GenerationStore> store;
  {
    absl::MutexLock lock(&mu_);
    auto it = stores_.find({job_id, generation});
    if (it == stores_.end()) return;
    store = std::move(it->second);
    stores_.erase(it);
  }
  AIDN_LOG(INFO) << "c10d store stopped" << Kv("job", job_id) << Kv("generation", generation);
  store.reset();  // outside the lock: stopping joins its thread
}

std::vector<std::pair<std::string, int64_t>> CommandAgent::StoreGenerations() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, int64_t>> generations;
  for (const auto& [key, store] : stores_) generations.push_back(key);
  return generations;
}

}  // namespace aidn::worker
