#ifndef AIDN_COORDINATOR_GPT_SPEC_H_
#define AIDN_COORDINATOR_GPT_SPEC_H_

// Language-model jobs (model.name "gpt" on dataset.kind "text"): their
// defaults and validation. Pure functions; ValidateJobSpec
// (coordinator/spec.h) calls them for a built-in trainer's spec.

#include "absl/status/status.h"
#include "aidn/v1/job.pb.h"

namespace aidn::coordinator {

inline constexpr char kGptModel[] = "gpt";
inline constexpr char kTextDataset[] = "text";
// The corpus a text dataset reads when it names no files: Debian's
// fortunes (about 2.5 MB of plain text).
inline constexpr char kDefaultTextCorpus[] = "/usr/share/games/fortunes";

// model gpt: config "gpt-char" when it names none, the sizes it leaves at 0
// from the named configuration, bias on; dataset.kind "text" when unset.
// dataset text: the default corpus when it names no files, val_fraction 0.1,
// eval_windows 64. Anything else is left alone.
void ApplyGptDefaults(v1::JobSpec* spec);

// OK, or INVALID_ARGUMENT naming the field. For model gpt: an unknown
// config, sizes out of range, n_embd not a multiple of n_head, a tensor
// beyond 2^31 elements, hidden_sizes set, a dataset other than text, a
// vocabulary below 256 (bytes), device gpu (the GPU engine has no GPT
// yet). For any other model: a gpt field that is set.
absl::Status ValidateGptModel(const v1::JobSpec& spec);

// OK, or INVALID_ARGUMENT naming the field. For dataset text: no files (or
// more than 1024), a bad path, val_fraction outside (0, 0.5], eval_windows
// outside [1, 1000000], a field of the image datasets that is set, a model
// other than gpt. For any other dataset: a text field that is set.
absl::Status ValidateTextDataset(const v1::JobSpec& spec);

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_GPT_SPEC_H_
