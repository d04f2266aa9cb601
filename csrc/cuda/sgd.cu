// SGD step (K2 and single launch) over a tensor table: the per-element math is sgd_update in math.h.
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

}  // namespace

std::string sgd_step(int device, uintptr_t stream, const StepArgs& args, const WorkList& work, const SgdHyper& h,
                    int32_t* counter, bool single_launch) {
  return launch_step<SgdOp>(device, stream, args, work, h, counter, single_launch);
}

std::string prepare_sgd(int device) { return prepare_step<SgdOp>(device); }

}  // namespace cuda
}  // namespace ampfused
