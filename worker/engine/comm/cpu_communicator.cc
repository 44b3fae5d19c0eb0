#include "worker/engine/comm/cpu_communicator.h"

#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/engine/comm/shm_communicator.h"

namespace aidn::engine {

absl::StatusOr<CpuCommunicator> CreateCpuCommunicator(const CpuCommunicatorOptions& options,
                                                      KeyValueStore* store) {
  const GlooOptions& gloo = options.gloo;
  std::string why_not_shm;
  if (options.transport != CpuTransport::kGloo && gloo.world_size > 1) {
    ShmOptions shm;
    shm.rank = gloo.rank;
    shm.world_size = gloo.world_size;
    shm.timeout = gloo.timeout;
    shm.prefix = gloo.prefix.empty() ? "shm" : absl::StrCat(gloo.prefix, "/shm");
    shm.slot_bytes = options.shm_slot_bytes;
    shm.host_identity = options.shm_host_identity;
    absl::StatusOr<ShmAttempt> attempt = CreateShmCommunicator(shm, store);
    if (!attempt.ok()) return attempt.status();
    if (attempt->communicator != nullptr) {
      return CpuCommunicator{std::move(attempt->communicator), "shm",
                             std::move(attempt->description)};
    }
    if (options.transport == CpuTransport::kShm) {
      return absl::UnavailableError(absl::StrCat(
          "shared memory was asked for but cannot serve this generation: ", attempt->description));
    }
    why_not_shm = std::move(attempt->description);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateGlooCommunicator(gloo, store);
  if (!comm.ok()) return comm.status();
  std::string description;
  if (gloo.world_size == 1) {
    description = "one rank";
  } else if (options.transport == CpuTransport::kGloo) {
    description = "asked for";
  } else {
    description = absl::StrCat("no shared memory: ", why_not_shm);
  }
  return CpuCommunicator{*std::move(comm), "gloo", std::move(description)};
}

absl::StatusOr<CpuCommunicator> CreateCpuGroupCommunicator(const CpuCommunicatorOptions& options,
                                                           const std::vector<int>& members,
                                                           const std::string& name,
                                                           KeyValueStore* store) {
  const int rank = options.gloo.rank;
  int index = -1;
  std::set<int> seen;
  for (size_t i = 0; i < members.size(); ++i) {
    const int m = members[i];
    if (m < 0 || m >= options.gloo.world_size || !seen.insert(m).second) {
      return absl::InvalidArgumentError(absl::StrCat("group ", name, ": member ", m,
                                                     " is out of range or repeated (world_size ",
                                                     options.gloo.world_size, ")"));
    }
    if (m == rank) index = static_cast<int>(i);
  }
  if (index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("group ", name, ": rank ", rank, " is not one of its members"));
  }
  CpuCommunicatorOptions group = options;
  group.gloo.rank = index;
  group.gloo.world_size = static_cast<int>(members.size());
  group.gloo.prefix =
      options.gloo.prefix.empty() ? name : absl::StrCat(options.gloo.prefix, "/", name);
  return CreateCpuCommunicator(group, store);
}

}  // namespace aidn::engine
