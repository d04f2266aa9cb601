// Baseline x86-64 / any-architecture build of the CPU drivers.
#define AMPFUSED_ISA isa_default
#define AMPFUSED_ISA_DEFAULT 1  // the object that also builds the steps written once for every set
#include "kernels_impl.h"
