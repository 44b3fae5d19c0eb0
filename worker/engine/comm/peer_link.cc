#include "worker/engine/comm/peer_link.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace aidn::engine {

absl::StatusOr<PeerLink> PeerLink::Create(std::unique_ptr<Communicator> pair) {
  if (pair == nullptr || pair->world_size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("a peer link needs a communicator of 2 ranks, got ",
                     pair == nullptr ? 0 : pair->world_size()));
  }
  return PeerLink(std::move(pair));
}

absl::Status PeerLink::Send(const float* data, size_t count) {
  // Broadcast writes the root's buffer back unchanged.
  return pair_->Broadcast(const_cast<float*>(data), count, self());
}

absl::Status PeerLink::Recv(float* data, size_t count) {
  return pair_->Broadcast(data, count, peer());
}

absl::Status PeerLink::Exchange(const float* send, size_t send_count, float* recv,
                                size_t recv_count) {
  // Both ranks size the blocks alike: the larger of the two counts.
  const size_t block = std::max(send_count, recv_count);
  if (block == 0) return absl::OkStatus();
  gather_.resize(2 * block);
  float* mine = gather_.data() + static_cast<size_t>(self()) * block;
  std::memcpy(mine, send, send_count * sizeof(float));
  std::fill(mine + send_count, mine + block, 0.0f);
  if (absl::Status s = pair_->AllGather(mine, block, gather_.data()); !s.ok()) return s;
  std::memcpy(recv, gather_.data() + static_cast<size_t>(peer()) * block,
              recv_count * sizeof(float));
  return absl::OkStatus();
}

}  // namespace aidn::engine
