#ifndef AIDN_WORKER_C10D_STORE_SERVER_H_
#define AIDN_WORKER_C10D_STORE_SERVER_H_

// A c10d TCPStore server: what `torch.distributed.TCPStore(is_master=True)`
// serves, for ranks that are all clients (TORCHELASTIC_USE_AGENT_STORE=True).
// The worker daemon of a job's rank-0 node runs one per job generation, on a
// fresh port, so a generation never sees another's keys.
//
// One thread runs an epoll loop over non-blocking sockets: a client blocked
// in WAIT holds no thread, and is answered when its keys appear. Each
// connection speaks the dialect of its client (protocol.h): kValidated
// clients are recognised by their handshake, the others are taken to speak
// `StoreServerOptions::unvalidated_dialect`. A client that sends something
// the server cannot serve (an unknown command byte, a field over the limits,
// a frame cut off by a disconnect, a request that would take the store over
// its byte budget) is disconnected with a log line; other clients do not
// notice.
//
// Thread-safe: Start, port, Stop and the counters may be called from any
// thread.

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "worker/c10d/protocol.h"

namespace aidn::worker::c10d {

struct StoreServerOptions {
  // The numeric address to listen on (IPv4 or IPv6), the one peers reach.
  std::string bind_address = "127.0.0.1";
  // 0: the kernel picks a free port (read it back with port()).
  int port = 0;
  // Connections beyond this are accepted and closed at once. PyTorch 1.13
  // opens two connections per TCPStore (one for watchKey callbacks).
  size_t max_clients = 4096;
  // Limits on one request's fields (checked before they are buffered).
  size_t max_key_bytes = 64 * 1024;
  size_t max_value_bytes = 64 * 1024 * 1024;
  size_t max_keys_per_request = 128 * 1024;
  // One request, all fields together.
  size_t max_request_bytes = 128 * 1024 * 1024;
  // All keys, values and queued items together.
  size_t max_total_bytes = 1024ull * 1024 * 1024;
  // Bytes buffered for all clients together: requests still arriving and
  // replies the client has not read yet. The client whose bytes would go over
  // is disconnected.
  size_t max_buffered_bytes = 1024ull * 1024 * 1024;
  // The dialect of clients that do not open with VALIDATE: PyTorch up to 2.0
  // (kTorch1, which includes this machine's 1.13) or 2.1 (kTorch21).
  Dialect unvalidated_dialect = Dialect::kTorch1;
  // listen(2) backlog: a whole job's ranks connect at once.
  int listen_backlog = 4096;
  // Refuses every client until AllowPeers says who may connect (a worker's
  // store, before the rendezvous names the generation's hosts).
  bool refuse_until_peers_set = false;
};

// Who may connect to a generation's store: clients from the hosts of its
// ranks only, and, from an address of this host, only processes of the
// users its ranks run as (the owner of the client's socket, from
// /proc/net/tcp).
struct StorePeers {
  // Numeric addresses (what getpeername gives).
  std::set<std::string> addresses;
  std::set<uid_t> local_users;
};

class StoreServer {
 public:
  // Binds, listens and starts the loop thread. INVALID_ARGUMENT for a bad
  // address or option, the bind error (e.g. port in use) otherwise.
  static absl::StatusOr<std::unique_ptr<StoreServer>> Start(const StoreServerOptions& options);
  ~StoreServer();  // Stop()
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // The port it listens on (the kernel's pick when options.port was 0).
  int port() const;
  // Closes every client and the listener and joins the loop thread.
  // Idempotent.
  void Stop();

  // From now on, only these peers are accepted (clients already connected
  // stay). Without a call every client is (tests, benchmarks);
  // StoreServerOptions::refuse_until_peers_set refuses all until one.
  void AllowPeers(StorePeers peers);

  // For tests and metrics; updated by the loop as it goes.
  size_t num_keys() const;
  size_t num_clients() const;
  // Clients disconnected for bad input or over a limit, since Start.
  size_t num_dropped() const;

  class Impl;

 private:
  explicit StoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace aidn::worker::c10d

#endif  // AIDN_WORKER_C10D_STORE_SERVER_H_
