// Baseline x86-64 / any-architecture build of the CPU drivers.
#define AMPFUSED_ISA isa_default
#include "kernels_impl.h"
