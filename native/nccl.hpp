// The NCCL path for GPU buffers. libnccl and libcudart are opened with dlopen at
// first use, so the module builds and loads with only a C++ compiler, and
// nccl_built() answers for the machine it runs on.
#pragma once

#include <pybind11/pybind11.h>

namespace nbdist {

void bind_nccl(pybind11::module_& m);

}  // namespace nbdist
