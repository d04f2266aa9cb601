// Adam / AdamW step (K2 and single launch) over a tensor table, fp32 moments; bf16 and 8-bit moments are in
// adam_bf16m.cu and adam_q8m.cu (the Op: adam_op.cuh).
#include "adam_op.cuh"
#include "entry.h"

namespace ampfused {
namespace cuda {

namespace {

// One launch over every parameter of the table (device memory), driven by the work lists (device memory);
// single_launch: K1 over the gradients into args.partials (then an output of [2, work.num_columns]), a grid
// barrier, then the step, in one cooperative launch.
std::string adam_step(const StepPack& p) {
  const WorkList w = flat_work(p);
  const double beta1 = p.h(0), beta2 = p.h(1);
  const AdamHyper h{beta1, beta2, p.h(2), p.h(3), p.h(4), p.flag(5), p.flag(6), log_beta(beta1), log_beta(beta2)};
  const StepArgs& a = p.args;
  const int device = device_of(p);
  const uintptr_t stream = stream_of(p);
  switch (a.state_dtype) {
    case kBF16: return adam_step_in<kBf16States>(device, stream, a, w, h, counter_of(p), single_launch_of(p));
    case kStateU8: return adam_step_in<kU8States>(device, stream, a, w, h, counter_of(p), single_launch_of(p));
    default: return adam_step_in<kFp32States>(device, stream, a, w, h, counter_of(p), single_launch_of(p));
  }
}

std::string prepare_adam(int device) { return prepare_step<AdamOp>(device); }

}  // namespace

AMPFUSED_CUDA_STEP("adam_step_", adam_step, prepare_adam, "beta1", "beta2", "eps", "weight_decay", "max_norm",
                   "decoupled", "maximize");

}  // namespace cuda
}  // namespace ampfused
