#include "coordinator/rendezvous.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

namespace aidn::coordinator {

void Rendezvous::Join(const v1::Peer& peer, Callback done, Deferred* deferred) {
  if (peer.rank() < 0 || peer.rank() >= world_size_) {
    deferred->Add([done = std::move(done), peer, n = world_size_]() {
      done(absl::InvalidArgumentError(
          absl::StrCat("rank: must be in [0, ", n, "), got ", peer.rank())));
    });
    return;
  }
  if (!failed_.ok()) {
    deferred->Add([done = std::move(done), s = failed_]() { done(s); });
    return;
  }
  if (completed_.has_value()) {
    v1::JoinRendezvousResponse response = *completed_;
    response.set_rank(peer.rank());
    deferred->Add([done = std::move(done), response]() { done(response); });
    return;
  }
  peers_[peer.rank()] = peer;
  auto it = waiters_.find(peer.rank());
  if (it != waiters_.end()) {
    // A retried join: the earlier call's client has most likely gone away.
    deferred->Add([old = std::move(it->second), rank = peer.rank()]() {
      old(absl::AbortedError(absl::StrCat("superseded by a newer join of rank ", rank)));
    });
    it->second = std::move(done);
  } else {
    waiters_.emplace(peer.rank(), std::move(done));
  }
}

std::vector<int> Rendezvous::MissingRanks() const {
  std::vector<int> missing;
  for (int r = 0; r < world_size_; ++r) {
    if (!peers_.contains(r)) missing.push_back(r);
  }
  return missing;
}

std::vector<v1::Peer> Rendezvous::Peers() const {
  std::vector<v1::Peer> peers;
  for (const auto& [rank, peer] : peers_) peers.push_back(peer);
  return peers;
}

void Rendezvous::Complete(const v1::JoinRendezvousResponse& base, Deferred* deferred) {
  completed_ = base;
  // Each rank's answer lists every peer: world_size^2 peers in all (a
  // million at 1,024 ranks). They are copied once the caller's lock is
  // released, not under it, where they held up every other call.
  auto shared = std::make_shared<const v1::JoinRendezvousResponse>(base);
  for (auto& [rank, done] : waiters_) {
    deferred->Add([done = std::move(done), shared, rank = rank]() {
      v1::JoinRendezvousResponse response = *shared;
      response.set_rank(rank);
      done(std::move(response));
    });
  }
  waiters_.clear();
}

void Rendezvous::Fail(const absl::Status& status, Deferred* deferred) {
  failed_ = status;
  for (auto& [rank, done] : waiters_) {
    deferred->Add([done = std::move(done), status]() { done(status); });
  }
  waiters_.clear();
}

}  // namespace aidn::coordinator
