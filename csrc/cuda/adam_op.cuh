// The Adam / AdamW Op that step.cuh runs (the per-element math is adam_update in math.h), shared by adam.cu (fp32
// moments), adam_bf16m.cu (bf16 moments) and adam_q8m.cu (8-bit moments), which nvcc compiles in parallel.
#pragma once

#include "step.cuh"

namespace ampfused {
namespace cuda {

struct AdamOp {
  using Hyper = AdamHyper;
  using Consts = AdamConsts;
  __device__ __noinline__ static Consts make(float coef, float lr, double step, const Hyper& h) {
    return make_adam_consts(coef, lr, float(next_step(step)), h.beta1, h.beta2, h.log_beta1, h.log_beta2, h.eps,
                            h.weight_decay, h.decoupled, h.maximize);
  }
  __device__ static void apply(float g, float& w, float& m, float& v, const Consts& c) { adam_update(g, w, m, v, c); }
};

// adam_step over one moment storage (a StateSet of step.cuh); the bf16 and 8-bit ones are instantiated in their
// own files (adam_bf16m.cu, adam_q8m.cu), not where they are called.
template <int kSet>
std::string adam_step_in(int device, uintptr_t stream, const StepArgs& args, const WorkList& work, const AdamHyper& h,
                         int32_t* counter, bool single_launch) {
  return launch_step<AdamOp, kSet>(device, stream, args, work, h, counter, single_launch);
}

#define AMPFUSED_ADAM_STEP_IN(prefix, set)                                                                       \
  prefix template std::string adam_step_in<set>(int, uintptr_t, const StepArgs&, const WorkList&, const AdamHyper&, \
                                                int32_t*, bool)
AMPFUSED_ADAM_STEP_IN(extern, kBf16States);
AMPFUSED_ADAM_STEP_IN(extern, kU8States);

}  // namespace cuda
}  // namespace ampfused
