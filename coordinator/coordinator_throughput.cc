// Coordinator: a succeeded job's throughput and scaling efficiency
// (scaling_report.h).

#include "absl/strings/str_cat.h"
#include "coordinator/coordinator.h"
#include "coordinator/job_entry.h"
#include "coordinator/scaling_report.h"

namespace aidn::coordinator {

void Coordinator::RecordThroughput(JobEntry* entry, const std::vector<v1::StepMetrics>& steps,
                                   Deferred* deferred) {
  v1::Job& job = entry->stored.job;
  if (job.spec().has_command()) return;  // a program's own steps: no samples counted
  v1::Throughput t = SummarizeThroughput(steps, job.spec().world_size());
  if (t.steps() == 0) return;
  const std::string& named = job.spec().scaling_baseline();
  if (!named.empty()) {
    const auto it = jobs_.find(named);
    if (it == jobs_.end()) {
      t.set_note(absl::StrCat("baseline ", named, " is not a job of this cluster"));
    } else {
      CompareWithBaseline(it->second->stored.job, &t);
    }
  } else {
    // The newest succeeded 1-rank run of the same step.
    const std::string key = ScalingKey(job.spec());
    const StoredJob* best = nullptr;
    for (const auto& [id, other] : jobs_) {
      const v1::Job& o = other->stored.job;
      if (id == job.id() || o.state() != v1::Job::SUCCEEDED || o.spec().world_size() != 1 ||
          o.throughput().samples_per_second() <= 0 || ScalingKey(o.spec()) != key) {
        continue;
      }
      if (best == nullptr || other->stored.number > best->number) best = &other->stored;
    }
    if (best != nullptr) CompareWithBaseline(best->job, &t);
  }
  *job.mutable_throughput() = t;
  Emit("job.throughput", job.id(), "", job.generation(), ThroughputLine(t), deferred);
}

}  // namespace aidn::coordinator
