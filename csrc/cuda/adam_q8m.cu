// Adam / AdamW step over 8-bit moments (compact_q8.cuh): its own object, compiled in parallel with adam.cu
// (adam_op.cuh).
#include "adam_op.cuh"

namespace ampfused {
namespace cuda {

AMPFUSED_ADAM_STEP_IN(, kU8States);

}  // namespace cuda
}  // namespace ampfused
