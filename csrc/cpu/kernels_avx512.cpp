// AVX-512 build of the CPU drivers (compiled with -mavx512f/bw/vl/dq and 512-bit vectors; chosen at
// run time when the CPU has them).
#define AMPFUSED_ISA isa_avx512
#include "kernels_impl.h"
