#ifndef AIDN_WORKER_C10D_STORE_STATE_H_
#define AIDN_WORKER_C10D_STORE_STATE_H_

// The keys, values, queues, waiters and watchers of one c10d store, and what
// each request does to them: the store without its sockets. Requests come in
// already parsed (protocol.h); replies go out as bytes addressed to clients.
// Not thread-safe: the server's event loop is its only user.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "worker/c10d/protocol.h"

namespace aidn::worker::c10d {

using ClientId = uint64_t;

// Bytes for one client, in the order they must be sent.
struct Delivery {
  ClientId client;
  std::string bytes;
};

class StoreState {
 public:
  // `max_total_bytes` bounds the sum of the sizes of all keys, values and
  // queued items.
  explicit StoreState(size_t max_total_bytes) : max_total_bytes_(max_total_bytes) {}

  // Applies `request` from `client`, appending what must be sent to *out: the
  // requester's reply (if the op has one) and the messages its change
  // releases to others (STOP_WAITING to waiters whose last key appeared,
  // WATCH_KEY updates). An error means the client must be dropped (nothing
  // changed): RESOURCE_EXHAUSTED over the byte budget, INVALID_ARGUMENT for an
  // ADD to a value that is not an integer or that overflows.
  //
  // Semantics follow PyTorch's servers: GET and MULTI_GET of a missing key
  // answer an empty value; COMPARE_SET of a missing key sets it only when
  // the expected value is empty and answers the value now stored (or the
  // expected value if nothing was set); ADD stores the decimal sum; a WAIT
  // on keys that all exist answers at once, otherwise the client's STOP_WAITING
  // is sent when the last missing key appears (SET, COMPARE_SET, ADD, APPEND,
  // MULTI_SET, or a QUEUE_PUSH on a key of that name, which releases one
  // waiter).
  absl::Status Apply(ClientId client, const Request& request, std::vector<Delivery>* out);

  // Drops everything `client` waits for or watches (it disconnected).
  void ForgetClient(ClientId client);

  size_t num_keys() const { return values_.size(); }
  size_t total_bytes() const { return total_bytes_; }
  // Clients with an outstanding WAIT.
  size_t num_waiting() const { return waits_.size(); }

 private:
  struct Wait {
    std::vector<std::string> keys;  // the missing keys it registered on
    size_t missing = 0;
  };

  bool Present(const std::string& key) const;
  absl::Status Reserve(size_t add_bytes, size_t release_bytes) const;
  void Store(const std::string& key, std::string value, std::vector<Delivery>* out);
  void Released(const std::string& key, std::vector<Delivery>* out);
  void ReleaseOne(const std::string& key, std::vector<Delivery>* out);
  void Notify(const std::string& key, uint8_t type, const std::string& old_value,
              const std::string& new_value, std::vector<Delivery>* out);
  void StartWait(ClientId client, const std::vector<std::string>& keys, std::vector<Delivery>* out);
  void CancelWait(ClientId client);
  absl::Status Add(ClientId client, const Request& request, std::vector<Delivery>* out);
  absl::Status CompareSet(ClientId client, const Request& request, std::vector<Delivery>* out);
  absl::Status QueueOp(ClientId client, const Request& request, std::vector<Delivery>* out);

  size_t max_total_bytes_;
  size_t total_bytes_ = 0;
  std::unordered_map<std::string, std::string> values_;
  std::unordered_map<std::string, std::deque<std::string>> queues_;
  // key -> clients waiting for it (a client appears once per occurrence of
  // the key in its WAIT).
  std::unordered_map<std::string, std::vector<ClientId>> waiters_;
  std::unordered_map<ClientId, Wait> waits_;
  // key -> clients watching it (kTorch1 WATCH_KEY), and the reverse.
  std::unordered_map<std::string, std::vector<ClientId>> watchers_;
  std::unordered_map<ClientId, std::vector<std::string>> watched_;
};

}  // namespace aidn::worker::c10d

#endif  // AIDN_WORKER_C10D_STORE_STATE_H_
