#include "aidnctl/generate.h"

#include <memory>
#include <ostream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "aidnctl/export.h"
#include "common/rpc/client.h"
#include "common/status.h"

namespace aidn::ctl {

absl::Status RunGenerate(const CommandEnv& env, const GenerateOptions& options) {
  if (options.job_id.empty() == options.file.empty()) {
    return absl::InvalidArgumentError("generate: name a job or a --file, one of them");
  }
  if (options.prompt.empty()) {
    return absl::InvalidArgumentError("generate: --prompt must not be empty");
  }
  std::string path = options.file;
  if (!options.job_id.empty()) {
    v1::ListCheckpointsRequest request;
    request.set_job_id(options.job_id);
    v1::ListCheckpointsResponse response;
    grpc::ClientContext context;
    rpc::PrepareContext(&context, env.options.connection.token, env.options.timeout);
    const grpc::Status status = env.stub->ListCheckpoints(&context, request, &response);
    if (!status.ok()) return RpcError(status, env.options.connection.address, env.options.timeout);
    AIDN_ASSIGN_OR_RETURN(const v1::Checkpoint checkpoint,
                          ChooseCheckpoint(response.checkpoints(), options.job_id, options.step));
    AIDN_ASSIGN_OR_RETURN(path, VerifiedWeights(checkpoint));
  }
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<engine::Gpt> gpt, engine::LoadGpt(path));
  std::vector<int32_t> prompt;
  for (char c : options.prompt) prompt.push_back(static_cast<unsigned char>(c));
  AIDN_ASSIGN_OR_RETURN(const std::vector<int32_t> tokens,
                        engine::Generate(*gpt, std::move(prompt), options.sample));
  std::string text;
  for (int32_t t : tokens) {
    // A model with a vocabulary beyond bytes may pick a token that is
    // none; it shows as U+FFFD.
    if (t < 256) {
      text.push_back(static_cast<char>(t));
    } else {
      text += "\xEF\xBF\xBD";
    }
  }
  *env.out << text << "\n";
  env.out->flush();
  return absl::OkStatus();
}

}  // namespace aidn::ctl
