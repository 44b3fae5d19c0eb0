#ifndef AIDN_COORDINATOR_STEP_METRICS_H_
#define AIDN_COORDINATOR_STEP_METRICS_H_

// How the ranks' records of one step become the job's StepMetrics: mean
// loss, summed samples, the slowest rank's step time (and which rank),
// mean allreduce time, throughput, and per-rank times.

#include <vector>

#include "aidn/v1/job.pb.h"

namespace aidn::coordinator {

// `records`: one step's records of one kind, at most one per rank, each with
// rank in [0, world_size). Empty `records` gives an empty StepMetrics.
v1::StepMetrics CombineRecords(const std::vector<v1::MetricRecord>& records, int world_size);

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_STEP_METRICS_H_
