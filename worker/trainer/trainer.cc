#include "worker/trainer/trainer.h"

#include <cstdlib>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"

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
  AIDN_LOG(ERROR) << "trainer failed: " << failure->status;
  // What the coordinator shows as the reason: the whole status, in the
  // error file the worker reads (torch elastic's format, as a command
  // rank's @record writes it), rather than its last log line cut short.
  if (const char* path = std::getenv("TORCHELASTIC_ERROR_FILE"); path != nullptr && *path != '\0') {
    const nlohmann::json doc = {
        {"message",
         {{"message", failure->status.ToString()},
          {"extraInfo", {{"timestamp", absl::StrCat(absl::ToUnixSeconds(absl::Now()))}}}}}};
    std::ofstream(path) << doc.dump();
  }
  return failure->exit_code;
}

}  // namespace aidn::trainer
