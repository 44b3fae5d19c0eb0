#include "worker/trainer/stop_signal.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <utility>

#include "common/log.h"

namespace aidn::trainer {
namespace {

// Where the handler writes (one StopSignal per process).
std::atomic<int> g_wake_fd{-1};

// Async-signal-safe: one byte, the signal's number, to the watcher.
void OnSignal(int signal) {
  const int saved = errno;
  const int fd = g_wake_fd.load();
  if (fd >= 0) {
    const char byte = static_cast<char>(signal);
    ssize_t ignored = write(fd, &byte, 1);
    (void)ignored;
  }
  errno = saved;
}

// The default action of `signal` (for SIGTERM and SIGINT: the process ends,
// killed by it, as it would have been without the handler).
void DieOf(int signal) {
  struct sigaction dfl = {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(signal, &dfl, nullptr);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, signal);
  pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
  raise(signal);
  _exit(128 + signal);  // not reached
}

}  // namespace

StopSignal::StopSignal(const StopSignalOptions& options) : options_(options) {
  if (pipe2(pipe_, O_CLOEXEC) != 0) {
    AIDN_LOG(WARNING) << "stop signal: no pipe; SIGTERM ends the trainer at once"
                      << Kv("errno", errno);
    return;
  }
  // The handler must never block: once the watcher has taken the first
  // signal it reads no more, and a full pipe would hang a later handler.
  fcntl(pipe_[1], F_SETFL, O_NONBLOCK);
  g_wake_fd.store(pipe_[1]);
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  // Calls interrupted by the handler resume where they can.
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, &old_term_);
  sigaction(SIGINT, &action, &old_int_);
  thread_ = std::thread([this] { Watch(); });
}

StopSignal::~StopSignal() {
  if (!thread_.joinable()) return;
  sigaction(SIGTERM, &old_term_, nullptr);
  sigaction(SIGINT, &old_int_, nullptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
  // Wakes the watcher (which sees done_), unless it is carrying out a stop
  // that came in the meantime: that then ends as any stop does.
  const char zero = 0;
  ssize_t ignored = write(pipe_[1], &zero, 1);
  (void)ignored;
  thread_.join();
  g_wake_fd.store(-1);
  close(pipe_[0]);
  close(pipe_[1]);
}

void StopSignal::SetFlush(std::function<void(std::chrono::milliseconds)> flush) {
  std::lock_guard<std::mutex> lock(mu_);
  flush_ = std::move(flush);
}

void StopSignal::Park() {
  std::unique_lock<std::mutex> lock(mu_);
  parked_ = true;
  cv_.notify_all();
  cv_.wait(lock, [this] { return ended_; });
}

void StopSignal::Watch() {
  char byte = 0;
  while (true) {
    const ssize_t n = read(pipe_[0], &byte, 1);
    if (n < 0 && errno == EINTR) continue;
    std::lock_guard<std::mutex> lock(mu_);
    if (n != 1 || done_) return;
    if (byte != 0) break;
  }
  Stop(static_cast<int>(byte));
}

void StopSignal::Stop(int signal) {
  std::function<void(std::chrono::milliseconds)> flush;
  {
    std::unique_lock<std::mutex> lock(mu_);
    requested_ = true;
    if (flush_) {
      AIDN_LOG(INFO) << "stop signal: stopping at the next step boundary, then sending what the "
                        "reporter holds"
                     << Kv("signal", signal);
      if (!cv_.wait_for(lock, options_.boundary_wait, [this] { return parked_ || done_; })) {
        AIDN_LOG(WARNING) << "the training thread did not reach a step boundary in time"
                          << Kv("waited_ms", options_.boundary_wait.count());
      }
      flush = flush_;
    }
  }
  if (flush) flush(options_.flush_timeout);
  if (options_.end) {
    options_.end(signal);
  } else {
    DieOf(signal);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = true;
  }
  cv_.notify_all();
}

}  // namespace aidn::trainer
