#ifndef AIDN_COORDINATOR_DEFERRED_H_
#define AIDN_COORDINATOR_DEFERRED_H_

// Work collected while a lock is held and run after it is released: answering
// a blocked RPC (which may re-enter the coordinator) or waking a watcher must
// never happen under the coordinator's mutex.

#include <functional>
#include <utility>
#include <vector>

namespace aidn::coordinator {

class Deferred {
 public:
  Deferred() = default;
  Deferred(const Deferred&) = delete;
  Deferred& operator=(const Deferred&) = delete;
  // Runs whatever is left.
  ~Deferred() { Run(); }

  void Add(std::function<void()> fn) { fns_.push_back(std::move(fn)); }
  void Run() {
    std::vector<std::function<void()>> fns;
    fns.swap(fns_);
    for (auto& fn : fns) fn();
  }

 private:
  std::vector<std::function<void()>> fns_;
};

// Answers a parked call's callback with `status` once the lock is released.
template <typename Callback, typename Status>
void AnswerLater(Deferred* deferred, Callback done, const Status& status) {
  deferred->Add([done = std::move(done), status]() { done(status); });
}

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_DEFERRED_H_
