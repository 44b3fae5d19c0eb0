#ifndef AIDN_AIDNCTL_METRICS_H_
#define AIDN_AIDNCTL_METRICS_H_

// `aidnctl metrics JOB`: a job's step metrics (GetMetrics) over a step range,
// read page by page, as a table, CSV, JSON or YAML.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "aidn/v1/job.pb.h"
#include "aidnctl/commands.h"
#include "nlohmann/json.hpp"

namespace aidn::ctl {

struct MetricsOptions {
  std::string job_id;
  // Inclusive; to_step 0: no upper bound.
  int64_t from_step = 0;
  int64_t to_step = 0;
  // Steps asked for per call (the coordinator's default; it serves at most
  // 100000). Halved while the coordinator says an answer is too large.
  int32_t page_size = 10000;
};

// Calls GetMetrics from options.from_step on, handing each page's steps to
// `visit` in order, until a page comes back short. A full page is cut before
// its last step, which the next call asks for again, so that a step's TRAIN
// and EVAL are never split between pages and nothing is handed over twice.
absl::Status ForEachStepPage(
    const CommandEnv& env, const MetricsOptions& options,
    const std::function<absl::Status(const std::vector<v1::StepMetrics>&)>& visit);

// Prints the steps in env.options.format:
//   table  MetricsTable
//   csv    StepMetricsCsvHeader, then a StepMetricsCsvRow per step
//   json   one array of StepMetricsToJson objects
//   yaml   the same array as YAML
absl::Status RunMetrics(const CommandEnv& env, const MetricsOptions& options);

// kind,step,epoch,generation,loss,samples,step_seconds,slowest_rank,
// allreduce_seconds,samples_per_second,lr,test_loss,test_accuracy,
// ranks_reported,world_size,time — with a final newline.
std::string StepMetricsCsvHeader();
// One line of those columns: kind TRAIN or EVAL, numbers as written by
// printf's %.10g (fields that do not apply to the kind are 0), time in RFC
// 3339 UTC with milliseconds (empty if unset). With a final newline.
std::string StepMetricsCsvRow(const v1::StepMetrics& step);

// The step under its proto field names, numbers as numbers (int64 too), kind
// as "TRAIN"/"EVAL", time as in the CSV, and the per-rank arrays.
nlohmann::ordered_json StepMetricsToJson(const v1::StepMetrics& step);

// KIND STEP EPOCH GEN LOSS SAMPLES/S STEP-TIME SLOWEST ALLREDUCE LR TEST-LOSS
// TEST-ACC RANKS TIME, "-" where a column does not apply to the kind.
std::string MetricsTable(const std::vector<v1::StepMetrics>& steps);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_METRICS_H_
