#ifndef AIDN_WORKER_ENGINE_COMM_SHM_COMMUNICATOR_H_
#define AIDN_WORKER_ENGINE_COMM_SHM_COMMUNICATOR_H_

// The same-host Communicator: every rank of the generation maps one POSIX
// shared-memory segment and the collectives are copies and sums through it,
// instead of TCP over loopback (Gloo reaches ~1.1 GB/s on loopback; memory
// copies run at ~10 GB/s per core).
//
// Setting up (through a KeyValueStore, as every communicator):
// each rank publishes its host identity (boot id, PID namespace); unless
// all are equal the communicator is "not applicable". Rank 0 creates the
// segment (/dev/shm/aidn-<pid>-<random>, mode 0600) with a random nonce in
// its header and publishes the name; the others map it and check the nonce
// (a rank that sees another /dev/shm, as in another container, fails that
// check); every rank publishes whether it attached, and unless all did the
// communicator is "not applicable" on every rank alike. Rank 0 unlinks the
// name once all attached, so nothing is left in /dev/shm whatever happens
// to the processes later.
//
// Segment: a header (per rank: a sequence word, a sleeper count, the pid, a
// failed flag, each on its own cache line), then one staging slot per rank
// and one result slot of `slot_bytes` each. Collectives go in chunks of one
// slot. AllReduce per chunk: copy in, barrier, each rank sums its 1/world
// share of the chunk over all slots (in rank order, so every rank gets the
// same bits) into the result slot and its own buffer, barrier, copy the
// other shares out. A barrier is "bump my sequence word, wait until every
// rank's reached this phase": a short spin, then a futex wait (shared, on
// the peer's word) woken by the peer's bump.
//
// Errors: a peer process that exits mid-collective is noticed within
// ~20 ms (UNAVAILABLE naming its rank and pid); a peer that stops
// answering gives DEADLINE_EXCEEDED after `timeout`; a rank that fails
// sets its failed flag, and peers waiting on it fail at once (ABORTED).
// After an error the communicator answers FAILED_PRECONDITION.
//
// Thread safety: as the Communicator contract (one collective at a time);
// rank(), world_size() and sequence() may be called from any thread.

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/comm/kv_store.h"

namespace aidn::engine {

struct ShmOptions {
  int rank = 0;
  int world_size = 1;
  // Applies to the set-up exchange and to each wait within a collective.
  std::chrono::milliseconds timeout{60'000};
  // Prefix of the store keys ("<prefix>/host/0", ...).
  std::string prefix = "shm";
  // Per-rank staging slot; collectives larger than this go in chunks.
  // Clamped so that the segment stays under 512 MiB.
  size_t slot_bytes = size_t{4} << 20;
  // Pause instructions spun before sleeping on a futex.
  int spin = 4000;
  // Host identity to publish; empty: this machine's (boot id and PID
  // namespace). Tests set it to play ranks on different hosts.
  std::string host_identity;
};

struct ShmAttempt {
  // Null when shared memory cannot serve this generation (ranks on other
  // hosts or unable to map the segment); every rank gets the same answer.
  std::unique_ptr<Communicator> communicator;
  // Why not, or what was set up ("2 ranks, 4 MiB slots").
  std::string description;
};

// Blocks until every rank took part in the exchange; `store` is used during
// the call only. Errors are the store's, with their codes
// (DEADLINE_EXCEEDED for a rank that never arrives), or INVALID_ARGUMENT for
// bad options; "not applicable" is no error but a null communicator.
absl::StatusOr<ShmAttempt> CreateShmCommunicator(const ShmOptions& options, KeyValueStore* store);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_COMM_SHM_COMMUNICATOR_H_
