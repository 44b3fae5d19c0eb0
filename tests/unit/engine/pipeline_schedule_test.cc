// The GPipe and 1F1B schedules: every link's transfers meet from both ends
// for many shapes, each stage runs every micro-batch once (forward before
// backward, in order), 1F1B holds at most P - s micro-batches, and four
// stages run both schedules over real links (shared memory) without a
// deadlock, every activation and gradient arriving where it should.

#include "worker/engine/pipeline_schedule.h"

#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "tests/support/run_ranks.h"
#include "worker/engine/comm/cpu_communicator.h"
#include "worker/engine/comm/peer_link.h"

namespace aidn::engine {
namespace {

using Transfer = std::tuple<std::string, int, int>;

// Stage `s`'s transfers with stage s + 1, as (what moves, activation's
// micro-batch, gradient's micro-batch), from s's end.
std::vector<Transfer> TowardNext(const std::vector<PipelineAction>& actions) {
  std::vector<Transfer> out;
  for (const PipelineAction& a : actions) {
    if (a.kind == PipelineAction::kSendActivation) out.emplace_back("act", a.micro_batch, -1);
    if (a.kind == PipelineAction::kRecvGradient) out.emplace_back("grad", -1, a.micro_batch);
    if (a.kind == PipelineAction::kSendActivationRecvGradient) {
      out.emplace_back("exchange", a.micro_batch, a.other);
    }
  }
  return out;
}

// The same link from stage s + 1's end.
std::vector<Transfer> TowardPrevious(const std::vector<PipelineAction>& actions) {
  std::vector<Transfer> out;
  for (const PipelineAction& a : actions) {
    if (a.kind == PipelineAction::kRecvActivation) out.emplace_back("act", a.micro_batch, -1);
    if (a.kind == PipelineAction::kSendGradient) out.emplace_back("grad", -1, a.micro_batch);
    if (a.kind == PipelineAction::kSendGradientRecvActivation) {
      out.emplace_back("exchange", a.other, a.micro_batch);
    }
  }
  return out;
}

TEST(PipelineScheduleTest, EveryLinksTransfersMeetAndEveryMicroBatchRunsOnce) {
  for (PipelineSchedule schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
    for (int stages = 1; stages <= 6; ++stages) {
      for (int m = 1; m <= 9; ++m) {
        SCOPED_TRACE(absl::StrCat(schedule == PipelineSchedule::kGPipe ? "GPipe" : "1F1B",
                                  " P=", stages, " m=", m));
        std::vector<std::vector<PipelineAction>> all;
        for (int s = 0; s < stages; ++s) {
          absl::StatusOr<std::vector<PipelineAction>> actions =
              StageActions(schedule, stages, s, m);
          ASSERT_TRUE(actions.ok()) << actions.status();
          all.push_back(*actions);
          std::vector<int> forwards, backwards;
          for (const PipelineAction& a : *actions) {
            if (a.kind == PipelineAction::kForward) forwards.push_back(a.micro_batch);
            if (a.kind == PipelineAction::kBackward) {
              EXPECT_LE(static_cast<int>(backwards.size()), static_cast<int>(forwards.size()));
              backwards.push_back(a.micro_batch);
            }
          }
          std::vector<int> in_order(m);
          for (int i = 0; i < m; ++i) in_order[i] = i;
          EXPECT_EQ(forwards, in_order);
          EXPECT_EQ(backwards, in_order);
          const int peak = PeakInFlight(*actions);
          if (schedule == PipelineSchedule::kGPipe) {
            EXPECT_EQ(peak, m);
          } else {
            EXPECT_EQ(peak, std::min(stages - s, m)) << "stage " << s;
          }
        }
        for (int s = 0; s + 1 < stages; ++s) {
          EXPECT_EQ(TowardNext(all[s]), TowardPrevious(all[s + 1])) << "link " << s;
        }
      }
    }
  }
  EXPECT_DOUBLE_EQ(IdealBubble(4, 8), 3.0 / 11.0);
  EXPECT_FALSE(StageActions(PipelineSchedule::k1F1B, 2, 2, 4).ok());
  EXPECT_FALSE(StageActions(PipelineSchedule::kGPipe, 2, 0, 0).ok());
}

// Activations count the stages they passed; the last stage turns an
// activation into its gradient, and gradients count the stages on the way
// back.
float Activation(int mb, int stage) { return static_cast<float>(mb * 100 + stage); }

TEST(PipelineScheduleTest, FourStagesRunBothSchedulesOverLinks) {
  constexpr int kStages = 4;
  constexpr size_t kWidth = 20'000;  // larger than one 64 KiB slot
  for (PipelineSchedule schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
    for (int m : {1, 3, 8}) {
      SCOPED_TRACE(absl::StrCat(schedule == PipelineSchedule::kGPipe ? "GPipe" : "1F1B", " m=", m));
      std::vector<absl::Status> results =
          testing::RunRanks(kStages, [&](int s, KeyValueStore& store) -> absl::Status {
            CpuCommunicatorOptions options;
            options.gloo.rank = s;
            options.gloo.world_size = kStages;
            options.gloo.timeout = std::chrono::seconds(60);
            options.transport = CpuTransport::kShm;
            options.shm_slot_bytes = size_t{64} << 10;
            std::optional<PeerLink> prev, next;
            for (int left = 0; left + 1 < kStages; ++left) {
              if (s != left && s != left + 1) continue;
              AIDN_ASSIGN_OR_RETURN(CpuCommunicator pair, CreateCpuGroupCommunicator(
                                                              options, {left, left + 1},
                                                              absl::StrCat("edge/", left), &store));
              AIDN_ASSIGN_OR_RETURN(PeerLink link, PeerLink::Create(std::move(pair.communicator)));
              (s == left ? next : prev).emplace(std::move(link));
            }
            std::map<int, std::vector<float>> act_in, act_out, grad_in, grad_out;
            auto expect = [&](const std::vector<float>& v, float want,
                              const std::string& what) -> absl::Status {
              for (float x : v) {
                if (x != want) {
                  return absl::InternalError(
                      absl::StrCat("stage ", s, ": ", what, " holds ", x, ", want ", want));
                }
              }
              return absl::OkStatus();
            };
            AIDN_ASSIGN_OR_RETURN(std::vector<PipelineAction> actions,
                                  StageActions(schedule, kStages, s, m));
            for (const PipelineAction& a : actions) {
              const int mb = a.micro_batch;
              switch (a.kind) {
                case PipelineAction::kRecvActivation:
                  act_in[mb].resize(kWidth);
                  AIDN_RETURN_IF_ERROR(prev->Recv(act_in[mb].data(), kWidth));
                  break;
                case PipelineAction::kForward:
                  if (s == 0) act_in[mb].assign(kWidth, Activation(mb, 0));
                  AIDN_RETURN_IF_ERROR(expect(act_in[mb], Activation(mb, s), "activation"));
                  act_out[mb].assign(kWidth, Activation(mb, s + 1));
                  break;
                case PipelineAction::kSendActivation:
                  AIDN_RETURN_IF_ERROR(next->Send(act_out[mb].data(), kWidth));
                  break;
                case PipelineAction::kRecvGradient:
                  grad_in[mb].resize(kWidth);
                  AIDN_RETURN_IF_ERROR(next->Recv(grad_in[mb].data(), kWidth));
                  break;
                case PipelineAction::kBackward:
                  if (s == kStages - 1) grad_in[mb].assign(kWidth, -Activation(mb, kStages));
                  AIDN_RETURN_IF_ERROR(expect(grad_in[mb], -Activation(mb, s + 1), "gradient"));
                  grad_out[mb].assign(kWidth, -Activation(mb, s));
                  break;
                case PipelineAction::kSendGradient:
                  AIDN_RETURN_IF_ERROR(prev->Send(grad_out[mb].data(), kWidth));
                  break;
                case PipelineAction::kSendActivationRecvGradient:
                  grad_in[a.other].resize(kWidth);
                  AIDN_RETURN_IF_ERROR(
                      next->Exchange(act_out[mb].data(), kWidth, grad_in[a.other].data(), kWidth));
                  break;
                case PipelineAction::kSendGradientRecvActivation:
                  act_in[a.other].resize(kWidth);
                  AIDN_RETURN_IF_ERROR(
                      prev->Exchange(grad_out[mb].data(), kWidth, act_in[a.other].data(), kWidth));
                  break;
              }
            }
            if (static_cast<int>(grad_out.size()) != m) {
              return absl::InternalError(
                  absl::StrCat("stage ", s, " ran ", grad_out.size(), " backwards of ", m));
            }
            return absl::OkStatus();
          });
      EXPECT_TRUE(testing::AllOk(results));
    }
  }
}

}  // namespace
}  // namespace aidn::engine
