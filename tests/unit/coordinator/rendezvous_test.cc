#include "coordinator/rendezvous.h"

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

namespace aidn::coordinator {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Answer = absl::StatusOr<v1::JoinRendezvousResponse>;

v1::Peer MakePeer(int rank, const std::string& address = "") {
  v1::Peer p;
  p.set_rank(rank);
  p.set_worker_id("w" + std::to_string(rank));
  p.set_address(address.empty() ? "10.0.0." + std::to_string(rank) + ":29500" : address);
  return p;
}

// Answers per call, in the order they came.
struct Answers {
  std::vector<Answer> got;
  Rendezvous::Callback Callback() {
    return [this](Answer a) { got.push_back(std::move(a)); };
  }
};

// What the coordinator does when the last rank arrives.
v1::JoinRendezvousResponse Base(const Rendezvous& rv, int world_size, int64_t generation) {
  v1::JoinRendezvousResponse base;
  base.set_world_size(world_size);
  base.set_generation(generation);
  for (const v1::Peer& p : rv.Peers()) *base.add_peers() = p;
  return base;
}

class RendezvousTest : public ::testing::Test {
 protected:
  FakeClock clock_;
  Rendezvous rv_{3, clock_.Now() + std::chrono::seconds(5)};
};

TEST_F(RendezvousTest, IsNotCompleteUntilEveryRankJoined) {
  Answers a0, a2;
  Deferred d;
  rv_.Join(MakePeer(0), a0.Callback(), &d);
  rv_.Join(MakePeer(2), a2.Callback(), &d);
  d.Run();
  EXPECT_FALSE(rv_.AllJoined());
  EXPECT_FALSE(rv_.completed());
  EXPECT_TRUE(a0.got.empty());
  EXPECT_TRUE(a2.got.empty());
  EXPECT_THAT(rv_.MissingRanks(), ElementsAre(1));

  Answers a1;
  rv_.Join(MakePeer(1), a1.Callback(), &d);
  d.Run();
  EXPECT_TRUE(rv_.AllJoined());
  EXPECT_THAT(rv_.MissingRanks(), ElementsAre());
  // Joining alone answers no one: Complete does.
  EXPECT_FALSE(rv_.completed());
  EXPECT_TRUE(a1.got.empty());
}

TEST_F(RendezvousTest, MissingRanksAreAscending) {
  EXPECT_THAT(rv_.MissingRanks(), ElementsAre(0, 1, 2));
  Answers a;
  Deferred d;
  rv_.Join(MakePeer(1), a.Callback(), &d);
  EXPECT_THAT(rv_.MissingRanks(), ElementsAre(0, 2));
}

TEST_F(RendezvousTest, PeersComeInRankOrderWhateverTheJoinOrder) {
  Answers a;
  Deferred d;
  rv_.Join(MakePeer(2), a.Callback(), &d);
  rv_.Join(MakePeer(0), a.Callback(), &d);
  rv_.Join(MakePeer(1), a.Callback(), &d);
  std::vector<v1::Peer> peers = rv_.Peers();
  ASSERT_EQ(peers.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(peers[r].rank(), r);
    EXPECT_EQ(peers[r].worker_id(), "w" + std::to_string(r));
  }
}

TEST_F(RendezvousTest, CompleteAnswersEveryWaiterWithItsOwnRankAndTheSamePeers) {
  std::map<int, Answers> answers;
  Deferred d;
  for (int r : {1, 0, 2}) rv_.Join(MakePeer(r), answers[r].Callback(), &d);
  ASSERT_TRUE(rv_.AllJoined());
  rv_.Complete(Base(rv_, 3, 7), &d);
  EXPECT_TRUE(rv_.completed());
  for (auto& [r, a] : answers) EXPECT_TRUE(a.got.empty()) << "callback ran inside Complete";
  d.Run();

  for (auto& [r, a] : answers) {
    ASSERT_EQ(a.got.size(), 1u) << "rank " << r;
    ASSERT_TRUE(a.got[0].ok()) << a.got[0].status();
    const v1::JoinRendezvousResponse& resp = *a.got[0];
    EXPECT_EQ(resp.rank(), r);
    EXPECT_EQ(resp.world_size(), 3);
    EXPECT_EQ(resp.generation(), 7);
    ASSERT_EQ(resp.peers_size(), 3);
    for (int p = 0; p < 3; ++p) {
      EXPECT_EQ(resp.peers(p).rank(), p);
      EXPECT_EQ(resp.peers(p).address(), MakePeer(p).address());
    }
    // Identical apart from the rank.
    v1::JoinRendezvousResponse other = *answers[0].got[0];
    other.set_rank(r);
    EXPECT_TRUE(MessageDifferencer::Equals(resp, other)) << "rank " << r;
  }
}

TEST_F(RendezvousTest, JoinAfterCompletionIsAnsweredAtOnceWithTheSameAnswer) {
  Answers first[3];
  Deferred d;
  for (int r = 0; r < 3; ++r) rv_.Join(MakePeer(r), first[r].Callback(), &d);
  rv_.Complete(Base(rv_, 3, 1), &d);
  d.Run();

  Answers again;
  rv_.Join(MakePeer(1), again.Callback(), &d);
  EXPECT_TRUE(again.got.empty()) << "callback ran inside Join";
  d.Run();
  ASSERT_EQ(again.got.size(), 1u);
  ASSERT_TRUE(again.got[0].ok()) << again.got[0].status();
  EXPECT_EQ(again.got[0]->rank(), 1);
  EXPECT_TRUE(MessageDifferencer::Equals(*again.got[0], *first[1].got[0]));
}

TEST_F(RendezvousTest, DuplicateJoinBeforeCompletionSupersedesTheEarlierOne) {
  Answers old_call, new_call, other;
  Deferred d;
  rv_.Join(MakePeer(0, "10.0.0.9:1111"), old_call.Callback(), &d);
  rv_.Join(MakePeer(0, "10.0.0.9:2222"), new_call.Callback(), &d);
  EXPECT_TRUE(old_call.got.empty()) << "callback ran inside Join";
  d.Run();
  ASSERT_EQ(old_call.got.size(), 1u);
  EXPECT_EQ(old_call.got[0].status().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(new_call.got.empty());
  EXPECT_THAT(rv_.MissingRanks(), ElementsAre(1, 2));

  rv_.Join(MakePeer(1), other.Callback(), &d);
  rv_.Join(MakePeer(2), other.Callback(), &d);
  rv_.Complete(Base(rv_, 3, 1), &d);
  d.Run();
  EXPECT_EQ(old_call.got.size(), 1u) << "the superseded call was answered twice";
  ASSERT_EQ(new_call.got.size(), 1u);
  ASSERT_TRUE(new_call.got[0].ok()) << new_call.got[0].status();
  // The newer join's address is the one peers see.
  EXPECT_EQ(new_call.got[0]->peers(0).address(), "10.0.0.9:2222");
}

TEST_F(RendezvousTest, OutOfRangeRankIsInvalidAndDoesNotCount) {
  Answers low, high;
  Deferred d;
  rv_.Join(MakePeer(-1), low.Callback(), &d);
  rv_.Join(MakePeer(3), high.Callback(), &d);
  EXPECT_TRUE(low.got.empty()) << "callback ran inside Join";
  d.Run();
  ASSERT_EQ(low.got.size(), 1u);
  ASSERT_EQ(high.got.size(), 1u);
  EXPECT_EQ(low.got[0].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(high.got[0].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(high.got[0].status().message(), HasSubstr("3"));
  EXPECT_THAT(rv_.MissingRanks(), ElementsAre(0, 1, 2));
  EXPECT_TRUE(rv_.Peers().empty());
}

TEST_F(RendezvousTest, FailAnswersWaitersAndEveryLaterJoin) {
  Answers a0, a1;
  Deferred d;
  rv_.Join(MakePeer(0), a0.Callback(), &d);
  rv_.Join(MakePeer(1), a1.Callback(), &d);
  rv_.Fail(absl::DeadlineExceededError("rendezvous timed out: missing ranks 2"), &d);
  EXPECT_TRUE(a0.got.empty()) << "callback ran inside Fail";
  d.Run();
  for (Answers* a : {&a0, &a1}) {
    ASSERT_EQ(a->got.size(), 1u);
    EXPECT_EQ(a->got[0].status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(a->got[0].status().message(), HasSubstr("missing ranks 2"));
  }

  Answers late;
  rv_.Join(MakePeer(2), late.Callback(), &d);
  EXPECT_TRUE(late.got.empty());
  d.Run();
  ASSERT_EQ(late.got.size(), 1u);
  EXPECT_EQ(late.got[0].status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(rv_.completed());
}

TEST_F(RendezvousTest, KeepsItsDeadline) {
  Rendezvous rv(2, clock_.Now() + std::chrono::seconds(30));
  EXPECT_EQ(rv.deadline(), clock_.Now() + std::chrono::seconds(30));
}

TEST(Rendezvous, WorldSizeOneCompletesWithOneJoin) {
  FakeClock clock;
  Rendezvous rv(1, clock.Now());
  Answers a;
  Deferred d;
  rv.Join(MakePeer(0), a.Callback(), &d);
  ASSERT_TRUE(rv.AllJoined());
  rv.Complete(Base(rv, 1, 1), &d);
  d.Run();
  ASSERT_EQ(a.got.size(), 1u);
  ASSERT_TRUE(a.got[0].ok());
  EXPECT_EQ(a.got[0]->peers_size(), 1);
}

}  // namespace
}  // namespace aidn::coordinator
