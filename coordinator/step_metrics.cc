#include "coordinator/step_metrics.h"

#include <algorithm>

namespace aidn::coordinator {

v1::StepMetrics CombineRecords(const std::vector<v1::MetricRecord>& records, int world_size) {
  v1::StepMetrics out;
  if (records.empty()) return out;
  int ranks = world_size;
  for (const v1::MetricRecord& r : records) ranks = std::max(ranks, r.rank() + 1);
  const v1::MetricRecord& first = records.front();
  out.set_kind(first.kind());
  out.set_step(first.step());
  out.set_epoch(first.epoch());
  out.set_generation(first.generation());
  out.set_world_size(ranks);
  out.set_ranks_reported(static_cast<int>(records.size()));
  // Evaluations have no step times.
  const bool train = first.kind() == v1::MetricRecord::TRAIN;
  if (train) {
    out.mutable_rank_step_seconds()->Resize(ranks, 0.0);
    out.mutable_rank_allreduce_seconds()->Resize(ranks, 0.0);
  }

  double loss = 0, allreduce = 0, test_loss = 0, test_accuracy = 0;
  int64_t samples = 0, tokens = 0, peak_memory = 0;
  double slowest = -1;
  for (const v1::MetricRecord& r : records) {
    loss += r.loss();
    allreduce += r.allreduce_seconds();
    test_loss += r.test_loss();
    test_accuracy += r.test_accuracy();
    samples += r.samples();
    tokens += r.tokens();
    peak_memory = std::max(peak_memory, r.peak_memory_bytes());
    out.set_parameter_bytes(std::max(out.parameter_bytes(), r.parameter_bytes()));
    out.set_gradient_comm_bytes(std::max(out.gradient_comm_bytes(), r.gradient_comm_bytes()));
    out.set_gradient_comm_bytes_uncompressed(
        std::max(out.gradient_comm_bytes_uncompressed(), r.gradient_comm_bytes_uncompressed()));
    out.set_gradient_bytes(std::max(out.gradient_bytes(), r.gradient_bytes()));
    out.set_optimizer_state_bytes(std::max(out.optimizer_state_bytes(), r.optimizer_state_bytes()));
    out.set_buffer_bytes(std::max(out.buffer_bytes(), r.buffer_bytes()));
    out.set_device_peak_memory_bytes(
        std::max(out.device_peak_memory_bytes(), r.device_peak_memory_bytes()));
    if (train && r.rank() >= 0) {
      out.set_rank_step_seconds(r.rank(), r.step_seconds());
      out.set_rank_allreduce_seconds(r.rank(), r.allreduce_seconds());
    }
    if (r.step_seconds() > slowest) {
      slowest = r.step_seconds();
      out.set_slowest_rank(r.rank());
    }
    // The newest of the ranks' times: when the step was done everywhere.
    if (r.time().seconds() > out.time().seconds() ||
        (r.time().seconds() == out.time().seconds() && r.time().nanos() > out.time().nanos())) {
      *out.mutable_time() = r.time();
    }
    // Every rank computes the same schedule; the first rank's is as good.
    if (out.lr() == 0) out.set_lr(r.lr());
  }
  const double n = static_cast<double>(records.size());
  out.set_loss(loss / n);
  out.set_allreduce_seconds(allreduce / n);
  out.set_test_loss(test_loss / n);
  out.set_test_accuracy(test_accuracy / n);
  out.set_samples(samples);
  out.set_tokens(tokens);
  out.set_peak_memory_bytes(peak_memory);
  out.set_step_seconds(std::max(slowest, 0.0));
  // A step's samples are done when its slowest rank is: the job's rate.
  if (slowest > 0) {
    out.set_samples_per_second(static_cast<double>(samples) / slowest);
    out.set_tokens_per_second(static_cast<double>(tokens) / slowest);
  }
  return out;
}

}  // namespace aidn::coordinator
