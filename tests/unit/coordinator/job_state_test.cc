#include "coordinator/job_state.h"

#include <set>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace aidn::coordinator {
namespace {

using ::testing::HasSubstr;
using v1::Job;

const std::vector<Job::State>& AllStates() {
  static const std::vector<Job::State> states = {
      Job::STATE_UNSPECIFIED, Job::PENDING, Job::SCHEDULED, Job::RUNNING, Job::RESTARTING,
      Job::SUCCEEDED,         Job::FAILED,  Job::CANCELLED, Job::PAUSED,
  };
  return states;
}

// The lifecycle as job_state.h draws it, written out edge by edge.
const std::set<std::pair<Job::State, Job::State>>& AllowedEdges() {
  static const std::set<std::pair<Job::State, Job::State>> edges = {
      {Job::PENDING, Job::SCHEDULED},    {Job::PENDING, Job::FAILED},
      {Job::PENDING, Job::CANCELLED},    {Job::SCHEDULED, Job::RUNNING},
      {Job::SCHEDULED, Job::RESTARTING}, {Job::SCHEDULED, Job::FAILED},
      {Job::SCHEDULED, Job::CANCELLED},  {Job::SCHEDULED, Job::SUCCEEDED},
      {Job::RUNNING, Job::SUCCEEDED},    {Job::RUNNING, Job::RESTARTING},
      {Job::RUNNING, Job::FAILED},       {Job::RUNNING, Job::CANCELLED},
      {Job::RESTARTING, Job::SCHEDULED}, {Job::RESTARTING, Job::FAILED},
      {Job::RESTARTING, Job::CANCELLED}, {Job::PENDING, Job::PAUSED},
      {Job::SCHEDULED, Job::PAUSED},     {Job::RUNNING, Job::PAUSED},
      {Job::RESTARTING, Job::PAUSED},    {Job::PAUSED, Job::PENDING},
      {Job::PAUSED, Job::FAILED},        {Job::PAUSED, Job::CANCELLED},
  };
  return edges;
}

TEST(CheckTransition, AllowsEveryEdgeOfTheLifecycle) {
  for (const auto& [from, to] : AllowedEdges()) {
    absl::Status status = CheckTransition(from, to);
    EXPECT_TRUE(status.ok()) << StateName(from) << " -> " << StateName(to) << ": " << status;
  }
}

TEST(CheckTransition, RefusesEveryOtherPairWithFailedPrecondition) {
  int refused = 0;
  for (Job::State from : AllStates()) {
    for (Job::State to : AllStates()) {
      if (AllowedEdges().contains({from, to})) continue;
      absl::Status status = CheckTransition(from, to);
      EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition)
          << StateName(from) << " -> " << StateName(to) << ": " << status;
      ++refused;
    }
  }
  const int states = static_cast<int>(AllStates().size());
  EXPECT_EQ(refused, states * states - static_cast<int>(AllowedEdges().size()));
}

TEST(CheckTransition, TerminalStatesGoNowhere) {
  for (Job::State from : {Job::SUCCEEDED, Job::FAILED, Job::CANCELLED}) {
    for (Job::State to : AllStates()) {
      EXPECT_EQ(CheckTransition(from, to).code(), absl::StatusCode::kFailedPrecondition)
          << StateName(from) << " -> " << StateName(to);
    }
  }
}

TEST(CheckTransition, RefusesSkippingOrGoingBack) {
  const std::vector<std::pair<Job::State, Job::State>> forbidden = {
      {Job::PENDING, Job::RUNNING},           {Job::PENDING, Job::SUCCEEDED},
      {Job::PENDING, Job::RESTARTING},        {Job::RUNNING, Job::SCHEDULED},
      {Job::RUNNING, Job::PENDING},           {Job::SCHEDULED, Job::PENDING},
      {Job::RESTARTING, Job::RUNNING},        {Job::RESTARTING, Job::PENDING},
      {Job::RUNNING, Job::RUNNING},           {Job::SUCCEEDED, Job::RUNNING},
      {Job::CANCELLED, Job::PENDING},         {Job::FAILED, Job::RESTARTING},
      {Job::STATE_UNSPECIFIED, Job::PENDING}, {Job::PAUSED, Job::RUNNING},
      {Job::PAUSED, Job::SCHEDULED},          {Job::SUCCEEDED, Job::PAUSED},
  };
  for (const auto& [from, to] : forbidden) {
    EXPECT_EQ(CheckTransition(from, to).code(), absl::StatusCode::kFailedPrecondition)
        << StateName(from) << " -> " << StateName(to);
  }
}

TEST(CheckTransition, MessageNamesBothStates) {
  absl::Status status = CheckTransition(Job::PENDING, Job::RUNNING);
  ASSERT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("PENDING"));
  EXPECT_THAT(status.message(), HasSubstr("RUNNING"));

  status = CheckTransition(Job::SUCCEEDED, Job::CANCELLED);
  ASSERT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("SUCCEEDED"));
  EXPECT_THAT(status.message(), HasSubstr("CANCELLED"));
}

TEST(IsTerminal, IsTrueExactlyForSucceededFailedAndCancelled) {
  for (Job::State s : AllStates()) {
    const bool terminal = s == Job::SUCCEEDED || s == Job::FAILED || s == Job::CANCELLED;
    EXPECT_EQ(IsTerminal(s), terminal) << StateName(s);
  }
}

TEST(HoldsSlots, IsTrueExactlyForScheduledAndRunning) {
  for (Job::State s : AllStates()) {
    const bool holds = s == Job::SCHEDULED || s == Job::RUNNING;
    EXPECT_EQ(HoldsSlots(s), holds) << StateName(s);
  }
}

TEST(StateName, SpellsStatesAsTheProtoDoes) {
  EXPECT_EQ(StateName(Job::PENDING), "PENDING");
  EXPECT_EQ(StateName(Job::RUNNING), "RUNNING");
  EXPECT_EQ(StateName(Job::RESTARTING), "RESTARTING");
  EXPECT_EQ(StateName(Job::CANCELLED), "CANCELLED");
  EXPECT_FALSE(StateName(static_cast<Job::State>(42)).empty());
}

}  // namespace
}  // namespace aidn::coordinator
