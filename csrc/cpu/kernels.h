// CPU drivers of the per-element math in include/ampfused/math.h.
//
// The same source (kernels_impl.h) is compiled once per instruction set into its own namespace
// (kernels_default.cpp, kernels_avx2.cpp, kernels_avx512.cpp), with each optimizer's drivers (csrc/cpu/steps)
// in objects of their own, and module.cpp picks one set at run time, so a wheel runs on any x86-64 CPU. Every
// variant gives the same bits: accumulations use a fixed number of lanes and the build disables floating-point
// contraction.
#pragma once

#include <cstdint>

#include "ampfused/math.h"

namespace ampfused {
namespace cpu {

// Elements per partial sum. Partials are per chunk (not per thread) and reduced in chunk order, so
// the result never depends on the thread count.
constexpr int64_t kChunk = 16384;
// Elements per unit of parallel work in the elementwise step pass.
constexpr int64_t kStepBlock = 8192;
// Steps over at least this many elements write the low-precision model copy with streaming stores: their
// streams (about 30 B per element) are larger than a last-level cache, so the copy would not be found there
// by the next forward pass anyway, and skipping its write-allocate read saves 2 of the step's 32 B/element.
constexpr int64_t kStreamElements = int64_t(1) << 21;

struct Buf {
  void* ptr;
  int64_t n;
  int dtype;
};

// One parameter of a step: pointers resolved, per-step constants derived from its own step count.
struct StepTensor {
  void* param;
  const void* grad;  // never null here: parameters without a gradient are not handed to the drivers
  int64_t n;
  int64_t offset;    // of its first element in master / state1 / state2
  uint32_t key;      // stochastic rounding (compact state): step_key at this step, each element's one draw
};

// The step's flat state buffers and the dtypes of the tensors.
struct StepBufs {
  int param_dtype;
  int grad_dtype;
  float* master;  // null: the parameters are the fp32 compute copy (or no master: kMasterNone)
  float* state1;
  float* state2;
  int master_format = kMasterF32;  // kMasterRemainder: master holds uint16 remainders
  int state_dtype = kF32;          // kBF16: state1 / state2 hold bf16 moments; kStateU8: 8-bit codes
  float* state_scales = nullptr;   // kStateU8: [moments, scale_blocks] block scales (row 0 state1's)
  int64_t scale_blocks = 0;
};

// The health sums a step call writes when asked (the pack's health slot; reference_common.HealthSums).
struct HealthSink {
  double* out;      // [5]: grad_sq, update_sq, weight_sq, stagnant, nonfinite
  float inv_scale;  // the gradients' numbers are those of g * inv_scale (unscaled, before the clip)
  bool decays;      // the step decays the weights besides its term (lr * weight_decay != 0)
};

// What a pass sums of the health numbers (compact_span's kHealth): its gradients', its weights', or both.
constexpr int kHealthGrads = 1, kHealthWeights = 2, kHealthAll = 3;

// One unit of parallel work's health sums, added into HealthSink::out in work order.
struct HealthPart {
  double g2 = 0.0, u2 = 0.0, w2 = 0.0;
  int64_t stagnant = 0;
};

#define AMPFUSED_CPU_ISA_API(ns)                                                                      \
  namespace ns {                                                                                    \
  void norm_check(const Buf* bufs, int64_t nbufs, const int64_t* first_chunk, float inv_scale,      \
                  float* partials, int64_t num_partials, bool unscale, int nthreads);               \
  }

AMPFUSED_CPU_ISA_API(isa_default)
#if defined(AMPFUSED_HAVE_AVX2)
AMPFUSED_CPU_ISA_API(isa_avx2)
#endif
#if defined(AMPFUSED_HAVE_AVX512)
AMPFUSED_CPU_ISA_API(isa_avx512)
#endif

}  // namespace cpu
}  // namespace ampfused
