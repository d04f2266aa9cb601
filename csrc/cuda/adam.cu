// Adam / AdamW step (K2 and single launch) over a tensor table, fp32 moments; bf16 and 8-bit moments are in
// adam_bf16m.cu and adam_q8m.cu (the Op: adam_op.cuh).
#include "adam_op.cuh"

namespace ampfused {
namespace cuda {

std::string adam_step(int device, uintptr_t stream, const StepArgs& args, const WorkList& work, const AdamHyper& h,
                      int32_t* counter, bool single_launch) {
  switch (args.state_dtype) {
    case kBF16: return adam_step_in<kBf16States>(device, stream, args, work, h, counter, single_launch);
    case kStateU8: return adam_step_in<kU8States>(device, stream, args, work, h, counter, single_launch);
    default: return adam_step_in<kFp32States>(device, stream, args, work, h, counter, single_launch);
  }
}

std::string prepare_adam(int device) { return prepare_step<AdamOp>(device); }

}  // namespace cuda
}  // namespace ampfused
