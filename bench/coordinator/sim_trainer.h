#ifndef AIDN_BENCH_COORDINATOR_SIM_TRAINER_H_
#define AIDN_BENCH_COORDINATOR_SIM_TRAINER_H_

// One simulated trainer process: it joins the rendezvous, then reports as
// worker/trainer/trainer.cc's Reporter does (one StreamMetrics call a
// second with the TRAIN records made since the last, one in flight at a
// time, and a ReportProgress beat a second, the first at once). A trainer
// of the big rendezvous job (role "rendezvous") exits 0 once answered.

#include <cstdint>
#include <memory>
#include <mutex>

#include "aidn/v1/cluster.grpc.pb.h"
#include "bench/coordinator/load.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace aidn::bench {

class SimWorker;

// Thread-safe; owned by shared pointers (its calls hold one).
class SimTrainer : public std::enable_shared_from_this<SimTrainer> {
 public:
  SimTrainer(Load* load, SimWorker* worker, v1::TrainerAssignment a, size_t channel)
      : load_(load),
        worker_(worker),
        a_(std::move(a)),
        stub_(load->Stub(channel)),
        generic_stub_(load->GenericStub(channel)) {
    auto it = a_.spec().labels().find(kRoleLabel);
    rendezvous_only_ = it != a_.spec().labels().end() && it->second == "rendezvous";
  }

  TrainerKey key() const { return {a_.job_id(), a_.generation(), a_.rank()}; }

  void Start() { Join(); }

  // SIGTERM from its worker: it stops reporting.
  void Stop() {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }

 private:
  struct JoinCall {
    explicit JoinCall(Load* l) : guard(l) {}
    InFlight guard;
    grpc::ClientContext context;
    v1::JoinRendezvousRequest request;
    v1::JoinRendezvousResponse response;
    // The big rendezvous' answers stay serialised (see Join).
    grpc::ByteBuffer raw_request;
    grpc::ByteBuffer raw_response;
    Clock::time_point start;
  };

  void Join();
  void OnJoined(JoinCall* call, const grpc::Status& status);
  void Tick();
  void SendMetrics(int64_t from_step, int64_t to_step);
  void SendProgress(int64_t step);
  // Ends the trainer: its worker reports the exit.
  void Exit(int code);

  Load* const load_;
  SimWorker* const worker_;
  const v1::TrainerAssignment a_;
  v1::ClusterService::Stub* const stub_;
  grpc::GenericStub* const generic_stub_;
  bool rendezvous_only_ = false;

  std::mutex mu_;
  bool stopped_ = false;
  bool exited_ = false;
  Clock::time_point started_{};  // training start: steps follow from it
  int64_t sent_step_ = 0;        // records up to here were sent
  bool metrics_in_flight_ = false;
  bool progress_in_flight_ = false;
  Clock::time_point next_beat_{};
};

}  // namespace aidn::bench

#endif  // AIDN_BENCH_COORDINATOR_SIM_TRAINER_H_
