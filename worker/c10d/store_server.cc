#include "worker/c10d/store_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/c10d/store_state.h"

namespace aidn::worker::c10d {
namespace {

constexpr uint64_t kListenId = 0;
constexpr uint64_t kWakeId = 1;
constexpr size_t kReadChunk = 64 * 1024;
// Per readable event, so one busy client cannot starve the others.
constexpr int kReadsPerEvent = 16;

struct Client {
  ClientId id = 0;
  int fd = -1;
  std::string peer;
  std::optional<Dialect> dialect;
  std::string in;  // received, parsed up to in_pos
  size_t in_pos = 0;
  std::string out;  // to send, sent up to out_pos
  size_t out_pos = 0;
  size_t held = 0;  // in.size() + out.size(), as last counted in buffered_
  bool want_write = false;
  bool dirty = false;
  bool closing = false;
};

std::string PeerName(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
  }
  return absl::StrCat(host, ":", port);
}

// The client's numeric address, without the port.
std::string HostOf(const sockaddr_storage& addr) {
  const std::string name = PeerName(addr);
  return name.substr(0, name.rfind(':'));
}

bool IsLoopback(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr.s_addr) >> 24) == 127;
  }
  return addr.ss_family == AF_INET6 &&
         IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_addr);
}

// The uid of the socket listed in `table` (/proc/net/tcp or tcp6) whose
// local end is `local` and whose remote port is `remote_port` (":PPPP").
std::optional<uid_t> OwnerIn(const char* table, const std::string& local,
                             const std::string& remote_port) {
  std::ifstream in(table);
  std::string line;
  while (std::getline(in, line)) {
    const std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    uint32_t uid = 0;
    if (f.size() > 7 && f[1] == local && absl::EndsWith(f[2], remote_port) &&
        absl::SimpleAtoi(f[7], &uid)) {
      return static_cast<uid_t>(uid);
    }
  }
  return std::nullopt;
}

// The owner of a client's socket on this host, from /proc/net/tcp(6): the
// line whose local end is the client's address and whose remote port is
// the server's. The kernel prints each 32-bit word of the address as the
// integer it is in memory, then the port, in hex. An IPv4 client may be an
// IPv6 socket speaking through a v4-mapped address (PyTorch's client is):
// then it is listed in tcp6.
std::optional<uid_t> SocketOwner(const sockaddr_storage& client, int server_port) {
  const std::string remote_port = absl::StrFormat(":%04X", server_port);
  if (client.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&client);
    const uint16_t port = ntohs(in->sin_port);
    if (std::optional<uid_t> owner =
            OwnerIn("/proc/net/tcp", absl::StrFormat("%08X:%04X", in->sin_addr.s_addr, port),
                    remote_port)) {
      return owner;
    }
    uint32_t mapped_word = 0;
    const uint8_t mapped[4] = {0, 0, 0xff, 0xff};
    std::memcpy(&mapped_word, mapped, sizeof(mapped_word));
    return OwnerIn(
        "/proc/net/tcp6",
        absl::StrFormat("%08X%08X%08X%08X:%04X", 0, 0, mapped_word, in->sin_addr.s_addr, port),
        remote_port);
  }
  if (client.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&client);
    uint32_t words[4];
    std::memcpy(words, &in6->sin6_addr, sizeof(words));
    return OwnerIn("/proc/net/tcp6",
                   absl::StrFormat("%08X%08X%08X%08X:%04X", words[0], words[1], words[2], words[3],
                                   ntohs(in6->sin6_port)),
                   remote_port);
  }
  return std::nullopt;
}

absl::Status ValidateOptions(const StoreServerOptions& options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("port ", options.port, " is out of range"));
  }
  if (options.max_clients == 0) return absl::InvalidArgumentError("max_clients must be > 0");
  if (options.max_key_bytes == 0 || options.max_request_bytes == 0 ||
      options.max_total_bytes == 0 || options.max_buffered_bytes == 0) {
    return absl::InvalidArgumentError("byte limits must be > 0");
  }
  if (options.listen_backlog <= 0) {
    return absl::InvalidArgumentError("listen_backlog must be > 0");
  }
  return absl::OkStatus();
}

// A listening, non-blocking socket on `address`:`port`.
absl::StatusOr<int> Listen(const StoreServerOptions& options) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(options.port);
  if (int err = getaddrinfo(options.bind_address.c_str(), port.c_str(), &hints, &found); err != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bind_address \"", options.bind_address,
                     "\" is not a numeric address: ", gai_strerror(err)));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(found);
    return PosixError("c10d store socket", errno);
  }
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const int bound = bind(fd, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  if (bound != 0 || listen(fd, options.listen_backlog) != 0) {
    const int err = errno;
    close(fd);
    return PosixError(absl::StrCat("c10d store listen on ", options.bind_address, ":", port), err);
  }
  return fd;
}

int LocalPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return -1;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
}

}  // namespace

class StoreServer::Impl {
 public:
  Impl(const StoreServerOptions& options, int listen_fd, int epoll_fd, int wake_fd)
      : options_(options),
        limits_{options.max_key_bytes, options.max_value_bytes, options.max_keys_per_request},
        listen_fd_(listen_fd),
        epoll_fd_(epoll_fd),
        wake_fd_(wake_fd),
        port_(LocalPort(listen_fd)),
        state_(options.max_total_bytes) {
    spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (options.refuse_until_peers_set) peers_ = StorePeers{};
  }

  ~Impl() {
    for (int fd : {listen_fd_, epoll_fd_, wake_fd_, spare_fd_}) {
      if (fd >= 0) close(fd);
    }
  }

  void StartThread() {
    thread_ = std::thread([this] { Run(); });
  }

  void Stop() {
    std::lock_guard<std::mutex> lock(stop_mu_);
    if (stopped_) return;
    stopped_ = true;
    const uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof(one)) < 0) {
      AIDN_LOG(ERROR) << "c10d store: cannot wake its loop" << Kv("errno", errno);
    }
    if (thread_.joinable()) thread_.join();
  }

  int port() const { return port_; }
  void AllowPeers(StorePeers peers);
  size_t num_keys() const { return num_keys_.load(); }
  size_t num_clients() const { return num_clients_.load(); }
  size_t num_dropped() const { return num_dropped_.load(); }

 private:
  void Run();
  void Accept();
  void AcceptOne(int fd, const sockaddr_storage& addr);
  // Whether the client at `addr` may connect (StoreServer::AllowPeers); if
  // not, *why says why.
  bool Allowed(const sockaddr_storage& addr, std::string* why);
  void OnReadable(Client& client);
  void Process(Client& client);
  void Deliver();
  void Flush(Client& client);
  void SetWantWrite(Client& client, bool want);
  void Recount(Client& client);
  // Marks `client` for closing at the end of this loop turn. `bad` counts it
  // in num_dropped and logs a warning (else the line is at debug level).
  void Drop(Client& client, std::string_view reason, bool bad);
  void CloseDropped();
  void CloseAll();

  const StoreServerOptions options_;
  const ParseLimits limits_;
  int listen_fd_;  // closed (-1) when the loop ends
  const int epoll_fd_;
  const int wake_fd_;
  const int port_;
  int spare_fd_ = -1;  // closed to accept (and refuse) a client when out of fds
  std::thread thread_;
  std::mutex stop_mu_;
  // Who may connect; everyone when unset.
  std::mutex peers_mu_;
  std::optional<StorePeers> peers_;
  bool stopped_ = false;

  // Owned by the loop thread.
  StoreState state_;
  std::unordered_map<ClientId, std::unique_ptr<Client>> clients_;
  ClientId next_id_ = 2;
  size_t buffered_ = 0;
  std::vector<Delivery> deliveries_;
  std::vector<ClientId> dirty_;
  std::vector<ClientId> dropped_;

  std::atomic<size_t> num_keys_{0};
  std::atomic<size_t> num_clients_{0};
  std::atomic<size_t> num_dropped_{0};
};

void StoreServer::Impl::Run() {
  std::vector<epoll_event> events(256);
  bool stop = false;
  while (!stop) {
    const int n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      AIDN_LOG(ERROR) << "c10d store: epoll_wait failed, stopping" << Kv("errno", errno);
      break;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == kWakeId) {
        stop = true;
      } else if (id == kListenId) {
        Accept();
      } else if (auto it = clients_.find(id); it != clients_.end() && !it->second->closing) {
        Client& client = *it->second;
        if (events[i].events & EPOLLOUT) Flush(client);
        if (!client.closing && (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) {
          OnReadable(client);
        }
      }
    }
    for (ClientId id : dirty_) {
      auto it = clients_.find(id);
      if (it == clients_.end()) continue;
      it->second->dirty = false;
      if (!it->second->closing) Flush(*it->second);
    }
    dirty_.clear();
    CloseDropped();
    num_keys_.store(state_.num_keys());
  }
  CloseAll();
}

void StoreServer::Impl::Accept() {
  while (true) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    const int fd =
        accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      AcceptOne(fd, addr);
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if ((errno == EMFILE || errno == ENFILE) && spare_fd_ >= 0) {
      // Out of descriptors: take the waiting connection with the spare one and
      // close it, or the listener would stay readable and spin the loop.
      AIDN_LOG(WARNING) << "c10d store: out of file descriptors, refusing a client"
                        << Kv("clients", clients_.size());
      close(spare_fd_);
      const int refused = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (refused >= 0) close(refused);
      spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
      continue;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      AIDN_LOG(WARNING) << "c10d store: accept failed" << Kv("errno", errno);
    }
    return;
  }
}

bool StoreServer::Impl::Allowed(const sockaddr_storage& addr, std::string* why) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  if (!peers_.has_value()) return true;
  const std::string host = HostOf(addr);
  const bool local = IsLoopback(addr) || host == options_.bind_address;
  if (!local) {
    if (peers_->addresses.contains(host)) return true;
    *why = "not a host of the generation's ranks";
    return false;
  }
  const std::optional<uid_t> owner = SocketOwner(addr, port_);
  if (owner.has_value() && peers_->local_users.contains(*owner)) return true;
  *why = owner.has_value()
             ? absl::StrCat("a local process of uid ", *owner, ", not of a user the ranks run as")
             : std::string("a local process whose owner is unknown");
  return false;
}

void StoreServer::Impl::AllowPeers(StorePeers peers) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  peers_ = std::move(peers);
}

void StoreServer::Impl::AcceptOne(int fd, const sockaddr_storage& addr) {
  if (std::string why; !Allowed(addr, &why)) {
    AIDN_LOG(WARNING) << "c10d store: refusing a client" << Kv("peer", PeerName(addr))
                      << Kv("why", why);
    num_dropped_.fetch_add(1);
    close(fd);
    return;
  }
  if (clients_.size() >= options_.max_clients) {
    AIDN_LOG(WARNING) << "c10d store: refusing a client over max_clients"
                      << Kv("peer", PeerName(addr)) << Kv("max_clients", options_.max_clients);
    num_dropped_.fetch_add(1);
    close(fd);
    return;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  auto client = std::make_unique<Client>();
  client->id = next_id_++;
  client->fd = fd;
  client->peer = PeerName(addr);
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = client->id;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) {
    AIDN_LOG(WARNING) << "c10d store: cannot watch a client" << Kv("errno", errno);
    close(fd);
    return;
  }
  AIDN_LOG(DEBUG) << "c10d store: client connected" << Kv("peer", client->peer);
  clients_.emplace(client->id, std::move(client));
  num_clients_.store(clients_.size());
}

void StoreServer::Impl::OnReadable(Client& client) {
  char buffer[kReadChunk];
  bool eof = false;
  for (int i = 0; i < kReadsPerEvent; ++i) {
    const ssize_t n = recv(client.fd, buffer, sizeof(buffer), 0);
    if (n > 0) {
      if (buffered_ + static_cast<size_t>(n) > options_.max_buffered_bytes) {
        Drop(client, "the server's buffer budget (max_buffered_bytes) is spent", true);
        return;
      }
      client.in.append(buffer, static_cast<size_t>(n));
      Recount(client);
      if (static_cast<size_t>(n) < sizeof(buffer)) break;
      continue;
    }
    if (n == 0) {
      eof = true;
      break;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) break;
    Drop(client, absl::StrCat("receive failed: ", strerror(errno)), false);
    return;
  }
  Process(client);
  if (eof && !client.closing) {
    if (client.in_pos < client.in.size()) {
      Drop(client,
           absl::StrCat("disconnected in the middle of a request (",
                        client.in.size() - client.in_pos, " bytes of it had arrived)"),
           true);
    } else {
      Drop(client, "disconnected", false);
    }
  }
}

void StoreServer::Impl::Process(Client& client) {
  Request request;
  while (!client.closing && client.in_pos < client.in.size()) {
    const std::string_view input = std::string_view(client.in).substr(client.in_pos);
    if (!client.dialect) {
      client.dialect = DetectDialect(input, options_.unvalidated_dialect);
      if (!client.dialect) break;
    }
    auto taken = ParseRequest(*client.dialect, input, limits_, &request);
    if (!taken.ok()) {
      Drop(client, std::string(taken.status().message()), true);
      break;
    }
    if (*taken == 0) {
      if (input.size() > options_.max_request_bytes) {
        Drop(client,
             absl::StrCat("a request longer than max_request_bytes (", options_.max_request_bytes,
                          ")"),
             true);
      }
      break;
    }
    client.in_pos += *taken;
    if (auto status = state_.Apply(client.id, request, &deliveries_); !status.ok()) {
      Drop(client, absl::StrCat(OpName(request.op), ": ", status.message()), true);
      deliveries_.clear();
      break;
    }
    Deliver();
  }
  if (client.in_pos == client.in.size()) {
    client.in.clear();
    client.in_pos = 0;
  } else if (client.in_pos > kReadChunk) {
    client.in.erase(0, client.in_pos);
    client.in_pos = 0;
  }
  Recount(client);
}

void StoreServer::Impl::Deliver() {
  for (Delivery& delivery : deliveries_) {
    auto it = clients_.find(delivery.client);
    if (it == clients_.end() || it->second->closing) continue;
    Client& target = *it->second;
    target.out.append(delivery.bytes);
    if (!target.dirty) {
      target.dirty = true;
      dirty_.push_back(target.id);
    }
    Recount(target);
    if (target.out.size() - target.out_pos > options_.max_request_bytes) {
      Drop(target, "it does not read its replies (more than max_request_bytes pending)", true);
    } else if (buffered_ > options_.max_buffered_bytes) {
      Drop(target, "the server's buffer budget (max_buffered_bytes) is spent", true);
    }
  }
  deliveries_.clear();
}

void StoreServer::Impl::Flush(Client& client) {
  while (client.out_pos < client.out.size()) {
    const ssize_t n = send(client.fd, client.out.data() + client.out_pos,
                           client.out.size() - client.out_pos, MSG_NOSIGNAL);
    if (n > 0) {
      client.out_pos += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      SetWantWrite(client, true);
      Recount(client);
      return;
    }
    Drop(client, absl::StrCat("send failed: ", strerror(errno)), false);
    return;
  }
  client.out.clear();
  client.out_pos = 0;
  SetWantWrite(client, false);
  Recount(client);
}

void StoreServer::Impl::SetWantWrite(Client& client, bool want) {
  if (client.want_write == want) return;
  epoll_event event{};
  event.events = want ? (EPOLLIN | EPOLLOUT) : EPOLLIN;
  event.data.u64 = client.id;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, client.fd, &event) != 0) {
    Drop(client, absl::StrCat("epoll_ctl failed: ", strerror(errno)), false);
    return;
  }
  client.want_write = want;
}

void StoreServer::Impl::Recount(Client& client) {
  const size_t held = client.in.size() + client.out.size();
  buffered_ = buffered_ - client.held + held;
  client.held = held;
}

void StoreServer::Impl::Drop(Client& client, std::string_view reason, bool bad) {
  if (client.closing) return;
  client.closing = true;
  dropped_.push_back(client.id);
  if (bad) {
    num_dropped_.fetch_add(1);
    AIDN_LOG(WARNING) << "c10d store: dropping client" << Kv("peer", client.peer)
                      << Kv("reason", reason);
  } else {
    AIDN_LOG(DEBUG) << "c10d store: client gone" << Kv("peer", client.peer) << Kv("reason", reason);
  }
}

void StoreServer::Impl::CloseDropped() {
  for (ClientId id : dropped_) {
    auto it = clients_.find(id);
    if (it == clients_.end()) continue;
    Client& client = *it->second;
    state_.ForgetClient(id);
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, client.fd, nullptr);
    close(client.fd);
    buffered_ -= client.held;
    clients_.erase(it);
  }
  dropped_.clear();
  num_clients_.store(clients_.size());
}

void StoreServer::Impl::CloseAll() {
  for (auto& [id, client] : clients_) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, client->fd, nullptr);
    close(client->fd);
  }
  clients_.clear();
  close(listen_fd_);
  listen_fd_ = -1;
  buffered_ = 0;
  num_clients_.store(0);
}

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(const StoreServerOptions& options) {
  AIDN_RETURN_IF_ERROR(ValidateOptions(options));
  AIDN_ASSIGN_OR_RETURN(const int listen_fd, Listen(options));
  const int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  const int epoll_errno = errno;
  const int wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  const int wake_errno = errno;
  // Owns the descriptors from here on, so every return below closes them.
  auto impl = std::make_unique<Impl>(options, listen_fd, epoll_fd, wake_fd);
  if (epoll_fd < 0) return PosixError("c10d store epoll_create1", epoll_errno);
  if (wake_fd < 0) return PosixError("c10d store eventfd", wake_errno);
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = kListenId;
  if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listen_fd, &event) != 0) {
    return PosixError("c10d store epoll_ctl", errno);
  }
  event.data.u64 = kWakeId;
  if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &event) != 0) {
    return PosixError("c10d store epoll_ctl", errno);
  }
  impl->StartThread();
  AIDN_LOG(INFO) << "c10d store listening" << Kv("address", options.bind_address)
                 << Kv("port", impl->port())
                 << Kv("unvalidated_dialect", DialectName(options.unvalidated_dialect));
  return std::unique_ptr<StoreServer>(new StoreServer(std::move(impl)));
}

StoreServer::StoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StoreServer::~StoreServer() { Stop(); }
int StoreServer::port() const { return impl_->port(); }
void StoreServer::Stop() { impl_->Stop(); }
void StoreServer::AllowPeers(StorePeers peers) { impl_->AllowPeers(std::move(peers)); }
size_t StoreServer::num_keys() const { return impl_->num_keys(); }
size_t StoreServer::num_clients() const { return impl_->num_clients(); }
size_t StoreServer::num_dropped() const { return impl_->num_dropped(); }

}  // namespace aidn::worker::c10d
