// CPU drivers of the per-element math in include/ampfused/math.h.
//
// The same source (kernels_impl.h) is compiled once per instruction set into its own namespace
// (kernels_default.cpp, kernels_avx2.cpp, kernels_avx512.cpp) and module.cpp picks one at run time,
// so a wheel runs on any x86-64 CPU. Every variant gives the same bits: accumulations use a fixed
// number of lanes and the build disables floating-point contraction.
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

struct Buf {
  void* ptr;
  int64_t n;
  int dtype;
};

// Flat-buffer step over [0, n): pointers already resolved; consts already derived by the prologue.
struct StepBufs {
  void* param;
  int param_dtype;
  const void* grad;
  int grad_dtype;
  float* master;
  float* state1;
  float* state2;
  int64_t n;
};

#define AMPFUSED_CPU_ISA_API(ns)                                                                      \
  namespace ns {                                                                                    \
  void norm_check(const Buf* bufs, int64_t nbufs, const int64_t* first_chunk, float inv_scale,      \
                  float* partials, int64_t num_partials, bool unscale, int nthreads);               \
  void adam_apply(const StepBufs& b, const AdamConsts& c, int nthreads);                            \
  void sgd_apply(const StepBufs& b, const SgdConsts& c, int nthreads);                              \
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
