#ifndef AIDN_BENCH_COORDINATOR_LOAD_H_
#define AIDN_BENCH_COORDINATOR_LOAD_H_

// What the simulated workers and trainers share: the channels to the
// coordinator, the timer that paces them, and what they count.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "aidn/v1/cluster.grpc.pb.h"
#include "bench/coordinator/measure.h"
#include "bench/coordinator/options.h"
#include "bench/coordinator/timer.h"
#include "grpcpp/generic/generic_stub.h"

namespace aidn::bench {

// What the real daemon and trainer use (worker/daemon.h, trainer.cc).
constexpr milliseconds kDaemonRpcTimeout{5'000};
constexpr milliseconds kTrainerRpcTimeout{10'000};
constexpr milliseconds kReporterPeriod{1'000};  // Reporter::kReportPeriod
constexpr milliseconds kBeatPeriod{1'000};
constexpr size_t kReporterBatch = 512;
constexpr int kExitSuperseded = 75;  // worker/trainer/trainer.h
// A job's role, "load" or "rendezvous", in this label of its spec.
constexpr char kRoleLabel[] = "aidn-bench/role";

// The rendezvous of the big job, as its simulated trainers saw it.
struct RendezvousTrace {
  std::mutex mu;
  Clock::time_point submitted{};
  Clock::time_point first_join_sent{};
  Clock::time_point last_join_sent{};
  Clock::time_point last_answer{};
  int joins_sent = 0;
  int answered = 0;
  int failed = 0;
  std::string first_error;
  std::vector<float> waits_ms;  // each rank's join to answer
  size_t answer_bytes = 0;      // the largest answer, serialised
};

// Everything the simulated processes share. Thread-safe (atomics, and
// Latencies and RendezvousTrace lock themselves).
struct Load {
  explicit Load(const Options& o)
      : options(o),
        heartbeat_now(&window),
        heartbeat_late(&window),
        metrics(&window),
        progress(&window),
        join(&window),
        exit_reports(&window) {}

  const Options options;
  std::string worker_token;
  std::vector<std::unique_ptr<v1::ClusterService::Stub>> stubs;
  // Over the same channels, for calls whose answer is not parsed.
  std::vector<std::unique_ptr<grpc::GenericStub>> generic_stubs;
  Timer timer;
  Window window;
  std::atomic<bool> stopping{false};
  std::atomic<int64_t> in_flight{0};
  std::atomic<int64_t> calls_done{0};  // every call answered (or failed)

  // Heartbeats answered at once (probes, and the first after a
  // registration); held heartbeats answered at their deadline: how late
  // past max_wait.
  Latencies heartbeat_now;
  Latencies heartbeat_late;
  Latencies metrics;
  Latencies progress;
  Latencies join;
  Latencies exit_reports;
  std::atomic<int64_t> heartbeats{0};  // every answered heartbeat
  std::atomic<int64_t> woken{0};       // held ones answered by a change
  std::atomic<int64_t> records_sent{0};
  std::atomic<int64_t> registered{0};
  std::atomic<int64_t> registrations_failed{0};
  std::atomic<int64_t> reregistrations{0};  // after NOT_FOUND
  std::atomic<int64_t> load_ranks_streaming{0};
  std::atomic<int64_t> trainers_superseded{0};
  std::atomic<int64_t> trainer_failures{0};  // rendezvous refused etc.
  RendezvousTrace rendezvous;

  v1::ClusterService::Stub* Stub(size_t i) { return stubs[i % stubs.size()].get(); }
  grpc::GenericStub* GenericStub(size_t i) { return generic_stubs[i % stubs.size()].get(); }
};

// Counts a call in flight for as long as it lives.
class InFlight {
 public:
  explicit InFlight(Load* load) : load_(load) { load_->in_flight.fetch_add(1); }
  ~InFlight() {
    load_->calls_done.fetch_add(1);
    load_->in_flight.fetch_sub(1);
  }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  Load* const load_;
};

struct TrainerKey {
  std::string job_id;
  int64_t generation = 0;
  int rank = 0;
  bool operator<(const TrainerKey& o) const {
    return std::tie(job_id, generation, rank) < std::tie(o.job_id, o.generation, o.rank);
  }
};

}  // namespace aidn::bench

#endif  // AIDN_BENCH_COORDINATOR_LOAD_H_
