#ifndef AIDN_TESTS_SUPPORT_WAIT_H_
#define AIDN_TESTS_SUPPORT_WAIT_H_

// Waiting for a state in tests: poll with a deadline, never sleep for a
// fixed time and hope. The deadline only bounds how long a failing test
// takes; a passing test returns as soon as the state is there.

#include <chrono>
#include <functional>
#include <string>

#include "gtest/gtest.h"

namespace aidn::testing {

// How often WaitFor asks.
inline constexpr std::chrono::milliseconds kPollEvery{20};

// Asks `predicate` every kPollEvery until it returns true (→ true) or
// `timeout` has passed (→ false). It is asked at least once, the last time
// at the deadline.
bool WaitFor(const std::function<bool()>& predicate, std::chrono::milliseconds timeout);

// As above, for ASSERT_TRUE/EXPECT_TRUE: on a timeout the failure says
// "<what> did not happen within <timeout> ms", followed by `explain()` when
// given (say what was seen instead).
::testing::AssertionResult WaitFor(const std::function<bool()>& predicate,
                                   std::chrono::milliseconds timeout, const std::string& what,
                                   const std::function<std::string()>& explain = nullptr);

}  // namespace aidn::testing

#endif  // AIDN_TESTS_SUPPORT_WAIT_H_
