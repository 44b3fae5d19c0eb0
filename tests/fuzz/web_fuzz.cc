// The web UI's JSON API (coordinator/web/web_api.h) as any browser or
// script may call it: a method, a bearer token, a path under /api/v1/, a
// query string and a body, all from the fuzz input, through the real API
// into the real gRPC server (in-process) and coordinator, which holds a
// small cluster (fuzz_cluster.h).
//
// Every answer must carry a known HTTP status and, unless it is a file, a
// body that parses as JSON. A GET (or any method but POST) must leave the
// coordinator's state exactly as it was, and so must every refused call.
//
// Input: byte 0 picks the method, byte 1 the token; the rest is
// "PATH\nQUERY\nBODY" (PATH after /api/v1/, QUERY as k=v&k=v).

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "coordinator/web/web_api.h"
#include "tests/fuzz/fuzz_cluster.h"

namespace {

using aidn::coordinator::web::WebApi;
using aidn::coordinator::web::WebRequest;
using aidn::coordinator::web::WebResponse;
using aidn::fuzz::Compare;
using aidn::fuzz::Die;
using aidn::fuzz::kTokenCount;
using aidn::fuzz::kTokens;
using aidn::fuzz::Snapshot;
using aidn::fuzz::State;

constexpr const char* kMethods[] = {"GET", "POST", "HEAD", "DELETE", "PUT"};
constexpr size_t kMethodCount = sizeof(kMethods) / sizeof(kMethods[0]);
constexpr int kKnownStatuses[] = {200, 400, 401, 403, 404, 405, 409, 500, 503, 504};

class Cluster {
 public:
  Cluster() : api_(cluster_.server()->InProcessChannel(), std::chrono::seconds(5)) {}

  void RunOne(const uint8_t* data, size_t size) {
    WebRequest request;
    request.method = kMethods[data[0] % kMethodCount];
    request.authorization = kTokens[data[1] % kTokenCount];
    const absl::string_view rest(reinterpret_cast<const char*>(data + 2), size - 2);
    const std::vector<absl::string_view> parts = absl::StrSplit(rest, absl::MaxSplits('\n', 2));
    request.path = "/api/v1/" + std::string(parts[0]);
    if (parts.size() > 1) {
      for (absl::string_view kv : absl::StrSplit(parts[1], '&', absl::SkipEmpty())) {
        const std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
        request.query[p.first] = p.second;
      }
    }
    if (parts.size() > 2) request.body = std::string(parts[2]);

    const State before = Snapshot(cluster_.coordinator());
    const WebResponse r = api_.Handle(request);
    const std::string what = request.method + " " + request.path + " with " +
                             (request.authorization.empty() ? "no token" : request.authorization);
    bool known = false;
    for (int s : kKnownStatuses) known = known || s == r.status;
    if (!known) Die(what + ": HTTP status " + std::to_string(r.status));
    if (r.file == nullptr && !nlohmann::json::accept(r.body)) {
      Die(what + ": an answer that is not JSON: " + r.body.substr(0, 200));
    }
    if (r.status == 200 && request.method == "POST") return;
    const State after = Snapshot(cluster_.coordinator());
    if (std::string diff = Compare(before, after); !diff.empty()) {
      Die(what + " (" + std::to_string(r.status) + ": " + r.body.substr(0, 200) +
          ") changed the coordinator's state: " + diff);
    }
  }

 private:
  aidn::fuzz::FuzzCluster cluster_;
  WebApi api_;
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  aidn::fuzz::QuietLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Cluster* cluster = new Cluster();  // lives for the process
  if (size < 2) return 0;
  cluster->RunOne(data, size);
  return 0;
}
