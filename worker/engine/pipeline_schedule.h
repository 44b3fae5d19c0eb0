#ifndef AIDN_WORKER_ENGINE_PIPELINE_SCHEDULE_H_
#define AIDN_WORKER_ENGINE_PIPELINE_SCHEDULE_H_

// The order in which one pipeline stage runs its micro-batches, and the
// point-to-point transfers around each compute step, for the two schedules
// of synchronous pipeline parallelism (one optimizer step after the flush,
// the same arithmetic as one large batch):
//
//   GPipe: every micro-batch's forward, then every backward; a stage holds
//     the activations of all m micro-batches at once.
//   1F1B (PipeDream-Flush, Megatron-LM's schedule without interleaving):
//     stage s of P runs min(P - s - 1, m) forwards to fill the pipeline,
//     then alternates one forward and one backward, then drains the
//     backwards; at most P - s micro-batches are in flight on stage s.
//
// Both have the bubble (P - 1) / (m + P - 1) of the step's time.
//
// Transfers: an activation goes from stage s to s+1 after s's forward and
// its gradient back after s+1's backward. In 1F1B's steady phase a stage
// sends an activation forward while it waits for a gradient from the same
// neighbour (and the other way round), so those pairs are one Exchange
// (peer_link.h) rather than a send and a receive that would each wait for
// the other. The sequence of transfers on every link is the same, step by
// step, from both of its ends (the tests check it for many shapes): every
// Send meets a Recv and every Exchange an Exchange.
//
// Pure; thread-compatible.

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace aidn::engine {

enum class PipelineSchedule { kGPipe, k1F1B };

struct PipelineAction {
  enum Kind {
    kRecvActivation,  // from the previous stage
    kForward,
    kSendActivation,  // to the next stage
    kRecvGradient,    // from the next stage
    kBackward,
    kSendGradient,  // to the previous stage
    // One Exchange with the next stage: send the activation of
    // `micro_batch`, receive the gradient of `other`.
    kSendActivationRecvGradient,
    // One Exchange with the previous stage: send the gradient of
    // `micro_batch`, receive the activation of `other`.
    kSendGradientRecvActivation,
  };
  Kind kind;
  int micro_batch = 0;
  int other = -1;
};

// The actions of stage `stage` (0-based) of `stages` for one step of
// `micro_batches`. Transfers with a neighbour that does not exist (before
// the first stage, after the last) are left out; the last stage's
// backward starts from the loss. INVALID_ARGUMENT for sizes < 1 or a
// stage out of range.
absl::StatusOr<std::vector<PipelineAction>> StageActions(PipelineSchedule schedule, int stages,
                                                         int stage, int micro_batches);

// The most micro-batches whose forward ran and whose backward has not.
int PeakInFlight(const std::vector<PipelineAction>& actions);

// (P - 1) / (m + P - 1).
double IdealBubble(int stages, int micro_batches);

std::string ActionName(const PipelineAction& action);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_PIPELINE_SCHEDULE_H_
