#include "coordinator/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace aidn::coordinator {
namespace {

// First slots of every run of `k` consecutive free slots, packed from the
// left of each free run.
std::vector<int> RankStarts(const std::vector<bool>& used, int k) {
  std::vector<int> starts;
  int run_start = -1;
  for (int i = 0; i <= static_cast<int>(used.size()); ++i) {
    const bool free = i < static_cast<int>(used.size()) && !used[i];
    if (free && run_start < 0) run_start = i;
    if (!free && run_start >= 0) {
      for (int s = run_start; s + k <= i; s += k) starts.push_back(s);
      run_start = -1;
    }
  }
  return starts;
}

}  // namespace

absl::StatusOr<std::vector<v1::RankPlacement>> PlaceGang(const GangRequest& request,
                                                         const std::vector<WorkerSlots>& workers) {
  const int k = request.gpu ? 1 : std::max(1, request.slots_per_rank);
  const char* kind = request.gpu ? "gpu" : "cpu";
  const int needed_slots = request.world_size * k;

  struct Candidate {
    const WorkerSlots* worker;
    std::vector<int> starts;
  };
  std::vector<Candidate> candidates;
  int capacity_if_idle = 0;
  int capacity_now = 0;
  int total_slots = 0;
  for (const WorkerSlots& w : workers) {
    const std::vector<bool>& used = request.gpu ? w.gpu_used : w.cpu_used;
    total_slots += static_cast<int>(used.size());
    capacity_if_idle += static_cast<int>(used.size()) / k;
    Candidate c{&w, RankStarts(used, k)};
    capacity_now += static_cast<int>(c.starts.size());
    if (!c.starts.empty()) candidates.push_back(std::move(c));
  }
  if (capacity_if_idle < request.world_size) {
    return absl::FailedPreconditionError(
        absl::StrCat("needs ", request.world_size, " ranks x ", k, " ", kind, " slots (",
                     needed_slots, "); the cluster has ", total_slots, " ", kind, " slots on ",
                     workers.size(), " alive workers, room for ", capacity_if_idle, " such ranks"));
  }
  if (capacity_now < request.world_size) {
    return absl::ResourceExhaustedError(absl::StrCat("waiting for room: needs ", request.world_size,
                                                     " ranks x ", k, " ", kind,
                                                     " slots; free room for ", capacity_now));
  }

  std::vector<const Candidate*> chosen;
  const Candidate* best_single = nullptr;
  for (const Candidate& c : candidates) {
    if (static_cast<int>(c.starts.size()) >= request.world_size &&
        (best_single == nullptr || c.starts.size() < best_single->starts.size() ||
         (c.starts.size() == best_single->starts.size() &&
          c.worker->worker_id < best_single->worker->worker_id))) {
      best_single = &c;
    }
  }
  if (best_single != nullptr) {
    chosen.push_back(best_single);
  } else {
    std::vector<const Candidate*> order;
    for (const Candidate& c : candidates) order.push_back(&c);
    std::sort(order.begin(), order.end(), [](const Candidate* a, const Candidate* b) {
      if (a->starts.size() != b->starts.size()) return a->starts.size() > b->starts.size();
      return a->worker->worker_id < b->worker->worker_id;
    });
    int room = 0;
    for (const Candidate* c : order) {
      if (room >= request.world_size) break;
      chosen.push_back(c);
      room += static_cast<int>(c->starts.size());
    }
  }

  std::vector<v1::RankPlacement> placement;
  int rank = 0;
  for (const Candidate* c : chosen) {
    for (int start : c->starts) {
      if (rank >= request.world_size) break;
      v1::RankPlacement p;
      p.set_rank(rank++);
      p.set_worker_id(c->worker->worker_id);
      p.set_slot(start);
      placement.push_back(std::move(p));
    }
  }
  return placement;
}

GangRequest GangRequestOf(const v1::JobSpec& spec) {
  GangRequest request;
  request.world_size = spec.world_size();
  request.gpu = spec.device() == v1::JobSpec::GPU;
  request.slots_per_rank = spec.threads_per_rank();
  return request;
}

void SlotTable::AddWorker(const std::string& worker_id, int cpu_slots, int gpus) {
  WorkerSlots& ws = workers_[worker_id];
  ws.worker_id = worker_id;
  ws.cpu_used.assign(std::max(0, cpu_slots), false);
  ws.gpu_used.assign(std::max(0, gpus), false);
}

void SlotTable::MarkUsed(const v1::Job& job) {
  const bool gpu = job.spec().device() == v1::JobSpec::GPU;
  const int k = gpu ? 1 : std::max(1, job.spec().threads_per_rank());
  for (const v1::RankPlacement& p : job.placement()) {
    auto it = workers_.find(p.worker_id());
    if (it == workers_.end()) continue;
    std::vector<bool>& used = gpu ? it->second.gpu_used : it->second.cpu_used;
    for (int s = p.slot(); s < p.slot() + k && s < static_cast<int>(used.size()); ++s) {
      if (s >= 0) used[s] = true;
    }
  }
}

std::vector<WorkerSlots> SlotTable::Snapshot(
    const std::function<bool(const std::string& worker_id)>& eligible) const {
  std::vector<WorkerSlots> out;
  for (const auto& [id, ws] : workers_) {
    if (eligible(id)) out.push_back(ws);
  }
  return out;
}

std::optional<PathOutside> PathRefusedBy(const v1::JobSpec& spec, const v1::WorkerInfo& worker) {
  if (worker.path_roots().empty()) return std::nullopt;
  return FirstPathOutside(spec, {worker.path_roots().begin(), worker.path_roots().end()});
}

}  // namespace aidn::coordinator
