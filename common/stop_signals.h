#ifndef AIDN_COMMON_STOP_SIGNALS_H_
#define AIDN_COMMON_STOP_SIGNALS_H_

// The daemons stop on SIGINT or SIGTERM, taken by sigwait on the main thread.

#include <pthread.h>
#include <signal.h>

namespace aidn {

// Blocks SIGINT and SIGTERM in the calling thread, and so in every thread
// it starts later, and returns that set for sigwait: call before any thread
// starts. (A child process inherits the mask: whoever starts one gives it
// an empty mask again.)
inline sigset_t BlockStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

}  // namespace aidn

#endif  // AIDN_COMMON_STOP_SIGNALS_H_
