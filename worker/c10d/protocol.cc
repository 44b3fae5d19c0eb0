#include "worker/c10d/protocol.h"

#include <array>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace aidn::worker::c10d {
namespace {

constexpr std::array<Op, 9> kTorch1Ops = {Op::kSet,        Op::kCompareSet, Op::kGet,
                                          Op::kAdd,        Op::kCheck,      Op::kWait,
                                          Op::kGetNumKeys, Op::kWatchKey,   Op::kDeleteKey};
constexpr std::array<Op, 12> kTorch21Ops = {
    Op::kSet,        Op::kCompareSet, Op::kGet,    Op::kAdd,      Op::kCheck,    Op::kWait,
    Op::kGetNumKeys, Op::kDeleteKey,  Op::kAppend, Op::kMultiGet, Op::kMultiSet, Op::kCancelWait};
constexpr std::array<Op, 17> kValidatedOps = {
    Op::kValidate,   Op::kSet,        Op::kCompareSet, Op::kGet,      Op::kAdd,      Op::kCheck,
    Op::kWait,       Op::kGetNumKeys, Op::kDeleteKey,  Op::kAppend,   Op::kMultiGet, Op::kMultiSet,
    Op::kCancelWait, Op::kPing,       Op::kQueuePush,  Op::kQueuePop, Op::kQueueLen};

template <size_t N>
absl::StatusOr<uint8_t> Find(const std::array<Op, N>& table, Op op) {
  for (size_t i = 0; i < N; ++i) {
    if (table[i] == op) return static_cast<uint8_t>(i);
  }
  return absl::InvalidArgumentError("no such command in this dialect");
}

// Reads fixed-size fields and length-prefixed strings from the front of a
// buffer. `ok()` turns false for good once a field is incomplete.
class Reader {
 public:
  Reader(std::string_view input, const ParseLimits& limits) : input_(input), limits_(limits) {}

  bool complete() const { return complete_; }
  size_t offset() const { return offset_; }

  template <typename T>
  bool Fixed(T* value) {
    if (!complete_) return false;
    if (input_.size() - offset_ < sizeof(T)) return complete_ = false;
    std::memcpy(value, input_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return true;
  }

  // A u64 length and that many bytes, at most `max` (`what` names it in the
  // error). The length is checked as soon as it has arrived.
  absl::Status String(size_t max, const char* what, std::string* out) {
    uint64_t size = 0;
    if (!Fixed(&size)) return absl::OkStatus();
    if (size > max) {
      return absl::ResourceExhaustedError(
          absl::StrCat(what, " of ", size, " bytes is over the limit of ", max));
    }
    if (input_.size() - offset_ < size) {
      complete_ = false;
      return absl::OkStatus();
    }
    out->assign(input_.data() + offset_, size);
    offset_ += size;
    return absl::OkStatus();
  }
  absl::Status Key(std::string* out) { return String(limits_.max_key_bytes, "key", out); }
  absl::Status Value(std::string* out) { return String(limits_.max_value_bytes, "value", out); }

  absl::Status Count(uint64_t* count) {
    if (!Fixed(count)) return absl::OkStatus();
    if (*count > limits_.max_keys_per_request) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "request names ", *count, " keys, over the limit of ", limits_.max_keys_per_request));
    }
    return absl::OkStatus();
  }

 private:
  std::string_view input_;
  const ParseLimits& limits_;
  size_t offset_ = 0;
  bool complete_ = true;
};

#define AIDN_C10D_TRY(expr)                                \
  do {                                                     \
    absl::Status aidn_c10d_status_ = (expr);               \
    if (!aidn_c10d_status_.ok()) return aidn_c10d_status_; \
    if (!reader.complete()) return absl::OkStatus();       \
  } while (false)

// Parses the arguments of `request->op`; an incomplete request leaves
// `reader.complete()` false.
absl::Status ParseArguments(Reader& reader, Request* request) {
  request->keys.clear();
  request->values.clear();
  switch (request->op) {
    case Op::kValidate:
    case Op::kPing:
      reader.Fixed(&request->word);
      return absl::OkStatus();
    case Op::kGetNumKeys:
    case Op::kCancelWait:
      return absl::OkStatus();
    case Op::kGet:
    case Op::kDeleteKey:
    case Op::kWatchKey:
    case Op::kQueuePop:
    case Op::kQueueLen:
      request->keys.resize(1);
      return reader.Key(&request->keys[0]);
    case Op::kSet:
    case Op::kAppend:
    case Op::kQueuePush:
      request->keys.resize(1);
      request->values.resize(1);
      AIDN_C10D_TRY(reader.Key(&request->keys[0]));
      return reader.Value(&request->values[0]);
    case Op::kCompareSet:
      request->keys.resize(1);
      request->values.resize(2);
      AIDN_C10D_TRY(reader.Key(&request->keys[0]));
      AIDN_C10D_TRY(reader.Value(&request->values[0]));
      return reader.Value(&request->values[1]);
    case Op::kAdd:
      request->keys.resize(1);
      AIDN_C10D_TRY(reader.Key(&request->keys[0]));
      reader.Fixed(&request->delta);
      return absl::OkStatus();
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet:
    case Op::kMultiSet: {
      uint64_t count = 0;
      AIDN_C10D_TRY(reader.Count(&count));
      const bool with_values = request->op == Op::kMultiSet;
      // Grown as keys arrive, so a large count costs nothing until its keys
      // are there.
      for (uint64_t i = 0; i < count; ++i) {
        request->keys.emplace_back();
        AIDN_C10D_TRY(reader.Key(&request->keys.back()));
        if (with_values) {
          request->values.emplace_back();
          AIDN_C10D_TRY(reader.Value(&request->values.back()));
        }
      }
      return absl::OkStatus();
    }
  }
  return absl::InternalError("unhandled op");
}

#undef AIDN_C10D_TRY

}  // namespace

const char* DialectName(Dialect dialect) {
  switch (dialect) {
    case Dialect::kTorch1:
      return "torch1";
    case Dialect::kTorch21:
      return "torch2.1";
    case Dialect::kValidated:
      return "validated";
  }
  return "?";
}

const char* OpName(Op op) {
  static constexpr const char* kNames[] = {
      "VALIDATE",  "SET",         "COMPARE_SET", "GET",        "ADD",       "CHECK",
      "WAIT",      "GETNUMKEYS",  "WATCH_KEY",   "DELETE_KEY", "APPEND",    "MULTI_GET",
      "MULTI_SET", "CANCEL_WAIT", "PING",        "QUEUE_PUSH", "QUEUE_POP", "QUEUE_LEN"};
  const auto index = static_cast<size_t>(op);
  return index < std::size(kNames) ? kNames[index] : "?";
}

absl::StatusOr<Op> OpForCommand(Dialect dialect, uint8_t command) {
  switch (dialect) {
    case Dialect::kTorch1:
      if (command < kTorch1Ops.size()) return kTorch1Ops[command];
      break;
    case Dialect::kTorch21:
      if (command < kTorch21Ops.size()) return kTorch21Ops[command];
      break;
    case Dialect::kValidated:
      if (command < kValidatedOps.size()) return kValidatedOps[command];
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown command byte ", int{command}, " in the ",
                                                 DialectName(dialect), " dialect"));
}

absl::StatusOr<uint8_t> CommandForOp(Dialect dialect, Op op) {
  absl::StatusOr<uint8_t> command = absl::InvalidArgumentError("");
  switch (dialect) {
    case Dialect::kTorch1:
      command = Find(kTorch1Ops, op);
      break;
    case Dialect::kTorch21:
      command = Find(kTorch21Ops, op);
      break;
    case Dialect::kValidated:
      command = Find(kValidatedOps, op);
      break;
  }
  if (!command.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(OpName(op), " does not exist in the ", DialectName(dialect), " dialect"));
  }
  return command;
}

std::optional<Dialect> DetectDialect(std::string_view first_bytes, Dialect unvalidated) {
  if (first_bytes.empty()) return std::nullopt;
  if (first_bytes[0] != 0) return unvalidated;
  if (first_bytes.size() < 5) return std::nullopt;
  uint32_t magic = 0;
  std::memcpy(&magic, first_bytes.data() + 1, sizeof(magic));
  return magic == kValidationMagic ? Dialect::kValidated : unvalidated;
}

absl::StatusOr<size_t> ParseRequest(Dialect dialect, std::string_view input,
                                    const ParseLimits& limits, Request* request) {
  if (input.empty()) return 0;
  auto op = OpForCommand(dialect, static_cast<uint8_t>(input[0]));
  if (!op.ok()) return op.status();
  request->op = *op;
  Reader reader(input.substr(1), limits);
  absl::Status status = ParseArguments(reader, request);
  if (!status.ok()) return status;
  if (!reader.complete()) return 0;
  return 1 + reader.offset();
}

void AppendU8(std::string* out, uint8_t value) { out->push_back(static_cast<char>(value)); }

void AppendU32(std::string* out, uint32_t value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(value));
}

void AppendI64(std::string* out, int64_t value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(value));
}

void AppendBytes(std::string* out, std::string_view bytes) {
  const uint64_t size = bytes.size();
  out->append(reinterpret_cast<const char*>(&size), sizeof(size));
  out->append(bytes.data(), bytes.size());
}

absl::StatusOr<std::string> EncodeRequest(Dialect dialect, const Request& request) {
  auto command = CommandForOp(dialect, request.op);
  if (!command.ok()) return command.status();
  std::string out;
  AppendU8(&out, *command);
  auto key = [&](size_t i) -> std::string_view {
    return i < request.keys.size() ? std::string_view(request.keys[i]) : std::string_view();
  };
  auto value = [&](size_t i) -> std::string_view {
    return i < request.values.size() ? std::string_view(request.values[i]) : std::string_view();
  };
  switch (request.op) {
    case Op::kValidate:
    case Op::kPing:
      AppendU32(&out, request.word);
      break;
    case Op::kGetNumKeys:
    case Op::kCancelWait:
      break;
    case Op::kGet:
    case Op::kDeleteKey:
    case Op::kWatchKey:
    case Op::kQueuePop:
    case Op::kQueueLen:
      AppendBytes(&out, key(0));
      break;
    case Op::kSet:
    case Op::kAppend:
    case Op::kQueuePush:
      AppendBytes(&out, key(0));
      AppendBytes(&out, value(0));
      break;
    case Op::kCompareSet:
      AppendBytes(&out, key(0));
      AppendBytes(&out, value(0));
      AppendBytes(&out, value(1));
      break;
    case Op::kAdd:
      AppendBytes(&out, key(0));
      AppendI64(&out, request.delta);
      break;
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet:
    case Op::kMultiSet:
      AppendI64(&out, static_cast<int64_t>(request.keys.size()));
      for (size_t i = 0; i < request.keys.size(); ++i) {
        AppendBytes(&out, key(i));
        if (request.op == Op::kMultiSet) AppendBytes(&out, value(i));
      }
      break;
  }
  return out;
}

}  // namespace aidn::worker::c10d
