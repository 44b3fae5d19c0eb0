#ifndef AIDN_WORKER_COMMAND_AGENT_H_
#define AIDN_WORKER_COMMAND_AGENT_H_

// The worker as the agent of its command ranks (JobSpec.command), as
// torchrun's elastic agent is for its workers: before a rank's program
// starts, the worker joins the job's rendezvous for it, so the program gets
// the whole placement in its environment (worker/command_launch.h). The
// worker of rank 0 serves the generation's c10d store on a fresh port (or,
// with command.store RANK0, finds a free port for rank 0 to bind) and joins
// with that address; every rank learns it from the rendezvous.
//
//   CommandAgent agent(options, stub);
//   agent.Begin(assignment);                   // the join runs on its own thread
//   ...
//   for (CommandAgent::Ready& r : agent.TakeReady()) { start r.assignment with r.placement }
//   agent.EndGeneration(job, generation);     // its last rank here ended: the store goes

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "worker/command_launch.h"

namespace aidn::worker {

// A c10d store serving one generation; it stops when destroyed.
class GenerationStore {
 public:
  virtual ~GenerationStore() = default;
  virtual int port() const = 0;
  // Once the rendezvous named the generation's hosts: only clients from
  // those (numeric) addresses, and from this host only processes of
  // `local_users`, may connect from now on.
  virtual void AllowPeers(const std::set<std::string>& /*addresses*/,
                          const std::set<uid_t>& /*local_users*/) {}
};

struct CommandAgentOptions {
  std::string worker_id;
  // The node's address for peers: the store binds it.
  std::string address;
  // Starts a store bound to `address` on a fresh port (command.store AGENT).
  std::function<absl::StatusOr<std::unique_ptr<GenerationStore>>(const std::string& address)>
      start_store;
  // The users the ranks of command jobs run as: from this host, only their
  // processes may reach a generation's store.
  std::set<uid_t> local_users;
  // Called (from the join's thread, no lock held) when a join finished, so
  // the caller can take it at once rather than at its next look.
  std::function<void()> on_ready;
  // How long a join keeps retrying an unreachable coordinator.
  std::chrono::milliseconds join_deadline{30 * 60 * 1000};
};

class CommandAgent {
 public:
  // `channel` and `stub` are not owned and outlive the agent.
  CommandAgent(CommandAgentOptions options, grpc::Channel* channel,
               v1::ClusterService::StubInterface* stub);
  // Cancels pending joins and joins their threads; stores stop.
  ~CommandAgent();
  CommandAgent(const CommandAgent&) = delete;
  CommandAgent& operator=(const CommandAgent&) = delete;

  // Starts the join of this rank (a no-op if one is pending or done).
  void Begin(const v1::TrainerAssignment& assignment) ABSL_LOCKS_EXCLUDED(mu_);

  struct Ready {
    v1::TrainerAssignment assignment;
    // The placement, or why the join failed: FAILED_PRECONDITION or
    // DEADLINE_EXCEEDED when the generation ended or timed out (the
    // coordinator knows; nothing to report), CANCELLED after Cancel, or a
    // store that could not start.
    absl::StatusOr<CommandPlacement> placement;
  };
  // Joins that finished since the last call.
  std::vector<Ready> TakeReady() ABSL_LOCKS_EXCLUDED(mu_);

  // The rank is no longer assigned: its pending join is cancelled.
  void Cancel(const std::string& job_id, int64_t generation, int rank) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a join of this rank is under way.
  bool Pending(const std::string& job_id, int64_t generation, int rank) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // No rank of this generation runs here any more: its store stops.
  void EndGeneration(const std::string& job_id, int64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  // The generations whose store this worker serves now.
  std::vector<std::pair<std::string, int64_t>> StoreGenerations() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Key = std::tuple<std::string, int64_t, int>;
  struct Join {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> cancelled;
    bool done = false;
  };

  void Run(v1::TrainerAssignment assignment, std::shared_ptr<std::atomic<bool>> cancelled);
  // The address rank 0 joins with: the store's (starting it), or a free port
  // for rank 0 to bind.
  // The joined generation's store on this worker (if it serves one) takes
  // clients only from the hosts the rendezvous named.
  void RestrictStore(const v1::TrainerAssignment& assignment,
                     const v1::JoinRendezvousResponse& joined) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::string> StoreAddress(const v1::TrainerAssignment& assignment)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::JoinRendezvousResponse> JoinRendezvous(const v1::TrainerAssignment& assignment,
                                                            const std::string& address,
                                                            const std::atomic<bool>& cancelled)
      ABSL_LOCKS_EXCLUDED(mu_);

  const CommandAgentOptions options_;
  grpc::Channel* const channel_;
  v1::ClusterService::StubInterface* const stub_;

  mutable absl::Mutex mu_;
  std::map<Key, Join> joins_ ABSL_GUARDED_BY(mu_);
  std::vector<Ready> ready_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, int64_t>, std::unique_ptr<GenerationStore>> stores_
      ABSL_GUARDED_BY(mu_);
  // The context of each join's call in flight, to cancel it.
  std::map<Key, grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);
};

// A TCP port on `address` that was free a moment ago (bound to port 0, read
// back, closed). INTERNAL when nothing can be bound there.
absl::StatusOr<int> FindFreePort(const std::string& address);

}  // namespace aidn::worker

#endif  // AIDN_WORKER_COMMAND_AGENT_H_
