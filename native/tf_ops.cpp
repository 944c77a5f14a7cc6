// NbdistWait: the wait half of an nbdist collective in a TF1 graph, as an AsyncOpKernel.
//
// In a graph, an nbdist collective is two ops: a submit (a cheap numpy_function that
// hands the arrays to the engine and returns a handle id) and a wait. A TF1 Session runs
// ops on a small inter-op thread pool; a wait that blocks one of those threads (as a
// numpy_function must) can take the last free thread while this rank has not yet
// submitted the op a peer waits for, and every rank blocks. This kernel does not hold
// an inter-op thread: ComputeAsync hands the wait to a thread of its own, which calls
// the Python waiter (it releases the GIL while it waits), copies the result arrays into
// the op's outputs and calls done(). Horovod's kernels are asynchronous for the same
// reason.
//
// The waiter is registered from Python (nbdist/tensorflow/_wait_op.py) and returns
// either the list of result arrays, or (TF error code, message) for a failed op, so the
// graph raises the error type Horovod's ops raise (FailedPrecondition for a mismatch,
// InvalidArgument for bad input), not UnknownError.
//
// Built only when TensorFlow is installed at build time (CMakeLists.txt); without it the
// bridge keeps its numpy_function wait.
#include <Python.h>

#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"

namespace {

PyObject* g_waiter = nullptr;  // owned reference; set and read with the GIL held

// The text of the pending Python exception (clears it).
std::string FetchPythonError() {
  PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  std::string text = "nbdist wait failed";
  PyObject* str = value ? PyObject_Str(value) : nullptr;
  if (str) {
    const char* utf8 = PyUnicode_AsUTF8(str);
    if (utf8) text = utf8;
    Py_DECREF(str);
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(trace);
  return text;
}

// Fill ctx's outputs from `result` (a list of C-contiguous arrays, one per output) or set
// its status from `result` = (code, message). The GIL is held.
void Deliver(tensorflow::OpKernelContext* ctx, PyObject* result) {
  if (PyTuple_Check(result) && PyTuple_Size(result) == 2) {
    const long code = PyLong_AsLong(PyTuple_GetItem(result, 0));
    const char* message = PyUnicode_AsUTF8(PyTuple_GetItem(result, 1));
    if (PyErr_Occurred()) {
      ctx->SetStatus(absl::InternalError(FetchPythonError()));
      return;
    }
    ctx->SetStatus(absl::Status(static_cast<absl::StatusCode>(code), message));
    return;
  }
  if (!PyList_Check(result) || PyList_Size(result) != ctx->num_outputs()) {
    ctx->SetStatus(absl::InternalError("nbdist wait: the waiter returned the wrong outputs"));
    return;
  }
  for (int i = 0; i < ctx->num_outputs(); ++i) {
    Py_buffer view;
    if (PyObject_GetBuffer(PyList_GetItem(result, i), &view, PyBUF_ND | PyBUF_C_CONTIGUOUS) != 0) {
      ctx->SetStatus(absl::InternalError(FetchPythonError()));
      return;
    }
    tensorflow::TensorShape shape;
    for (int d = 0; d < view.ndim; ++d) shape.AddDim(view.shape[d]);
    tensorflow::Tensor* out = nullptr;
    absl::Status status = ctx->allocate_output(i, shape, &out);
    if (status.ok() && static_cast<Py_ssize_t>(out->TotalBytes()) != view.len) {
      status = absl::InternalError("nbdist wait: a result's size does not match its dtype");
    }
    if (status.ok() && view.len > 0) {
      void* dst = out->data();
      Py_BEGIN_ALLOW_THREADS  // the array stays alive: `result` holds it
      std::memcpy(dst, view.buf, view.len);
      Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    if (!status.ok()) {
      ctx->SetStatus(status);
      return;
    }
  }
}

void Wait(tensorflow::OpKernelContext* ctx, long long handle) {
  PyGILState_STATE gil = PyGILState_Ensure();
  if (g_waiter == nullptr) {
    ctx->SetStatus(absl::FailedPreconditionError("nbdist wait: no waiter is registered"));
  } else {
    PyObject* result = PyObject_CallFunction(g_waiter, "L", handle);
    if (result == nullptr) {
      ctx->SetStatus(absl::UnknownError(FetchPythonError()));
    } else {
      Deliver(ctx, result);
      Py_DECREF(result);
    }
  }
  PyGILState_Release(gil);
}

class NbdistWaitOp : public tensorflow::AsyncOpKernel {
 public:
  explicit NbdistWaitOp(tensorflow::OpKernelConstruction* c) : AsyncOpKernel(c) {}

  void ComputeAsync(tensorflow::OpKernelContext* ctx, DoneCallback done) override {
    const long long handle = ctx->input(0).scalar<int64_t>()();
    // A thread per wait: waits are few per step, and each may block for as long as the
    // slowest peer takes, so they must not queue behind each other in a fixed pool.
    std::thread([ctx, handle, done = std::move(done)]() {
      Wait(ctx, handle);
      done();
    }).detach();
  }
};

}  // namespace

REGISTER_OP("NbdistWait")
    .Input("handle: int64")
    .Output("outputs: Tout")
    .Attr("Tout: list(type) >= 0")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnknownShape);

REGISTER_KERNEL_BUILDER(Name("NbdistWait").Device(tensorflow::DEVICE_CPU), NbdistWaitOp);

// Called from Python through ctypes.PyDLL (the GIL is held): the callable the kernels run.
extern "C" __attribute__((visibility("default"))) int nbdist_tf_set_waiter(PyObject* waiter) {
  Py_XINCREF(waiter);
  Py_XDECREF(g_waiter);
  g_waiter = waiter;
  return 0;
}
