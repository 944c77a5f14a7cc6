// Picks, once, the best compiled variant of the reduction kernels for this CPU.
#include "kernels.hpp"

#include <cstdlib>
#include <cstring>

namespace nbdist {
namespace {

struct Table {
  ReduceFn fn[kNumDTypes][kNumOps] = {};
  CopyFn copy = &isa_baseline::stream_copy;
  const char* isa = "baseline";
  Table() {
#if defined(NBDIST_HAVE_AVX2)
    // NBDIST_KERNELS=baseline forces the portable variant (to test it on any CPU).
    const char* force = std::getenv("NBDIST_KERNELS");
    const bool baseline_only = force != nullptr && std::strcmp(force, "baseline") == 0;
    __builtin_cpu_init();
    if (!baseline_only && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
      isa_avx2::fill(fn);
      copy = &isa_avx2::stream_copy;
      isa = "avx2";
      return;
    }
#endif
    isa_baseline::fill(fn);
  }
};

const Table& table() {
  static const Table t;  // thread-safe one-time initialisation
  return t;
}

}  // namespace

size_t dtype_size(int dtype) {
  switch (dtype) {
    case kF16: case kBF16: case kI16: case kU16: return 2;
    case kF32: case kI32: case kU32: return 4;
    case kF64: case kI64: case kU64: return 8;
    case kI8: case kU8: return 1;
    default: return 0;
  }
}

const char* dtype_name(int dtype) {
  static const char* names[kNumDTypes] = {"float16", "bfloat16", "float32", "float64",
                                          "int8", "int16", "int32", "int64",
                                          "uint8", "uint16", "uint32", "uint64"};
  return (dtype >= 0 && dtype < kNumDTypes) ? names[dtype] : "unknown";
}

ReduceFn reduce_kernel(int dtype, int op) {
  if (dtype < 0 || dtype >= kNumDTypes || op < 0 || op >= kNumOps) return nullptr;
  return table().fn[dtype][op];
}

bool scale_in_place(void* buf, size_t count, int dtype, double factor) {
  if (dtype == kF32) {
    float* p = static_cast<float*>(buf);
    const float f = static_cast<float>(factor);  // rounded once, as numpy's float32(factor)
    for (size_t i = 0; i < count; ++i) p[i] *= f;
    return true;
  }
  if (dtype == kF64) {
    double* p = static_cast<double*>(buf);
    for (size_t i = 0; i < count; ++i) p[i] *= factor;
    return true;
  }
  return false;
}

const char* kernel_isa() { return table().isa; }

CopyFn stream_copy() { return table().copy; }

}  // namespace nbdist
