// Adam / AdamW step (K2 and single launch) over a tensor table: the per-element math is adam_update in math.h.
#include "step.cuh"

namespace ampfused {
namespace cuda {
namespace {

struct AdamOp {
  using Hyper = AdamHyper;
  using Consts = AdamConsts;
  __device__ __noinline__ static Consts make(float coef, float lr, double step, const Hyper& h) {
    return make_adam_consts(coef, lr, float(next_step(step)), h.beta1, h.beta2, h.log_beta1, h.log_beta2, h.eps,
                            h.weight_decay, h.decoupled, h.maximize);
  }
  __device__ static void apply(float g, float& w, float& m, float& v, const Consts& c) { adam_update(g, w, m, v, c); }
};

}  // namespace

std::string adam_step(int device, uintptr_t stream, const StepArgs& args, const WorkList& work, const AdamHyper& h,
                      int32_t* counter, bool single_launch) {
  return launch_step<AdamOp>(device, stream, args, work, h, counter, single_launch);
}

std::string prepare_adam(int device) { return prepare_step<AdamOp>(device); }

}  // namespace cuda
}  // namespace ampfused
