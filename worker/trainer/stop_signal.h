#ifndef AIDN_WORKER_TRAINER_STOP_SIGNAL_H_
#define AIDN_WORKER_TRAINER_STOP_SIGNAL_H_

// How a trainer stops on SIGTERM (the worker stopping it) or SIGINT: not at
// once, losing the metric records and commits its reporter still holds, but
// in three bounded stages, well within the worker's stop grace (10 s by
// default):
//
//   1. requested() turns true: the training loop stops at its next step
//      boundary and calls Park(). A thread stuck elsewhere (a collective
//      whose peer died) is not waited for beyond `boundary_wait`.
//   2. The flush registered with SetFlush runs (the reporter's Close) with
//      `flush_timeout`.
//   3. The process dies of the signal it got, as it would have without the
//      handler, so its parent sees the same exit.
//
// Without a registered flush (before the reporter exists) stage 3 comes at
// once.
//
// The handlers it installs (restored by the destructor) only wake a thread
// of the StopSignal's own, which carries out the stop; whichever thread the
// kernel picks for the signal runs the handler. One per process.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include <signal.h>

namespace aidn::trainer {

struct StopSignalOptions {
  // How long the stop waits for the training loop to reach a step boundary
  // (a step takes milliseconds; a rank blocked in a collective whose peer
  // died never gets there, and its restart waits this long).
  std::chrono::milliseconds boundary_wait{1000};
  // What the flush is given.
  std::chrono::milliseconds flush_timeout{3000};
  // Stage 3 (tests replace it): by default, the default action of `signal`
  // (the process ends).
  std::function<void(int signal)> end;
};

class StopSignal {
 public:
  explicit StopSignal(const StopSignalOptions& options = {});
  // Without a stop: ends the thread and restores the previous handlers.
  ~StopSignal();
  StopSignal(const StopSignal&) = delete;
  StopSignal& operator=(const StopSignal&) = delete;

  // A stop signal arrived. Thread-safe and cheap (the loop asks every step).
  bool requested() const { return requested_.load(std::memory_order_relaxed); }
  // What stage 2 runs, given its timeout (replaces the previous one; an
  // empty function clears it). Thread-safe.
  void SetFlush(std::function<void(std::chrono::milliseconds)> flush);
  // The training thread at a step boundary after requested(): lets stage 2
  // start at once and waits for the end (with the default end, forever).
  void Park();

 private:
  void Watch();
  void Stop(int signal);

  const StopSignalOptions options_;
  // The handlers write the signal's number here; the watcher reads it.
  int pipe_[2] = {-1, -1};
  struct sigaction old_term_ = {};
  struct sigaction old_int_ = {};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> requested_{false};
  bool parked_ = false;
  bool ended_ = false;
  bool done_ = false;
  std::function<void(std::chrono::milliseconds)> flush_;
  std::thread thread_;
};

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_STOP_SIGNAL_H_
