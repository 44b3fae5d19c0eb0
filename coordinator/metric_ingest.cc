#include "coordinator/metric_ingest.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "coordinator/job_state.h"

namespace aidn::coordinator {

using v1::Job;

StepLog* MetricIngest::StepsOf(const Job& job, JobMetrics* m) {
  if (m->steps == nullptr) m->steps = std::make_unique<StepLog>(options_.step_log);
  if (m->steps_generation != job.generation()) {
    m->steps->StartGeneration(job.generation(), job.spec().world_size());
    m->steps_generation = job.generation();
    if (m->resent_generation == job.generation()) m->steps->ExpectFrom(m->resent_first_step);
  }
  return m->steps.get();
}

void MetricIngest::RecoverStored(const Job& job, JobMetrics* m, int64_t resumed_from_step) {
  absl::StatusOr<std::optional<v1::StepMetrics>> last = store_->LastStepOfGeneration(
      job.id(), job.generation(), std::max<int64_t>(resumed_from_step - 1, -1));
  if (!last.ok()) {
    AIDN_LOG(ERROR) << "could not find the job's stored steps: " << last.status()
                    << Kv("job", job.id());
    return;
  }
  m->resent_generation = job.generation();
  m->resent_first_step = std::max<int64_t>(resumed_from_step, 0) + 1;
  if (last->has_value()) {
    NoteStored(job.generation(), m, **last);
    // The last row may be an EVAL one: its step's TRAIN row is stored too.
    m->stored_train_step[job.generation()] =
        std::max(m->stored_train_step[job.generation()], (*last)->step());
    m->resent_floor = m->stored_key;
    m->resent_first_step = (*last)->step() + 1;
  }
}

bool MetricIngest::Append(const Job& job, JobMetrics* m, const v1::StreamMetricsRequest& request,
                          Clock::TimePoint now,
                          const std::function<void(const v1::MetricRecord&)>& on_train) {
  StepLog* steps = StepsOf(job, m);
  EnsureRankSeries(job, m);
  const int64_t seq_before = steps->last_seq();
  const int rank = request.rank();
  // Records of steps the last coordinator process stored: a trainer sends
  // again what it was not told is durable when the coordinator restarted.
  // (Later duplicates the StepLog drops as late.)
  std::optional<std::pair<int64_t, int>> stored;
  if (m->resent_generation == job.generation()) stored = m->resent_floor;
  int64_t dropped = 0;
  for (const v1::MetricRecord& in : request.records()) {
    if (stored.has_value() && std::make_pair(in.step(), static_cast<int>(in.kind())) <= *stored) {
      continue;
    }
    v1::MetricRecord r = in;
    r.set_rank(rank);
    r.set_generation(request.generation());
    if (r.kind() == v1::MetricRecord::TRAIN) {
      m->rank_step_seconds[rank]->Observe(r.step_seconds());
      m->rank_allreduce_seconds[rank]->Observe(r.allreduce_seconds());
      on_train(r);
    }
    if (!steps->Add(r, now)) ++dropped;
  }
  metrics_->records_received.Increment(request.records_size());
  if (dropped > 0) metrics_->records_dropped.Increment(static_cast<double>(dropped));
  return steps->last_seq() != seq_before;
}

bool MetricIngest::Expire(const Job& job, JobMetrics* m, Clock::TimePoint now) {
  if (m->steps == nullptr) return false;
  const int64_t before = m->steps->last_seq();
  m->steps->Expire(now, /*everything=*/false);
  const bool changed = m->steps->last_seq() != before;
  // A finished job's steps are all in the store; past the retention
  // period, watchers read them back from there.
  if (IsTerminal(job.state()) && !m->steps->has_unstored() &&
      m->stored_seq == m->steps->last_seq() && PastRetention(job)) {
    m->steps.reset();
  }
  return changed;
}

bool MetricIngest::EndGeneration(JobMetrics* m) {
  if (m->steps == nullptr) return false;
  m->steps->Expire(Clock::TimePoint::max(), /*everything=*/true);
  return true;
}

void MetricIngest::Take(const std::string& job_id, JobMetrics* m, FlushBatch* batch) {
  if (m->steps == nullptr || !m->steps->has_unstored()) return;
  std::vector<v1::StepMetrics> steps;
  const int64_t seq = m->steps->TakeUnstored(&steps);
  for (v1::StepMetrics& step : steps) batch->steps.push_back({job_id, std::move(step)});
  batch->taken.emplace_back(job_id, seq);
}

void MetricIngest::InFlight(const FlushBatch& batch) {
  unstored_first_step_.clear();
  for (const Store::JobStep& j : batch.steps) {
    auto [it, inserted] = unstored_first_step_.emplace(j.job_id, j.step.step());
    if (!inserted) it->second = std::min(it->second, j.step.step());
  }
}

void MetricIngest::NoteStored(int64_t generation, JobMetrics* m, const v1::StepMetrics& step) {
  if (step.kind() == v1::MetricRecord::TRAIN) {
    int64_t& train = m->stored_train_step.try_emplace(step.generation(), -1).first->second;
    train = std::max(train, step.step());
  }
  if (step.generation() != generation) return;
  if (m->stored_generation != generation) {
    m->stored_generation = generation;
    m->stored_key.reset();
  }
  const std::pair<int64_t, int> key{step.step(), static_cast<int>(step.kind())};
  if (!m->stored_key.has_value() || key > *m->stored_key) m->stored_key = key;
}

int64_t MetricIngest::StoredTrainStep(const JobMetrics& m, int64_t generation) {
  auto it = m.stored_train_step.find(generation);
  return it == m.stored_train_step.end() ? -1 : it->second;
}

int64_t MetricIngest::DurableStep(const Job& job, const JobMetrics& m) const {
  int64_t durable = 0;
  if (m.stored_generation == job.generation() && m.stored_key.has_value()) {
    durable = m.stored_key->first;
  }
  if (m.steps != nullptr) {
    if (std::optional<int64_t> first = m.steps->FirstStepNotTaken(); first.has_value()) {
      durable = std::min(durable, *first - 1);
    }
  }
  if (auto it = unstored_first_step_.find(job.id()); it != unstored_first_step_.end()) {
    durable = std::min(durable, it->second - 1);
  }
  return std::max<int64_t>(durable, 0);
}

void MetricIngest::EnsureRankSeries(const Job& job, JobMetrics* m) {
  const int world = job.spec().world_size();
  if (static_cast<int>(m->rank_step_seconds.size()) == world) return;
  m->rank_step_seconds.clear();
  m->rank_allreduce_seconds.clear();
  for (int r = 0; r < world; ++r) {
    const metrics::Labels labels{{"job_id", job.id()}, {"rank", absl::StrCat(r)}};
    m->rank_step_seconds.push_back(&metrics_->rank_step_seconds.Add(labels));
    m->rank_allreduce_seconds.push_back(&metrics_->rank_allreduce_seconds.Add(labels));
  }
  m->series_removed = false;
}

metrics::Labels MetricIngest::JobLabels(const Job& job) {
  return {{"job_id", job.id()}, {"name", job.spec().name()}, {"owner", job.owner()}};
}

bool MetricIngest::PastRetention(const Job& job) const {
  if (!IsTerminal(job.state())) return false;
  const absl::Time finished = absl::FromUnixSeconds(job.finished_at().seconds()) +
                              absl::Nanoseconds(job.finished_at().nanos());
  return clock_->WallNow() - finished >= absl::FromChrono(options_.metrics_retention);
}

void MetricIngest::SeriesRemoved(JobMetrics* m) {
  m->rank_step_seconds.clear();
  m->rank_allreduce_seconds.clear();
  m->series_removed = true;
  m->state_in_series = -1;
  m->rank_series_present = false;
}

void MetricIngest::RemoveSeriesOfJobs(const std::set<std::string>& job_ids) {
  if (job_ids.empty()) return;
  const auto doomed = [&job_ids](const std::string& id) { return job_ids.contains(id); };
  CoordinatorMetrics& cm = *metrics_;
  cm.job_steps_total.RemoveWhere("job_id", doomed);
  cm.job_samples_total.RemoveWhere("job_id", doomed);
  for (metrics::Family<metrics::Gauge>* f : {&cm.job_state,
                                             &cm.job_step,
                                             &cm.job_total_steps,
                                             &cm.job_epoch,
                                             &cm.job_loss,
                                             &cm.job_samples_per_second,
                                             &cm.job_tokens_per_second,
                                             &cm.job_peak_memory_bytes,
                                             &cm.job_device_peak_memory_bytes,
                                             &cm.job_step_seconds,
                                             &cm.job_allreduce_seconds,
                                             &cm.job_restarts,
                                             &cm.job_generation,
                                             &cm.job_world_size,
                                             &cm.job_last_checkpoint_step,
                                             &cm.job_test_accuracy,
                                             &cm.job_test_loss,
                                             &cm.rank_step,
                                             &cm.rank_last_progress_age_seconds,
                                             &cm.rank_straggler}) {
    f->RemoveWhere("job_id", doomed);
  }
  cm.rank_step_seconds.RemoveWhere("job_id", doomed);
  cm.rank_allreduce_seconds.RemoveWhere("job_id", doomed);
}

bool MetricIngest::CollectJob(const Job& job, JobMetrics* m, const JobHealth& health,
                              Clock::TimePoint now) {
  if (m->series_removed) return true;
  if (PastRetention(job)) return false;
  CoordinatorMetrics& cm = *metrics_;
  const std::string& id = job.id();
  const metrics::Labels labels = JobLabels(job);
  // One series per job: the old state's goes when the state changes. Each
  // RemoveMatching looks at every series of its family: only when needed.
  if (m->state_in_series != job.state()) {
    cm.job_state.RemoveMatching({{"job_id", id}});
    m->state_in_series = job.state();
  }
  metrics::Labels with_state = labels;
  with_state.emplace("state", StateName(job.state()));
  cm.job_state.Add(with_state).Set(1);
  cm.job_step.Add(labels).Set(static_cast<double>(job.last_step()));
  cm.job_total_steps.Add(labels).Set(static_cast<double>(job.total_steps()));
  cm.job_epoch.Add(labels).Set(job.epoch());
  cm.job_restarts.Add(labels).Set(job.restarts());
  cm.job_generation.Add(labels).Set(static_cast<double>(job.generation()));
  cm.job_world_size.Add(labels).Set(job.spec().world_size());
  cm.job_last_checkpoint_step.Add(labels).Set(static_cast<double>(job.last_checkpoint_step()));
  metrics::Counter& steps_total = cm.job_steps_total.Add(labels);
  metrics::Counter& samples_total = cm.job_samples_total.Add(labels);
  if (m->steps != nullptr) {
    steps_total.Increment(static_cast<double>(m->steps->train_steps() - m->steps_counted));
    samples_total.Increment(static_cast<double>(m->steps->train_samples() - m->samples_counted));
    m->steps_counted = m->steps->train_steps();
    m->samples_counted = m->steps->train_samples();
    if (const v1::StepMetrics* t = m->steps->last_train(); t != nullptr) {
      cm.job_loss.Add(labels).Set(t->loss());
      cm.job_samples_per_second.Add(labels).Set(t->samples_per_second());
      if (t->tokens() > 0) cm.job_tokens_per_second.Add(labels).Set(t->tokens_per_second());
      if (t->peak_memory_bytes() > 0) {
        cm.job_peak_memory_bytes.Add(labels).Set(static_cast<double>(t->peak_memory_bytes()));
      }
      if (t->device_peak_memory_bytes() > 0) {
        cm.job_device_peak_memory_bytes.Add(labels).Set(
            static_cast<double>(t->device_peak_memory_bytes()));
      }
      cm.job_step_seconds.Add(labels).Set(t->step_seconds());
      cm.job_allreduce_seconds.Add(labels).Set(t->allreduce_seconds());
    }
    if (const v1::StepMetrics* e = m->steps->last_eval(); e != nullptr) {
      cm.job_test_accuracy.Add(labels).Set(e->test_accuracy());
      cm.job_test_loss.Add(labels).Set(e->test_loss());
    }
  }
  // Progress of the ranks of a generation that holds slots; none after.
  const bool has_ranks = !health.beats.empty() || job.state() == Job::RUNNING;
  if (has_ranks || m->rank_series_present) {
    const metrics::Labels job_match{{"job_id", id}};
    cm.rank_step.RemoveMatching(job_match);
    cm.rank_last_progress_age_seconds.RemoveMatching(job_match);
    cm.rank_straggler.RemoveMatching(job_match);
  }
  m->rank_series_present = has_ranks;
  for (const auto& [rank, beat] : health.beats) {
    const metrics::Labels rank_labels{{"job_id", id}, {"rank", absl::StrCat(rank)}};
    cm.rank_step.Add(rank_labels).Set(static_cast<double>(beat.step));
    cm.rank_last_progress_age_seconds.Add(rank_labels)
        .Set(std::chrono::duration<double>(now - beat.at).count());
  }
  if (job.state() == Job::RUNNING) {
    for (int rank = 0; rank < job.spec().world_size(); ++rank) {
      cm.rank_straggler.Add({{"job_id", id}, {"rank", absl::StrCat(rank)}})
          .Set(health.stragglers.contains(rank) ? 1 : 0);
    }
  }
  return true;
}

}  // namespace aidn::coordinator
