#include "bench/coordinator/sim_worker.h"

#include <unistd.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/rpc/client.h"

namespace aidn::bench {

struct SimWorker::RegisterCall {
  explicit RegisterCall(Load* l) : guard(l) {}
  InFlight guard;
  grpc::ClientContext context;
  v1::RegisterWorkerRequest request;
  v1::RegisterWorkerResponse response;
};

struct SimWorker::HeartbeatCall {
  explicit HeartbeatCall(Load* l) : guard(l) {}
  InFlight guard;
  grpc::ClientContext context;
  v1::HeartbeatRequest request;
  v1::HeartbeatResponse response;
  Clock::time_point start;
  milliseconds max_wait{0};
};

struct SimWorker::ExitCall {
  explicit ExitCall(Load* l) : guard(l) {}
  InFlight guard;
  grpc::ClientContext context;
  v1::ReportTrainerExitRequest request;
  v1::ReportTrainerExitResponse response;
  Clock::time_point start;
};

SimWorker::SimWorker(Load* load, int index, bool probe)
    : load_(load),
      index_(index),
      id_(absl::StrFormat("sim-%05d", index)),
      probe_(probe),
      stub_(load->Stub(static_cast<size_t>(index))) {}

void SimWorker::Start(std::function<void(bool)> registered) {
  registered_cb_ = std::move(registered);
  Register();
}

void SimWorker::TrainerEnded(const TrainerKey& key, int exit_code, bool by_order) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (trainers_.erase(key) == 0) return;
    finished_.insert(key);
  }
  ReportExit(key, exit_code, by_order, /*attempt=*/0);
}

void SimWorker::Register() {
  if (load_->stopping) return;
  auto* call = new RegisterCall(load_);
  rpc::PrepareContext(&call->context, load_->worker_token, kDaemonRpcTimeout);
  v1::WorkerInfo* info = call->request.mutable_info();
  info->set_id(id_);
  info->set_hostname(id_);
  info->set_address("127.0.0.1");
  // A probe answers at once, not held, so it would learn of new work up
  // to an interval late: it offers no slots, and gets no ranks.
  info->set_cpu_slots(probe_ ? 0 : load_->options.slots_per_worker);
  info->set_version("coordinator_load");
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, trainer] : trainers_) AddStatus(key, call->request.add_trainers());
  }
  stub_->async()->RegisterWorker(&call->context, &call->request, &call->response,
                                 [this, call](grpc::Status status) { OnRegistered(call, status); });
}

void SimWorker::OnRegistered(RegisterCall* call, const grpc::Status& status) {
  std::unique_ptr<RegisterCall> owned(call);
  const bool ok = status.ok();
  if (registered_cb_) {
    auto cb = std::move(registered_cb_);
    registered_cb_ = nullptr;
    cb(ok);
  }
  if (!ok) {
    load_->timer.After(backoff_, [this] { Register(); });
    backoff_ = std::min(backoff_ * 2, milliseconds(2000));
    return;
  }
  backoff_ = milliseconds(100);
  version_ = 0;
  if (FromProto(owned->response.heartbeat_interval()).count() > 0) {
    interval_ = FromProto(owned->response.heartbeat_interval());
  }
  Heartbeat();
}

void SimWorker::AddStatus(const TrainerKey& key, v1::TrainerStatus* t) const {
  t->set_job_id(key.job_id);
  t->set_generation(key.generation);
  t->set_rank(key.rank);
  t->set_pid(getpid());
}

void SimWorker::Heartbeat() {
  if (load_->stopping) return;
  auto* call = new HeartbeatCall(load_);
  call->max_wait = probe_ ? milliseconds(0) : interval_;
  rpc::PrepareContext(&call->context, load_->worker_token, interval_ + kDaemonRpcTimeout);
  call->request.set_worker_id(id_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, trainer] : trainers_) AddStatus(key, call->request.add_trainers());
  }
  *call->request.mutable_max_wait() = ToProto(call->max_wait);
  call->request.set_assignments_version(version_);
  call->start = Clock::now();
  stub_->async()->Heartbeat(&call->context, &call->request, &call->response,
                            [this, call](grpc::Status status) { OnHeartbeat(call, status); });
}

void SimWorker::OnHeartbeat(HeartbeatCall* call, const grpc::Status& status) {
  std::unique_ptr<HeartbeatCall> owned(call);
  const double ms = MsSince(call->start);
  if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
    // The coordinator forgot or lost this worker: register again, as the
    // daemon does. Never expected in this benchmark.
    load_->reregistrations++;
    load_->heartbeat_now.Fail(call->start, status.error_code());
    Register();
    return;
  }
  if (!status.ok()) {
    load_->heartbeat_now.Fail(call->start, status.error_code());
    load_->timer.After(backoff_, [this] { Heartbeat(); });
    backoff_ = std::min(backoff_ * 2, milliseconds(2000));
    return;
  }
  backoff_ = milliseconds(100);
  load_->heartbeats++;
  const v1::HeartbeatResponse& r = call->response;
  const int64_t sent_version = call->request.assignments_version();
  const bool changed = r.assignments_version() != sent_version;
  const double max_wait_ms = static_cast<double>(call->max_wait.count());
  if (call->max_wait.count() == 0 || sent_version == 0) {
    load_->heartbeat_now.Add(call->start, ms);  // answered at once by design
  } else if (ms >= max_wait_ms) {
    // Held to its deadline (a version bumped for other workers meanwhile
    // is learnt here too).
    load_->heartbeat_late.Add(call->start, ms - max_wait_ms);
  } else if (changed && load_->window.Contains(call->start)) {
    load_->woken++;  // its assignments changed
  }
  version_ = r.assignments_version();
  if (FromProto(r.heartbeat_interval()).count() > 0) interval_ = FromProto(r.heartbeat_interval());
  Reconcile(r);
  if (changed) {
    Heartbeat();
    return;
  }
  // Answered early without news: keep to the interval rather than spin.
  const auto elapsed = std::chrono::duration_cast<milliseconds>(Clock::now() - call->start);
  if (elapsed < interval_ / 2) {
    load_->timer.After(interval_ - elapsed, [this] { Heartbeat(); });
  } else {
    Heartbeat();
  }
}

void SimWorker::Reconcile(const v1::HeartbeatResponse& r) {
  std::vector<std::shared_ptr<SimTrainer>> to_stop, to_start;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const v1::StopOrder& order : r.stops()) {
      for (auto& [key, trainer] : trainers_) {
        if (key.job_id != order.job_id() || key.generation != order.generation()) continue;
        if (order.ranks_size() > 0 && std::find(order.ranks().begin(), order.ranks().end(),
                                                key.rank) == order.ranks().end()) {
          continue;
        }
        to_stop.push_back(trainer);
      }
    }
    std::set<TrainerKey> wanted;
    for (const v1::TrainerAssignment& a : r.assignments()) {
      wanted.insert({a.job_id(), a.generation(), a.rank()});
    }
    for (auto& [key, trainer] : trainers_) {
      if (!wanted.contains(key)) to_stop.push_back(trainer);
    }
    for (auto it = finished_.begin(); it != finished_.end();) {
      it = wanted.contains(*it) ? std::next(it) : finished_.erase(it);
    }
    for (const v1::TrainerAssignment& a : r.assignments()) {
      const TrainerKey key{a.job_id(), a.generation(), a.rank()};
      if (trainers_.contains(key) || finished_.contains(key)) continue;
      auto trainer = std::make_shared<SimTrainer>(load_, this, a,
                                                  channel() + static_cast<size_t>(a.rank()) + 1);
      trainers_[key] = trainer;
      to_start.push_back(std::move(trainer));
    }
  }
  for (auto& t : to_stop) {
    t->Stop();
    TrainerEnded(t->key(), 0, /*by_order=*/true);
  }
  for (auto& t : to_start) t->Start();
}

void SimWorker::ReportExit(const TrainerKey& key, int exit_code, bool by_order, int attempt) {
  if (load_->stopping) return;
  auto* call = new ExitCall(load_);
  rpc::PrepareContext(&call->context, load_->worker_token, kDaemonRpcTimeout);
  call->request.set_worker_id(id_);
  call->request.set_job_id(key.job_id);
  call->request.set_generation(key.generation);
  call->request.set_rank(key.rank);
  call->request.set_exit_code(exit_code);
  call->request.set_stopped_by_order(by_order);
  call->start = Clock::now();
  stub_->async()->ReportTrainerExit(
      &call->context, &call->request, &call->response,
      [this, call, key, exit_code, by_order, attempt](grpc::Status status) {
        std::unique_ptr<ExitCall> owned(call);
        if (status.ok()) {
          load_->exit_reports.Add(call->start);
          return;
        }
        load_->exit_reports.Fail(call->start, status.error_code());
        const auto code = status.error_code();
        if (attempt < 5 && (code == grpc::StatusCode::UNAVAILABLE ||
                            code == grpc::StatusCode::DEADLINE_EXCEEDED)) {
          load_->timer.After(milliseconds(200), [this, key, exit_code, by_order, attempt] {
            ReportExit(key, exit_code, by_order, attempt + 1);
          });
        }
      });
}

}  // namespace aidn::bench
