// Lion step (K2 and single launch) over a tensor table: the per-element math is lion_update in math.h.
#include "step.cuh"

namespace ampfused {
namespace cuda {
namespace {

struct LionOp {
  using Hyper = LionHyper;
  using Consts = LionConsts;
  static constexpr int kStates = 1;  // exp_avg (state2 is never used)
  // the step count is not in Lion's math (it keys only the stochastic rounding, which step.cuh draws)
  __device__ __noinline__ static Consts make(float coef, float lr, double, const Hyper& h) {
    return make_lion_consts(coef, lr, h.beta1, h.beta2, h.weight_decay, h.maximize);
  }
  // s1 is exp_avg; s2 is unused (the step has one moment)
  __device__ static void apply(float g, float& w, float& m, float&, const Consts& c) { lion_update(g, w, m, c); }
};

}  // namespace

std::string lion_step(int device, uintptr_t stream, const StepArgs& args, const WorkList& work, const LionHyper& h,
                      int32_t* counter, bool single_launch) {
  return launch_step<LionOp>(device, stream, args, work, h, counter, single_launch);
}

std::string prepare_lion(int device) { return prepare_step<LionOp>(device); }

}  // namespace cuda
}  // namespace ampfused
