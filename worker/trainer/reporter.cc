#include "worker/trainer/reporter.h"

#include <algorithm>
#include <utility>

#include "common/log.h"
#include "common/rpc/client.h"
#include "common/rpc/retry.h"

namespace aidn::trainer {

using std::chrono::milliseconds;

namespace {

// Records per StreamMetrics message, and per call.
constexpr size_t kBatch = 512;
constexpr size_t kMaxPerCall = 16 * kBatch;

}  // namespace

struct Reporter::Work {
  std::vector<v1::MetricRecord> batch;
  // A commit is waiting (SendCommitIfDue decides whether it goes).
  bool commit = false;
  // Closing, nothing left to send: ask whether the records sent are stored.
  bool confirm = false;
  bool beat = false;
  int64_t step = 0;
  int32_t epoch = 0;
  int64_t seq = 0;
  int64_t total = 0;
  int64_t ack = 0;
  int64_t missed = 0;
  // Each call's deadline.
  milliseconds timeout{0};
};

Reporter::Reporter(std::shared_ptr<grpc::Channel> channel,
                   std::shared_ptr<v1::ClusterService::StubInterface> stub,
                   const ReporterOptions& options, RetireFn retire)
    : channel_(std::move(channel)),
      stub_(std::move(stub)),
      options_(options),
      retire_(std::move(retire)) {
  const Clock::time_point now = Clock::now();
  next_send_ = now + options_.report_period;
  next_beat_ = now;
  retry_at_ = now;
  thread_ = std::thread([this] { Loop(); });
}

Reporter::~Reporter() {
  Close(milliseconds(5000));
  // A Close that timed out left the thread; it ends at its own deadline.
  if (thread_.joinable()) thread_.join();
}

void Reporter::Record(v1::MetricRecord record) {
  std::lock_guard<std::mutex> lock(mu_);
  if (records_.size() + unacked_.size() >= options_.max_records) {
    // Sent but unconfirmed ones go first: they most likely arrived.
    if (!unacked_.empty()) {
      unacked_.pop_front();
    } else {
      records_.pop_front();
      ++dropped_;
    }
  }
  records_.push_back(std::move(record));
}

void Reporter::SendNow() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    next_send_ = Clock::now();
  }
  cv_.notify_all();
}

void Reporter::Commit(v1::CommitCheckpointRequest request) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (commits_.size() >= options_.max_commits) {
      commits_.pop_front();
      ++dropped_commits_;
    }
    commits_.push_back(std::move(request));
  }
  cv_.notify_all();
}

void Reporter::Progress(int64_t step, int32_t epoch, int64_t collective_seq, int64_t total_steps) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = progress_step_ < 0;
    total_steps_ = total_steps;
    progress_step_ = step;
    progress_epoch_ = epoch;
    collective_seq_ = collective_seq;
    if (first) first_beat_ = true;
  }
  // The first beat goes at once: until every rank has sent one the
  // coordinator counts the generation as still setting up.
  if (first) cv_.notify_all();
}

void Reporter::MarkSuperseded() {
  {
    // Under the lock, so that a waiter between its check and its wait
    // does not miss the wake-up.
    std::lock_guard<std::mutex> lock(mu_);
    superseded_ = true;
  }
  ask_cv_.notify_all();
}

Reporter::CheckpointAsk Reporter::checkpoint_ask() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ask_;
}

Reporter::CheckpointAsk Reporter::AtStepBoundary(int64_t completed) {
  bool answered = false;
  CheckpointAsk ask;
  {
    std::lock_guard<std::mutex> lock(mu_);
    boundary_ = completed;
    ask = ask_;
    if (ask.step != 0 && ask.step != ask_answered_) {
      if (completed > ask.step) {
        AIDN_LOG(INFO) << "already past the checkpoint step asked for" << Kv("step", ask.step)
                       << Kv("completed", completed);
      }
      AnswerCheckpointAskLocked(ask.step, /*missed=*/completed > ask.step);
      answered = true;
    }
  }
  if (answered) cv_.notify_all();
  return ask;
}

void Reporter::AnswerCheckpointAsk(int64_t step, bool missed) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    AnswerCheckpointAskLocked(step, missed);
  }
  cv_.notify_all();
}

void Reporter::AnswerCheckpointAskLocked(int64_t step, bool missed) {
  ask_answered_ = step;
  ask_ack_ = missed ? 0 : step;
  ask_missed_ = missed ? step : 0;
  beat_now_ = true;
}

Reporter::CheckpointAsk Reporter::AwaitCheckpointGo(int64_t step, milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  awaiting_go_ = true;
  beat_now_ = true;
  cv_.notify_all();
  ask_cv_.wait_for(lock, timeout, [&] {
    return ask_.step != step || ask_.go || superseded_.load() || loop_done_;
  });
  awaiting_go_ = false;
  return ask_;
}

void Reporter::Close(milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  bool join = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!closing_) {
      closing_ = true;
      close_deadline_ = deadline;
    } else {
      close_deadline_ = std::min(close_deadline_, deadline);
    }
    cv_.notify_all();
    // Every call's deadline is cut to the close deadline, so the loop ends
    // about then.
    done_cv_.wait_until(lock, deadline + milliseconds(100), [this] { return loop_done_; });
    if (!loop_done_ || joined_) return;
    joined_ = true;
    join = true;
  }
  if (!join) return;
  thread_.join();
  if (dropped_ > 0) {
    AIDN_LOG(WARNING) << "metric records dropped while the coordinator was away"
                      << Kv("dropped", dropped_);
  }
  if (dropped_commits_ > 0) {
    AIDN_LOG(WARNING) << "checkpoint commits dropped while the coordinator was away"
                      << Kv("dropped", dropped_commits_);
  }
}

std::optional<Reporter::Work> Reporter::TakeDueLocked(Clock::time_point now,
                                                      Clock::time_point* wake) {
  const bool may_send = now >= retry_at_;
  const bool commit = !commits_.empty();
  // A pending commit takes its records along at once.
  const bool records_due =
      may_send && !records_.empty() && (closing_ || commit || now >= next_send_);
  const bool beat = progress_step_ >= 0 && (first_beat_ || beat_now_ || now >= next_beat_);
  const bool unconfirmed = closing_ && records_.empty() && !commit && !unacked_.empty();
  const bool confirm = unconfirmed && may_send && now >= next_confirm_;
  if (!records_due && !(may_send && commit) && !beat && !confirm) {
    *wake = next_send_;
    if (progress_step_ >= 0) *wake = std::min(*wake, next_beat_);
    if (commit || (closing_ && !records_.empty())) *wake = std::min(*wake, retry_at_);
    if (unconfirmed) *wake = std::min(*wake, std::max(next_confirm_, retry_at_));
    if (closing_) *wake = std::min(*wake, close_deadline_);
    if (now >= next_send_) next_send_ = now + options_.report_period;  // nothing to send
    return std::nullopt;
  }
  Work work;
  if (records_due) {
    while (!records_.empty() && work.batch.size() < kMaxPerCall) {
      work.batch.push_back(std::move(records_.front()));
      records_.pop_front();
    }
    // A backlog (after an outage) goes call after call.
    next_send_ = records_.empty() ? now + options_.report_period : now;
  }
  work.commit = may_send && commit;
  work.confirm = confirm;
  if (confirm) next_confirm_ = now + options_.confirm_period;
  work.beat = beat;
  first_beat_ = false;
  if (beat) beat_now_ = false;
  work.ack = ask_ack_;
  work.missed = ask_missed_;
  work.step = progress_step_;
  work.epoch = progress_epoch_;
  work.seq = collective_seq_;
  work.total = total_steps_;
  work.timeout = options_.rpc_timeout;
  if (closing_) {
    work.timeout = std::clamp(std::chrono::duration_cast<milliseconds>(close_deadline_ - now),
                              milliseconds(1), options_.rpc_timeout);
  }
  return work;
}

void Reporter::Loop() {
  rpc::Backoff backoff;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    const Clock::time_point now = Clock::now();
    const bool all_stored =
        records_.empty() && commits_.empty() && (unacked_.empty() || superseded_.load());
    if (closing_ && (all_stored || now >= close_deadline_)) break;
    Clock::time_point wake;
    std::optional<Work> work = TakeDueLocked(now, &wake);
    if (!work.has_value()) {
      // Record() does not wake the loop: records wait for the next send.
      cv_.wait_until(lock, wake);
      continue;
    }
    lock.unlock();
    bool failed = false;
    // An empty call is the question "stored yet?": its answer carries the
    // durable step and the incarnation (Send handles both).
    if (work->confirm && !Send({}, work->timeout)) failed = true;
    if (!work->batch.empty() && !Send(work->batch, work->timeout)) {
      lock.lock();
      // Back in front, in order, for the next try.
      for (auto it = work->batch.rbegin(); it != work->batch.rend(); ++it) {
        records_.push_front(std::move(*it));
      }
      lock.unlock();
      failed = true;
    }
    // Records first: a commit goes once none up to its step waits.
    if (!failed && work->commit && !SendCommitIfDue(work->timeout)) failed = true;
    if (work->beat) SendProgress(*work);
    lock.lock();
    if (work->beat) {
      next_beat_ = Clock::now() + (awaiting_go_ ? options_.fast_beat_period : options_.beat_period);
    }
    if (failed) {
      retry_at_ = Clock::now() + backoff.Next();
    } else if (!work->batch.empty() || work->commit || work->confirm) {
      backoff.Reset();
    }
  }
  loop_done_ = true;
  done_cv_.notify_all();
  ask_cv_.notify_all();
}

bool Reporter::Send(const std::vector<v1::MetricRecord>& batch, milliseconds timeout) {
  grpc::ClientContext context;
  rpc::PrepareContext(&context, options_.token, timeout);
  v1::StreamMetricsResponse response;
  std::unique_ptr<grpc::ClientWriterInterface<v1::StreamMetricsRequest>> writer =
      stub_->StreamMetrics(&context, &response);
  // At least one message, so that an empty call still names the job.
  for (size_t first = 0; first == 0 || first < batch.size(); first += kBatch) {
    v1::StreamMetricsRequest request;
    request.set_job_id(options_.job_id);
    request.set_generation(options_.generation);
    request.set_rank(options_.rank);
    const size_t end = std::min(batch.size(), first + kBatch);
    for (size_t i = first; i < end; ++i) *request.add_records() = batch[i];
    if (!writer->Write(request)) break;  // the call failed; Finish says why
  }
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  rpc::ResetBackoffAfter(status, channel_.get());
  if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
    MarkSuperseded();
    return true;  // nobody wants them any more
  }
  if (!status.ok()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  for (const v1::MetricRecord& r : batch) unacked_.push_back(r);
  SeenIncarnationLocked(response.incarnation());
  const int64_t durable = response.durable_step();
  unacked_.erase(
      std::remove_if(unacked_.begin(), unacked_.end(),
                     [durable](const v1::MetricRecord& r) { return r.step() <= durable; }),
      unacked_.end());
  return true;
}

// A new incarnation is a restarted coordinator: whatever it had not stored
// is gone, so every unconfirmed record goes again (it ignores the ones it
// has).
void Reporter::SeenIncarnationLocked(const std::string& incarnation) {
  if (incarnation.empty()) return;
  if (!incarnation_.empty() && incarnation != incarnation_) {
    AIDN_LOG(INFO) << "the coordinator restarted; sending unconfirmed metric records again"
                   << Kv("records", unacked_.size());
    records_.insert(records_.begin(), unacked_.begin(), unacked_.end());
    unacked_.clear();
  }
  incarnation_ = incarnation;
}

bool Reporter::SendCommitIfDue(milliseconds timeout) {
  v1::CommitCheckpointRequest request;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (commits_.empty()) return true;
    request = commits_.front();
    const int64_t step = request.step();
    if (std::any_of(records_.begin(), records_.end(),
                    [step](const v1::MetricRecord& r) { return r.step() <= step; })) {
      return true;  // the next batch takes them first
    }
  }
  if (!SendCommit(request, timeout)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  commits_.pop_front();
  return true;
}

bool Reporter::SendCommit(const v1::CommitCheckpointRequest& request, milliseconds timeout) {
  grpc::ClientContext context;
  rpc::PrepareContext(&context, options_.token, timeout);
  v1::CommitCheckpointResponse response;
  grpc::Status status = stub_->CommitCheckpoint(&context, request, &response);
  rpc::ResetBackoffAfter(status, channel_.get());
  if (rpc::Transient(status)) return false;
  if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
    MarkSuperseded();
    return true;
  }
  if (!status.ok()) {
    AIDN_LOG(ERROR) << "checkpoint commit refused: " << status.error_message()
                    << Kv("step", request.step());
    return true;
  }
  AIDN_LOG(INFO) << "checkpoint reported" << Kv("step", request.step())
                 << Kv("committed", response.committed() ? "yes" : "no");
  if (retire_) retire_(request, response);
  return true;
}

void Reporter::SendProgress(const Work& work) {
  grpc::ClientContext context;
  rpc::PrepareContext(&context, options_.token, work.timeout);
  v1::ReportProgressRequest request;
  request.set_job_id(options_.job_id);
  request.set_generation(options_.generation);
  request.set_rank(options_.rank);
  request.set_step(work.step);
  request.set_epoch(work.epoch);
  request.set_collective_seq(work.seq);
  request.set_total_steps(work.total);
  request.set_checkpoint_ack(work.ack);
  request.set_checkpoint_missed(work.missed);
  v1::ReportProgressResponse response;
  grpc::Status status = stub_->ReportProgress(&context, request, &response);
  rpc::ResetBackoffAfter(status, channel_.get());
  if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION || response.stop()) {
    MarkSuperseded();
  }
  if (status.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    SeenIncarnationLocked(response.incarnation());
    const CheckpointAsk ask{response.checkpoint().step(), response.checkpoint().go()};
    if (ask.step != ask_.step || ask.go != ask_.go) {
      if (ask.step != ask_.step && ask.step != 0) {
        AIDN_LOG(INFO) << "the coordinator asks for a checkpoint" << Kv("step", ask.step)
                       << Kv("reason", response.checkpoint().reason());
      }
      ask_ = ask;
      // Answered here, not by the training thread, which may wait in a
      // collective for a rank that already waits at the step.
      if (ask.step != 0 && ask.step != ask_answered_ && boundary_ >= 0) {
        if (boundary_ >= ask.step) {
          AIDN_LOG(INFO) << "already past the checkpoint step asked for" << Kv("step", ask.step)
                         << Kv("completed", boundary_);
        }
        AnswerCheckpointAskLocked(ask.step, /*missed=*/boundary_ >= ask.step);
      }
      ask_cv_.notify_all();
    }
  }
}

}  // namespace aidn::trainer
