#include "coordinator/web/web_api.h"

#include <optional>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/checkpoint_check.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/time_util.h"
#include "grpcpp/client_context.h"

namespace aidn::coordinator::web {
namespace {

constexpr char kPrefix[] = "/api/v1/";
// ListJobs pages gathered for one answer, of the service's largest size.
constexpr int kJobPages = 10;
constexpr int kJobPageSize = 1000;
constexpr int64_t kDefaultLogTail = 200;
constexpr int64_t kMaxLogTail = 10'000;
constexpr size_t kMaxReasonBytes = 1000;

std::string Dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

WebResponse Error(int status, absl::StatusCode code, absl::string_view message) {
  WebResponse r;
  r.status = status;
  r.body = Dump({{"error", std::string(message)}, {"code", absl::StatusCodeToString(code)}});
  return r;
}

int HttpStatusOf(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
      return 409;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

WebResponse FromStatus(const absl::Status& s) {
  return Error(HttpStatusOf(s.code()), s.code(), s.message());
}

WebResponse FromRpc(const grpc::Status& s) {
  const auto code = static_cast<absl::StatusCode>(s.error_code());
  return Error(HttpStatusOf(code), code, s.error_message());
}

WebResponse Json(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  WebResponse r;
  const auto status = google::protobuf::util::MessageToJsonString(message, &r.body, options);
  if (!status.ok()) {
    return Error(500, absl::StatusCode::kInternal,
                 absl::StrCat("cannot write the answer as JSON: ", status.ToString()));
  }
  return r;
}

// An integer query parameter in [lo, hi]; `fallback` when absent.
absl::StatusOr<int64_t> IntParam(const WebRequest& request, const std::string& name,
                                 int64_t fallback, int64_t lo, int64_t hi) {
  const auto it = request.query.find(name);
  if (it == request.query.end()) return fallback;
  int64_t value = 0;
  if (!absl::SimpleAtoi(it->second, &value) || value < lo || value > hi) {
    return absl::InvalidArgumentError(absl::StrCat("query parameter ", name,
                                                   ": want an integer in [", lo, ", ", hi,
                                                   "], got \"", it->second, "\""));
  }
  return value;
}

// A header value gRPC takes as metadata: printable ASCII only.
bool PrintableAscii(absl::string_view s) {
  for (const char c : s) {
    if (c < 0x20 || c > 0x7E) return false;
  }
  return true;
}

std::string Timestamp(const google::protobuf::Timestamp& t) {
  return google::protobuf::util::TimeUtil::ToString(t);
}

}  // namespace

WebApi::WebApi(std::shared_ptr<grpc::Channel> channel, std::chrono::milliseconds timeout)
    : stub_(v1::CoordinatorService::NewStub(std::move(channel))), timeout_(timeout) {}

WebResponse WebApi::Handle(const WebRequest& request) const {
  absl::string_view rest = request.path;
  if (!absl::ConsumePrefix(&rest, kPrefix)) {
    return Error(404, absl::StatusCode::kNotFound, "not an API path");
  }
  if (!PrintableAscii(request.authorization)) {
    return Error(400, absl::StatusCode::kInvalidArgument,
                 "the Authorization header must be printable ASCII");
  }
  const std::vector<std::string> parts = absl::StrSplit(rest, '/');
  auto prepare = [&](grpc::ClientContext* context) {
    if (!request.authorization.empty())
      context->AddMetadata("authorization", request.authorization);
    context->set_deadline(std::chrono::system_clock::now() + timeout_);
  };
  auto want = [&](const char* method) -> std::optional<WebResponse> {
    if (request.method == method || (request.method == "HEAD" && std::string(method) == "GET")) {
      return std::nullopt;
    }
    WebResponse r = Error(405, absl::StatusCode::kInvalidArgument,
                          absl::StrCat(request.path, " answers ", method, " only"));
    r.allow = std::string(method) == "GET" ? "GET, HEAD" : method;
    return r;
  };
  const size_t n = parts.size();

  if (n == 1 && parts[0] == "workers") {
    if (auto bad = want("GET")) return *bad;
    grpc::ClientContext context;
    prepare(&context);
    v1::ListWorkersResponse response;
    const grpc::Status s = stub_->ListWorkers(&context, v1::ListWorkersRequest(), &response);
    return s.ok() ? Json(response) : FromRpc(s);
  }

  if (n == 1 && parts[0] == "jobs") {
    if (auto bad = want("GET")) return *bad;
    v1::ListJobsRequest list;
    list.set_page_size(kJobPageSize);
    if (auto it = request.query.find("state"); it != request.query.end() && !it->second.empty()) {
      for (absl::string_view name : absl::StrSplit(it->second, ',')) {
        v1::Job::State state;
        if (!v1::Job::State_Parse(std::string(name), &state)) {
          return Error(400, absl::StatusCode::kInvalidArgument,
                       absl::StrCat("query parameter state: unknown state \"", name, "\""));
        }
        list.add_states(state);
      }
    }
    if (auto it = request.query.find("label"); it != request.query.end()) {
      const std::pair<std::string, std::string> kv =
          absl::StrSplit(it->second, absl::MaxSplits('=', 1));
      if (kv.first.empty()) {
        return Error(400, absl::StatusCode::kInvalidArgument,
                     "query parameter label: want key=value");
      }
      (*list.mutable_labels())[kv.first] = kv.second;
    }
    v1::ListJobsResponse all;
    for (int page = 0; page < kJobPages; ++page) {
      grpc::ClientContext context;
      prepare(&context);
      v1::ListJobsResponse response;
      const grpc::Status s = stub_->ListJobs(&context, list, &response);
      if (!s.ok()) return FromRpc(s);
      for (v1::Job& job : *response.mutable_jobs()) *all.add_jobs() = std::move(job);
      // Non-empty after the last page read: the list goes on (more than
      // kJobPages pages).
      all.set_next_page_token(response.next_page_token());
      if (response.next_page_token().empty()) break;
      list.set_page_token(response.next_page_token());
    }
    return Json(all);
  }

  if (n < 2 || parts[0] != "jobs" || parts[1].empty()) {
    return Error(404, absl::StatusCode::kNotFound, absl::StrCat("no API path ", request.path));
  }
  const std::string& job_id = parts[1];

  if (n == 2) {
    if (auto bad = want("GET")) return *bad;
    grpc::ClientContext context;
    prepare(&context);
    v1::GetJobRequest get;
    get.set_job_id(job_id);
    v1::Job job;
    const grpc::Status s = stub_->GetJob(&context, get, &job);
    return s.ok() ? Json(job) : FromRpc(s);
  }

  const std::string& what = parts[2];
  if (n == 3 && what == "metrics") {
    if (auto bad = want("GET")) return *bad;
    v1::GetMetricsRequest get;
    get.set_job_id(job_id);
    for (const auto& [name, setter] :
         {std::pair<const char*, void (v1::GetMetricsRequest::*)(int64_t)>{
              "from_step", &v1::GetMetricsRequest::set_from_step},
          {"to_step", &v1::GetMetricsRequest::set_to_step}}) {
      absl::StatusOr<int64_t> value = IntParam(request, name, 0, 0, int64_t{1} << 50);
      if (!value.ok()) return FromStatus(value.status());
      (get.*setter)(*value);
    }
    absl::StatusOr<int64_t> limit = IntParam(request, "limit", 10'000, 1, 100'000);
    if (!limit.ok()) return FromStatus(limit.status());
    get.set_limit(static_cast<int32_t>(*limit));
    grpc::ClientContext context;
    prepare(&context);
    v1::GetMetricsResponse response;
    const grpc::Status s = stub_->GetMetrics(&context, get, &response);
    return s.ok() ? Json(response) : FromRpc(s);
  }

  if (n == 3 && what == "events") {
    if (auto bad = want("GET")) return *bad;
    v1::ListEventsRequest list;
    list.set_job_id(job_id);
    absl::StatusOr<int64_t> after = IntParam(request, "after_seq", 0, 0, int64_t{1} << 62);
    if (!after.ok()) return FromStatus(after.status());
    absl::StatusOr<int64_t> limit = IntParam(request, "limit", 1000, 1, 10'000);
    if (!limit.ok()) return FromStatus(limit.status());
    list.set_after_seq(*after);
    list.set_limit(static_cast<int32_t>(*limit));
    grpc::ClientContext context;
    prepare(&context);
    v1::ListEventsResponse response;
    const grpc::Status s = stub_->ListEvents(&context, list, &response);
    return s.ok() ? Json(response) : FromRpc(s);
  }

  if ((n == 3 || n == 5) && what == "checkpoints") {
    if (auto bad = want("GET")) return *bad;
    int64_t step = 0;
    if (n == 5 && (!absl::SimpleAtoi(parts[3], &step) || parts[4] != kCheckpointModelFile)) {
      return Error(404, absl::StatusCode::kNotFound, absl::StrCat("no API path ", request.path));
    }
    grpc::ClientContext context;
    prepare(&context);
    v1::ListCheckpointsRequest list;
    list.set_job_id(job_id);
    v1::ListCheckpointsResponse response;
    const grpc::Status s = stub_->ListCheckpoints(&context, list, &response);
    if (!s.ok()) return FromRpc(s);
    if (n == 3) return Json(response);
    const v1::Checkpoint* found = nullptr;
    for (const v1::Checkpoint& c : response.checkpoints()) {
      if (c.step() == step) found = &c;
    }
    if (found == nullptr) {
      return Error(404, absl::StatusCode::kNotFound,
                   absl::StrCat("job ", job_id, " has no checkpoint at step ", step, " (",
                                ExportableSteps(response.checkpoints()), ")"));
    }
    if (!Exportable(*found)) {
      return Error(409, absl::StatusCode::kFailedPrecondition,
                   absl::StrCat("the checkpoint of step ", step, " is ", WhyNotExportable(*found)));
    }
    absl::StatusOr<std::optional<OpenedWeights>> model = OpenCommittedWeights(*found);
    if (!model.ok()) return FromStatus(model.status());
    if (!model->has_value()) {
      return Error(409, absl::StatusCode::kFailedPrecondition,
                   absl::StrCat("the checkpoint of step ", step,
                                " is sharded (a file per rank): aidnctl export puts its pieces "
                                "together into one file"));
    }
    WebResponse r;
    r.content_type = "application/octet-stream";
    r.file = (*model)->file;
    r.file_bytes = (*model)->entry.bytes;
    r.file_crc32c = (*model)->entry.crc32c;
    r.download_name = absl::StrCat(job_id, "-step", step, ".safetensors");
    return r;
  }

  if (n == 3 && what == "logs") {
    if (auto bad = want("GET")) return *bad;
    v1::ReadLogsRequest read;
    read.set_job_id(job_id);
    absl::StatusOr<int64_t> tail = IntParam(request, "tail", kDefaultLogTail, 1, kMaxLogTail);
    if (!tail.ok()) return FromStatus(tail.status());
    read.set_tail(static_cast<int32_t>(*tail));
    if (request.query.contains("rank")) {
      absl::StatusOr<int64_t> rank = IntParam(request, "rank", 0, 0, 1 << 20);
      if (!rank.ok()) return FromStatus(rank.status());
      read.set_rank(static_cast<int32_t>(*rank));
    }
    if (request.query.contains("generation")) {
      absl::StatusOr<int64_t> generation = IntParam(request, "generation", 0, 1, int64_t{1} << 50);
      if (!generation.ok()) return FromStatus(generation.status());
      read.set_generation(*generation);
    }
    grpc::ClientContext context;
    prepare(&context);
    std::unique_ptr<grpc::ClientReader<v1::ReadLogsResponse>> reader =
        stub_->ReadLogs(&context, read);
    nlohmann::json lines = nlohmann::json::array();
    int64_t dropped = 0;
    v1::ReadLogsResponse part;
    while (reader->Read(&part)) {
      dropped = std::max(dropped, part.dropped_lines());
      for (const v1::LogEntry& e : part.lines()) {
        lines.push_back({{"generation", absl::StrCat(e.generation())},
                         {"rank", e.rank()},
                         {"seq", absl::StrCat(e.seq())},
                         {"text", e.text()},
                         {"time", Timestamp(e.time())}});
      }
    }
    const grpc::Status s = reader->Finish();
    if (!s.ok()) return FromRpc(s);
    WebResponse r;
    r.body = Dump({{"lines", std::move(lines)}, {"dropped_lines", absl::StrCat(dropped)}});
    return r;
  }

  if (n == 3 && (what == "cancel" || what == "pause" || what == "resume")) {
    if (auto bad = want("POST")) return *bad;
    std::string reason =
        absl::StrCat(what == "cancel" ? "cancelled" : "paused", " from the web UI");
    if (!request.body.empty()) {
      const nlohmann::json body = nlohmann::json::parse(request.body, nullptr, false);
      if (body.is_discarded() || !body.is_object()) {
        return Error(400, absl::StatusCode::kInvalidArgument, "the body must be a JSON object");
      }
      if (auto it = body.find("reason"); it != body.end()) {
        if (!it->is_string() || it->get<std::string>().size() > kMaxReasonBytes) {
          return Error(
              400, absl::StatusCode::kInvalidArgument,
              absl::StrCat("reason: want a string of at most ", kMaxReasonBytes, " bytes"));
        }
        if (!it->get<std::string>().empty()) reason = it->get<std::string>();
      }
    }
    grpc::ClientContext context;
    prepare(&context);
    v1::Job job;
    grpc::Status s;
    if (what == "cancel") {
      v1::CancelJobRequest cancel;
      cancel.set_job_id(job_id);
      cancel.set_reason(reason);
      s = stub_->CancelJob(&context, cancel, &job);
    } else if (what == "pause") {
      v1::PauseJobRequest pause;
      pause.set_job_id(job_id);
      pause.set_reason(reason);
      s = stub_->PauseJob(&context, pause, &job);
    } else {
      v1::ResumeJobRequest resume;
      resume.set_job_id(job_id);
      s = stub_->ResumeJob(&context, resume, &job);
    }
    return s.ok() ? Json(job) : FromRpc(s);
  }

  return Error(404, absl::StatusCode::kNotFound, absl::StrCat("no API path ", request.path));
}

}  // namespace aidn::coordinator::web
