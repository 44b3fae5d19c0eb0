// Job specs as users write them (YAML or JSON, aidnctl/spec_io.h), through
// the coordinator's defaults and validation (coordinator/spec.h). A spec
// that validates must survive aidnctl's own YAML and JSON forms of it: what
// `aidnctl describe` prints can be submitted again and means the same.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "aidnctl/spec_io.h"
#include "coordinator/spec.h"
#include "google/protobuf/util/message_differencer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<aidn::v1::JobSpec> spec = aidn::ctl::ParseJobSpec(text, "fuzz");
  if (!spec.ok()) return 0;
  const aidn::coordinator::SpecLimits limits;
  aidn::coordinator::ApplyJobSpecDefaults(limits, &*spec);
  if (!aidn::coordinator::ValidateJobSpec(limits, *spec).ok()) return 0;
  for (const auto& printed : {aidn::ctl::MessageToYaml(*spec), aidn::ctl::MessageToJson(*spec)}) {
    if (!printed.ok()) std::abort();
    absl::StatusOr<aidn::v1::JobSpec> again = aidn::ctl::ParseJobSpec(*printed, "printed");
    if (!again.ok() || !google::protobuf::util::MessageDifferencer::Equals(*spec, *again)) {
      std::abort();  // printed, it reads back as another spec (or not at all)
    }
  }
  return 0;
}
