#include "aidnctl/metrics.h"

#include <algorithm>
#include <ostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "aidnctl/output.h"
#include "aidnctl/spec_io.h"
#include "aidnctl/watch_view.h"
#include "common/rpc/client.h"
#include "common/status.h"
#include "grpcpp/client_context.h"

namespace aidn::ctl {
namespace {

std::string Number(double value) { return absl::StrFormat("%.10g", value); }

std::string KindName(v1::MetricRecord::Kind kind) {
  return kind == v1::MetricRecord::EVAL ? "EVAL" : "TRAIN";
}

// RFC 3339 UTC with milliseconds; empty if unset.
std::string PreciseTime(const google::protobuf::Timestamp& t) {
  if (t.seconds() == 0 && t.nanos() == 0) return "";
  const absl::Time time = absl::FromUnixSeconds(t.seconds()) + absl::Nanoseconds(t.nanos());
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", time, absl::UTCTimeZone());
}

absl::Status CheckWritten(const CommandEnv& env) {
  env.out->flush();
  if (!*env.out) return absl::DataLossError("cannot write the output");
  return absl::OkStatus();
}

}  // namespace

absl::Status ForEachStepPage(
    const CommandEnv& env, const MetricsOptions& options,
    const std::function<absl::Status(const std::vector<v1::StepMetrics>&)>& visit) {
  int32_t page_size = options.page_size > 0 ? options.page_size : 10000;
  int64_t from = options.from_step;
  while (options.to_step <= 0 || from <= options.to_step) {
    v1::GetMetricsRequest request;
    request.set_job_id(options.job_id);
    request.set_from_step(from);
    request.set_to_step(options.to_step);
    request.set_limit(page_size);
    v1::GetMetricsResponse response;
    grpc::ClientContext context;
    rpc::PrepareContext(&context, env.options.connection.token, env.options.timeout);
    const grpc::Status status = env.stub->GetMetrics(&context, request, &response);
    if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED && page_size > 1) {
      // The answer was larger than a message may be (many ranks per step).
      page_size = std::max(page_size / 2, 1);
      continue;
    }
    if (!status.ok()) {
      return RpcError(status, env.options.connection.address, env.options.timeout);
    }
    std::vector<v1::StepMetrics> steps(std::make_move_iterator(response.mutable_steps()->begin()),
                                       std::make_move_iterator(response.mutable_steps()->end()));
    if (static_cast<int64_t>(steps.size()) < page_size) return visit(steps);

    // A full page: what follows may hold more of its last step.
    const int64_t last = steps.back().step();
    size_t keep = steps.size();
    while (keep > 0 && steps[keep - 1].step() == last) --keep;
    int64_t next = last;
    if (keep == 0) {
      keep = steps.size();  // one step filled the page
      next = last + 1;
    }
    if (next <= from) {
      return absl::InternalError(absl::StrCat("the coordinator answered GetMetrics from step ",
                                              from, " with steps up to ", last, " only"));
    }
    steps.resize(keep);
    AIDN_RETURN_IF_ERROR(visit(steps));
    from = next;
  }
  return absl::OkStatus();
}

absl::Status RunMetrics(const CommandEnv& env, const MetricsOptions& options) {
  switch (env.options.format) {
    case OutputFormat::kCsv: {
      // Nothing is printed before the first answer: a failed call prints
      // only its error.
      bool started = false;
      AIDN_RETURN_IF_ERROR(
          ForEachStepPage(env, options, [&](const std::vector<v1::StepMetrics>& steps) {
            if (!started) *env.out << StepMetricsCsvHeader();
            started = true;
            for (const v1::StepMetrics& step : steps) *env.out << StepMetricsCsvRow(step);
            return CheckWritten(env);
          }));
      if (!started) *env.out << StepMetricsCsvHeader();
      return CheckWritten(env);
    }
    case OutputFormat::kJson: {
      // One object per line, written as the pages come.
      bool first = true;
      AIDN_RETURN_IF_ERROR(
          ForEachStepPage(env, options, [&](const std::vector<v1::StepMetrics>& steps) {
            for (const v1::StepMetrics& step : steps) {
              *env.out << (first ? "[\n  " : ",\n  ") << StepMetricsToJson(step).dump();
              first = false;
            }
            return CheckWritten(env);
          }));
      *env.out << (first ? "[]\n" : "\n]\n");
      return CheckWritten(env);
    }
    case OutputFormat::kYaml:
    case OutputFormat::kTable:
      break;
  }
  std::vector<v1::StepMetrics> all;
  AIDN_RETURN_IF_ERROR(
      ForEachStepPage(env, options, [&](const std::vector<v1::StepMetrics>& steps) {
        all.insert(all.end(), steps.begin(), steps.end());
        return absl::OkStatus();
      }));
  if (env.options.format == OutputFormat::kTable) {
    *env.out << MetricsTable(all);
  } else {
    nlohmann::ordered_json array = nlohmann::ordered_json::array();
    for (const v1::StepMetrics& step : all) array.push_back(StepMetricsToJson(step));
    *env.out << (all.empty() ? "[]\n" : JsonToYaml(array));
  }
  return CheckWritten(env);
}

std::string StepMetricsCsvHeader() {
  return "kind,step,epoch,generation,loss,samples,step_seconds,slowest_rank,allreduce_seconds,"
         "samples_per_second,lr,test_loss,test_accuracy,ranks_reported,world_size,time,tokens,"
         "tokens_per_second,peak_memory_bytes\n";
}

std::string StepMetricsCsvRow(const v1::StepMetrics& step) {
  return absl::StrCat(
      absl::StrJoin(
          {KindName(step.kind()), absl::StrCat(step.step()), absl::StrCat(step.epoch()),
           absl::StrCat(step.generation()), Number(step.loss()), absl::StrCat(step.samples()),
           Number(step.step_seconds()), absl::StrCat(step.slowest_rank()),
           Number(step.allreduce_seconds()), Number(step.samples_per_second()), Number(step.lr()),
           Number(step.test_loss()), Number(step.test_accuracy()),
           absl::StrCat(step.ranks_reported()), absl::StrCat(step.world_size()),
           PreciseTime(step.time()), absl::StrCat(step.tokens()), Number(step.tokens_per_second()),
           absl::StrCat(step.peak_memory_bytes())},
          ","),
      "\n");
}

nlohmann::ordered_json StepMetricsToJson(const v1::StepMetrics& step) {
  return {
      {"kind", KindName(step.kind())},
      {"step", step.step()},
      {"epoch", step.epoch()},
      {"generation", step.generation()},
      {"loss", step.loss()},
      {"samples", step.samples()},
      {"step_seconds", step.step_seconds()},
      {"slowest_rank", step.slowest_rank()},
      {"allreduce_seconds", step.allreduce_seconds()},
      {"samples_per_second", step.samples_per_second()},
      {"lr", step.lr()},
      {"test_loss", step.test_loss()},
      {"test_accuracy", step.test_accuracy()},
      {"ranks_reported", step.ranks_reported()},
      {"world_size", step.world_size()},
      {"time", PreciseTime(step.time())},
      {"tokens", step.tokens()},
      {"tokens_per_second", step.tokens_per_second()},
      {"peak_memory_bytes", step.peak_memory_bytes()},
      {"device_peak_memory_bytes", step.device_peak_memory_bytes()},
      {"parameter_bytes", step.parameter_bytes()},
      {"gradient_bytes", step.gradient_bytes()},
      {"optimizer_state_bytes", step.optimizer_state_bytes()},
      {"buffer_bytes", step.buffer_bytes()},
      {"gradient_comm_bytes", step.gradient_comm_bytes()},
      {"gradient_comm_bytes_uncompressed", step.gradient_comm_bytes_uncompressed()},
      {"rank_step_seconds",
       std::vector<double>(step.rank_step_seconds().begin(), step.rank_step_seconds().end())},
      {"rank_allreduce_seconds", std::vector<double>(step.rank_allreduce_seconds().begin(),
                                                     step.rank_allreduce_seconds().end())},
  };
}

std::string MetricsTable(const std::vector<v1::StepMetrics>& steps) {
  std::vector<std::vector<std::string>> rows;
  rows.reserve(steps.size());
  for (const v1::StepMetrics& step : steps) {
    std::vector<std::string> row = {KindName(step.kind()), absl::StrCat(step.step()),
                                    absl::StrCat(step.epoch()), absl::StrCat(step.generation())};
    if (step.kind() == v1::MetricRecord::EVAL) {
      row.insert(row.end(),
                 {"-", "-", "-", "-", "-", "-", absl::StrFormat("%.4f", step.test_loss()),
                  absl::StrFormat("%.2f%%", step.test_accuracy() * 100)});
    } else {
      row.insert(
          row.end(),
          {absl::StrFormat("%.4f", step.loss()), absl::StrFormat("%.0f", step.samples_per_second()),
           FormatSeconds(step.step_seconds()), absl::StrCat(step.slowest_rank()),
           FormatSeconds(step.allreduce_seconds()), absl::StrFormat("%.4g", step.lr()), "-", "-"});
    }
    row.push_back(absl::StrCat(step.ranks_reported(), "/", step.world_size()));
    row.push_back(FormatTimestamp(step.time()));
    rows.push_back(std::move(row));
  }
  return FormatTable({"KIND", "STEP", "EPOCH", "GEN", "LOSS", "SAMPLES/S", "STEP-TIME", "SLOWEST",
                      "ALLREDUCE", "LR", "TEST-LOSS", "TEST-ACC", "RANKS", "TIME"},
                     rows);
}

}  // namespace aidn::ctl
