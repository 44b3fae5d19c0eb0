#ifndef AIDN_AIDNCTL_SPEC_IO_H_
#define AIDN_AIDNCTL_SPEC_IO_H_

// Job specs in and out: YAML or JSON text into v1::JobSpec, and protobuf's
// JSON back out as YAML.
//
// Reading goes through protobuf's JSON mapping (JsonStringToMessage, unknown
// fields refused, enum names in any case), so field names and value forms are
// exactly those of job.proto's JSON mapping; nothing is parsed field by field.
// YAML is first turned into JSON:
//   - a quoted scalar ('...' or "...") or one tagged !!str is a string;
//   - a plain scalar: true/True/TRUE and false/False/FALSE are booleans;
//     null, Null, NULL, ~ and nothing are null; an integer ([-+]?(0|[1-9][0-9]*))
//     or a decimal/exponent float (1.5, .5, 1e-3) is a number; anything else
//     (yes, no, 007, 1_000, ...) is a string;
//   - except that a plain scalar written where job.proto has a string field
//     (name: 123, a label value) stays the text as written.
// In both YAML and JSON a google.protobuf.Duration may be written as a
// string in Go/Abseil form ("5m", "1h30m", "250ms") besides protobuf's
// seconds form ("10s", "1.5s").
//
// Errors are INVALID_ARGUMENT and name the source and, where there is one,
// the field and the YAML line:
//   job.yaml: optimizer.lrr: unknown field (line 7)
//   job.yaml: line 3, column 9: illegal map value

#include <cstddef>
#include <iosfwd>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "aidn/v1/job.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"

namespace aidn::ctl {

// Parses `text`: JSON if its first non-space character is '{', YAML
// otherwise. `source` names the text in errors (a file name, "<stdin>").
absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view text, absl::string_view source);

// Reads the file at `path` ("-": all of `stdin_stream`) and parses it.
absl::StatusOr<v1::JobSpec> ReadJobSpec(const std::string& path, std::istream& stdin_stream);

// OK, or INVALID_ARGUMENT naming the first field too large for the
// coordinator (common/job_spec_limits.h) or the field that makes the whole
// spec larger than `max_message_bytes`, a call's limit:
//   job.yaml: labels["notes"]: 10485760 bytes, the coordinator takes at most 256
// Checked before sending, as gRPC would refuse such a call with a transport
// error that names nothing.
absl::Status CheckJobSpecSizes(const v1::JobSpec& spec, absl::string_view source,
                               size_t max_message_bytes);

// Writes `json` as block YAML. Strings that a YAML reader would take for
// something else ("123", "true", "") are quoted. With `type`, the message
// type `json` is the JSON mapping of, 64-bit integers (which the mapping
// writes as strings) are written as numbers.
std::string JsonToYaml(const nlohmann::ordered_json& json,
                       const google::protobuf::Descriptor* type = nullptr);

// `message` as protobuf's JSON mapping (proto field names, fields at their
// default left out), indented by two spaces, with a final newline.
absl::StatusOr<std::string> MessageToJson(const google::protobuf::Message& message);

// The same JSON on one line, ending in a newline: one record of JSON Lines.
absl::StatusOr<std::string> MessageToJsonLine(const google::protobuf::Message& message);

// MessageToJson's JSON as YAML (JsonToYaml with the message's type).
absl::StatusOr<std::string> MessageToYaml(const google::protobuf::Message& message);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_SPEC_IO_H_
