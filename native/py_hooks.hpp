// The should_stop hook shared by the shm and NCCL bindings: a Python callable
// (returning a reason string, or None) polled from C++ while the GIL is released.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <string>

namespace nbdist {

// Polled while an op waits: true (and a reason) to give up.
using StopHook = std::function<bool(std::string&)>;

// `hook` must stay alive for as long as the returned function may be called
// (the bindings pass the argument of the running call). Borrowing the raw
// pointer means no reference counting happens without the GIL.
inline StopHook make_stop_hook(const pybind11::object& hook) {
  if (hook.is_none()) return {};
  PyObject* raw = hook.ptr();
  return [raw](std::string& reason) -> bool {
    pybind11::gil_scoped_acquire gil;
    try {
      pybind11::object r = pybind11::reinterpret_borrow<pybind11::object>(raw)();
      if (r.is_none() || !PyObject_IsTrue(r.ptr())) return false;
      reason = pybind11::str(r);
      return true;
    } catch (pybind11::error_already_set& e) {
      reason = std::string("should_stop raised ") + e.what();
      return true;
    }
  };
}

}  // namespace nbdist
