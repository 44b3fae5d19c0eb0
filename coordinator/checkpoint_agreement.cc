#include "coordinator/checkpoint_agreement.h"

#include <algorithm>
#include <cmath>

namespace aidn::coordinator {

int64_t CheckpointAgreements::Propose(CheckpointAgreement* agreement, const AgreementInputs& in) {
  int64_t lead = kUnknownLeadSteps;
  if (in.step_seconds > 0) {
    const double lead_seconds = std::chrono::duration<double>(in.lead).count();
    lead = static_cast<int64_t>(std::ceil(lead_seconds / in.step_seconds));
  }
  // Twice the lead after each miss (capped: a step time off by a factor of
  // a million is no step time).
  lead = std::max<int64_t>(lead, 1) << std::min(agreement->proposals, 20);
  int64_t step = std::max<int64_t>(in.max_step, 0) + lead;
  if (in.total_steps > 0) step = std::min(step, std::max(in.total_steps, in.max_step + 1));
  // Always a new step: a rank waiting at the old one must see it change.
  if (step <= agreement->step) step = agreement->step + 1;
  agreement->step = step;
  agreement->go = false;
  agreement->acked.clear();
  ++agreement->proposals;
  return step;
}

bool CheckpointAgreements::Beat(CheckpointAgreement* agreement, int rank, int64_t ack,
                                int64_t missed, const AgreementInputs& in) {
  if (agreement->step == 0) {
    Propose(agreement, in);
    return true;
  }
  if (missed != 0 && missed == agreement->step && !agreement->go) {
    Propose(agreement, in);
    return true;
  }
  if (ack != 0 && ack == agreement->step && !agreement->go) {
    agreement->acked.insert(rank);
    if (static_cast<int>(agreement->acked.size()) >= in.world_size) {
      agreement->go = true;
      return true;
    }
  }
  return false;
}

}  // namespace aidn::coordinator
