// Lion step (K2 and single launch) over a tensor table: the per-element math is lion_update in math.h.
#include "ampfused/lion_math.h"
#include "entry.h"
#include "step.cuh"

namespace ampfused {
namespace cuda {
namespace {

struct LionHyper {
  double beta1, beta2, weight_decay, max_norm;
  bool maximize;
};

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

// One moment: args.state1 is exp_avg.
std::string lion_step(const StepPack& p) {
  const WorkList w = flat_work(p);
  const LionHyper h{p.h(0), p.h(1), p.h(2), p.h(3), p.flag(4)};
  return launch_step<LionOp>(device_of(p), stream_of(p), p.args, w, h, counter_of(p), single_launch_of(p));
}

std::string prepare_lion(int device) { return prepare_step<LionOp>(device); }

}  // namespace

AMPFUSED_CUDA_STEP("lion_step_", lion_step, prepare_lion, "beta1", "beta2", "weight_decay", "max_norm", "maximize");

}  // namespace cuda
}  // namespace ampfused
