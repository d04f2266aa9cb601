// AVX2 build of the CPU drivers (compiled with -mavx2; chosen at run time when the CPU has it).
#define AMPFUSED_ISA isa_avx2
#include "kernels_impl.h"
