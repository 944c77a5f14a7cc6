// The reduction kernels at the baseline instruction set (x86-64 / SSE2, or the
// target's default elsewhere): always compiled, always correct.
#define NBDIST_ISA_NS isa_baseline
#include "kernels_impl.inc"
