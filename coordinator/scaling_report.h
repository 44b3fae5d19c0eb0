#ifndef AIDN_COORDINATOR_SCALING_REPORT_H_
#define AIDN_COORDINATOR_SCALING_REPORT_H_

// A finished job's throughput and scaling efficiency (Job.throughput), as
// a DDP benchmark reports them: samples a second over the whole run, and
// against a run of fewer ranks, throughput(N) / (N / n x throughput(n)).
//
// The baseline is the job the spec names (scaling_baseline), else the
// newest succeeded 1-rank job whose spec matches but for what does not
// change the speed of a step (ScalingKey).
//
// Pure functions; the coordinator calls them as a job succeeds.

#include <string>
#include <vector>

#include "aidn/v1/job.pb.h"

namespace aidn::coordinator {

// Throughput over `steps` (any order): samples (tokens) of each TRAIN step
// over the wall time from the previous step's record to its own (the last
// rank's), for consecutive steps of a generation, but the interval after an
// evaluation. So each generation's first step (allocation, the first
// collectives) is left out, and the time between steps (the next batch,
// reporting, checkpoint writes) is in. Without two such steps: the summed
// step times. No steps: all zero. world_size from `world_size`.
v1::Throughput SummarizeThroughput(const std::vector<v1::StepMetrics>& steps, int32_t world_size);

// The spec with what does not change a step's speed cleared (name, labels,
// priority, world_size, length, seed, checkpoints, timeouts, restarts,
// evaluation, the baseline itself, model parallelism), serialised
// deterministically: equal keys are runs of the same step on any number of
// ranks.
std::string ScalingKey(const v1::JobSpec& spec);

// Sets the baseline fields and the efficiency of `t` from `baseline` (a job
// with a throughput). A baseline without one sets `note` instead.
void CompareWithBaseline(const v1::Job& baseline, v1::Throughput* t);

// One line for the job's event and `aidnctl describe`:
// "2,345.6 samples/s over 300 steps at 2 ranks; scaling efficiency 0.91
// against job-3 (1 rank, 1,290.4 samples/s)".
std::string ThroughputLine(const v1::Throughput& t);

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_SCALING_REPORT_H_
