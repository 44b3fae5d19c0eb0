// A binary of its own: the signals these tests send go to the whole
// process.

#include "worker/trainer/stop_signal.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "gtest/gtest.h"

namespace aidn::trainer {
namespace {

using std::chrono::milliseconds;

// What the stop did, in order.
struct Trace {
  std::mutex mu;
  std::condition_variable cv;
  milliseconds flushed{-1};
  int ended_by = 0;
  bool parked_before_flush = false;

  bool WaitEnded() {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), [this] { return ended_by != 0; });
  }
};

StopSignalOptions OptionsFor(Trace* trace, milliseconds boundary_wait) {
  StopSignalOptions options;
  options.boundary_wait = boundary_wait;
  options.flush_timeout = milliseconds(1234);
  options.end = [trace](int signal) {
    std::lock_guard<std::mutex> lock(trace->mu);
    trace->ended_by = signal;
    trace->cv.notify_all();
  };
  return options;
}

bool Handled(int signal) {
  struct sigaction now = {};
  sigaction(signal, nullptr, &now);
  return now.sa_handler != SIG_DFL;
}

TEST(StopSignal, AParkedLoopIsFlushedThenTheSignalEndsIt) {
  Trace trace;
  StopSignal stop(OptionsFor(&trace, std::chrono::minutes(5)));
  std::atomic<bool> parked{false};
  stop.SetFlush([&](milliseconds timeout) {
    std::lock_guard<std::mutex> lock(trace.mu);
    trace.flushed = timeout;
    trace.parked_before_flush = parked.load();
  });
  EXPECT_FALSE(stop.requested());
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  // The training loop asks at each step boundary.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!stop.requested() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  ASSERT_TRUE(stop.requested());
  parked = true;
  stop.Park();  // returns once the (test's) end ran
  std::lock_guard<std::mutex> lock(trace.mu);
  EXPECT_EQ(trace.ended_by, SIGTERM);
  EXPECT_EQ(trace.flushed, milliseconds(1234));
  // The boundary wait (5 minutes) did not hold the flush back.
  EXPECT_TRUE(trace.parked_before_flush);
}

TEST(StopSignal, AThreadThatNeverParksIsNotWaitedForBeyondTheBoundaryWait) {
  Trace trace;
  StopSignal stop(OptionsFor(&trace, milliseconds(20)));
  bool flushed = false;
  stop.SetFlush([&](milliseconds) { flushed = true; });
  ASSERT_EQ(kill(getpid(), SIGINT), 0);
  ASSERT_TRUE(trace.WaitEnded());
  EXPECT_EQ(trace.ended_by, SIGINT);
  EXPECT_TRUE(flushed);
}

TEST(StopSignal, WithNothingToFlushTheSignalEndsAtOnce) {
  Trace trace;
  StopSignal stop(OptionsFor(&trace, std::chrono::minutes(5)));
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  ASSERT_TRUE(trace.WaitEnded());
  EXPECT_EQ(trace.ended_by, SIGTERM);
  EXPECT_EQ(trace.flushed, milliseconds(-1));
}

TEST(StopSignal, HandlesTheSignalsWhileItLivesAndRestoresTheDefaults) {
  ASSERT_FALSE(Handled(SIGTERM));
  {
    Trace trace;
    StopSignal stop(OptionsFor(&trace, milliseconds(10)));
    EXPECT_TRUE(Handled(SIGTERM));
    EXPECT_TRUE(Handled(SIGINT));
    EXPECT_FALSE(stop.requested());
  }
  EXPECT_FALSE(Handled(SIGTERM));
  EXPECT_FALSE(Handled(SIGINT));
}

}  // namespace
}  // namespace aidn::trainer
