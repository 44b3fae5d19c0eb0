#ifndef AIDN_WORKER_ENGINE_UNITS_H_
#define AIDN_WORKER_ENGINE_UNITS_H_

// A model's units: the groups of parameters that fully sharded data
// parallelism (fsdp.h) gathers before a group is used and frees after, as
// torch's FSDP wraps modules. Unit 0 is the root: the parameters outside
// every other unit (a GPT's embeddings and final LayerNorm), used first in
// forward and first in backward. The other units follow in forward order
// (a GPT's blocks, a Sequential's layers with parameters).
//
// A model with hooks set calls them around each unit's work:
//   forward:  BeforeForward(0), then per unit u in order BeforeForward(u) ...
//             AfterForward(u), and AfterForward(0) at the end;
//   backward: BeforeBackward(0), then per unit in reverse order
//             BeforeBackward(u) ... AfterBackward(u) (the unit's gradients
//             are then final for this backward), and AfterBackward(0) at
//             the end.
// A unit's parameter values are read only between its Before and After
// calls, its gradients written only between BeforeBackward and
// AfterBackward, so the hooks may move them (Parameter::value and grad
// become views into other memory) in between.

namespace aidn::engine {

class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void BeforeForward(int unit) = 0;
  virtual void AfterForward(int unit) = 0;
  virtual void BeforeBackward(int unit) = 0;
  virtual void AfterBackward(int unit) = 0;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_UNITS_H_
