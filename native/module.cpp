// nbdist._native: the C++ data path (shared memory on one node, NCCL on GPUs).
// Placeholder module until the native-data-path issue lands: it only reports
// what it was built with, so the package's build and install are exercised.
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() = "nbdist native data path";
  m.def("shm_built", []() { return false; }, "True when the shared-memory collectives are built.");
  m.def("nccl_built", []() { return false; }, "True when libnccl can be loaded on this machine.");
}
