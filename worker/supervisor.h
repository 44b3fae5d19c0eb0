#ifndef AIDN_WORKER_SUPERVISOR_H_
#define AIDN_WORKER_SUPERVISOR_H_

// Child processes of the worker daemon (its trainers): start, stop with a
// grace period, reap, and tell how each one ended. No gRPC inside; the daemon
// (worker/daemon.h) maps children onto assignments and reports their exits.
//
//   Supervisor supervisor;
//   AIDN_ASSIGN_OR_RETURN(Supervisor::ChildId id,
//                         supervisor.Start({.argv = {"/bin/sh", "-c", "exit 3"},
//                                           .log_path = "/tmp/w/rank-0.log"}));
//   ...
//   for (const ChildExit& e : supervisor.Reap()) { ... e.exit_code, e.signal, e.log_tail ... }

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"

namespace aidn::worker {

struct SupervisorOptions {
  // How much of the end of a child's log ChildExit::log_tail holds: at most
  // this many lines...
  int log_tail_lines = 20;
  // ...and at most this many bytes (the newest ones).
  size_t log_tail_max_bytes = 4096;
  // Time for kill deadlines; nullptr means Clock::Real(). Not owned.
  Clock* clock = nullptr;
  // How long a SIGKILLed child may take to end before it is reported as
  // ended anyway (ChildExit::abandoned).
  std::chrono::milliseconds kill_timeout{10'000};
};

// What to run.
struct ChildSpec {
  // The file executed: a path (no $PATH search). Empty: argv[0].
  std::string program = {};
  // argv[0] is the name the child shows in `ps` and /proc/<pid>/cmdline.
  std::vector<std::string> argv = {};
  // "KEY=VALUE" entries added to (or replacing those in) the daemon's own
  // environment. Secrets go here, never in argv (argv is world-readable in
  // /proc).
  std::vector<std::string> env = {};
  // stdout and stderr of the child are appended to this file; its parent
  // directories are created (0755) if missing. stdin is /dev/null.
  std::string log_path = {};
  // The child's current directory; empty: the daemon's.
  std::string cwd = {};
  // When set, the child drops to this user and group (supplementary groups
  // cleared) before exec; the daemon must be root to do so.
  struct RunAs {
    uid_t uid = 0;
    gid_t gid = 0;
  };
  std::optional<RunAs> run_as = std::nullopt;
  // Made by the child itself, after it took run_as and before it enters
  // cwd, so the daemon never creates or changes anything in a directory the
  // child's user controls: directories to create (with their parents, mode
  // 0755; existing ones are fine) and a file to remove if present.
  std::vector<std::string> make_dirs = {};
  std::string remove_file = {};
};

// The executable `program` names: itself when it contains a '/', else the
// first executable file of that name in the directories of `path` (a $PATH
// value). NOT_FOUND naming the program and the path otherwise.
absl::StatusOr<std::string> FindProgram(const std::string& program, const std::string& path);

// How a child ended.
struct ChildExit {
  int64_t id = 0;
  pid_t pid = 0;
  // The exit status if the child exited, else 0.
  int exit_code = 0;
  // The signal that killed it, else 0.
  int signal = 0;
  // The last lines of its log file (see SupervisorOptions).
  std::string log_tail;
  // Stop() had been called for it before it ended.
  bool stopped = false;
  // Stop() escalated to SIGKILL.
  bool killed_after_grace = false;
  // It did not end within SupervisorOptions::kill_timeout of its SIGKILL (a
  // process stuck in the kernel): reported as ended (signal SIGKILL) so that
  // nothing waits on it for ever; it is still reaped when it does end.
  bool abandoned = false;
};

// A child not yet reaped.
struct ChildStatus {
  int64_t id = 0;
  pid_t pid = 0;
  bool stopping = false;
};

// Runs children, each the leader of its own process group, and follows them
// until they are reaped. Guarantees:
//  - Every child gets PR_SET_PDEATHSIG(SIGKILL): if the daemon dies (even by
//    SIGKILL), its children die too. Linux delivers that signal when the
//    *thread* that forked the child exits, so call Start from a thread that
//    outlives the children (the daemon's supervision thread).
//  - Stop() sends SIGTERM to the child's whole process group, and SIGKILL to
//    the group once the grace period has passed (checked by Reap()).
//  - When a child ends, whatever is left of its process group is SIGKILLed
//    before the child is reaped (the zombie keeps the group id from being
//    reused meanwhile), so a child's own children never outlive it.
//  - The child starts with an empty signal mask and default signal
//    dispositions, whatever the daemon blocked or ignored.
//  - The destructor SIGKILLs every group still running and reaps it.
// Reap() is non-blocking; call it regularly (e.g. every 50 ms). The daemon
// must not ignore SIGCHLD (children would then be reaped by the kernel).
//
// Thread-safe; calls are serialised by an internal mutex.
class Supervisor {
 public:
  using ChildId = int64_t;

  explicit Supervisor(SupervisorOptions options = {});
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Forks and execs `spec`. Returns once the exec succeeded; an exec that
  // fails (no such file, not executable), a cwd that cannot be entered or a
  // user that cannot be taken is an error (naming which) and leaves no
  // child behind.
  absl::StatusOr<ChildId> Start(const ChildSpec& spec);

  // Sends SIGTERM to the child's process group now and SIGKILL once `grace`
  // has passed (at once if `grace` is zero or negative). Stopping a child
  // that is already stopping keeps the earlier SIGKILL deadline. NOT_FOUND if
  // `id` is not a running child.
  absl::Status Stop(ChildId id, std::chrono::milliseconds grace);

  // Reaps the children that have ended (without blocking) and escalates
  // overdue stops to SIGKILL. Each child is reported exactly once.
  std::vector<ChildExit> Reap();

  // Stops every child (as Stop) and waits until all are reaped, polling
  // every `poll`. Returns their exits.
  std::vector<ChildExit> StopAllAndWait(
      std::chrono::milliseconds grace,
      std::chrono::milliseconds poll = std::chrono::milliseconds(20));

  // Children started and not yet reaped, in start order.
  std::vector<ChildStatus> Running() const;

 private:
  struct Child {
    pid_t pid = 0;
    std::string log_path;
    bool stopping = false;
    bool killed = false;
    Clock::TimePoint kill_at;
    // When SIGKILL was sent.
    Clock::TimePoint killed_at;
  };

  std::string LogTail(const std::string& path) const;

  const SupervisorOptions options_;
  Clock* const clock_;

  mutable absl::Mutex mu_;
  ChildId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<ChildId, Child> children_ ABSL_GUARDED_BY(mu_);
  // Abandoned children (see ChildExit::abandoned), reaped when they end.
  std::vector<pid_t> abandoned_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aidn::worker

#endif  // AIDN_WORKER_SUPERVISOR_H_
