#include "aidnctl/output.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "aidnctl/spec_io.h"
#include "common/status.h"
#include "coordinator/scaling_report.h"

namespace aidn::ctl {
namespace {

constexpr char kColumnGap[] = "   ";
// Longest MESSAGE shown in a listing; describe shows all of it.
constexpr size_t kListMessageChars = 60;
// Longest invalid_reason shown in the checkpoints table: the reasons
// VerifyCheckpointDir gives ("optimizer.safetensors: CRC-32C 1a2b3c4d, the
// manifest says 5e6f7a8b") fit whole.
constexpr size_t kInvalidReasonChars = 80;

bool IsSet(const google::protobuf::Timestamp& t) { return t.seconds() != 0 || t.nanos() != 0; }

std::string OrDash(const std::string& s) { return s.empty() ? "-" : s; }

std::string TimeWithAge(const google::protobuf::Timestamp& t, absl::Time now) {
  if (!IsSet(t)) return "-";
  return absl::StrCat(FormatTimestamp(t), " (", FormatTimestampAge(t, now), " ago)");
}

std::string Labels(const google::protobuf::Map<std::string, std::string>& labels) {
  std::vector<std::pair<std::string, std::string>> sorted(labels.begin(), labels.end());
  std::sort(sorted.begin(), sorted.end());
  return OrDash(absl::StrJoin(sorted, ", ", absl::PairFormatter("=")));
}

}  // namespace

absl::StatusOr<OutputFormat> ParseOutputFormat(absl::string_view text) {
  const std::string lower = absl::AsciiStrToLower(text);
  if (lower == "table") return OutputFormat::kTable;
  if (lower == "json") return OutputFormat::kJson;
  if (lower == "yaml") return OutputFormat::kYaml;
  if (lower == "csv") return OutputFormat::kCsv;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown output format \"", text, "\" (table, json or yaml; csv for metrics)"));
}

bool IsTerminal(v1::Job::State state) {
  return state == v1::Job::SUCCEEDED || state == v1::Job::FAILED || state == v1::Job::CANCELLED;
}

std::string StateName(v1::Job::State state) {
  if (state == v1::Job::STATE_UNSPECIFIED || !v1::Job::State_IsValid(state)) return "UNKNOWN";
  return v1::Job::State_Name(state);
}

std::string StateName(v1::Worker::State state) {
  if (state == v1::Worker::STATE_UNSPECIFIED || !v1::Worker::State_IsValid(state)) {
    return "UNKNOWN";
  }
  return v1::Worker::State_Name(state);
}

std::string FormatTable(const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows) {
  size_t columns = header.size();
  for (const auto& row : rows) columns = std::max(columns, row.size());
  std::vector<size_t> widths(columns, 0);
  auto measure = [&widths](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  };
  measure(header);
  for (const auto& row : rows) measure(row);

  std::string out;
  auto print = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t i = 0; i < columns; ++i) {
      const std::string cell = i < row.size() ? row[i] : "";
      if (i + 1 == columns) {
        line += cell;
      } else {
        absl::StrAppend(&line, cell, std::string(widths[i] - cell.size(), ' '), kColumnGap);
      }
    }
    // No trailing blanks when the last cells are empty.
    line.erase(line.find_last_not_of(' ') + 1);
    absl::StrAppend(&out, line, "\n");
  };
  print(header);
  for (const auto& row : rows) print(row);
  return out;
}

std::string OneLine(absl::string_view text, size_t max_chars) {
  std::string out;
  bool in_space = false;
  for (char c : text) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c))) {
      in_space = true;
      continue;
    }
    if (in_space && !out.empty()) out += ' ';
    in_space = false;
    out += c;
  }
  if (max_chars > 3 && out.size() > max_chars) {
    out.resize(max_chars - 3);
    // Do not cut a UTF-8 sequence in half.
    while (!out.empty() && (static_cast<unsigned char>(out.back()) & 0xC0) == 0x80) out.pop_back();
    if (!out.empty() && (static_cast<unsigned char>(out.back()) & 0xC0) == 0xC0) out.pop_back();
    out += "...";
  }
  return out;
}

std::string FormatAge(absl::Duration age) {
  if (age < absl::ZeroDuration()) age = absl::ZeroDuration();
  if (age < absl::Minutes(2)) return absl::StrCat(absl::ToInt64Seconds(age), "s");
  if (age < absl::Hours(2)) return absl::StrCat(absl::ToInt64Minutes(age), "m");
  if (age < absl::Hours(48)) return absl::StrCat(absl::ToInt64Hours(age), "h");
  return absl::StrCat(absl::ToInt64Hours(age) / 24, "d");
}

absl::Time ToTime(const google::protobuf::Timestamp& timestamp) {
  return absl::FromUnixSeconds(timestamp.seconds()) + absl::Nanoseconds(timestamp.nanos());
}

std::string FormatTimestamp(const google::protobuf::Timestamp& timestamp) {
  if (!IsSet(timestamp)) return "-";
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", ToTime(timestamp), absl::UTCTimeZone());
}

std::string FormatTimestampAge(const google::protobuf::Timestamp& timestamp, absl::Time now) {
  if (!IsSet(timestamp)) return "-";
  return FormatAge(now - ToTime(timestamp));
}

std::string FormatBytes(int64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, "B");
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes) / 1024;
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f%s", value, kUnits[unit]);
}

std::string JobsTable(const google::protobuf::RepeatedPtrField<v1::Job>& jobs, absl::Time now) {
  std::vector<std::vector<std::string>> rows;
  for (const v1::Job& job : jobs) {
    rows.push_back({job.id(), OrDash(OneLine(job.spec().name(), 40)), StateName(job.state()),
                    absl::StrCat(job.spec().world_size()), absl::StrCat(job.generation()),
                    absl::StrCat(job.restarts()), FormatTimestampAge(job.created_at(), now),
                    OneLine(job.message(), kListMessageChars)});
  }
  return FormatTable({"ID", "NAME", "STATE", "WORLD", "GEN", "RESTARTS", "AGE", "MESSAGE"}, rows);
}

std::string WorkersTable(const google::protobuf::RepeatedPtrField<v1::Worker>& workers,
                         absl::Time now) {
  std::vector<std::vector<std::string>> rows;
  for (const v1::Worker& worker : workers) {
    // As kubectl shows a cordoned node: the state, then how it schedules.
    std::string state = StateName(worker.state());
    if (worker.scheduling() == v1::Worker::CORDONED) state += ",cordoned";
    if (worker.scheduling() == v1::Worker::DRAINING) {
      state += worker.job_ids().empty() ? ",drained" : ",draining";
    }
    rows.push_back({worker.info().id(), OrDash(worker.info().address()), state,
                    absl::StrCat(worker.cpu_slots_used(), "/", worker.info().cpu_slots()),
                    absl::StrCat(worker.gpus_used(), "/", worker.info().gpus_size()),
                    OrDash(absl::StrJoin(worker.job_ids(), ",")),
                    FormatTimestampAge(worker.last_heartbeat(), now)});
  }
  return FormatTable(
      {"ID", "ADDRESS", "STATE", "CPU(USED/TOTAL)", "GPUS", "JOBS", "LAST-HEARTBEAT"}, rows);
}

std::string EventsTable(const google::protobuf::RepeatedPtrField<v1::Event>& events) {
  std::vector<std::vector<std::string>> rows;
  for (const v1::Event& event : events) {
    rows.push_back({absl::StrCat(event.seq()), FormatTimestamp(event.time()),
                    OrDash(event.job_id()), event.type(), OneLine(event.message())});
  }
  return FormatTable({"SEQ", "TIME", "JOB", "TYPE", "MESSAGE"}, rows);
}

std::string CheckpointsTable(
    const google::protobuf::RepeatedPtrField<v1::Checkpoint>& checkpoints) {
  std::vector<std::vector<std::string>> rows;
  for (const v1::Checkpoint& checkpoint : checkpoints) {
    const std::string committed = checkpoint.committed()
                                      ? "yes"
                                      : absl::StrCat("no(", checkpoint.ranks_reported_size(), "/",
                                                     checkpoint.ranks_expected_size(), ")");
    // A rank found it fails verification; it is never resumed from nor
    // exported. The full reason is in -o json and in the job's events.
    const std::string note =
        checkpoint.invalid_reason().empty()
            ? ""
            : absl::StrCat("invalid: ", OneLine(checkpoint.invalid_reason(), kInvalidReasonChars));
    rows.push_back({absl::StrCat(checkpoint.step()), absl::StrCat(checkpoint.generation()),
                    committed, FormatTimestamp(checkpoint.created_at()),
                    FormatBytes(checkpoint.bytes()), OrDash(checkpoint.path()), note});
  }
  return FormatTable({"STEP", "GEN", "COMMITTED", "CREATED", "BYTES", "PATH", "NOTE"}, rows);
}

absl::StatusOr<std::string> DescribeJob(const v1::Job& job, absl::Time now) {
  const std::string restarts =
      job.spec().has_max_restarts()
          ? absl::StrCat(job.restarts(), " of ", job.spec().max_restarts(), " allowed")
          : absl::StrCat(job.restarts());
  const std::vector<std::pair<std::string, std::string>> fields = {
      {"ID", job.id()},
      {"Name", OrDash(job.spec().name())},
      {"State", job.has_pausing() ? absl::StrCat(StateName(job.state()), " (pausing, asked by ",
                                                 OrDash(job.pausing().by()), ")")
                                  : StateName(job.state())},
      {"Message", OrDash(OneLine(job.message()))},
      {"Owner", OrDash(job.owner())},
      {"Labels", Labels(job.spec().labels())},
      {"World size", absl::StrCat(job.spec().world_size())},
      {"Generation", absl::StrCat(job.generation())},
      {"Restarts", restarts},
      {"Last step", absl::StrCat(job.last_step())},
      // Step 0 is never checkpointed (checkpoints follow completed steps),
      // so 0 means none yet.
      {"Last checkpoint", job.last_checkpoint_step() > 0
                              ? absl::StrCat("step ", job.last_checkpoint_step())
                              : std::string("none")},
      {"Created", TimeWithAge(job.created_at(), now)},
      {"Started", TimeWithAge(job.started_at(), now)},
      {"Updated", TimeWithAge(job.updated_at(), now)},
      {"Finished", TimeWithAge(job.finished_at(), now)},
      // Set as the job succeeds.
      {"Throughput",
       job.throughput().steps() > 0 ? coordinator::ThroughputLine(job.throughput()) : "-"},
  };
  size_t width = 0;
  for (const auto& [key, value] : fields) width = std::max(width, key.size() + 1);
  std::string out;
  for (const auto& [key, value] : fields) {
    absl::StrAppend(&out, absl::StrFormat("%-*s ", width, key + ":"), value, "\n");
  }

  AIDN_ASSIGN_OR_RETURN(const std::string spec, MessageToYaml(job.spec()));
  absl::StrAppend(&out, "Spec:\n");
  for (absl::string_view line : absl::StrSplit(spec, '\n', absl::SkipEmpty())) {
    absl::StrAppend(&out, "  ", line, "\n");
  }

  if (job.placement().empty()) {
    absl::StrAppend(&out, "Placement: none\n");
  } else {
    std::vector<std::vector<std::string>> rows;
    for (const v1::RankPlacement& rank : job.placement()) {
      rows.push_back({absl::StrCat(rank.rank()), rank.worker_id(), absl::StrCat(rank.slot()),
                      OrDash(rank.address())});
    }
    absl::StrAppend(&out, "Placement:\n");
    const std::string table = FormatTable({"RANK", "WORKER", "SLOT", "ADDRESS"}, rows);
    for (absl::string_view line : absl::StrSplit(table, '\n', absl::SkipEmpty())) {
      absl::StrAppend(&out, "  ", line, "\n");
    }
  }
  return out;
}

absl::StatusOr<std::string> FormatMessage(const google::protobuf::Message& message,
                                          OutputFormat format) {
  switch (format) {
    case OutputFormat::kJson:
      return MessageToJson(message);
    case OutputFormat::kYaml:
      return MessageToYaml(message);
    case OutputFormat::kCsv:
      return absl::InvalidArgumentError(
          "-o csv is only for `aidnctl metrics`; use table, json or yaml here");
    case OutputFormat::kTable:
      break;
  }
  return absl::InternalError("FormatMessage called for table output");
}

}  // namespace aidn::ctl
