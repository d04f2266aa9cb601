// Adam / AdamW step over bf16 moments (compact.cuh): its own object, compiled in parallel with adam.cu
// (adam_op.cuh).
#include "adam_op.cuh"

namespace ampfused {
namespace cuda {

AMPFUSED_ADAM_STEP_IN(, kBf16States);

}  // namespace cuda
}  // namespace ampfused
