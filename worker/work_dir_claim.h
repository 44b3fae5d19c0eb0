#ifndef AIDN_WORKER_WORK_DIR_CLAIM_H_
#define AIDN_WORKER_WORK_DIR_CLAIM_H_

// A worker daemon's claim on its work directory, held for the daemon's
// life: an exclusive lock on <work_dir>/worker.lock (flock: released by the
// kernel however the process ends), so two daemons never share a directory
// (their trainers' files, checkpoints and logs would collide), and the
// worker's instance id kept in <work_dir>/worker.instance: the same across
// restarts of the worker on that directory, different for any other
// worker. The coordinator refuses a registration under a live worker's id
// from another instance (WorkerInfo.instance).

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace aidn::worker {

class WorkDirClaim {
 public:
  // Locks `work_dir` (which must exist) and reads its instance id, making
  // one (32 random hex digits, written atomically) the first time.
  // FAILED_PRECONDITION naming the directory and the holder's pid when
  // another process holds it; the file system's errors otherwise.
  static absl::StatusOr<std::unique_ptr<WorkDirClaim>> Take(const std::string& work_dir);
  ~WorkDirClaim();
  WorkDirClaim(const WorkDirClaim&) = delete;
  WorkDirClaim& operator=(const WorkDirClaim&) = delete;

  const std::string& instance() const { return instance_; }

 private:
  WorkDirClaim(int fd, std::string instance) : fd_(fd), instance_(std::move(instance)) {}
  int fd_;
  std::string instance_;
};

}  // namespace aidn::worker

#endif  // AIDN_WORKER_WORK_DIR_CLAIM_H_
