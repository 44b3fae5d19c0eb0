#include "aidnctl/generate.h"

#include <memory>
#include <ostream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "aidnctl/export.h"
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
  std::unique_ptr<WeightsFile> weights;
  if (!options.job_id.empty()) {
    AIDN_ASSIGN_OR_RETURN(const v1::Checkpoint checkpoint,
                          FetchCheckpoint(env, options.job_id, options.step));
    AIDN_ASSIGN_OR_RETURN(weights, VerifiedWeights(checkpoint));
    path = weights->path();
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
