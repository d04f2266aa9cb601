// Adam / AdamW step over 8-bit moments (compact_q8.cuh): its own object, compiled in parallel with adam.cu (the Op:
// adam_op.cuh).
#include "adam_op.cuh"

namespace ampfused {
namespace cuda {

std::string adam_step_q8m(int device, uintptr_t stream, const StepArgs& args, const WorkList& work,
                          const AdamHyper& h, int32_t* counter, bool single_launch) {
  return launch_step<AdamOp, kU8States>(device, stream, args, work, h, counter, single_launch);
}

}  // namespace cuda
}  // namespace ampfused
