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

// adam_step over bf16 moments (adam_bf16m.cu) and over 8-bit moments (adam_q8m.cu).
std::string adam_step_bf16m(int device, uintptr_t stream, const StepArgs& args, const WorkList& work,
                            const AdamHyper& h, int32_t* counter, bool single_launch);
std::string adam_step_q8m(int device, uintptr_t stream, const StepArgs& args, const WorkList& work,
                          const AdamHyper& h, int32_t* counter, bool single_launch);

}  // namespace cuda
}  // namespace ampfused
