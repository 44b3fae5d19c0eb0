#include "aidnctl/spec_io.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <istream>
#include <iterator>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "aidnctl/config.h"
#include "common/job_spec_limits.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"
#include "yaml-cpp/eventhandler.h"
#include "yaml-cpp/yaml.h"

namespace aidn::ctl {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using Json = nlohmann::ordered_json;

// ---------------------------------------------------------------------------
// What job.proto says a node holds. Only used to keep string fields' text
// as written and to find durations and 64-bit integers; protobuf itself
// checks everything.

struct Expect {
  enum Kind { kUnknown, kMessage, kValue, kList, kMap };
  Kind kind = kUnknown;
  const Descriptor* message = nullptr;     // kMessage
  const FieldDescriptor* field = nullptr;  // kValue, kList, kMap

  // A node for one value (or list element) of `field`.
  static Expect ValueOf(const FieldDescriptor* field) {
    if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE &&
        field->message_type()->well_known_type() == Descriptor::WELLKNOWNTYPE_UNSPECIFIED) {
      return {kMessage, field->message_type(), nullptr};
    }
    return {kValue, nullptr, field};
  }
  // A node for the whole of `field` (nullptr: an unknown field).
  static Expect Of(const FieldDescriptor* field) {
    if (field == nullptr) return {};
    if (field->is_map()) return {kMap, nullptr, field};
    if (field->is_repeated()) return {kList, nullptr, field};
    return ValueOf(field);
  }
  // A member of a mapping that this node is.
  Expect Member(const std::string& key) const {
    if (kind == kMessage) {
      const FieldDescriptor* found = message->FindFieldByName(key);
      for (int i = 0; found == nullptr && i < message->field_count(); ++i) {
        if (message->field(i)->json_name() == key) found = message->field(i);
      }
      return Of(found);
    }
    if (kind == kMap) return ValueOf(field->message_type()->map_value());
    return {};
  }
  // An element of a sequence that this node is.
  Expect Element() const { return kind == kList ? ValueOf(field) : Expect{}; }

  bool IsStringField() const {
    return kind == kValue && (field->type() == FieldDescriptor::TYPE_STRING ||
                              field->type() == FieldDescriptor::TYPE_BYTES);
  }
  bool IsDuration() const {
    return kind == kValue && field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE &&
           field->message_type()->well_known_type() == Descriptor::WELLKNOWNTYPE_DURATION;
  }
  bool Is64BitInteger() const {
    if (kind != kValue) return false;
    const auto type = field->cpp_type();
    return type == FieldDescriptor::CPPTYPE_INT64 || type == FieldDescriptor::CPPTYPE_UINT64;
  }
};

// ---------------------------------------------------------------------------
// Plain YAML scalars.

bool IsNullWord(const std::string& s) {
  return s.empty() || s == "~" || s == "null" || s == "Null" || s == "NULL";
}

// The JSON value of a plain scalar (see spec_io.h for the rules).
Json InferPlainScalar(const std::string& s) {
  if (IsNullWord(s)) return nullptr;
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  static const std::regex kInteger(R"([-+]?(0|[1-9][0-9]*))");
  static const std::regex kFloat(R"([-+]?((0|[1-9][0-9]*)(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+)?)");
  // from_chars takes no '+'.
  const std::string digits = s[0] == '+' ? s.substr(1) : s;
  const char* begin = digits.data();
  const char* end = digits.data() + digits.size();
  if (std::regex_match(s, kInteger)) {
    int64_t value = 0;
    if (auto r = std::from_chars(begin, end, value); r.ec == std::errc() && r.ptr == end) {
      return value;
    }
    uint64_t unsigned_value = 0;
    if (auto r = std::from_chars(begin, end, unsigned_value); r.ec == std::errc() && r.ptr == end) {
      return unsigned_value;
    }
    return s;  // Out of range: protobuf says so for the field.
  }
  if (std::regex_match(s, kFloat)) {
    double value = 0;
    if (auto r = std::from_chars(begin, end, value);
        r.ec == std::errc() && r.ptr == end && std::isfinite(value)) {
      return value;
    }
    return s;
  }
  return s;
}

// "5m", "1h30m", "1.5s" → protobuf's "300s", "5400s", "1.5s"; nullopt if
// `text` is no duration Abseil reads.
std::optional<std::string> NormalizeDuration(const std::string& text) {
  absl::Duration duration;
  if (!absl::ParseDuration(text, &duration) || duration == absl::InfiniteDuration() ||
      duration == -absl::InfiniteDuration()) {
    return std::nullopt;
  }
  absl::Duration remainder;
  const int64_t seconds = absl::IDivDuration(duration, absl::Seconds(1), &remainder);
  const int64_t nanos = absl::ToInt64Nanoseconds(remainder);
  std::string out = absl::StrCat(seconds);
  if (nanos != 0) {
    if (seconds == 0 && nanos < 0) out = "-0";
    std::string fraction = absl::StrFormat("%09d", nanos < 0 ? -nanos : nanos);
    while (!fraction.empty() && fraction.back() == '0') fraction.pop_back();
    absl::StrAppend(&out, ".", fraction);
  }
  return absl::StrCat(out, "s");
}

// Rewrites duration strings in place so protobuf's JSON parser takes them.
void NormalizeDurations(Json& json, const Expect& expect) {
  if (json.is_object()) {
    for (auto& [key, value] : json.items()) NormalizeDurations(value, expect.Member(key));
  } else if (json.is_array()) {
    for (auto& element : json) NormalizeDurations(element, expect.Element());
  } else if (json.is_string() && expect.IsDuration()) {
    if (auto normalized = NormalizeDuration(json.get<std::string>())) json = *normalized;
  }
}

// ---------------------------------------------------------------------------
// YAML → JSON.

class YamlConverter {
 public:
  explicit YamlConverter(std::string source) : source_(std::move(source)) {}

  absl::StatusOr<Json> Convert(const YAML::Node& node, const Expect& expect,
                               const std::string& path) {
    switch (node.Type()) {
      case YAML::NodeType::Null:
        return Json(nullptr);
      case YAML::NodeType::Scalar:
        return Scalar(node, expect);
      case YAML::NodeType::Sequence: {
        Json array = Json::array();
        for (size_t i = 0; i < node.size(); ++i) {
          const std::string element_path = absl::StrCat(path, "[", i, "]");
          Note(element_path, node[i].Mark());
          AIDN_ASSIGN_OR_RETURN(Json element, Convert(node[i], expect.Element(), element_path));
          array.push_back(std::move(element));
        }
        return array;
      }
      case YAML::NodeType::Map: {
        Json object = Json::object();
        size_t index = 0;
        for (const auto& entry : node) {
          const YAML::Node& key = entry.first;
          if (!key.IsScalar()) {
            return Error(key.Mark(), path, "a mapping key must be a plain string");
          }
          const std::string name = key.Scalar();
          if (object.contains(name)) {
            return Error(key.Mark(), path, absl::StrCat("duplicate key \"", name, "\""));
          }
          // Paths as protobuf's JSON parser names them in errors: a.b,
          // a.list[2], and for map fields the entry's index: labels[0].value.
          std::string member_path;
          if (expect.kind == Expect::kMap) {
            member_path = absl::StrCat(path, "[", index, "]");
            Note(member_path + ".key", key.Mark());
            Note(member_path + ".value", entry.second.Mark());
            member_path += ".value";
          } else {
            member_path = path.empty() ? name : absl::StrCat(path, ".", name);
          }
          Note(member_path, key.Mark());
          AIDN_ASSIGN_OR_RETURN(Json value,
                                Convert(entry.second, expect.Member(name), member_path));
          object[name] = std::move(value);
          ++index;
        }
        return object;
      }
      case YAML::NodeType::Undefined:
        break;
    }
    return Error(node.Mark(), path, "unreadable YAML node");
  }

  // The 1-based YAML line of each field path seen.
  const std::map<std::string, int>& lines() const { return lines_; }

 private:
  Json Scalar(const YAML::Node& node, const Expect& expect) const {
    const std::string& text = node.Scalar();
    // yaml-cpp tags quoted and block scalars "!" and plain ones "?".
    if (node.Tag() == "!" || node.Tag() == "tag:yaml.org,2002:str") return text;
    if (expect.IsStringField() && !IsNullWord(text)) return text;
    return InferPlainScalar(text);
  }

  void Note(const std::string& path, const YAML::Mark& mark) {
    if (!mark.is_null() && !lines_.count(path)) lines_[path] = mark.line + 1;
  }

  absl::Status Error(const YAML::Mark& mark, const std::string& path,
                     const std::string& what) const {
    std::string message = source_ + ": ";
    if (!path.empty()) absl::StrAppend(&message, path, ": ");
    absl::StrAppend(&message, what);
    if (!mark.is_null()) absl::StrAppend(&message, " (line ", mark.line + 1, ")");
    return absl::InvalidArgumentError(message);
  }

  std::string source_;
  std::map<std::string, int> lines_;
};

// ---------------------------------------------------------------------------
// protobuf's JSON errors, made readable.

std::string DescribeExpectedType(const std::string& type, const std::string& value) {
  if (type == "TYPE_INT32" || type == "TYPE_INT64" || type == "TYPE_UINT32" ||
      type == "TYPE_UINT64" || type == "TYPE_SINT32" || type == "TYPE_SINT64" ||
      type == "TYPE_FIXED32" || type == "TYPE_FIXED64" || type == "TYPE_SFIXED32" ||
      type == "TYPE_SFIXED64") {
    return absl::StrCat("invalid value ", value, ": expected an integer (",
                        absl::AsciiStrToLower(type.substr(5)), ")");
  }
  if (type == "TYPE_DOUBLE" || type == "TYPE_FLOAT") {
    return absl::StrCat("invalid value ", value, ": expected a number");
  }
  if (type == "TYPE_BOOL") return absl::StrCat("invalid value ", value, ": expected true or false");
  if (type == "TYPE_STRING") return absl::StrCat("invalid value ", value, ": expected a string");
  const std::string name(absl::StripPrefix(type, "type.googleapis.com/"));
  if (name == "google.protobuf.Duration") {
    return "invalid duration: expected a string such as \"30s\", \"1.5s\", \"5m\" or \"1h30m\"";
  }
  if (const auto* enum_type =
          google::protobuf::DescriptorPool::generated_pool()->FindEnumTypeByName(name)) {
    std::vector<std::string> names;
    for (int i = 0; i < enum_type->value_count(); ++i) {
      if (enum_type->value(i)->number() != 0) names.push_back(enum_type->value(i)->name());
    }
    return absl::StrCat("invalid value ", value, ": expected one of ", absl::StrJoin(names, ", "),
                        " (in any case)");
  }
  return absl::StrCat("invalid value ", value, " for type ", name);
}

std::string ReadableJsonError(const std::string& message, const std::map<std::string, int>& lines,
                              const std::string& source) {
  static const std::regex kNestedUnknown(R"(^\((.*)\) (\S+): Cannot find field\.$)");
  static const std::regex kUnknown(R"(^(\S+): Cannot find field\.$)");
  static const std::regex kInvalidValue(R"(^\((.*)\): invalid value (.*) for type (\S+)$)");
  static const std::regex kOther(R"(^\(?([A-Za-z0-9_.\[\]]+)\)?: (.*)$)");
  std::smatch m;
  std::string path;
  std::string what;
  if (std::regex_match(message, m, kNestedUnknown)) {
    path = absl::StrCat(m[1].str(), ".", m[2].str());
    what = "unknown field";
  } else if (std::regex_match(message, m, kUnknown)) {
    path = m[1].str();
    what = "unknown field";
  } else if (std::regex_match(message, m, kInvalidValue)) {
    path = m[1].str();
    what = DescribeExpectedType(m[3].str(), m[2].str());
  } else if (std::regex_match(message, m, kOther)) {
    path = m[1].str();
    what = m[2].str();
  } else {
    what = message;
  }
  std::string out = source + ": ";
  if (!path.empty()) absl::StrAppend(&out, path, ": ");
  absl::StrAppend(&out, what);
  if (auto it = lines.find(path); it != lines.end()) {
    absl::StrAppend(&out, " (line ", it->second, ")");
  }
  return out;
}

// ---------------------------------------------------------------------------
// JSON → YAML.

bool NeedsQuotes(const std::string& s) {
  if (!InferPlainScalar(s).is_string()) return true;  // "123", "true", "", "~"
  // Words other YAML readers (YAML 1.1) take for booleans.
  static const std::set<std::string> kYaml11Words = {"y", "n", "yes", "no", "on", "off"};
  if (kYaml11Words.count(absl::AsciiStrToLower(s))) return true;
  return s.front() == ' ' || s.back() == ' ';
}

bool IsScalar(const Json& json) { return !json.is_object() && !json.is_array(); }

void EmitYaml(YAML::Emitter& out, const Json& json, const Expect& expect) {
  if (json.is_object()) {
    out << YAML::BeginMap;
    for (const auto& [key, value] : json.items()) {
      out << YAML::Key;
      if (NeedsQuotes(key)) {
        out << YAML::DoubleQuoted << key;
      } else {
        out << key;
      }
      out << YAML::Value;
      EmitYaml(out, value, expect.Member(key));
    }
    out << YAML::EndMap;
  } else if (json.is_array()) {
    const bool flow = std::all_of(json.begin(), json.end(), IsScalar);
    if (flow) out << YAML::Flow;
    out << YAML::BeginSeq;
    for (const auto& element : json) EmitYaml(out, element, expect.Element());
    out << YAML::EndSeq;
  } else if (json.is_string()) {
    const std::string& s = json.get_ref<const std::string&>();
    static const std::regex kInteger(R"(-?(0|[1-9][0-9]*))");
    if (expect.Is64BitInteger() && std::regex_match(s, kInteger)) {
      out << s;  // the JSON mapping's quoted int64, as a YAML number
    } else if (NeedsQuotes(s)) {
      out << YAML::DoubleQuoted << s;
    } else {
      out << s;
    }
  } else if (json.is_null()) {
    out << YAML::Null;
  } else if (json.is_boolean()) {
    out << (json.get<bool>() ? "true" : "false");
  } else {
    out << json.dump();  // numbers in their shortest round-trip form
  }
}

// Where the text's second YAML document starts, if it has one. Not
// YAML::LoadAll: on some malformed text (a quoted scalar, a comma, more
// lines) yaml-cpp 0.7's parser hands out empty documents for ever without
// reading on, and LoadAll collects them until memory runs out. Two are all
// there is to know.
class DocumentStarts : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark& mark) override { starts.push_back(mark); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
  std::vector<YAML::Mark> starts;
};

std::optional<YAML::Mark> SecondDocument(const std::string& text) {
  std::istringstream stream(text);
  YAML::Parser parser(stream);
  DocumentStarts starts;
  for (int i = 0; i < 2 && parser.HandleNextDocument(starts); ++i) {
  }
  if (starts.starts.size() < 2) return std::nullopt;
  return starts.starts[1];
}

Expect ExpectFor(const Descriptor* type) {
  if (type == nullptr) return {};
  return {Expect::kMessage, type, nullptr};
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view text, absl::string_view source_view) {
  const std::string source(source_view);
  const Expect expect = ExpectFor(v1::JobSpec::descriptor());
  Json json;
  std::map<std::string, int> lines;

  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != absl::string_view::npos && text[first] == '{') {
    try {
      json = Json::parse(text.begin(), text.end());
    } catch (const Json::exception& e) {
      // "[json.exception.parse_error.101] parse error at line 3, column 5: ..."
      std::string what = e.what();
      if (const size_t bracket = what.find("] "); bracket != std::string::npos) {
        what = what.substr(bracket + 2);
      }
      return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
    }
  } else {
    std::vector<YAML::Node> documents;
    std::optional<YAML::Mark> second;
    try {
      second = SecondDocument(std::string(text));
      if (!second.has_value()) documents.push_back(YAML::Load(std::string(text)));
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": line ", e.mark.line + 1,
                                                     ", column ", e.mark.column + 1, ": ", e.msg));
    }
    if (second.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(source,
                                                     ": a second YAML document starts at line ",
                                                     second->line + 1, "; expected one job spec"));
    }
    if (documents.empty() || documents[0].IsNull()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": the job spec is empty"));
    }
    if (!documents[0].IsMap()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": expected a mapping of job spec fields (name: ..., ...)"));
    }
    YamlConverter converter(source);
    try {
      AIDN_ASSIGN_OR_RETURN(json, converter.Convert(documents[0], expect, ""));
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": line ", e.mark.line + 1, ": ", e.msg));
    }
    lines = converter.lines();
  }
  if (!json.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": expected an object of job spec fields"));
  }
  NormalizeDurations(json, expect);

  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  options.case_insensitive_enum_parsing = true;
  v1::JobSpec spec;
  const auto status = google::protobuf::util::JsonStringToMessage(
      json.dump(-1, ' ', false, Json::error_handler_t::replace), &spec, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        ReadableJsonError(std::string(status.message()), lines, source));
  }
  return spec;
}

absl::StatusOr<v1::JobSpec> ReadJobSpec(const std::string& path, std::istream& stdin_stream) {
  if (path == "-") {
    std::string text(std::istreambuf_iterator<char>(stdin_stream), {});
    if (stdin_stream.bad()) return absl::DataLossError("cannot read the job spec from stdin");
    return ParseJobSpec(text, "<stdin>");
  }
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("cannot read job spec ", text.status().message()));
  }
  return ParseJobSpec(*text, path);
}

namespace {

// The first string field of `message` (recursively) over its limit, as
// "path: N bytes, ...".
std::optional<std::string> OversizedString(const google::protobuf::Message& message,
                                           const std::string& prefix) {
  const google::protobuf::Reflection* reflection = message.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const FieldDescriptor* field : fields) {
    const std::string path = prefix + field->name();
    if (field->is_map()) continue;  // labels, checked by the caller
    if (field->type() == FieldDescriptor::TYPE_MESSAGE && !field->is_repeated()) {
      if (auto found = OversizedString(reflection->GetMessage(message, field), path + ".")) {
        return found;
      }
      continue;
    }
    if (field->type() != FieldDescriptor::TYPE_STRING || field->is_repeated()) continue;
    const size_t limit =
        path == "name" ? job_spec_limits::kMaxNameBytes : job_spec_limits::kMaxPathBytes;
    const size_t size = reflection->GetStringReference(message, field, nullptr).size();
    if (size > limit) {
      return absl::StrCat(path, ": ", size, " bytes, the coordinator takes at most ", limit);
    }
  }
  return std::nullopt;
}

std::string ShortQuote(const std::string& text) {
  return absl::StrCat("\"", text.size() > 40 ? text.substr(0, 40) + "..." : text, "\"");
}

}  // namespace

absl::Status CheckJobSpecSizes(const v1::JobSpec& spec, absl::string_view source,
                               size_t max_message_bytes) {
  auto too_large = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
  };
  namespace limits = job_spec_limits;
  if (static_cast<size_t>(spec.labels_size()) > limits::kMaxLabels) {
    return too_large(absl::StrCat("labels: ", spec.labels_size(),
                                  " labels, the coordinator takes at most ", limits::kMaxLabels));
  }
  for (const auto& [key, value] : spec.labels()) {
    if (key.size() > limits::kMaxLabelKeyBytes) {
      return too_large(absl::StrCat("labels: key ", ShortQuote(key), " is ", key.size(),
                                    " bytes, the coordinator takes at most ",
                                    limits::kMaxLabelKeyBytes));
    }
    if (value.size() > limits::kMaxLabelValueBytes) {
      return too_large(absl::StrCat("labels[", ShortQuote(key), "]: ", value.size(),
                                    " bytes, the coordinator takes at most ",
                                    limits::kMaxLabelValueBytes));
    }
  }
  if (std::optional<std::string> what = OversizedString(spec, "")) return too_large(*what);
  // Anything else (a long repeated field): name the largest field.
  const size_t total = spec.ByteSizeLong();
  if (total <= max_message_bytes) return absl::OkStatus();
  const Descriptor* descriptor = spec.GetDescriptor();
  std::string largest;
  size_t largest_bytes = 0;
  for (int i = 0; i < descriptor->field_count(); ++i) {
    v1::JobSpec without = spec;
    without.GetReflection()->ClearField(&without, descriptor->field(i));
    const size_t bytes = total - without.ByteSizeLong();
    if (bytes > largest_bytes) largest = descriptor->field(i)->name(), largest_bytes = bytes;
  }
  return too_large(absl::StrCat("the spec is ", total, " bytes, more than the ", max_message_bytes,
                                " a call carries; ", largest, " takes ", largest_bytes));
}

std::string JsonToYaml(const nlohmann::ordered_json& json, const Descriptor* type) {
  YAML::Emitter out;
  out.SetIndent(2);
  EmitYaml(out, json, ExpectFor(type));
  return absl::StrCat(out.c_str(), "\n");
}

namespace {

// The message in protobuf's JSON mapping with proto field names, parsed into
// an ordered document (field order kept). `format` names the output in errors.
absl::StatusOr<Json> ToOrderedJson(const google::protobuf::Message& message, const char* format) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = false;
  std::string compact;
  const auto status = google::protobuf::util::MessageToJsonString(message, &compact, options);
  if (!status.ok()) {
    return absl::InternalError(absl::StrCat("cannot print ", message.GetTypeName(), " as ", format,
                                            ": ", std::string(status.message())));
  }
  return Json::parse(compact);
}

}  // namespace

absl::StatusOr<std::string> MessageToJson(const google::protobuf::Message& message) {
  AIDN_ASSIGN_OR_RETURN(Json json, ToOrderedJson(message, "JSON"));
  // Re-indented by nlohmann (protobuf's pretty printer indents by one space).
  return json.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

absl::StatusOr<std::string> MessageToJsonLine(const google::protobuf::Message& message) {
  AIDN_ASSIGN_OR_RETURN(Json json, ToOrderedJson(message, "JSON"));
  return json.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

absl::StatusOr<std::string> MessageToYaml(const google::protobuf::Message& message) {
  AIDN_ASSIGN_OR_RETURN(Json json, ToOrderedJson(message, "YAML"));
  return JsonToYaml(json, message.GetDescriptor());
}

}  // namespace aidn::ctl
