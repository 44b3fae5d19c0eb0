#include "worker/c10d/protocol.h"

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace aidn::worker::c10d {
namespace {

std::string U64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }
std::string Str(const std::string& s) { return U64(s.size()) + s; }

Request Make(Op op) {
  Request r;
  r.op = op;
  switch (op) {
    case Op::kValidate:
      r.word = kValidationMagic;
      break;
    case Op::kPing:
      r.word = 1234;
      break;
    case Op::kGetNumKeys:
    case Op::kCancelWait:
      break;
    case Op::kGet:
    case Op::kDeleteKey:
    case Op::kWatchKey:
    case Op::kQueuePop:
    case Op::kQueueLen:
      r.keys = {"/worker/attempt_0/k"};
      break;
    case Op::kSet:
    case Op::kAppend:
    case Op::kQueuePush:
      r.keys = {"key"};
      r.values = {std::string("v\0alue", 6)};
      break;
    case Op::kCompareSet:
      r.keys = {"key"};
      r.values = {"", "desired"};
      break;
    case Op::kAdd:
      r.keys = {"counter"};
      r.delta = -7;
      break;
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet:
      r.keys = {"a", "", "ccc"};
      break;
    case Op::kMultiSet:
      r.keys = {"a", "b"};
      r.values = {"1", ""};
      break;
  }
  return r;
}

std::vector<Op> AllOps() {
  std::vector<Op> ops;
  for (int i = 0; i <= static_cast<int>(Op::kQueueLen); ++i) ops.push_back(static_cast<Op>(i));
  return ops;
}

TEST(C10dProtocol, CommandBytesAreThoseOfEachPyTorchGeneration) {
  // PyTorch 1.13's TCPStore.cpp QueryType.
  EXPECT_EQ(*CommandForOp(Dialect::kTorch1, Op::kSet), 0);
  EXPECT_EQ(*CommandForOp(Dialect::kTorch1, Op::kWait), 5);
  EXPECT_EQ(*CommandForOp(Dialect::kTorch1, Op::kWatchKey), 7);
  EXPECT_EQ(*CommandForOp(Dialect::kTorch1, Op::kDeleteKey), 8);
  EXPECT_FALSE(CommandForOp(Dialect::kTorch1, Op::kAppend).ok());
  // 2.1: watchKey removed, APPEND/MULTI_*/CANCEL_WAIT added, no handshake.
  EXPECT_EQ(*CommandForOp(Dialect::kTorch21, Op::kDeleteKey), 7);
  EXPECT_EQ(*CommandForOp(Dialect::kTorch21, Op::kAppend), 8);
  EXPECT_EQ(*CommandForOp(Dialect::kTorch21, Op::kCancelWait), 11);
  EXPECT_FALSE(CommandForOp(Dialect::kTorch21, Op::kWatchKey).ok());
  // 2.2 onwards: VALIDATE first, everything shifted by one, then PING and queues.
  EXPECT_EQ(*CommandForOp(Dialect::kValidated, Op::kValidate), 0);
  EXPECT_EQ(*CommandForOp(Dialect::kValidated, Op::kSet), 1);
  EXPECT_EQ(*CommandForOp(Dialect::kValidated, Op::kCancelWait), 12);
  EXPECT_EQ(*CommandForOp(Dialect::kValidated, Op::kPing), 13);
  EXPECT_EQ(*CommandForOp(Dialect::kValidated, Op::kQueuePush), 14);
  EXPECT_EQ(*CommandForOp(Dialect::kValidated, Op::kQueueLen), 16);
}

TEST(C10dProtocol, ParsesTheExactBytesOfATorch113Set) {
  // sendCommandForKey(SET, key) then sendBytes(value): u8 0, u64 len, key, u64 len, value.
  const std::string wire = std::string(1, '\0') + Str("/worker/attempt_0/x") + Str("hello");
  Request r;
  auto taken = ParseRequest(Dialect::kTorch1, wire, ParseLimits{}, &r);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(*taken, wire.size());
  EXPECT_EQ(r.op, Op::kSet);
  EXPECT_EQ(r.keys, std::vector<std::string>{"/worker/attempt_0/x"});
  EXPECT_EQ(r.values, std::vector<std::string>{"hello"});
}

TEST(C10dProtocol, EveryOpOfEveryDialectRoundTrips) {
  for (Dialect dialect : {Dialect::kTorch1, Dialect::kTorch21, Dialect::kValidated}) {
    for (Op op : AllOps()) {
      if (!CommandForOp(dialect, op).ok()) continue;
      SCOPED_TRACE(std::string(DialectName(dialect)) + " " + OpName(op));
      const Request in = Make(op);
      auto wire = EncodeRequest(dialect, in);
      ASSERT_TRUE(wire.ok()) << wire.status();
      Request out;
      auto taken = ParseRequest(dialect, *wire, ParseLimits{}, &out);
      ASSERT_TRUE(taken.ok()) << taken.status();
      EXPECT_EQ(*taken, wire->size());
      EXPECT_EQ(out.op, op);
      EXPECT_EQ(out.keys, in.keys);
      EXPECT_EQ(out.values, in.values);
      EXPECT_EQ(out.delta, in.delta);
      EXPECT_EQ(out.word, in.word);
      // Every strict prefix is an incomplete request, never an error.
      for (size_t cut = 0; cut < wire->size(); ++cut) {
        auto partial =
            ParseRequest(dialect, std::string_view(*wire).substr(0, cut), ParseLimits{}, &out);
        ASSERT_TRUE(partial.ok()) << cut << ": " << partial.status();
        EXPECT_EQ(*partial, 0u) << cut;
      }
    }
  }
}

TEST(C10dProtocol, TakesOneRequestAtATimeFromABufferHoldingSeveral) {
  Request set = Make(Op::kSet), add = Make(Op::kAdd);
  const std::string wire = *EncodeRequest(Dialect::kTorch1, set) +
                           *EncodeRequest(Dialect::kTorch1, add) + std::string(1, '\x06');
  Request r;
  auto first = ParseRequest(Dialect::kTorch1, wire, ParseLimits{}, &r);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(r.op, Op::kSet);
  auto second =
      ParseRequest(Dialect::kTorch1, std::string_view(wire).substr(*first), ParseLimits{}, &r);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(r.op, Op::kAdd);
  EXPECT_EQ(r.delta, -7);
  auto third = ParseRequest(Dialect::kTorch1, std::string_view(wire).substr(*first + *second),
                            ParseLimits{}, &r);
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(*third, 1u);
  EXPECT_EQ(r.op, Op::kGetNumKeys);
}

TEST(C10dProtocol, UnknownCommandBytesAreErrors) {
  Request r;
  EXPECT_EQ(ParseRequest(Dialect::kTorch1, "\x09", ParseLimits{}, &r).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRequest(Dialect::kTorch21, "\x0c", ParseLimits{}, &r).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRequest(Dialect::kValidated, "\x11", ParseLimits{}, &r).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRequest(Dialect::kValidated, "\xff", ParseLimits{}, &r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(C10dProtocol, OversizedFieldsAreRefusedFromTheirLengthAlone) {
  ParseLimits limits;
  limits.max_key_bytes = 16;
  limits.max_value_bytes = 32;
  limits.max_keys_per_request = 4;
  Request r;
  // Only the 9 header bytes have arrived: the claimed length is enough.
  auto key = ParseRequest(Dialect::kTorch1, std::string(1, '\x02') + U64(17), limits, &r);
  EXPECT_EQ(key.status().code(), absl::StatusCode::kResourceExhausted);
  auto value =
      ParseRequest(Dialect::kTorch1, std::string(1, '\0') + Str("k") + U64(1ull << 40), limits, &r);
  EXPECT_EQ(value.status().code(), absl::StatusCode::kResourceExhausted);
  auto count = ParseRequest(Dialect::kTorch1, std::string(1, '\x05') + U64(5), limits, &r);
  EXPECT_EQ(count.status().code(), absl::StatusCode::kResourceExhausted);
  // At the limit is fine.
  auto ok = ParseRequest(Dialect::kTorch1, std::string(1, '\x02') + Str(std::string(16, 'k')),
                         limits, &r);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, 1u + 8 + 16);
}

TEST(C10dProtocol, DetectsTheDialectFromTheFirstBytes) {
  uint32_t magic = kValidationMagic;
  const std::string validate =
      std::string(1, '\0') + std::string(reinterpret_cast<char*>(&magic), 4);
  EXPECT_EQ(DetectDialect("", Dialect::kTorch1), std::nullopt);
  EXPECT_EQ(DetectDialect(validate.substr(0, 4), Dialect::kTorch1), std::nullopt);
  EXPECT_EQ(DetectDialect(validate, Dialect::kTorch1), Dialect::kValidated);
  EXPECT_EQ(DetectDialect(validate, Dialect::kTorch21), Dialect::kValidated);
  // A 1.13 SET: 0, then a key length.
  EXPECT_EQ(DetectDialect(std::string(1, '\0') + U64(5), Dialect::kTorch1), Dialect::kTorch1);
  EXPECT_EQ(DetectDialect("\x03", Dialect::kTorch21), Dialect::kTorch21);
}

}  // namespace
}  // namespace aidn::worker::c10d
