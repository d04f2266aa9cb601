// SGD step (K2 and single launch) over a tensor table: the per-element math is sgd_update in math.h.
#include "entry.h"
#include "step.cuh"

namespace ampfused {
namespace cuda {
namespace {

struct SgdOp {
  using Hyper = SgdHyper;
  using Consts = SgdConsts;
  static constexpr int kStates = 1;  // the momentum buffer (state2 is never used)
  __device__ __noinline__ static Consts make(float coef, float lr, double step, const Hyper& h) {
    return make_sgd_consts(coef, lr, float(step), h.momentum, h.dampening, h.weight_decay, h.nesterov, h.maximize);
  }
  // s2 is unused; s1 is the momentum buffer (untouched without momentum)
  __device__ static void apply(float g, float& w, float& b, float&, const Consts& c) { sgd_update(g, w, b, c); }
};

std::string sgd_step(const StepPack& pack) {
  const WorkList w = flat_work(pack);
  const SgdHyper h{pack.h(0), pack.h(1), pack.h(2), pack.h(4), pack.flag(3), pack.flag(5)};
  StepArgs a = pack.args;
  if (h.momentum == 0.0) a.state1 = nullptr;  // no buffer is read or written without momentum
  return launch_step<SgdOp>(device_of(pack), stream_of(pack), a, w, h, counter_of(pack), single_launch_of(pack));
}

std::string prepare_sgd(int device) { return prepare_step<SgdOp>(device); }

}  // namespace

AMPFUSED_CUDA_STEP("sgd_step_", sgd_step, prepare_sgd, "momentum", "dampening", "weight_decay", "nesterov",
                   "max_norm", "maximize");

}  // namespace cuda
}  // namespace ampfused
