#ifndef AIDN_WORKER_TRAINER_ENGINE_CONFIG_H_
#define AIDN_WORKER_TRAINER_ENGINE_CONFIG_H_

// The job spec (aidn.v1.JobSpec, what the coordinator hands a rank at the
// rendezvous) turned into the engine's configs and options. Plain functions
// of the spec: no I/O except LoadData.

#include <chrono>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "aidn/v1/job.pb.h"
#include "worker/engine/comm/cpu_communicator.h"
#include "worker/engine/data.h"
#include "worker/engine/gpt.h"
#include "worker/engine/gpu_session.h"
#include "worker/engine/lr_schedule.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/powersgd.h"
#include "worker/engine/shard_map.h"
#include "worker/trainer/trainer.h"

namespace aidn::trainer {

engine::ModelConfig ModelConfigOf(const v1::JobSpec& spec);
// model gpt: the spec's sizes (after the coordinator's defaults), dropout
// and bias.
engine::GptConfig GptConfigOf(const v1::JobSpec& spec);
engine::OptimizerConfig OptimizerConfigOf(const v1::JobSpec& spec);
engine::LrScheduleConfig ScheduleOf(const v1::JobSpec& spec);

// The DDP bucket size: spec bucket_mb, 25 MB when unset (torch's default).
double BucketMbOf(const v1::JobSpec& spec);
// ddp.compression powersgd: its options; nullopt otherwise.
std::optional<engine::PowerSgdOptions> PowerSgdOf(const v1::JobSpec& spec);
// ddp.compression fp16 or bf16: the format; nullopt otherwise.
std::optional<engine::HalfFormat> HalfCompressionOf(const v1::JobSpec& spec);
// The spec's strategy (and fsdp.sharding) as the CPU session's sharding.
engine::Sharding ShardingOf(const v1::JobSpec& spec);
// How long the rank waits for its peers (communicator rendezvous, NCCL
// initialisation): the spec's rendezvous timeout, at least 30 s.
std::chrono::milliseconds PeerTimeoutOf(const v1::JobSpec& spec);
// The spec's comm_backend.
engine::CpuTransport CpuTransportOf(const v1::JobSpec& spec);
// device: gpu: the session's options for `rank` of `world_size` (its store
// is left for the caller).
engine::GpuSessionOptions GpuSessionOptionsOf(const v1::JobSpec& spec, int rank, int world_size);

// Loads the train and test sets the spec names, through the worker's cache
// of inflated files (`cache_dir`; empty: none) when there is one; an error
// names the files the spec names. Every error here is permanent: no restart
// makes a missing or corrupt file appear.
absl::Status LoadData(const v1::DatasetSpec& spec, const std::string& cache_dir,
                      engine::Dataset* train, engine::Dataset* test);

// Where this job's checkpoints go on this worker: <checkpoint.dir>/<job>,
// a relative checkpoint.dir taken under the worker's checkpoint root (or,
// without one, its directory for the job). Empty when the spec asks for
// none.
std::string CheckpointDirOf(const v1::JobSpec& spec, const TrainerOptions& options);

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_ENGINE_CONFIG_H_
