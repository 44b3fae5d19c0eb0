#include "tests/support/wait.h"

#include <thread>

namespace aidn::testing {

bool WaitFor(const std::function<bool()>& predicate, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (predicate()) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    // A polling interval, not a wait for a state.
    // The last sleep ends at the deadline, so the predicate is asked there once more.
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(kPollEvery, deadline - now));
  }
}

::testing::AssertionResult WaitFor(const std::function<bool()>& predicate,
                                   std::chrono::milliseconds timeout, const std::string& what,
                                   const std::function<std::string()>& explain) {
  if (WaitFor(predicate, timeout)) return ::testing::AssertionSuccess();
  ::testing::AssertionResult failure = ::testing::AssertionFailure();
  failure << what << " did not happen within " << timeout.count() << " ms";
  if (explain) failure << "; " << explain();
  return failure;
}

}  // namespace aidn::testing
