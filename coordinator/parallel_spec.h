#ifndef AIDN_COORDINATOR_PARALLEL_SPEC_H_
#define AIDN_COORDINATOR_PARALLEL_SPEC_H_

// Model parallelism in a job spec (`parallel: {tensor, pipeline,
// micro_batches, schedule}`): its defaults and validation. Pure functions;
// ValidateJobSpec (coordinator/spec.h) calls them for a built-in trainer's
// spec.

#include <cstdint>

#include "absl/status/status.h"
#include "aidn/v1/job.pb.h"

namespace aidn::coordinator {

// tensor and pipeline 1 when unset; with pipeline > 1, micro_batches
// `pipeline` and schedule ONE_F_ONE_B when unset. A spec without
// `parallel` is left alone.
void ApplyParallelDefaults(v1::JobSpec* spec);

// OK, or INVALID_ARGUMENT naming the field: sizes below 1, a world_size
// that tensor x pipeline does not divide, model parallelism with device
// gpu or a strategy other than ddp, tensor above 1 for a model other than
// gpt or one that does not divide its n_head and vocab_size, more stages
// than the model has layers to give them (a GPT's n_layer must divide by
// pipeline), micro_batches that does not divide batch_size, and
// micro_batches or schedule without pipeline > 1.
absl::Status ValidateParallel(const v1::JobSpec& spec);

// The data-parallel replicas: world_size / (tensor x pipeline), at least 1.
int64_t DataReplicas(const v1::JobSpec& spec);

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_PARALLEL_SPEC_H_
