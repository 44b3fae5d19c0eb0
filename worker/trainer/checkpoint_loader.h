#ifndef AIDN_WORKER_TRAINER_CHECKPOINT_LOADER_H_
#define AIDN_WORKER_TRAINER_CHECKPOINT_LOADER_H_

// Where a rank's resume comes from: the newest of the rendezvous's resume
// candidates that verifies, read through engine::CheckpointReader, so any
// checkpoint (whole or sharded, by any number of ranks) resumes under any
// strategy at any world size.
//
// DDP: rank 0 reads the weights and the whole optimizer state, and the
// trainer broadcasts them. ZeRO and FSDP: every rank reads the weights and
// only its own pieces of the optimizer state, so every rank must see the
// checkpoint directory (CheckSharedDirectory says so at the start).
//
// Not thread-safe.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "aidn/v1/job.pb.h"
#include "worker/engine/checkpoint_reader.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/shard_map.h"

namespace aidn::trainer {

// Sharded checkpoints: rank 0 writes a probe into `dir`, and every rank
// looks for it (a collective). FAILED_PRECONDITION naming the ranks that do
// not see it: their checkpoint storage is not rank 0's.
absl::Status CheckSharedDirectory(const std::string& dir, const std::string& nonce,
                                  engine::Communicator* comm);

class CheckpointLoader {
 public:
  // Tells the coordinator that `checkpoint`, at `path`, fails verification.
  using ReportInvalid = std::function<void(const v1::Checkpoint& checkpoint,
                                           const std::string& path, const absl::Status& why)>;
  struct Options {
    // This job's checkpoint directory; its own candidates are under it. A
    // candidate of another job (the spec's checkpoint.resume_from) is read
    // at its recorded path.
    std::string dir;
    std::string job_id;
    // Every rank reads (ZeRO, FSDP) or rank 0 alone (DDP).
    bool every_rank = false;
    engine::Communicator* comm = nullptr;
    ReportInvalid report_invalid;
  };
  explicit CheckpointLoader(Options options) : options_(std::move(options)) {}

  // The candidates in order: the first that opens and gives `params` their
  // values (on every reading rank: a collective with every_rank) is kept;
  // each one before it is reported invalid. Another job's checkpoint that
  // fails is an error (FAILED_PRECONDITION naming it), not skipped: the job
  // asked to start from it. OK with nothing loaded when none is left.
  absl::Status LoadNewest(const std::vector<v1::Checkpoint>& candidates,
                          const std::vector<engine::Parameter*>& params);
  // The loaded checkpoint (on the ranks that read), or null.
  engine::CheckpointReader* reader() { return reader_.get(); }
  const v1::Checkpoint& loaded() const { return loaded_; }

  // The optimizer state, entry by entry as `pieces` name them (whole
  // entries, or this rank's shards'): read by every rank (every_rank), or
  // by rank 0 and broadcast. DATA_LOSS naming an entry the checkpoint
  // lacks. With nothing loaded, every rank keeps its state.
  absl::Status LoadOptimizerState(const std::vector<engine::ShardMap::Piece>& pieces,
                                  int64_t optimizer_steps, engine::Optimizer* optimizer);
  // The reading half of it: one buffer per piece, of its tensor's shape,
  // holding the piece's elements of the checkpoint's entry.
  absl::StatusOr<std::vector<engine::Tensor>> ReadOptimizerState(
      const std::vector<engine::ShardMap::Piece>& pieces);
  // Done with the files.
  void Close() { reader_.reset(); }

 private:
  // Opens `path` and reads the weights into `params` (all or nothing). The
  // directory's manifest must be the one committed (`manifest_sha256`, when
  // the registry has it): a generation that was superseded but not yet
  // stopped (cut off by a partition) may write the same step again, and
  // what it wrote is never read.
  absl::Status TryLoad(const std::string& path, int64_t step, const std::string& manifest_sha256,
                       const std::vector<engine::Parameter*>& params);

  Options options_;
  std::unique_ptr<engine::CheckpointReader> reader_;
  v1::Checkpoint loaded_;
};

}  // namespace aidn::trainer

#endif  // AIDN_WORKER_TRAINER_CHECKPOINT_LOADER_H_
