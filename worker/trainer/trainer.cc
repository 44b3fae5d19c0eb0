#include "worker/trainer/trainer.h"

#include <optional>

#include "common/log.h"
#include "common/rpc/client.h"
#include "worker/trainer/rank_training.h"
#include "worker/trainer/stop_signal.h"

namespace aidn::trainer {

int RunTrainer(const TrainerOptions& options) {
  StopSignal stop;
  rpc::ChannelOptions channel;
  channel.address = options.coordinator;
  channel.tls_ca_file = options.tls_ca_file;
  channel.insecure = options.insecure;
  RankTraining training(options, rpc::MakeChannel(channel), &stop);
  std::optional<Failure> failure = training.Execute();
  // Stopped: the reporter's flush runs, then the process dies of the
  // signal (StopSignal); this does not return.
  if (stop.requested()) stop.Park();
  if (!failure.has_value()) {
    AIDN_LOG(INFO) << "training finished" << Kv("job", options.job_id) << Kv("rank", options.rank);
    return kExitOk;
  }
  // The last stderr line is what the coordinator shows as the reason.
  AIDN_LOG(ERROR) << "trainer failed: " << failure->status;
  return failure->exit_code;
}

}  // namespace aidn::trainer
