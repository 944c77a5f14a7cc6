// Element-wise reductions of n equally long source arrays into one destination.
//
// The same source (kernels_impl.inc) is compiled once per instruction-set level
// (plain x86-64, and AVX2+F16C) and the best one the CPU supports is chosen at
// load time, because the wheel must run on CPUs other than the build machine's
// (-march=native is not an option).
#pragma once

#include <cstddef>
#include <cstdint>

namespace nbdist {

// Codes shared with the Python side (nbdist/common/transports/_dtypes.py).
enum DType : int {
  kF16 = 0, kBF16, kF32, kF64, kI8, kI16, kI32, kI64, kU8, kU16, kU32, kU64, kNumDTypes
};
// Horovod's numbering of reduction ops (Average and Adasum never reach a transport).
enum ROp : int { kSum = 1, kMin = 3, kMax = 4, kProd = 5, kNumOps = 6 };

size_t dtype_size(int dtype);
const char* dtype_name(int dtype);

// dst[i] = srcs[0][i] op srcs[1][i] op ... (in source order, so every rank that
// reduces the same inputs gets the same bits). dst may alias srcs[k] exactly.
// 16-bit floats are accumulated in float32 and rounded once at the end.
using ReduceFn = void (*)(void* dst, const void* const* srcs, int nsrc, size_t count);

// nullptr when the (dtype, op) pair is not supported.
ReduceFn reduce_kernel(int dtype, int op);

// buf[i] *= factor in the buffer's own type, as numpy's `buf *= dtype.type(factor)`:
// float32 and float64 only (Horovod scales integers and 16-bit floats differently; the
// Python side does those). False when the dtype is not one of the two.
bool scale_in_place(void* buf, size_t count, int dtype, double factor);

// Which compiled variant was selected ("avx2", "baseline").
const char* kernel_isa();

// memcpy with non-temporal stores (where the CPU variant has them, else memcpy):
// for destinations far bigger than the caches, it skips the read-for-ownership
// of every destination line. Callers must fence (post() does) before others read.
using CopyFn = void (*)(void* dst, const void* src, size_t bytes);
CopyFn stream_copy();

// Per-variant tables, filled by each compiled copy of kernels_impl.inc.
namespace isa_baseline {
void fill(ReduceFn table[kNumDTypes][kNumOps]);
void stream_copy(void* dst, const void* src, size_t bytes);
}
namespace isa_avx2 {
void fill(ReduceFn table[kNumDTypes][kNumOps]);
void stream_copy(void* dst, const void* src, size_t bytes);
}

}  // namespace nbdist
