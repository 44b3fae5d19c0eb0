#ifndef AIDN_WORKER_ENGINE_COMM_GLOO_COMMUNICATOR_H_
#define AIDN_WORKER_ENGINE_COMM_GLOO_COMMUNICATOR_H_

// The CPU Communicator: Gloo (Debian's libgloo, 2022 snapshot) over TCP.
//
// Ranks find each other through the engine's KeyValueStore (kv_store.h),
// seen by Gloo through an adapter to its gloo::rendezvous::Store: each rank
// publishes its listening addresses under "<prefix>/<rank>" and connects a
// full mesh. In a trainer the store is the coordinator's job KV
// (trainer/coordinator_store.h); in tests, an InMemoryKeyValueStore shared
// by threads.
//
// Algorithms: AllReduce of a small buffer (each rank sending at most
// 256 KiB) is one direct exchange of whole buffers, summed in rank order;
// larger ones run gloo::allreduce (ring, 1 MiB segments). Broadcast,
// AllGather and Barrier are Gloo's; ReduceScatter is a ring reduce-scatter
// of aidn's own (the 2022 Gloo has only the bound-buffer
// ReduceScatterHalvingDoubling). Only Gloo's unbound buffers are used: once
// a bound-buffer algorithm (gloo::AllreduceRing) has run on a context, this
// Gloo's gloo::allreduce on it gets 20-50 times slower. kAvg sums, then
// divides by world_size (as PyTorch DDP does).
//
// Errors: every Gloo exception is caught and returned as a status naming
// the collective ("gloo allreduce of 1024 floats: ..."): DEADLINE_EXCEEDED
// for a timeout (a peer that never arrives or stops answering), UNAVAILABLE
// for other I/O failures (a peer gone), or the status of a failed store call
// with its code (FAILED_PRECONDITION: the generation was superseded).
// After an error the communicator answers FAILED_PRECONDITION.
//
// Calls with count 0 communicate nothing and count as completed in
// sequence(); refused calls (INVALID_ARGUMENT) and failed ones do not.
//
// Closing: the destructor of a healthy communicator exchanges a farewell
// with every peer (waiting at most min(timeout, 5 s)) so that no rank closes
// its connections while a peer still finishes the last collective.
//
// Thread safety: as the Communicator contract (one collective at a time);
// rank(), world_size() and sequence() may be called from any thread.

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/comm/kv_store.h"

namespace aidn::engine {

struct GlooOptions {
  // This process' rank, 0 <= rank < world_size.
  int rank = 0;
  int world_size = 1;
  // Address (or host name) to bind for peers; peers connect to it.
  std::string host = "127.0.0.1";
  // Applies to the rendezvous (waiting for every rank's address) and to
  // each collective end to end.
  std::chrono::milliseconds timeout{60'000};
  // Prefix of the keys this communicator uses in the store ("<prefix>/0",
  // ...); empty: the bare rank numbers.
  std::string prefix;
};

// Connects to the other ranks (blocking until all arrived or the timeout)
// and returns the communicator; `store` is used during the call only.
// world_size 1 needs neither a network nor a store (`store` may be null
// then). INVALID_ARGUMENT for bad options, DEADLINE_EXCEEDED if a peer does
// not arrive in time, a failed store call's status, UNAVAILABLE for other
// network errors.
absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(const GlooOptions& options,
                                                                     KeyValueStore* store);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_COMM_GLOO_COMMUNICATOR_H_
