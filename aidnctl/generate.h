#ifndef AIDN_AIDNCTL_GENERATE_H_
#define AIDN_AIDNCTL_GENERATE_H_

// `aidnctl generate JOB [--step N]` or `aidnctl generate --file F`: text
// from a language model's checkpoint (or an export of it), to see what it
// learned. The weights are read where they lie, as `aidnctl export` reads
// them (a checkpoint is verified against its MANIFEST and the coordinator's
// digest first), and the model runs here, on this machine's CPU.

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "aidnctl/commands.h"
#include "worker/engine/gpt.h"

namespace aidn::ctl {

struct GenerateOptions {
  // A job's checkpoint (the newest committed, valid one, or `step`'s)...
  std::string job_id;
  std::optional<int64_t> step;
  // ... or a safetensors file with the model's sizes in its metadata (an
  // export). Exactly one of job_id and file.
  std::string file;
  // The text to continue, as bytes; not empty.
  std::string prompt = "\n";
  engine::SampleOptions sample;
};

// Prints the prompt and its continuation, as the bytes they are, on
// env.out. Errors: both or neither of job and file, an empty prompt, a
// checkpoint that is not a language model's, or anything RunExport would
// refuse in reading it; a token of the prompt beyond the model's
// vocabulary cannot happen with bytes (vocabulary >= 256).
absl::Status RunGenerate(const CommandEnv& env, const GenerateOptions& options);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_GENERATE_H_
