#ifndef AIDN_WORKER_ENGINE_COMM_PEER_LINK_H_
#define AIDN_WORKER_ENGINE_COMM_PEER_LINK_H_

// Point to point between two ranks (a pipeline's neighbouring stages),
// carried by a Communicator of exactly those two ranks: a group of the
// job's ranks (CreateCpuGroupCommunicator) on shared memory or Gloo.
//
// Send and Recv pair up as a Broadcast from the sender, so they move what a
// send would, and any backend carries them. Exchange sends and receives at
// once, as 1F1B's steady state needs (a stage sends an activation forward
// while its next stage sends a gradient back): an AllGather of the two
// buffers, which no order of calls can deadlock, as two blocking sends
// could.
//
// Call-order contract: as the communicator's; the two ranks call matching
// operations (Send with Recv, Exchange with Exchange) with the same counts
// (an Exchange's mirrored). Host memory only. Errors are the
// communicator's; after one the link is unusable.

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"

namespace aidn::engine {

class PeerLink {
 public:
  // INVALID_ARGUMENT unless `pair` has world size 2.
  static absl::StatusOr<PeerLink> Create(std::unique_ptr<Communicator> pair);

  // The peer's rank within the pair (0 or 1) and this rank's.
  int self() const { return pair_->rank(); }
  int peer() const { return 1 - pair_->rank(); }

  absl::Status Send(const float* data, size_t count);
  absl::Status Recv(float* data, size_t count);
  // Sends `send_count` floats of `send` and receives the peer's
  // `recv_count` into `recv`; the peer passes the same two counts the other
  // way round.
  absl::Status Exchange(const float* send, size_t send_count, float* recv, size_t recv_count);

  Communicator* communicator() { return pair_.get(); }

 private:
  explicit PeerLink(std::unique_ptr<Communicator> pair) : pair_(std::move(pair)) {}

  std::unique_ptr<Communicator> pair_;
  // Exchange's gather buffer (two blocks of the larger count), kept.
  std::vector<float> gather_;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_COMM_PEER_LINK_H_
