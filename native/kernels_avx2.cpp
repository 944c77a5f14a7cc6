// The reduction kernels compiled with -mavx2 -mf16c (CMakeLists.txt sets the
// flags for this file only); chosen at run time when the CPU has both.
#define NBDIST_ISA_NS isa_avx2
#include "kernels_impl.inc"
