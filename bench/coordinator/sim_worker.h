#ifndef AIDN_BENCH_COORDINATOR_SIM_WORKER_H_
#define AIDN_BENCH_COORDINATOR_SIM_WORKER_H_

// One simulated worker daemon. It registers, then heartbeats the way
// worker/daemon.cc does: the call carries the trainers it runs, max_wait =
// the heartbeat interval and the assignments_version of the last answer, so
// the coordinator holds it until the assignments change or the interval
// passed; a changed answer is followed by the next heartbeat at once, an
// early unchanged one waits out the interval. Assignments are reconciled as
// the daemon does (start what is missing, stop what is not listed or
// ordered stopped, report every trainer's end with ReportTrainerExit).
// A probe heartbeats with max_wait 0 and offers no slots.

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "aidn/v1/cluster.grpc.pb.h"
#include "bench/coordinator/load.h"
#include "bench/coordinator/sim_trainer.h"

namespace aidn::bench {

// Thread-safe. Must outlive every call it started (see Teardown).
class SimWorker {
 public:
  SimWorker(Load* load, int index, bool probe);

  const std::string& id() const { return id_; }
  size_t channel() const { return static_cast<size_t>(index_); }

  // Registers, then heartbeats until the load stops. `registered` is
  // called once the first registration was answered (ok or not).
  void Start(std::function<void(bool)> registered);

  // A trainer of this worker ended: forget it, report it.
  void TrainerEnded(const TrainerKey& key, int exit_code, bool by_order);

 private:
  struct RegisterCall;
  struct HeartbeatCall;
  struct ExitCall;

  void Register();
  void OnRegistered(RegisterCall* call, const grpc::Status& status);
  void AddStatus(const TrainerKey& key, v1::TrainerStatus* t) const;
  void Heartbeat();
  void OnHeartbeat(HeartbeatCall* call, const grpc::Status& status);
  // As Daemon::ApplyStops and Daemon::Reconcile.
  void Reconcile(const v1::HeartbeatResponse& r);
  void ReportExit(const TrainerKey& key, int exit_code, bool by_order, int attempt);

  Load* const load_;
  const int index_;
  const std::string id_;
  const bool probe_;
  v1::ClusterService::Stub* const stub_;
  std::function<void(bool)> registered_cb_;
  // Touched only by the one call chain (register -> heartbeat -> ...).
  int64_t version_ = 0;
  milliseconds interval_{2000};
  milliseconds backoff_{100};

  std::mutex mu_;
  std::map<TrainerKey, std::shared_ptr<SimTrainer>> trainers_;
  // Ended, still listed by the coordinator: not started again.
  std::set<TrainerKey> finished_;
};

}  // namespace aidn::bench

#endif  // AIDN_BENCH_COORDINATOR_SIM_WORKER_H_
