// Adam / AdamW step over bf16 moments (compact.cuh): its own object, compiled in parallel with adam.cu (the Op:
// adam_op.cuh).
#include "adam_op.cuh"

namespace ampfused {
namespace cuda {

std::string adam_step_bf16m(int device, uintptr_t stream, const StepArgs& args, const WorkList& work,
                           const AdamHyper& h, int32_t* counter, bool single_launch) {
  return launch_step<AdamOp, kBf16States>(device, stream, args, work, h, counter, single_launch);
}

}  // namespace cuda
}  // namespace ampfused
