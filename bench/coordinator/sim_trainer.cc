#include "bench/coordinator/sim_trainer.h"

#include <algorithm>
#include <functional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "bench/coordinator/sim_worker.h"
#include "common/rpc/client.h"

namespace aidn::bench {
namespace {

// One StreamMetrics call carrying one message, as the Reporter sends it.
class MetricsCall final : public grpc::ClientWriteReactor<v1::StreamMetricsRequest> {
 public:
  using Done = std::function<void(const grpc::Status&, const v1::StreamMetricsResponse&)>;
  MetricsCall(Load* load, v1::ClusterService::Stub* stub, const std::string& token,
              v1::StreamMetricsRequest request, Done done)
      : guard_(load), request_(std::move(request)), done_(std::move(done)) {
    rpc::PrepareContext(&context_, token, kTrainerRpcTimeout);
    stub->async()->StreamMetrics(&context_, &response_, this);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartCall();
  }
  void OnWriteDone(bool) override {}
  void OnDone(const grpc::Status& status) override {
    done_(status, response_);
    delete this;
  }

 private:
  InFlight guard_;
  grpc::ClientContext context_;
  v1::StreamMetricsRequest request_;
  v1::StreamMetricsResponse response_;
  Done done_;
};

}  // namespace

void SimTrainer::Join() {
  auto* call = new JoinCall(load_);
  rpc::PrepareContext(&call->context, a_.trainer_token(), std::chrono::minutes(5));
  call->request.set_job_id(a_.job_id());
  call->request.set_generation(a_.generation());
  call->request.set_rank(a_.rank());
  call->request.set_worker_id(worker_->id());
  call->request.set_address(absl::StrCat("127.0.0.1:", 20000 + a_.rank()));
  call->start = Clock::now();
  if (rendezvous_only_) {
    std::lock_guard<std::mutex> lock(load_->rendezvous.mu);
    RendezvousTrace& r = load_->rendezvous;
    if (r.joins_sent++ == 0) r.first_join_sent = call->start;
    r.last_join_sent = std::max(r.last_join_sent, call->start);
  }
  auto self = shared_from_this();
  if (rendezvous_only_) {
    // Each answer of the big rendezvous lists every peer (a 1,024-rank
    // answer is some 40 KB, a thousand messages). Real trainers parse
    // theirs in parallel, each on its own host; parsing all of them here,
    // on the cores the coordinator needs, would time this process, not
    // the coordinator. So they are taken as bytes.
    const std::string bytes = call->request.SerializeAsString();
    grpc::Slice slice(bytes);
    call->raw_request = grpc::ByteBuffer(&slice, 1);
    generic_stub_->UnaryCall(&call->context, "/aidn.v1.ClusterService/JoinRendezvous",
                             grpc::StubOptions(), &call->raw_request, &call->raw_response,
                             [self, call](grpc::Status status) { self->OnJoined(call, status); });
    return;
  }
  stub_->async()->JoinRendezvous(
      &call->context, &call->request, &call->response,
      [self, call](grpc::Status status) { self->OnJoined(call, status); });
}

void SimTrainer::OnJoined(JoinCall* call, const grpc::Status& status) {
  std::unique_ptr<JoinCall> owned(call);
  const Clock::time_point now = Clock::now();
  if (rendezvous_only_) {
    std::lock_guard<std::mutex> lock(load_->rendezvous.mu);
    RendezvousTrace& r = load_->rendezvous;
    if (status.ok()) {
      r.answered++;
      r.answer_bytes = std::max(r.answer_bytes, call->raw_response.Length());
      r.last_answer = std::max(r.last_answer, now);
      r.waits_ms.push_back(
          static_cast<float>(std::chrono::duration<double, std::milli>(now - call->start).count()));
    } else {
      if (r.failed++ == 0) r.first_error = status.error_message();
    }
  }
  if (!status.ok()) {
    load_->join.Fail(call->start, status.error_code());
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;  // stopped by its worker meanwhile
    }
    // A real trainer exits: superseded (75) or failed (1).
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      load_->trainers_superseded++;
      Exit(kExitSuperseded);
    } else {
      load_->trainer_failures++;
      Exit(1);
    }
    return;
  }
  load_->join.Add(call->start);
  if (rendezvous_only_) {
    // Its part is done: the trainer exits 0, its worker reports it.
    Exit(0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    started_ = now;
    next_beat_ = now;  // the first beat goes at once
  }
  load_->load_ranks_streaming++;
  Tick();
}

void SimTrainer::Exit(int code) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (exited_) return;
    exited_ = true;
    stopped_ = true;
  }
  worker_->TrainerEnded(key(), code, /*by_order=*/false);
}

void SimTrainer::Tick() {
  if (load_->stopping) return;
  const Clock::time_point now = Clock::now();
  int64_t from = 0, to = 0, beat_step = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    // Steps completed since training started, at the configured rate.
    const int64_t step = static_cast<int64_t>(
        std::chrono::duration<double>(now - started_).count() * load_->options.records_per_second);
    if (!metrics_in_flight_ && step > sent_step_) {
      from = sent_step_ + 1;
      to = std::min<int64_t>(step, sent_step_ + static_cast<int64_t>(kReporterBatch));
      sent_step_ = to;
      metrics_in_flight_ = true;
    }
    if (!progress_in_flight_ && now >= next_beat_) {
      beat_step = std::max<int64_t>(step, 0);
      progress_in_flight_ = true;
      next_beat_ = now + kBeatPeriod;
    }
  }
  if (to > 0) SendMetrics(from, to);
  if (beat_step >= 0) SendProgress(beat_step);
  auto self = shared_from_this();
  load_->timer.After(kReporterPeriod, [self] { self->Tick(); });
}

void SimTrainer::SendMetrics(int64_t from_step, int64_t to_step) {
  v1::StreamMetricsRequest request;
  request.set_job_id(a_.job_id());
  request.set_generation(a_.generation());
  request.set_rank(a_.rank());
  for (int64_t step = from_step; step <= to_step; ++step) {
    v1::MetricRecord* r = request.add_records();
    r->set_kind(v1::MetricRecord::TRAIN);
    r->set_step(step);
    r->set_epoch(0);
    r->set_loss(2.0 / static_cast<double>(step + 1));
    r->set_samples(64);
    r->set_step_seconds(0.1);
    r->set_compute_seconds(0.09);
    r->set_allreduce_seconds(0.01);
    r->set_lr(0.01);
  }
  const int64_t n = to_step - from_step + 1;
  const Clock::time_point start = Clock::now();
  auto self = shared_from_this();
  new MetricsCall(
      load_, stub_, a_.trainer_token(), std::move(request),
      [self, start, n, from_step](const grpc::Status& status, const v1::StreamMetricsResponse&) {
        Load* load = self->load_;
        bool exit = false;
        {
          std::lock_guard<std::mutex> lock(self->mu_);
          self->metrics_in_flight_ = false;
          if (!status.ok() && status.error_code() != grpc::StatusCode::FAILED_PRECONDITION) {
            // Kept and sent again, as the Reporter does.
            self->sent_step_ = std::min(self->sent_step_, from_step - 1);
          }
          exit = status.error_code() == grpc::StatusCode::FAILED_PRECONDITION && !self->stopped_;
        }
        if (status.ok()) {
          load->metrics.Add(start);
          load->records_sent += n;
        } else {
          load->metrics.Fail(start, status.error_code());
        }
        if (exit) {
          load->trainers_superseded++;
          self->Exit(kExitSuperseded);
        }
      });
}

void SimTrainer::SendProgress(int64_t step) {
  struct ProgressCall {
    explicit ProgressCall(Load* l) : guard(l) {}
    InFlight guard;
    grpc::ClientContext context;
    v1::ReportProgressRequest request;
    v1::ReportProgressResponse response;
    Clock::time_point start;
  };
  auto* call = new ProgressCall(load_);
  rpc::PrepareContext(&call->context, a_.trainer_token(), kTrainerRpcTimeout);
  call->request.set_job_id(a_.job_id());
  call->request.set_generation(a_.generation());
  call->request.set_rank(a_.rank());
  call->request.set_step(step);
  call->request.set_epoch(0);
  call->request.set_collective_seq(step);
  call->request.set_total_steps(1'000'000'000);
  call->start = Clock::now();
  auto self = shared_from_this();
  stub_->async()->ReportProgress(
      &call->context, &call->request, &call->response, [self, call](grpc::Status status) {
        std::unique_ptr<ProgressCall> owned(call);
        Load* load = self->load_;
        bool exit = false;
        {
          std::lock_guard<std::mutex> lock(self->mu_);
          self->progress_in_flight_ = false;
          exit = (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
                  (status.ok() && owned->response.stop())) &&
                 !self->stopped_;
        }
        if (status.ok()) {
          load->progress.Add(owned->start);
        } else {
          load->progress.Fail(owned->start, status.error_code());
        }
        if (exit) {
          load->trainers_superseded++;
          self->Exit(kExitSuperseded);
        }
      });
}

}  // namespace aidn::bench
