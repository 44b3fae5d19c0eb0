#ifndef AIDN_WORKER_TRAINER_REPORTER_H_
#define AIDN_WORKER_TRAINER_REPORTER_H_

// A trainer's line to the coordinator while it trains: metric records
// (batched), checkpoint commits and progress beats, sent from a thread of
// its own so that training never waits on the coordinator.
//
// - Records go once a second on one StreamMetrics call. They stay held
//   until the coordinator says they are in its database (durable_step); all
//   those not yet there are sent again when it restarted (a new
//   incarnation), so a coordinator crash loses no step.
// - A commit goes at once, but only after every record up to its step has
//   been sent: the coordinator can make the checkpoint a resume point as
//   soon as the metrics it covers are stored.
// - Progress beats (failure detection) go every second on their own; the
//   first goes at once.
// - What cannot be sent is kept (records and commits bounded: the oldest
//   are dropped and counted) and retried with exponential backoff.
// - Close sends what is left within a deadline: at the end of training and
//   when the trainer is stopped (SIGTERM).
//
// Thread-safe: the training thread calls Record, Commit and Progress; any
// thread may call Close (concurrent calls all return once the thread ends
// or their own deadline passes).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "aidn/v1/cluster.grpc.pb.h"

namespace aidn::trainer {

struct ReporterOptions {
  // The job-scoped trainer token, and who reports.
  std::string token;
  std::string job_id;
  int64_t generation = 0;
  int rank = 0;
  // Records go this often. Once a second rather than more often: each call
  // costs the coordinator far more than its records do (at 1,000 ranks,
  // five calls a second each took half of its CPU), a live view refreshes
  // once a second anyway, and progress beats, which drive failure
  // detection, go on their own.
  std::chrono::milliseconds report_period{1000};
  // Progress beats go this often; while a rank waits at a requested
  // checkpoint step for the others to agree, every fast_beat_period.
  std::chrono::milliseconds beat_period{1000};
  std::chrono::milliseconds fast_beat_period{50};
  // Each call's deadline (shortened to what is left while closing).
  std::chrono::milliseconds rpc_timeout{10'000};
  // Records held (unsent and sent but not yet stored) before the oldest go.
  size_t max_records = 100'000;
  // Commits held while the coordinator is away (a resume takes the newest).
  size_t max_commits = 1024;
  // While closing, how often to ask whether the records sent are stored
  // (the coordinator stores them every tick, 100 ms by default).
  std::chrono::milliseconds confirm_period{100};
};

class Reporter {
 public:
  // Called (on the reporter's thread) with each commit the coordinator
  // answered: its retired_steps' directories are to go, and held_steps says
  // what the registry holds.
  using RetireFn = std::function<void(const v1::CommitCheckpointRequest& request,
                                      const v1::CommitCheckpointResponse& response)>;

  Reporter(std::shared_ptr<grpc::Channel> channel,
           std::shared_ptr<v1::ClusterService::StubInterface> stub, const ReporterOptions& options,
           RetireFn retire);
  // Close(5 s), then waits for the thread.
  ~Reporter();
  Reporter(const Reporter&) = delete;
  Reporter& operator=(const Reporter&) = delete;

  // Queues a record, sent with the next batch.
  void Record(v1::MetricRecord record);
  // Queues a commit; commits are sent in order, each after the records up
  // to its step, and retried until the coordinator answers.
  void Commit(v1::CommitCheckpointRequest request);
  // Sends the records held now rather than at the next report period: every
  // rank calls it at a checkpoint step, since the coordinator makes the
  // checkpoint a resume point only once every rank's records up to it are
  // stored.
  void SendNow();
  // The rank's position, for the next beat.
  void Progress(int64_t step, int32_t epoch, int64_t collective_seq, int64_t total_steps);

  // The coordinator said this generation is over.
  bool superseded() const { return superseded_.load(); }

  // A checkpoint the coordinator asks for outside the spec's schedule (a
  // pause), as its newest progress answer says: step 0 when none.
  struct CheckpointAsk {
    int64_t step = 0;
    bool go = false;
  };
  CheckpointAsk checkpoint_ask() const;
  // The training thread at the boundary after `completed` steps, where it
  // checks for an ask. Returns the ask, answered (as below) if it was not.
  //
  // From the first boundary on, an ask that arrives is answered at once by
  // the reporter's thread, since the training thread may be blocked in a
  // collective that waits for a rank already waiting at the step: ack when
  // the training thread has not yet passed the step's boundary (it will see
  // the ask there, since both take the same lock), missed when it has.
  CheckpointAsk AtStepBoundary(int64_t completed);
  // This rank's answer to the ask of `step`, sent with every beat from the
  // next one (which goes at once) on: it will wait at the step (ack), or it
  // was already past it (missed).
  void AnswerCheckpointAsk(int64_t step, bool missed);
  // At the step it acked, before go: beats every fast_beat_period until the
  // coordinator says go or asks for another step, the generation is over,
  // or `timeout` passes. Returns the ask then.
  CheckpointAsk AwaitCheckpointGo(int64_t step, std::chrono::milliseconds timeout);

  // Sends what is left (records, then commits) within `timeout` and stops
  // the thread, once the coordinator says every record sent is stored: until
  // then it asks every `confirm_period`, so that a coordinator that
  // restarted unnoticed (and lost records not yet stored) gets them again.
  // Returns once the thread ended or `timeout` passed.
  void Close(std::chrono::milliseconds timeout);

 private:
  using Clock = std::chrono::steady_clock;
  // A batch's worth of what the loop sends next, taken under the lock.
  struct Work;

  void Loop();
  // What is due now; nullopt (and *wake set) when nothing is.
  std::optional<Work> TakeDueLocked(Clock::time_point now, Clock::time_point* wake);
  // Sends a batch of records: true when done with (stored, or nobody wants
  // them any more).
  bool Send(const std::vector<v1::MetricRecord>& batch, std::chrono::milliseconds timeout);
  // Sends the oldest commit unless records up to its step still wait: true
  // when done with (answered, or never to be answered) or not yet due.
  bool SendCommitIfDue(std::chrono::milliseconds timeout);
  bool SendCommit(const v1::CommitCheckpointRequest& request, std::chrono::milliseconds timeout);
  void SendProgress(const Work& work);
  void SeenIncarnationLocked(const std::string& incarnation);
  // The coordinator said this generation is over; wakes AwaitCheckpointGo.
  void MarkSuperseded();
  void AnswerCheckpointAskLocked(int64_t step, bool missed);

  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::ClusterService::StubInterface> stub_;
  const ReporterOptions options_;
  const RetireFn retire_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::MetricRecord> records_;
  // Sent, but not yet reported stored by the coordinator.
  std::deque<v1::MetricRecord> unacked_;
  std::deque<v1::CommitCheckpointRequest> commits_;
  std::string incarnation_;
  int64_t dropped_ = 0;
  int64_t dropped_commits_ = 0;
  bool first_beat_ = false;
  int64_t progress_step_ = -1;
  int32_t progress_epoch_ = 0;
  int64_t collective_seq_ = 0;
  int64_t total_steps_ = 0;
  Clock::time_point next_send_;
  Clock::time_point next_beat_;
  // While closing with records sent but not confirmed stored: the next ask.
  Clock::time_point next_confirm_;
  // After a failed send, records and commits wait until then.
  Clock::time_point retry_at_;
  bool closing_ = false;
  Clock::time_point close_deadline_;
  // The loop has returned; `joined_`: a Close took the thread.
  bool loop_done_ = false;
  bool joined_ = false;
  std::condition_variable done_cv_;
  std::atomic<bool> superseded_{false};
  // The newest checkpoint ask, this rank's answer, and whether a rank waits
  // for go (fast beats); ask_cv_ wakes the waiter.
  CheckpointAsk ask_;
  int64_t ask_ack_ = 0;
  int64_t ask_missed_ = 0;
  // The ask step last answered, and the last step boundary the training
  // thread checked at (-1: none yet).
  int64_t ask_answered_ = 0;
  int64_t boundary_ = -1;
  bool awaiting_go_ = false;
  bool beat_now_ = false;
  std::condition_variable ask_cv_;
  std::thread thread_;
};

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_REPORTER_H_
