#ifndef AIDN_WORKER_ENGINE_COMM_CPU_COMMUNICATOR_H_
#define AIDN_WORKER_ENGINE_COMM_CPU_COMMUNICATOR_H_

// Picks the CPU Communicator of a generation: shared memory when every rank
// runs on one host (and can map the same segment), Gloo over TCP otherwise,
// or the one the job asked for. Every rank takes the same decision, made in
// the shared-memory set-up exchange (shm_communicator.h).

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/comm/gloo_communicator.h"

namespace aidn::engine {

enum class CpuTransport {
  kAuto,  // shared memory if all ranks share a host, else Gloo
  kGloo,  // Gloo over TCP, always
  kShm,   // shared memory; UNAVAILABLE when the ranks cannot share it
};

struct CpuCommunicatorOptions {
  // Rank, world size, timeout, host and prefix; the shared-memory exchange
  // uses the keys "<prefix>/shm/...".
  GlooOptions gloo;
  CpuTransport transport = CpuTransport::kAuto;
  size_t shm_slot_bytes = size_t{4} << 20;
  // ShmOptions::host_identity (tests).
  std::string shm_host_identity;
};

struct CpuCommunicator {
  std::unique_ptr<Communicator> communicator;
  // "shm" or "gloo".
  std::string transport;
  // Why this one, for the trainer's log ("2 ranks on one host, 4096 KiB
  // slots", "only 1 of 2 ranks share rank 0's host and pid namespace").
  std::string description;
};

absl::StatusOr<CpuCommunicator> CreateCpuCommunicator(const CpuCommunicatorOptions& options,
                                                      KeyValueStore* store);

// A communicator among `members`, ranks of the job (options.gloo.rank and
// world_size are the job's), for one group of a ProcessGrid dimension
// (process_grid.h): this rank's rank in it is its index in `members`, and
// its keys live under "<options.gloo.prefix>/<name>", so that every group
// meets through the job's one store. Every member calls it with the same
// `members` and `name`; groups of one rank need no store. INVALID_ARGUMENT
// when this rank is not a member or a member is out of range or repeated.
absl::StatusOr<CpuCommunicator> CreateCpuGroupCommunicator(const CpuCommunicatorOptions& options,
                                                           const std::vector<int>& members,
                                                           const std::string& name,
                                                           KeyValueStore* store);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_COMM_CPU_COMMUNICATOR_H_
