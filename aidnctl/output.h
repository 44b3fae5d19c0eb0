#ifndef AIDN_AIDNCTL_OUTPUT_H_
#define AIDN_AIDNCTL_OUTPUT_H_

// How aidnctl prints answers: tables for people, JSON and YAML for scripts.
//
// Tables have a header row and left-aligned columns three spaces apart, the
// last column unpadded; times are UTC (2026-11-22T04:10:00Z), ages short
// (45s, 12m, 5h, 3d), and enum values plain (RUNNING, ALIVE). JSON and YAML
// are the whole response message in protobuf's JSON mapping (see spec_io.h).

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "aidn/v1/coordinator.pb.h"
#include "aidn/v1/job.pb.h"
#include "google/protobuf/message.h"
#include "google/protobuf/timestamp.pb.h"

namespace aidn::ctl {

// kCsv is for `aidnctl metrics` only; other commands refuse it.
enum class OutputFormat { kTable, kJson, kYaml, kCsv };

// "table", "json", "yaml" or "csv", in any case.
absl::StatusOr<OutputFormat> ParseOutputFormat(absl::string_view text);

// "RUNNING"; "UNKNOWN" for STATE_UNSPECIFIED and values this build lacks.
std::string StateName(v1::Job::State state);
// SUCCEEDED, FAILED or CANCELLED: the job will not change again.
bool IsTerminal(v1::Job::State state);
std::string StateName(v1::Worker::State state);

// Aligned columns under `header`; rows shorter than the header are padded
// with empty cells. Cells should hold no newlines (see OneLine).
std::string FormatTable(const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows);

// `text` with each run of whitespace (newlines included) made one space and,
// if longer than `max_chars` (0: no limit), cut to end in "...".
std::string OneLine(absl::string_view text, size_t max_chars = 0);

// 45s, 12m, 5h, 3d ("0s" for a negative age).
std::string FormatAge(absl::Duration age);
// The instant a protobuf Timestamp names.
absl::Time ToTime(const google::protobuf::Timestamp& timestamp);
// RFC 3339 UTC to the second; "-" if unset.
std::string FormatTimestamp(const google::protobuf::Timestamp& timestamp);
// "-" if unset, else the age of `timestamp` at `now`.
std::string FormatTimestampAge(const google::protobuf::Timestamp& timestamp, absl::Time now);
// 512B, 1.5KiB, 20.0MiB, 3.2GiB.
std::string FormatBytes(int64_t bytes);

// ID NAME STATE WORLD GEN RESTARTS AGE MESSAGE
std::string JobsTable(const google::protobuf::RepeatedPtrField<v1::Job>& jobs, absl::Time now);
// ID ADDRESS STATE CPU(USED/TOTAL) GPUS JOBS LAST-HEARTBEAT; STATE is ALIVE
// or LOST, then ",cordoned", ",draining" or ",drained" (draining, no jobs).
std::string WorkersTable(const google::protobuf::RepeatedPtrField<v1::Worker>& workers,
                         absl::Time now);
// SEQ TIME JOB TYPE MESSAGE
std::string EventsTable(const google::protobuf::RepeatedPtrField<v1::Event>& events);
// STEP GEN COMMITTED CREATED BYTES PATH NOTE; NOTE is "invalid: <reason>"
// (shortened) for a checkpoint a rank found failing verification.
std::string CheckpointsTable(const google::protobuf::RepeatedPtrField<v1::Checkpoint>& checkpoints);

// "Key: value" lines, the spec as YAML and the placement table.
absl::StatusOr<std::string> DescribeJob(const v1::Job& job, absl::Time now);

// `message` as JSON or YAML; kTable is a programmer error (INTERNAL), kCsv
// INVALID_ARGUMENT (only `aidnctl metrics` writes CSV).
absl::StatusOr<std::string> FormatMessage(const google::protobuf::Message& message,
                                          OutputFormat format);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_OUTPUT_H_
