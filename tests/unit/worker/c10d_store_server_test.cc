// The c10d store server at the byte level: a raw socket client (WireClient)
// sends exactly what PyTorch's clients send, in each dialect, and some
// things they never would.

#include "worker/c10d/store_server.h"

#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/wait.h"
#include "worker/c10d/wire_client.h"

namespace aidn::worker::c10d {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kTimeout{5000};
// How long a reply that must not come is waited for.
constexpr milliseconds kQuiet{150};

Request Req(Op op, std::vector<std::string> keys = {}, std::vector<std::string> values = {}) {
  Request r;
  r.op = op;
  r.keys = std::move(keys);
  r.values = std::move(values);
  return r;
}

Request AddReq(const std::string& key, int64_t delta) {
  Request r = Req(Op::kAdd, {key});
  r.delta = delta;
  return r;
}

std::string Le64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }

class C10dStoreServerTest : public ::testing::Test {
 protected:
  void StartServer(StoreServerOptions options = {}) {
    auto server = StoreServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_GT(server_->port(), 0);
  }
  void SetUp() override { StartServer(); }

  // A connected client; in kValidated, after the handshake.
  std::unique_ptr<WireClient> Connect(Dialect dialect = Dialect::kTorch1) {
    auto client = WireClient::Connect("127.0.0.1", server_->port(), kTimeout);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    if (dialect == Dialect::kValidated) {
      Request validate = Req(Op::kValidate);
      validate.word = kValidationMagic;
      EXPECT_TRUE((*client)->Send(dialect, validate).ok());
    }
    return std::move(*client);
  }

  std::string Get(WireClient& c, Dialect d, const std::string& key) {
    EXPECT_TRUE(c.Send(d, Req(Op::kGet, {key})).ok());
    auto value = c.ReadBytes(kTimeout);
    EXPECT_TRUE(value.ok()) << value.status();
    return value.ok() ? *value : "<error>";
  }

  ::testing::AssertionResult DroppedCount(size_t n) {
    return testing::WaitFor([&] { return server_->num_dropped() == n; }, kTimeout,
                            "num_dropped == " + std::to_string(n));
  }

  std::unique_ptr<StoreServer> server_;
};

TEST_F(C10dStoreServerTest, AcceptsOnlyThePeersItIsToldOf) {
  StoreServerOptions options;
  options.refuse_until_peers_set = true;
  StartServer(options);
  const Dialect d = Dialect::kTorch1;
  // Before the rendezvous names the peers, nobody.
  auto early = Connect(d);
  ASSERT_NE(early, nullptr);
  ASSERT_TRUE(DroppedCount(1));
  // A local process of a user the ranks run as, yes.
  server_->AllowPeers({.addresses = {}, .local_users = {geteuid()}});
  auto rank = Connect(d);
  ASSERT_NE(rank, nullptr);
  ASSERT_TRUE(rank->Send(d, Req(Op::kSet, {"k"}, {"v"})).ok());
  EXPECT_EQ(Get(*rank, d, "k"), "v");
  // An IPv6 socket reaching it through a v4-mapped address (PyTorch's
  // client does): its owner is listed in tcp6.
  auto mapped = WireClient::Connect("::ffff:127.0.0.1", server_->port(), kTimeout);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_EQ(Get(**mapped, d, "k"), "v");
  // A local process of another user, no: its socket's owner is looked up.
  server_->AllowPeers({.addresses = {"10.0.0.7"}, .local_users = {geteuid() + 4242}});
  auto other = Connect(d);
  ASSERT_NE(other, nullptr);
  ASSERT_TRUE(DroppedCount(2));
  EXPECT_FALSE(other->ReadU8(std::chrono::milliseconds(500)).ok());
  // Those already connected stay.
  EXPECT_EQ(Get(*rank, d, "k"), "v");
}

TEST_F(C10dStoreServerTest, ServesEveryTorch1Command) {
  constexpr Dialect d = Dialect::kTorch1;
  auto c = Connect(d);
  ASSERT_TRUE(c->Send(d, Req(Op::kSet, {"a"}, {"alpha"})).ok());
  EXPECT_EQ(Get(*c, d, "a"), "alpha");

  ASSERT_TRUE(c->Send(d, AddReq("n", 5)).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 5);
  ASSERT_TRUE(c->Send(d, AddReq("n", -2)).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 3);
  EXPECT_EQ(Get(*c, d, "n"), "3");

  // COMPARE_SET: missing key + empty expected sets it; missing key + other
  // expected answers the expected value and sets nothing; present key swaps
  // only on a match and answers the value now stored.
  ASSERT_TRUE(c->Send(d, Req(Op::kCompareSet, {"cs"}, {"", "first"})).ok());
  EXPECT_EQ(*c->ReadBytes(kTimeout), "first");
  ASSERT_TRUE(c->Send(d, Req(Op::kCompareSet, {"missing"}, {"x", "y"})).ok());
  EXPECT_EQ(*c->ReadBytes(kTimeout), "x");
  ASSERT_TRUE(c->Send(d, Req(Op::kCompareSet, {"cs"}, {"wrong", "second"})).ok());
  EXPECT_EQ(*c->ReadBytes(kTimeout), "first");
  ASSERT_TRUE(c->Send(d, Req(Op::kCompareSet, {"cs"}, {"first", "second"})).ok());
  EXPECT_EQ(*c->ReadBytes(kTimeout), "second");

  ASSERT_TRUE(c->Send(d, Req(Op::kCheck, {"a", "n", "cs"})).ok());
  EXPECT_EQ(*c->ReadU8(kTimeout), kCheckReady);
  ASSERT_TRUE(c->Send(d, Req(Op::kCheck, {"a", "missing"})).ok());
  EXPECT_EQ(*c->ReadU8(kTimeout), kCheckNotReady);

  ASSERT_TRUE(c->Send(d, Req(Op::kGetNumKeys)).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 3);
  EXPECT_EQ(server_->num_keys(), 3u);

  ASSERT_TRUE(c->Send(d, Req(Op::kDeleteKey, {"a"})).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 1);
  ASSERT_TRUE(c->Send(d, Req(Op::kDeleteKey, {"a"})).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 0);

  // WAIT on keys that exist answers at once; GET of a missing key is empty.
  ASSERT_TRUE(c->Send(d, Req(Op::kWait, {"n", "cs"})).ok());
  EXPECT_EQ(*c->ReadU8(kTimeout), kStopWaiting);
  EXPECT_EQ(Get(*c, d, "a"), "");
  EXPECT_EQ(server_->num_dropped(), 0u);
}

TEST_F(C10dStoreServerTest, WaitersAreReleasedByEveryKindOfWrite) {
  constexpr Dialect d = Dialect::kValidated;
  auto setter = Connect(d);
  const std::vector<Request> writes = {
      Req(Op::kSet, {"k0"}, {"v"}),
      AddReq("k1", 1),
      Req(Op::kCompareSet, {"k2"}, {"", "v"}),
      Req(Op::kAppend, {"k3"}, {"v"}),
      Req(Op::kMultiSet, {"other", "k4"}, {"v", "v"}),
  };
  for (size_t i = 0; i < writes.size(); ++i) {
    SCOPED_TRACE(OpName(writes[i].op));
    auto waiter = Connect(d);
    ASSERT_TRUE(waiter->Send(d, Req(Op::kWait, {"k" + std::to_string(i)})).ok());
    EXPECT_TRUE(waiter->Silent(kQuiet));
    ASSERT_TRUE(setter->Send(d, writes[i]).ok());
    EXPECT_EQ(*waiter->ReadU8(kTimeout), kStopWaiting);
    if (writes[i].op == Op::kAdd) {
      EXPECT_EQ(*setter->ReadI64(kTimeout), 1);
    }
    if (writes[i].op == Op::kCompareSet) {
      EXPECT_EQ(*setter->ReadBytes(kTimeout), "v");
    }
  }
}

TEST_F(C10dStoreServerTest, AWaitOnSeveralKeysEndsWhenTheLastAppears) {
  constexpr Dialect d = Dialect::kTorch1;
  auto waiter = Connect(d), setter = Connect(d);
  ASSERT_TRUE(setter->Send(d, Req(Op::kSet, {"b"}, {"1"})).ok());
  ASSERT_TRUE(waiter->Send(d, Req(Op::kWait, {"a", "b", "c"})).ok());
  ASSERT_TRUE(setter->Send(d, Req(Op::kSet, {"a"}, {"1"})).ok());
  EXPECT_TRUE(waiter->Silent(kQuiet));
  ASSERT_TRUE(setter->Send(d, Req(Op::kSet, {"c"}, {"1"})).ok());
  EXPECT_EQ(*waiter->ReadU8(kTimeout), kStopWaiting);
}

TEST_F(C10dStoreServerTest, BlockedWaitersDoNotStallOtherClients) {
  constexpr Dialect d = Dialect::kTorch1;
  std::vector<std::unique_ptr<WireClient>> waiters;
  for (int i = 0; i < 20; ++i) {
    waiters.push_back(Connect(d));
    ASSERT_TRUE(waiters.back()->Send(d, Req(Op::kWait, {"go"})).ok());
  }
  auto busy = Connect(d);
  for (int i = 1; i <= 200; ++i) {
    ASSERT_TRUE(busy->Send(d, AddReq("counter", 1)).ok());
    ASSERT_EQ(*busy->ReadI64(kTimeout), i);
  }
  ASSERT_TRUE(busy->Send(d, Req(Op::kSet, {"go"}, {""})).ok());
  for (auto& waiter : waiters) EXPECT_EQ(*waiter->ReadU8(kTimeout), kStopWaiting);
}

TEST_F(C10dStoreServerTest, ServesEveryValidatedCommand) {
  constexpr Dialect d = Dialect::kValidated;
  auto c = Connect(d);
  Request ping = Req(Op::kPing);
  ping.word = 0xdeadbeef;
  ASSERT_TRUE(c->Send(d, ping).ok());
  EXPECT_EQ(*c->ReadU32(kTimeout), 0xdeadbeefu);

  ASSERT_TRUE(c->Send(d, Req(Op::kMultiSet, {"x", "y"}, {"1", "2"})).ok());
  ASSERT_TRUE(c->Send(d, Req(Op::kAppend, {"x"}, {"1"})).ok());
  ASSERT_TRUE(c->Send(d, Req(Op::kMultiGet, {"y", "x", "nope"})).ok());
  EXPECT_EQ(*c->ReadBytes(kTimeout), "2");
  EXPECT_EQ(*c->ReadBytes(kTimeout), "11");
  EXPECT_EQ(*c->ReadBytes(kTimeout), "");
  ASSERT_TRUE(c->Send(d, AddReq("x", 1)).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 12);
  ASSERT_TRUE(c->Send(d, Req(Op::kCheck, {"x", "y"})).ok());
  EXPECT_EQ(*c->ReadU8(kTimeout), kCheckReady);
  ASSERT_TRUE(c->Send(d, Req(Op::kGetNumKeys)).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 2);
  ASSERT_TRUE(c->Send(d, Req(Op::kDeleteKey, {"y"})).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 1);
  EXPECT_EQ(Get(*c, d, "x"), "12");

  // CANCEL_WAIT: the client times out its WAIT; the server answers
  // WAIT_CANCELED and forgets the wait.
  ASSERT_TRUE(c->Send(d, Req(Op::kWait, {"later"})).ok());
  EXPECT_TRUE(c->Silent(kQuiet));
  ASSERT_TRUE(c->Send(d, Req(Op::kCancelWait)).ok());
  EXPECT_EQ(*c->ReadU8(kTimeout), kWaitCanceled);
  auto other = Connect(d);
  ASSERT_TRUE(other->Send(d, Req(Op::kSet, {"later"}, {"v"})).ok());
  EXPECT_TRUE(c->Silent(kQuiet));

  // Queues: a WAIT on a queue's name is released by a push; POP answers
  // the length then the item; LEN the length.
  ASSERT_TRUE(c->Send(d, Req(Op::kWait, {"q"})).ok());
  ASSERT_TRUE(other->Send(d, Req(Op::kQueuePush, {"q"}, {"one"})).ok());
  EXPECT_EQ(*c->ReadU8(kTimeout), kStopWaiting);
  ASSERT_TRUE(other->Send(d, Req(Op::kQueuePush, {"q"}, {"two"})).ok());
  // A round trip on `other`: its push has been applied.
  ASSERT_TRUE(other->Send(d, Req(Op::kQueueLen, {"q"})).ok());
  EXPECT_EQ(*other->ReadI64(kTimeout), 2);
  ASSERT_TRUE(c->Send(d, Req(Op::kQueueLen, {"q"})).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 2);
  ASSERT_TRUE(c->Send(d, Req(Op::kQueuePop, {"q"})).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 2);
  EXPECT_EQ(*c->ReadBytes(kTimeout), "one");
  ASSERT_TRUE(c->Send(d, Req(Op::kQueuePop, {"q"})).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 1);
  EXPECT_EQ(*c->ReadBytes(kTimeout), "two");
  ASSERT_TRUE(c->Send(d, Req(Op::kQueuePop, {"q"})).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 0);
  EXPECT_EQ(server_->num_dropped(), 0u);
}

TEST_F(C10dStoreServerTest, ServesBothDialectsAtOnce) {
  auto old_client = Connect(Dialect::kTorch1);
  auto new_client = Connect(Dialect::kValidated);
  ASSERT_TRUE(old_client->Send(Dialect::kTorch1, Req(Op::kSet, {"k"}, {"from 1.13"})).ok());
  ASSERT_TRUE(old_client->Send(Dialect::kTorch1, Req(Op::kGetNumKeys)).ok());
  EXPECT_EQ(*old_client->ReadI64(kTimeout), 1);  // the SET has been applied
  EXPECT_EQ(Get(*new_client, Dialect::kValidated, "k"), "from 1.13");
  ASSERT_TRUE(new_client->Send(Dialect::kValidated, Req(Op::kDeleteKey, {"k"})).ok());
  EXPECT_EQ(*new_client->ReadI64(kTimeout), 1);
  ASSERT_TRUE(old_client->Send(Dialect::kTorch1, Req(Op::kCheck, {"k"})).ok());
  EXPECT_EQ(*old_client->ReadU8(kTimeout), kCheckNotReady);
}

TEST_F(C10dStoreServerTest, ServesTorch21ClientsWhenToldTo) {
  StoreServerOptions options;
  options.unvalidated_dialect = Dialect::kTorch21;
  StartServer(options);
  constexpr Dialect d = Dialect::kTorch21;
  auto c = Connect(d);
  ASSERT_TRUE(c->Send(d, Req(Op::kSet, {"k"}, {"a"})).ok());
  ASSERT_TRUE(c->Send(d, Req(Op::kAppend, {"k"}, {"b"})).ok());  // byte 8
  ASSERT_TRUE(c->Send(d, Req(Op::kMultiGet, {"k"})).ok());       // byte 9
  EXPECT_EQ(*c->ReadBytes(kTimeout), "ab");
  ASSERT_TRUE(c->Send(d, Req(Op::kDeleteKey, {"k"})).ok());  // byte 7
  EXPECT_EQ(*c->ReadI64(kTimeout), 1);
}

TEST_F(C10dStoreServerTest, WatchersOfAKeySeeItsChanges) {
  constexpr Dialect d = Dialect::kTorch1;
  auto watcher = Connect(d), writer = Connect(d);
  ASSERT_TRUE(watcher->Send(d, Req(Op::kWatchKey, {"w"})).ok());
  EXPECT_EQ(*watcher->ReadU8(kTimeout), kWatchRegistered);
  auto expect_update = [&](uint8_t type, const std::string& old_value,
                           const std::string& new_value) {
    EXPECT_EQ(*watcher->ReadU8(kTimeout), type);
    EXPECT_EQ(*watcher->ReadBytes(kTimeout), "w");
    EXPECT_EQ(*watcher->ReadBytes(kTimeout), old_value);
    EXPECT_EQ(*watcher->ReadBytes(kTimeout), new_value);
  };
  ASSERT_TRUE(writer->Send(d, Req(Op::kSet, {"w"}, {"1"})).ok());
  expect_update(kWatchKeyCreated, "", "1");
  ASSERT_TRUE(writer->Send(d, AddReq("w", 2)).ok());
  EXPECT_EQ(*writer->ReadI64(kTimeout), 3);
  expect_update(kWatchKeyUpdated, "1", "3");
  ASSERT_TRUE(writer->Send(d, Req(Op::kDeleteKey, {"w"})).ok());
  EXPECT_EQ(*writer->ReadI64(kTimeout), 1);
  expect_update(kWatchKeyDeleted, "3", "");
}

TEST_F(C10dStoreServerTest, AcceptsRequestsSplitIntoSingleBytes) {
  constexpr Dialect d = Dialect::kValidated;
  auto c = WireClient::Connect("127.0.0.1", server_->port(), kTimeout);
  ASSERT_TRUE(c.ok());
  Request validate = Req(Op::kValidate);
  validate.word = kValidationMagic;
  const std::string wire = *EncodeRequest(d, validate) +
                           *EncodeRequest(d, Req(Op::kSet, {"split"}, {"value"})) +
                           *EncodeRequest(d, Req(Op::kGet, {"split"}));
  for (char byte : wire) {
    ASSERT_TRUE((*c)->SendRaw(std::string(1, byte)).ok());
  }
  EXPECT_EQ(*(*c)->ReadBytes(kTimeout), "value");
}

TEST_F(C10dStoreServerTest, AnswersSeveralRequestsSentInOneWriteInOrder) {
  constexpr Dialect d = Dialect::kTorch1;
  auto c = Connect(d);
  std::string wire;
  wire += *EncodeRequest(d, Req(Op::kSet, {"a"}, {"1"}));
  wire += *EncodeRequest(d, AddReq("a", 41));
  wire += *EncodeRequest(d, Req(Op::kGet, {"a"}));
  wire += *EncodeRequest(d, Req(Op::kWait, {"a"}));
  wire += *EncodeRequest(d, Req(Op::kGetNumKeys));
  ASSERT_TRUE(c->SendRaw(wire).ok());
  EXPECT_EQ(*c->ReadI64(kTimeout), 42);
  EXPECT_EQ(*c->ReadBytes(kTimeout), "42");
  EXPECT_EQ(*c->ReadU8(kTimeout), kStopWaiting);
  EXPECT_EQ(*c->ReadI64(kTimeout), 1);
}

TEST_F(C10dStoreServerTest, DropsOnlyTheClientThatSendsBadInput) {
  constexpr Dialect d = Dialect::kTorch1;
  auto good = Connect(d);
  ASSERT_TRUE(good->Send(d, Req(Op::kWait, {"later"})).ok());
  size_t dropped = 0;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"unknown command byte", std::string(1, '\x2a')},
      {"oversized key length", std::string(1, '\x02') + Le64(1ull << 40)},
      {"oversized key count", std::string(1, '\x05') + Le64(1ull << 40)},
      {"VALIDATE with a wrong magic", std::string(1, '\0') + "abcd" + std::string(4, '\0')},
      {"ADD to a value that is no integer",
       *EncodeRequest(d, Req(Op::kSet, {"text"}, {"abc"})) + *EncodeRequest(d, AddReq("text", 1))},
  };
  for (const auto& [what, bytes] : bad) {
    SCOPED_TRACE(what);
    auto client = Connect(d);
    ASSERT_TRUE(client->SendRaw(bytes).ok());
    EXPECT_TRUE(client->WaitClosed(kTimeout));
    EXPECT_TRUE(DroppedCount(++dropped));
  }
  // A client that vanishes in the middle of a request.
  {
    auto client = Connect(d);
    const std::string set = *EncodeRequest(d, Req(Op::kSet, {"half"}, {"value"}));
    ASSERT_TRUE(client->SendRaw(set.substr(0, set.size() - 2)).ok());
  }
  EXPECT_TRUE(DroppedCount(++dropped));
  EXPECT_TRUE(testing::WaitFor([&] { return server_->num_clients() == 1; }, kTimeout,
                               "only the good client is left"));
  // The good client still waits, and is served.
  EXPECT_TRUE(good->Silent(kQuiet));
  auto setter = Connect(d);
  ASSERT_TRUE(setter->Send(d, Req(Op::kSet, {"later"}, {"v"})).ok());
  EXPECT_EQ(*good->ReadU8(kTimeout), kStopWaiting);
  EXPECT_EQ(Get(*good, d, "half"), "");
}

TEST_F(C10dStoreServerTest, KeepsToItsLimits) {
  StoreServerOptions options;
  options.max_clients = 3;
  options.max_total_bytes = 1000;
  options.max_value_bytes = 600;
  StartServer(options);
  constexpr Dialect d = Dialect::kTorch1;
  auto a = Connect(d), b = Connect(d);
  ASSERT_TRUE(a->Send(d, Req(Op::kSet, {"big"}, {std::string(600, 'x')})).ok());
  EXPECT_EQ(Get(*a, d, "big").size(), 600u);
  // Over the store's byte budget: dropped, nothing stored.
  ASSERT_TRUE(b->Send(d, Req(Op::kSet, {"more"}, {std::string(500, 'y')})).ok());
  EXPECT_TRUE(b->WaitClosed(kTimeout));
  ASSERT_TRUE(a->Send(d, Req(Op::kGetNumKeys)).ok());
  EXPECT_EQ(*a->ReadI64(kTimeout), 1);
  // Over the value limit: dropped from the header.
  auto c = Connect(d);
  ASSERT_TRUE(c->SendRaw(std::string(1, '\0') + Le64(1) + "k" + Le64(601)).ok());
  EXPECT_TRUE(c->WaitClosed(kTimeout));
  // Over max_clients: the fourth connection is closed at once.
  auto b2 = Connect(d), c2 = Connect(d);
  ASSERT_TRUE(b2->Send(d, Req(Op::kGetNumKeys)).ok());
  EXPECT_EQ(*b2->ReadI64(kTimeout), 1);
  auto d2 = Connect(d);
  EXPECT_TRUE(d2->WaitClosed(kTimeout));
  ASSERT_TRUE(a->Send(d, Req(Op::kGetNumKeys)).ok());
  EXPECT_EQ(*a->ReadI64(kTimeout), 1);
}

TEST_F(C10dStoreServerTest, ForgetsWaitersThatDisconnect) {
  constexpr Dialect d = Dialect::kTorch1;
  {
    auto waiter = Connect(d);
    ASSERT_TRUE(waiter->Send(d, Req(Op::kWait, {"k"})).ok());
    ASSERT_TRUE(
        testing::WaitFor([&] { return server_->num_clients() == 1; }, kTimeout, "1 client"));
  }
  ASSERT_TRUE(testing::WaitFor([&] { return server_->num_clients() == 0; }, kTimeout, "0 clients"));
  auto setter = Connect(d);
  ASSERT_TRUE(setter->Send(d, Req(Op::kSet, {"k"}, {"v"})).ok());
  EXPECT_EQ(Get(*setter, d, "k"), "v");
  EXPECT_EQ(server_->num_dropped(), 0u);
}

TEST_F(C10dStoreServerTest, StopClosesEveryClientAndIsIdempotent) {
  auto a = Connect(), b = Connect();
  ASSERT_TRUE(b->Send(Dialect::kTorch1, Req(Op::kWait, {"never"})).ok());
  ASSERT_TRUE(testing::WaitFor([&] { return server_->num_clients() == 2; }, kTimeout, "2 clients"));
  server_->Stop();
  EXPECT_TRUE(a->WaitClosed(kTimeout));
  EXPECT_TRUE(b->WaitClosed(kTimeout));
  server_->Stop();
  EXPECT_FALSE(WireClient::Connect("127.0.0.1", server_->port(), kTimeout).ok());
}

TEST(C10dStoreServerStart, RefusesBadOptionsAndBusyPorts) {
  StoreServerOptions options;
  options.bind_address = "not-an-address";
  EXPECT_EQ(StoreServer::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.bind_address = "127.0.0.1";
  options.port = 70000;
  EXPECT_EQ(StoreServer::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.port = 0;
  auto first = StoreServer::Start(options);
  ASSERT_TRUE(first.ok());
  options.port = (*first)->port();
  EXPECT_FALSE(StoreServer::Start(options).ok());
  options.bind_address = "::1";
  options.port = 0;
  auto v6 = StoreServer::Start(options);
  if (v6.ok()) {
    auto client = WireClient::Connect("::1", (*v6)->port(), kTimeout);
    ASSERT_TRUE(client.ok()) << client.status();
  }
}

}  // namespace
}  // namespace aidn::worker::c10d
