#ifndef AIDN_WORKER_TRAINER_TRAINER_H_
#define AIDN_WORKER_TRAINER_TRAINER_H_

// The per-rank trainer process: glue between the engine and the coordinator.
// It joins the rendezvous, builds the communicator (Gloo over the job's KV
// store), loads its shard of the data, trains with DDP, streams metric
// records and progress beats, evaluates after each epoch, and exits.
//
//   rank_training.h   one rank's training, from the rendezvous to the end
//   reporter.h        metric records, checkpoint commits, progress beats
//   training_state.h  what a checkpoint's state.txt holds, typed
//   engine_config.h   the job spec as the engine's configs
//   stop_signal.h     SIGTERM: stop at a step boundary, send, then exit
//   coordinator_store.h  the rendezvous store over the coordinator's KV

#include <cstdint>
#include <string>

namespace aidn::trainer {

// Exit codes of a trainer process.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
// A failure no restart can cure (missing or corrupt dataset, bad spec):
// EX_CONFIG, reported to the coordinator as permanent.
inline constexpr int kExitPermanent = 78;
// Fenced off: this generation is over (FAILED_PRECONDITION from the
// coordinator). Not an error of the trainer's own.
inline constexpr int kExitSuperseded = 75;

struct TrainerOptions {
  // host:port of the coordinator, and how to verify it (rpc::ChannelOptions).
  std::string coordinator;
  std::string tls_ca_file;
  bool insecure = false;
  // The job-scoped trainer token (passed in the environment, never argv).
  std::string token;
  std::string job_id;
  int64_t generation = 0;
  int rank = 0;
  int world_size = 1;
  std::string worker_id;
  // Address this rank binds for its peers (Gloo).
  std::string host = "127.0.0.1";
  // First CPU slot and number of threads.
  int slot = 0;
  int threads = 1;
  // The worker's directory for this job (scratch).
  std::string work_dir;
  // A relative checkpoint.dir is taken under this; checkpoints of the job
  // go to <dir>/<job_id>/step-NNNNNNNN.
  std::string checkpoint_root;
  // The worker's cache of inflated dataset files (engine::DecompressedPath);
  // empty: none.
  std::string cache_dir;
};

// Runs the rank to the end; returns the process exit code. Takes SIGTERM
// and SIGINT for the whole process (stop_signal.h): a stopped trainer
// sends what its reporter holds and dies of the signal, without returning.
int RunTrainer(const TrainerOptions& options);

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_TRAINER_H_
