// The c10d store protocol (worker/c10d): what any process on the network
// may send a command job's store. Bytes are parsed as a connection's stream
// (its dialect detected from the first of them), each request re-encoded as
// a client would send it and parsed back to the same request, and applied
// to a store whose byte bound must hold whatever arrives.
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "worker/c10d/protocol.h"
#include "worker/c10d/store_state.h"

namespace {

using aidn::worker::c10d::Dialect;
using aidn::worker::c10d::Request;

bool Same(const Request& a, const Request& b) {
  return a.op == b.op && a.keys == b.keys && a.values == b.values && a.delta == b.delta &&
         a.word == b.word;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace c10d = aidn::worker::c10d;
  if (size < 1) return 0;
  // The first byte: which dialect a client without the handshake speaks.
  const Dialect unvalidated = (data[0] & 1) != 0 ? Dialect::kTorch21 : Dialect::kTorch1;
  std::string_view input(reinterpret_cast<const char*>(data + 1), size - 1);
  const std::optional<Dialect> dialect = c10d::DetectDialect(input, unvalidated);
  if (!dialect.has_value()) return 0;
  const c10d::ParseLimits limits{
      .max_key_bytes = 256, .max_value_bytes = 4096, .max_keys_per_request = 64};
  constexpr size_t kMaxBytes = 64 * 1024;
  c10d::StoreState state(kMaxBytes);
  c10d::ClientId client = 1;
  while (!input.empty()) {
    Request request;
    const absl::StatusOr<size_t> used = c10d::ParseRequest(*dialect, input, limits, &request);
    if (!used.ok() || *used == 0) break;
    if (*used > input.size()) std::abort();  // took more than it was given
    if (absl::StatusOr<std::string> bytes = c10d::EncodeRequest(*dialect, request); bytes.ok()) {
      Request again;
      const absl::StatusOr<size_t> n = c10d::ParseRequest(*dialect, *bytes, limits, &again);
      if (!n.ok() || *n != bytes->size() || !Same(request, again)) std::abort();
    }
    std::vector<c10d::Delivery> out;
    (void)state.Apply(client, request, &out);
    if (state.total_bytes() > kMaxBytes) std::abort();  // the bound did not hold
    input.remove_prefix(*used);
    client = 1 + client % 3;  // a few clients, so that waits meet sets
  }
  return 0;
}
