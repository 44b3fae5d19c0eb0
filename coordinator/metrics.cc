#include "coordinator/metrics.h"

#include <chrono>
#include <string>

#include "grpcpp/support/status.h"

namespace aidn::coordinator {
namespace {

using metrics::ExponentialBuckets;

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

// One per call: notes when the call started, and records it when the
// status goes out (or, for a call that ends without sending one, when the
// call is torn down).
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(grpc::experimental::ServerRpcInfo* info, CoordinatorMetrics* metrics)
      : metrics_(metrics), start_(std::chrono::steady_clock::now()) {
    // "/aidn.v1.CoordinatorService/SubmitJob"
    std::string full = info->method() != nullptr ? info->method() : "";
    if (!full.empty() && full[0] == '/') full.erase(0, 1);
    const size_t slash = full.find('/');
    service_ = slash == std::string::npos ? "" : full.substr(0, slash);
    method_ = slash == std::string::npos ? full : full.substr(slash + 1);
  }

  ~RpcMetricsInterceptor() override {
    if (!recorded_) Record(grpc::StatusCode::CANCELLED);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (!recorded_ && methods->QueryInterceptionHookPoint(
                          grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      Record(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void Record(grpc::StatusCode code) {
    recorded_ = true;
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    metrics_->rpcs.Add({{"service", service_}, {"method", method_}, {"code", CodeName(code)}})
        .Increment();
    metrics_->rpc_duration_seconds.Add({{"service", service_}, {"method", method_}})
        .Observe(seconds);
  }

  CoordinatorMetrics* const metrics_;
  const std::chrono::steady_clock::time_point start_;
  std::string service_;
  std::string method_;
  bool recorded_ = false;
};

class RpcMetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsInterceptorFactory(CoordinatorMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcMetricsInterceptor(info, metrics_);
  }

 private:
  CoordinatorMetrics* const metrics_;
};

}  // namespace

CoordinatorMetrics::CoordinatorMetrics(metrics::Registry* r)
    : registry(r),
      jobs(r->AddGauge("aidn_jobs", "Jobs known to the coordinator, by state.")),
      jobs_in_memory(r->AddGauge("aidn_jobs_in_memory",
                                 "Jobs the coordinator holds in memory: those not finished and "
                                 "those finished within --job_retention; the others are read "
                                 "from its database.")
                         .Add({})),
      jobs_unstored(r->AddGauge("aidn_jobs_unstored",
                                "Jobs changed in memory whose write to the database failed (a "
                                "full disk?); retried every tick.")
                        .Add({})),
      job_state(
          r->AddGauge("aidn_job_state", "1 for the state the job is in (label state), per job.")),
      job_step(r->AddGauge("aidn_job_step", "Newest step any rank of the job completed.")),
      job_total_steps(r->AddGauge("aidn_job_total_steps",
                                  "Steps the job runs in all (0 until its trainers report).")),
      job_epoch(r->AddGauge("aidn_job_epoch", "Epoch of the job's newest step.")),
      job_loss(r->AddGauge("aidn_job_loss", "Training loss of the newest step, mean over ranks.")),
      job_samples_per_second(r->AddGauge(
          "aidn_job_samples_per_second",
          "Samples of the newest step, summed over ranks, over the slowest rank's step time.")),
      job_tokens_per_second(r->AddGauge(
          "aidn_job_tokens_per_second",
          "Tokens of the newest step, summed over ranks, over the slowest rank's step time "
          "(language models).")),
      job_peak_memory_bytes(
          r->AddGauge("aidn_job_peak_memory_bytes",
                      "The largest peak resident memory of the job's rank processes, as of the "
                      "newest step.")),
      job_device_peak_memory_bytes(r->AddGauge(
          "aidn_job_device_peak_memory_bytes",
          "The largest peak bytes in use of the job's ranks' GPU allocators, as of the newest "
          "step (GPU jobs; the CUDA libraries' own memory not counted).")),
      job_step_seconds(
          r->AddGauge("aidn_job_step_seconds", "The slowest rank's time for the newest step.")),
      job_allreduce_seconds(
          r->AddGauge("aidn_job_allreduce_seconds",
                      "Time in the gradient allreduce in the newest step, mean over ranks.")),
      job_restarts(r->AddGauge("aidn_job_restarts", "Failures of the job so far.")),
      job_generation(r->AddGauge("aidn_job_generation", "The job's current generation.")),
      job_world_size(r->AddGauge("aidn_job_world_size", "Ranks of the job.")),
      job_last_checkpoint_step(r->AddGauge("aidn_job_last_checkpoint_step",
                                           "Step of the job's newest committed checkpoint.")),
      job_test_accuracy(r->AddGauge("aidn_job_test_accuracy",
                                    "Test-set accuracy at the job's newest evaluation (0 to 1).")),
      job_test_loss(r->AddGauge("aidn_job_test_loss", "Test-set loss at the newest evaluation.")),
      job_steps_total(r->AddCounter("aidn_job_steps_total",
                                    "Training steps of the job combined from its ranks' records.")),
      job_samples_total(r->AddCounter(
          "aidn_job_samples_total",
          "Training samples of the job's combined steps, summed over ranks (rate() is the "
          "job's throughput).")),
      rank_step_seconds(r->AddHistogram("aidn_rank_step_seconds",
                                        "Time of each training step, per rank.",
                                        ExponentialBuckets(0.0005, 2, 16))),
      rank_allreduce_seconds(
          r->AddHistogram("aidn_rank_allreduce_seconds",
                          "Time spent in the gradient allreduce in each step, per rank.",
                          ExponentialBuckets(0.0001, 2, 18))),
      rank_step(r->AddGauge("aidn_rank_step", "Newest step the rank reported progress for.")),
      rank_last_progress_age_seconds(
          r->AddGauge("aidn_rank_last_progress_age_seconds",
                      "Seconds since the rank last reported progress (running generations only).")),
      rank_straggler(r->AddGauge("aidn_rank_straggler",
                                 "1 while the rank's median compute time (step less allreduce "
                                 "wait) is over 1.5x the other ranks' (running "
                                 "generations only).")),
      worker_up(r->AddGauge("aidn_worker_up", "1 while the worker heartbeats, 0 once lost.")),
      worker_scheduling(r->AddGauge("aidn_worker_scheduling",
                                    "1 for the worker's scheduling state (label scheduling: "
                                    "schedulable, cordoned or draining), 0 for the others.")),
      worker_heartbeat_age_seconds(r->AddGauge("aidn_worker_heartbeat_age_seconds",
                                               "Seconds since the worker's last heartbeat.")),
      worker_slots(r->AddGauge("aidn_worker_slots",
                               "Slots the worker offers: CPU threads or GPUs (label kind).")),
      worker_slots_used(r->AddGauge("aidn_worker_slots_used", "Slots given to jobs.")),
      worker_slots_free(r->AddGauge("aidn_worker_slots_free", "Slots free for new jobs.")),
      records_received(
          r->AddCounter("aidn_metric_records_total", "Per-rank metric records received.").Add({})),
      records_dropped(r->AddCounter("aidn_metric_records_dropped_total",
                                    "Metric records dropped: late for a step already "
                                    "combined, or from a rank out of range.")
                          .Add({})),
      steps_stored(r->AddCounter("aidn_metric_steps_stored_total",
                                 "Combined steps written to the SQLite store.")
                       .Add({})),
      store_batch_seconds(r->AddHistogram("aidn_metric_store_batch_seconds",
                                          "Time to write one batch of steps to SQLite.",
                                          ExponentialBuckets(0.0001, 2, 16))
                              .Add({})),
      tick_seconds(r->AddHistogram("aidn_coordinator_tick_seconds",
                                   "Time one tick (timeouts, scheduling, held heartbeats due, "
                                   "step expiry) held the coordinator's lock.",
                                   ExponentialBuckets(0.0001, 2, 16))
                       .Add({})),
      rpcs(r->AddCounter("aidn_rpcs_total", "RPCs handled, by method and status code.")),
      rpc_duration_seconds(r->AddHistogram(
          "aidn_rpc_duration_seconds",
          "Time from an RPC's arrival to its status, by method (long polls and streams "
          "included).",
          ExponentialBuckets(0.0001, 4, 12))) {}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewRpcMetricsInterceptor(
    CoordinatorMetrics* metrics) {
  return std::make_unique<RpcMetricsInterceptorFactory>(metrics);
}

}  // namespace aidn::coordinator
