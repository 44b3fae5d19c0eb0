#include "worker/c10d/wire_client.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace aidn::worker::c10d {
namespace {

using Clock = std::chrono::steady_clock;

int MillisLeft(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() < 0 ? 0 : static_cast<int>(left.count());
}

}  // namespace

absl::StatusOr<std::unique_ptr<WireClient>> WireClient::Connect(const std::string& host, int port,
                                                                std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int err = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); err != 0) {
    return absl::InvalidArgumentError(absl::StrCat("host \"", host, "\": ", gai_strerror(err)));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(found);
    return PosixError("socket", errno);
  }
  auto client = std::unique_ptr<WireClient>(new WireClient(fd));
  int rc = connect(fd, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  if (rc != 0 && errno != EINPROGRESS) return PosixError("connect", errno);
  if (rc != 0) {
    pollfd p{fd, POLLOUT, 0};
    if (poll(&p, 1, static_cast<int>(timeout.count())) != 1) {
      return absl::DeadlineExceededError(absl::StrCat("connect to ", host, ":", port));
    }
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return PosixError(absl::StrCat("connect to ", host, ":", port), err);
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return client;
}

WireClient::~WireClient() {
  if (fd_ >= 0) close(fd_);
}

absl::Status WireClient::SendRaw(std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("send", errno);
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status WireClient::Send(Dialect dialect, const Request& request) {
  auto bytes = EncodeRequest(dialect, request);
  if (!bytes.ok()) return bytes.status();
  return SendRaw(*bytes);
}

absl::StatusOr<std::string> WireClient::ReadExactly(size_t n, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    pollfd p{fd_, POLLIN, 0};
    const int ready = poll(&p, 1, MillisLeft(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("read ", got, " of ", n, " bytes within ", timeout.count(), " ms"));
    }
    const ssize_t r = recv(fd_, out.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      return absl::UnavailableError(
          absl::StrCat("connection closed after ", got, " of ", n, " bytes"));
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

absl::StatusOr<uint8_t> WireClient::ReadU8(std::chrono::milliseconds timeout) {
  AIDN_ASSIGN_OR_RETURN(std::string bytes, ReadExactly(1, timeout));
  return static_cast<uint8_t>(bytes[0]);
}

absl::StatusOr<uint32_t> WireClient::ReadU32(std::chrono::milliseconds timeout) {
  AIDN_ASSIGN_OR_RETURN(std::string bytes, ReadExactly(4, timeout));
  uint32_t value = 0;
  std::memcpy(&value, bytes.data(), sizeof(value));
  return value;
}

absl::StatusOr<int64_t> WireClient::ReadI64(std::chrono::milliseconds timeout) {
  AIDN_ASSIGN_OR_RETURN(std::string bytes, ReadExactly(8, timeout));
  int64_t value = 0;
  std::memcpy(&value, bytes.data(), sizeof(value));
  return value;
}

absl::StatusOr<std::string> WireClient::ReadBytes(std::chrono::milliseconds timeout) {
  AIDN_ASSIGN_OR_RETURN(int64_t size, ReadI64(timeout));
  if (size < 0 || size > (int64_t{1} << 32)) {
    return absl::DataLossError(absl::StrCat("reply length ", size));
  }
  return ReadExactly(static_cast<size_t>(size), timeout);
}

bool WireClient::Silent(std::chrono::milliseconds timeout) {
  pollfd p{fd_, POLLIN, 0};
  return poll(&p, 1, static_cast<int>(timeout.count())) == 0;
}

bool WireClient::WaitClosed(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  char buffer[4096];
  while (true) {
    pollfd p{fd_, POLLIN, 0};
    const int ready = poll(&p, 1, MillisLeft(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    const ssize_t r = recv(fd_, buffer, sizeof(buffer), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return true;
  }
}

}  // namespace aidn::worker::c10d
