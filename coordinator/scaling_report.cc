#include "coordinator/scaling_report.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace aidn::coordinator {

namespace {

double Seconds(const google::protobuf::Timestamp& t) {
  return static_cast<double>(t.seconds()) + static_cast<double>(t.nanos()) * 1e-9;
}

}  // namespace

v1::Throughput SummarizeThroughput(const std::vector<v1::StepMetrics>& steps, int32_t world_size) {
  v1::Throughput t;
  t.set_world_size(world_size);
  // Per generation, by step: its TRAIN row, and the steps an evaluation
  // followed.
  std::map<int64_t, std::map<int64_t, const v1::StepMetrics*>> train;
  std::map<int64_t, std::map<int64_t, bool>> evaluated;
  for (const v1::StepMetrics& s : steps) {
    if (s.kind() == v1::MetricRecord::TRAIN) {
      train[s.generation()][s.step()] = &s;
    } else {
      evaluated[s.generation()][s.step()] = true;
    }
  }
  // Wall time between consecutive steps' records (the last rank's), so
  // that what the step times leave out (the next batch, reporting, a
  // checkpoint write) counts; an interval after an evaluation does not.
  double samples = 0, tokens = 0, seconds = 0;
  int64_t n = 0;
  for (const auto& [generation, rows] : train) {
    const v1::StepMetrics* previous = nullptr;
    for (const auto& [step, row] : rows) {
      if (previous != nullptr && previous->step() + 1 == step && previous->has_time() &&
          row->has_time() && !evaluated[generation].contains(previous->step())) {
        const double interval = Seconds(row->time()) - Seconds(previous->time());
        if (interval > 0) {
          samples += static_cast<double>(row->samples());
          tokens += static_cast<double>(row->tokens());
          seconds += interval;
          ++n;
        }
      }
      previous = row;
    }
  }
  if (n == 0) {
    // No two consecutive steps with times: the step times themselves.
    for (const auto& [generation, rows] : train) {
      for (const auto& [step, row] : rows) {
        if (row->step_seconds() <= 0) continue;
        samples += static_cast<double>(row->samples());
        tokens += static_cast<double>(row->tokens());
        seconds += row->step_seconds();
        ++n;
      }
    }
  }
  t.set_steps(n);
  if (seconds > 0) {
    t.set_samples_per_second(samples / seconds);
    t.set_tokens_per_second(tokens / seconds);
  }
  return t;
}

std::string ScalingKey(const v1::JobSpec& spec) {
  v1::JobSpec key = spec;
  key.clear_name();
  key.clear_labels();
  key.clear_priority();
  key.clear_world_size();
  key.clear_epochs();
  key.clear_max_steps();
  key.clear_seed();
  key.clear_checkpoint();
  key.clear_timeouts();
  key.clear_max_restarts();
  key.clear_eval_every_steps();
  key.clear_eval_max_samples();
  key.clear_scaling_baseline();
  key.clear_parallel();
  std::string out;
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  key.SerializeToCodedStream(&coded);
  coded.Trim();
  return out;
}

void CompareWithBaseline(const v1::Job& baseline, v1::Throughput* t) {
  const v1::Throughput& b = baseline.throughput();
  if (b.samples_per_second() <= 0 || b.world_size() <= 0) {
    t->set_note(absl::StrCat("baseline ", baseline.id(), " has no throughput (",
                             v1::Job::State_Name(baseline.state()), ")"));
    return;
  }
  t->set_baseline_job(baseline.id());
  t->set_baseline_samples_per_second(b.samples_per_second());
  t->set_baseline_world_size(b.world_size());
  const double ideal = b.samples_per_second() * t->world_size() / b.world_size();
  t->set_scaling_efficiency(t->samples_per_second() / ideal);
}

std::string ThroughputLine(const v1::Throughput& t) {
  auto ranks = [](int n) { return absl::StrCat(n, n == 1 ? " rank" : " ranks"); };
  std::string line = absl::StrFormat("%.1f samples/s", t.samples_per_second());
  if (t.tokens_per_second() > 0)
    absl::StrAppendFormat(&line, " (%.0f tokens/s)", t.tokens_per_second());
  absl::StrAppend(&line, " over ", t.steps(), " steps at ", ranks(t.world_size()));
  if (!t.baseline_job().empty()) {
    absl::StrAppendFormat(&line, "; scaling efficiency %.2f against %s (%s, %.1f samples/s)",
                          t.scaling_efficiency(), t.baseline_job(), ranks(t.baseline_world_size()),
                          t.baseline_samples_per_second());
  } else if (!t.note().empty()) {
    absl::StrAppend(&line, "; ", t.note());
  }
  return line;
}

}  // namespace aidn::coordinator
