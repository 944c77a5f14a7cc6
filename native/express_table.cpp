// The express table: the one native call under a synchronous hvd.allreduce / allreduce_,
// allgather, broadcast / broadcast_ of a CPU op that the response cache knows
// (nbdist/common/agreement.py, ShmAgreement).
//
// Python works an op's plan out once (ShmAgreement._express_plan: cache id, transport,
// native arguments) and enters it here under the op's kind and name (None: the unnamed ops'
// template of that kind, numbered here as Engine.auto_name numbers them). From then on
// express_allreduce() / express_allgather() / express_broadcast(), called first thing by
// nbdist.common's synchronous forms (ops._allreduce, _allgather, _broadcast), check in C++
// what the Python path would check (the user's arguments against the plan, the engine with
// nothing else in flight), take the agreement lock without waiting, and run the vote and
// the bytes in one call (nbdist::express_allreduce and its twins in module.cpp).
// They return:
//   None     nothing was done: the Python path runs the op as before;
//   array    the result;
//   a tuple  the op started and did not finish here (the peers did not come in time, the
//            vote found other work, the transport failed): the agreement lock is still
//            held, and Python finishes the op (Engine.express_resume).
// No Python code runs in between (no bytecode: a Ctrl-C cannot land half-way through, and
// the stop hook reads the engine's flag directly), so the call needs no Ctrl-C gate of its
// own; it hands one to Python with the tuple (the gate's depth, counted up here).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <chrono>
#include <csignal>
#include <cstring>
#include <string>
#include <vector>

#include "py_shm.hpp"

namespace py = pybind11;

namespace nbdist {
namespace {

enum Kind { kAllreduce = 0, kAllgather = 1, kBroadcast = 2, kKinds = 3 };

// What the Python path checks of a call, worked out once for one name, and the native
// call's own arguments.
struct Plan {
  int64_t cid = 0;
  py::object dtype;  // the array's dtype object: numpy's are singletons
  std::vector<Py_ssize_t> shape;
  py::object data;  // the data transport's PyShm (kept alive by this reference)
  PyShm* data_shm = nullptr;
  size_t itemsize = 0;
  // allreduce
  py::object op;  // the resolved ReduceOp member the call passes
  double postscale = 1.0;
  int dtype_code = 0, op_code = 0;
  double factor = 1.0;
  // allgather: bytes from each rank, and the result's shape
  std::vector<int64_t> byte_counts;
  std::vector<Py_ssize_t> out_shape;
  // broadcast: the root (a global rank, as the user passes it), and whether it is this rank
  long root = -1;
  bool own = false;
};

// A float argument's value, if it is a float or an int (what the Python path compares).
bool number_of(PyObject* o, double& v) {
  if (PyFloat_CheckExact(o)) {
    v = PyFloat_AS_DOUBLE(o);
    return true;
  }
  if (PyLong_CheckExact(o)) {
    v = PyLong_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return true;
  }
  return false;
}

class ExpressTable {
 public:
  // `engine`, `agreement`: the Python objects whose state must be empty for an op to go
  // here (their containers are never rebound, so they are read once); `gate` the Ctrl-C
  // gate and `getsignal` _signal.getsignal (the builtin: signal.getsignal, its Python
  // wrapper, makes an Enum of the handler, ~3 us); `timeline` the timeline module's globals.
  ExpressTable(py::object control, py::object engine, py::object agreement, py::object gate,
               py::object getsignal, unsigned long main_thread, py::dict timeline,
               py::object global_set, double wait_s, double timeout_s, size_t pool_min_bytes,
               py::object empty_like, py::object empty, std::string stop_reason)
      : control_(std::move(control)), engine_(std::move(engine)), agreement_(std::move(agreement)),
        gate_(std::move(gate)), getsignal_(std::move(getsignal)), main_thread_(main_thread),
        timeline_(std::move(timeline)), global_set_(std::move(global_set)), wait_s_(wait_s),
        timeout_s_(timeout_s), pool_min_bytes_(pool_min_bytes), empty_like_(std::move(empty_like)),
        empty_(std::move(empty)) {
    py::object coord = agreement_.attr("coord");
    queue_ = engine_.attr("_queue");
    local_ = engine_.attr("_local");
    control_items_ = engine_.attr("_control");
    bit_pending_ = agreement_.attr("bit_pending");
    ready_ = coord.attr("ready");
    joined_ = coord.attr("joined");
    pending_ = coord.attr("pending");
    tombstones_ = coord.attr("tombstones");
    cache_by_id_ = coord.attr("cache_by_id");
    control_shm_ = &control_.cast<PyShm&>();
    py::object lock = agreement_.attr("lock");
    acquire_ = lock.attr("acquire");
    release_ = lock.attr("release");
    sigint_ = py::int_(SIGINT);
    active_key_ = py::str("_active");
    broken_key_ = py::str("_broken");
    stopping_key_ = py::str("_stopping");
    last_cycle_key_ = py::str("last_cycle");
    depth_key_ = py::str("depth");
    counter_key_ = py::str("auto_name_counter");
    // Polled while the op waits (only then: the table's references are alive): the
    // engine's flag, read as idle() reads it, without running Python code.
    stop_ = [this, reason = std::move(stop_reason)](std::string& why) {
      py::gil_scoped_acquire gil;
      if (flag_off(stopping_key_)) return false;
      why = reason;
      return true;
    };
  }

  // Enter (or replace) the plan of the allreduce named `name`; None: of the next unnamed one.
  void enter(py::object name, int64_t cid, py::object dtype, std::vector<Py_ssize_t> shape,
             py::object op, double postscale, py::object data, int dtype_code, int op_code,
             double factor) {
    Plan plan = base(cid, std::move(dtype), std::move(shape), std::move(data));
    plan.op = std::move(op);
    plan.postscale = postscale;
    plan.dtype_code = dtype_code;
    plan.op_code = op_code;
    plan.factor = factor;
    put(kAllreduce, name, std::move(plan));
  }

  void enter_allgather(py::object name, int64_t cid, py::object dtype,
                       std::vector<Py_ssize_t> shape, py::object data,
                       std::vector<int64_t> byte_counts, std::vector<Py_ssize_t> out_shape) {
    Plan plan = base(cid, std::move(dtype), std::move(shape), std::move(data));
    plan.byte_counts = std::move(byte_counts);
    plan.out_shape = std::move(out_shape);
    put(kAllgather, name, std::move(plan));
  }

  void enter_broadcast(py::object name, int64_t cid, py::object dtype,
                       std::vector<Py_ssize_t> shape, py::object data, long root, bool own) {
    Plan plan = base(cid, std::move(dtype), std::move(shape), std::move(data));
    plan.root = root;
    plan.own = own;
    put(kBroadcast, name, std::move(plan));
  }

  // The plans of this name, of every kind (a named op has one plan at most).
  void forget(py::object name) {
    for (py::dict& plans : plans_)
      if (PyDict_DelItem(plans.ptr(), name.ptr()) != 0) PyErr_Clear();
  }

  // From now on no op goes through this table; its references to the engine go once no
  // call is inside (they would keep the engine alive: Python's collector cannot see them).
  void close() {
    closed_ = true;
    if (calls_ == 0) let_go();
  }
  int64_t runs() const { return runs_[kAllreduce] + runs_[kAllgather] + runs_[kBroadcast]; }
  int64_t allreduce_runs() const { return runs_[kAllreduce]; }

  // The fast paths (see the top of this file); arguments as the user passed them.
  py::object allreduce(PyObject* array, PyObject* op, PyObject* name, PyObject* prescale,
                       PyObject* postscale, PyObject* process_set, bool inplace) {
    Inside inside(*this);
    const Plan* plan = plan_for(kAllreduce, array, name, process_set, inplace);
    double pre = 0.0, post = 0.0;
    if (plan == nullptr || op != plan->op.ptr() || !number_of(prescale, pre) || pre != 1.0 ||
        !number_of(postscale, post) || post != plan->postscale)
      return py::none();
    if (!ready(name)) return py::none();
    const size_t count = elements(array);
    py::object out = inplace ? py::reinterpret_borrow<py::object>(array)
                             : output_like(array, count * plan->itemsize);
    // (read now: the table may change while the op lets the GIL go)
    const int dtype_code = plan->dtype_code, op_code = plan->op_code;
    const double factor = plan->factor;
    return run(kAllreduce, *plan, name, out, [&](int64_t cid, int64_t nbits, PyShm& data) {
      return express_allreduce(*control_shm_, cid, nbits, wait_s_, data,
                               py::reinterpret_borrow<py::array>(array),
                               py::reinterpret_borrow<py::array>(out.ptr()), count, dtype_code,
                               op_code, factor, timeout_s_, stop_);
    });
  }

  py::object allgather(PyObject* array, PyObject* name, PyObject* process_set) {
    Inside inside(*this);
    const Plan* plan = plan_for(kAllgather, array, name, process_set, false);
    if (plan == nullptr || !ready(name)) return py::none();
    py::object out = output_shaped(*plan);
    const std::vector<int64_t> byte_counts = plan->byte_counts;
    return run(kAllgather, *plan, name, out, [&](int64_t cid, int64_t nbits, PyShm& data) {
      return express_allgather(*control_shm_, cid, nbits, wait_s_, data,
                               py::reinterpret_borrow<py::array>(array),
                               py::reinterpret_borrow<py::array>(out.ptr()), byte_counts,
                               timeout_s_, stop_);
    });
  }

  py::object broadcast(PyObject* array, PyObject* root_rank, PyObject* name,
                       PyObject* process_set, bool inplace) {
    Inside inside(*this);
    const Plan* plan = plan_for(kBroadcast, array, name, process_set, inplace);
    if (plan == nullptr || !PyLong_CheckExact(root_rank)) return py::none();
    const long root_given = PyLong_AsLong(root_rank);
    if (root_given == -1 && PyErr_Occurred()) PyErr_Clear();  // (too large: never a plan's)
    if (root_given != plan->root || !ready(name)) return py::none();
    const size_t nbytes = elements(array) * plan->itemsize;
    py::object out = py::reinterpret_borrow<py::object>(array);
    // Out of place, a new array; the root sends its input and copies it into that array
    // while the peers read (a single-copy broadcast's root would otherwise copy first).
    const void* send = nullptr;
    if (!inplace) {
      out = output_like(array, nbytes);
      if (plan->own) send = py::detail::array_proxy(array)->data;
    }
    const int root = static_cast<int>(plan->root);
    py::object done = run(kBroadcast, *plan, name, out, [&](int64_t cid, int64_t nbits, PyShm& data) {
      return express_broadcast(*control_shm_, cid, nbits, wait_s_, data,
                               py::reinterpret_borrow<py::array>(out.ptr()), nbytes, root,
                               timeout_s_, stop_, send);
    });
    // Not run here: Python finishes it from `out` (Request.out), which must hold the input.
    if (send != nullptr && done.ptr() != out.ptr())
      std::memcpy(py::detail::array_proxy(out.ptr())->data, send, nbytes);
    return done;
  }

 private:
  struct Inside {  // a call inside (the GIL is held whenever calls_ changes)
    ExpressTable& t;
    explicit Inside(ExpressTable& table) : t(table) { ++t.calls_; }
    ~Inside() {
      if (--t.calls_ == 0 && t.closed_) t.let_go();
    }
  };

  Plan base(int64_t cid, py::object dtype, std::vector<Py_ssize_t> shape, py::object data) {
    Plan plan;
    plan.cid = cid;
    plan.itemsize = dtype.attr("itemsize").cast<size_t>();
    plan.dtype = std::move(dtype);
    plan.shape = std::move(shape);
    plan.data_shm = &data.cast<PyShm&>();
    plan.data = std::move(data);
    return plan;
  }

  void put(int kind, const py::object& name, Plan plan) {
    if (name.ptr() != Py_None) forget(name);  // (a named op's plan of another kind)
    py::dict& plans = plans_[kind];
    PyObject* at = PyDict_GetItemWithError(plans.ptr(), name.ptr());
    if (at != nullptr) {
      plans_list_[PyLong_AsSsize_t(at)] = std::move(plan);
      return;
    }
    if (PyErr_Occurred()) throw py::error_already_set();
    plans[name] = py::int_(plans_list_.size());
    plans_list_.push_back(std::move(plan));
  }

  // The engine is idle for this op, and the main thread's Ctrl-C gate is in place.
  bool ready(PyObject* name) const {
    if (!idle(name)) return false;
    // (the Python path installs the gate)
    return PyThread_get_thread_ident() != main_thread_ || gate_installed();
  }

  // Take the agreement lock and run call(cid, nbits, data): the op's result `out` when it
  // ran; else the tuple for Python (the top of this file); None when the lock was taken.
  template <class Call>
  py::object run(int kind, const Plan& plan, PyObject* name, const py::object& out, Call call) {
    const bool main = PyThread_get_thread_ident() == main_thread_;
    if (!try_lock()) return py::none();
    // From here on the lock is held: whatever fails is handed to Python with it (below),
    // which releases it and breaks the runtime with the rank named (Engine.express_resume).
    const int64_t nbits = (PyDict_GET_SIZE(cache_by_id_.ptr()) + 15) / 16 * 16;
    // (read now: the table may change while the op lets the GIL go)
    const int64_t cid = plan.cid;
    const py::object data = plan.data;
    PyShm& data_shm = *plan.data_shm;
    py::object voted;
    py::object error = py::none();
    try {
      // An unnamed op is numbered as Engine.auto_name numbers it (Python gives the name
      // itself only to an op that must wait: Engine.last_auto_name).
      if (name == Py_None) count_unnamed();
      voted = call(cid, nbits, data_shm);
    } catch (py::error_already_set& e) {
      error = py::str(e.what());
    } catch (std::exception& e) {
      error = py::str(e.what());
    }
    if (error.is_none() && voted.is_none()) {  // ran
      ++runs_[kind];
      const double now = std::chrono::duration<double>(
          std::chrono::steady_clock::now().time_since_epoch()).count();
      py::float_ at(now);  // (time.monotonic's clock; a keep-alive hint only: errors ignored)
      if (PyObject_SetAttr(agreement_.ptr(), last_cycle_key_.ptr(), at.ptr()) != 0) PyErr_Clear();
      PyObject* r = PyObject_CallNoArgs(release_.ptr());
      if (r == nullptr) throw py::error_already_set();
      Py_DECREF(r);
      return out;
    }
    // Python finishes the op under the lock, with Ctrl-C held until it is done.
    if (main) gate_.attr(depth_key_) = gate_.attr(depth_key_).cast<int>() + 1;
    // (`voted` is a null handle when the call threw: make_tuple cannot cast one, and its
    // cast error would replace the real one and leave the lock held)
    return py::make_tuple(voted ? voted : py::none(), out, error, py::bool_(main));
  }

  static size_t elements(PyObject* array) {
    auto* a = py::detail::array_proxy(array);
    size_t count = 1;
    for (int i = 0; i < a->nd; ++i) count *= static_cast<size_t>(a->dimensions[i]);
    return count;
  }

  void let_go() {
    plans_list_.clear();
    for (py::dict& plans : plans_) plans = py::dict();
    for (py::object* o : {&control_, &engine_, &agreement_, &gate_, &getsignal_, &global_set_,
                          &empty_like_, &empty_, &queue_, &local_, &control_items_, &bit_pending_, &ready_,
                          &joined_, &pending_, &tombstones_, &cache_by_id_, &acquire_, &release_})
      *o = py::none();
    timeline_ = py::dict();
    stop_ = nullptr;
    control_shm_ = nullptr;
  }

  // The plan of this kind whose checks of the array, the name and the process set this
  // call passes (the caller checks the kind's own arguments), or nullptr.
  const Plan* plan_for(int kind, PyObject* array, PyObject* name, PyObject* process_set,
                       bool inplace) {
    auto& api = py::detail::npy_api::get();
    if (closed_ || Py_TYPE(array) != api.PyArray_Type_ || (!PyUnicode_CheckExact(name) && name != Py_None))
      return nullptr;
    if (process_set != Py_None && process_set != global_set_.ptr()) return nullptr;
    PyObject* at = PyDict_GetItemWithError(plans_[kind].ptr(), name);
    if (at == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    const Plan& plan = plans_list_[PyLong_AsSsize_t(at)];
    auto* a = py::detail::array_proxy(array);
    const int need = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ |
                     (inplace ? py::detail::npy_api::NPY_ARRAY_WRITEABLE_ : 0);
    if ((a->flags & need) != need || a->descr != plan.dtype.ptr() ||
        static_cast<size_t>(a->nd) != plan.shape.size())
      return nullptr;
    for (int i = 0; i < a->nd; ++i)
      if (a->dimensions[i] != plan.shape[i]) return nullptr;
    return &plan;
  }

  // Nothing else in flight on this rank, and nothing the replicas track by name
  // (ShmAgreement.express's checks, and _bit_ok).
  bool idle(PyObject* name) const {
    if (PyObject_Size(queue_.ptr()) != 0 || PyDict_GET_SIZE(local_.ptr()) != 0 ||
        PyObject_Size(control_items_.ptr()) != 0 || PyDict_GET_SIZE(bit_pending_.ptr()) != 0 ||
        PyList_GET_SIZE(ready_.ptr()) != 0 || PyList_GET_SIZE(joined_.ptr()) != 0)
      return false;
    // (an unnamed op's name is not given yet: any op the replicas track might be it)
    if (PyDict_GET_SIZE(pending_.ptr()) != 0 &&
        (name == Py_None || PyDict_Contains(pending_.ptr(), name) != 0))
      return false;
    if (PyDict_GET_SIZE(tombstones_.ptr()) != 0 &&
        (name == Py_None || PyDict_Contains(tombstones_.ptr(), name) != 0))
      return false;
    PyObject* active = PyDict_GetItemWithError(timeline_.ptr(), active_key_.ptr());
    if (active != nullptr && active != Py_None) return false;
    return flag_off(broken_key_) && flag_off(stopping_key_);
  }

  void count_unnamed() {
    py::object n = engine_.attr(counter_key_);
    engine_.attr(counter_key_) = py::int_(n.cast<int64_t>() + 1);
  }

  bool flag_off(const py::str& attr) const {
    PyObject* v = PyObject_GetAttr(engine_.ptr(), attr.ptr());
    if (v == nullptr) {
      PyErr_Clear();
      return false;
    }
    const bool off = PyObject_IsTrue(v) == 0;
    Py_DECREF(v);
    return off;
  }

  // The Ctrl-C gate is SIGINT's handler (a builtin's call: no Python code runs).
  bool gate_installed() const {
    PyObject* arg = sigint_.ptr();
    PyObject* h = PyObject_Vectorcall(getsignal_.ptr(), &arg, 1, nullptr);
    if (h == nullptr) {
      PyErr_Clear();
      return false;
    }
    const bool ours = h == gate_.ptr();
    Py_DECREF(h);
    return ours;
  }

  bool try_lock() const {
    PyObject* no = Py_False;
    PyObject* r = PyObject_Vectorcall(acquire_.ptr(), &no, 1, nullptr);
    if (r == nullptr) throw py::error_already_set();
    const bool got = r == Py_True;
    Py_DECREF(r);
    return got;
  }

  // A new array of `array`'s dtype and shape: numpy's own below the buffer pool's size,
  // else from the pool (nbdist.common.buffers.empty_like).
  py::object output_like(PyObject* array, size_t nbytes) const {
    auto* a = py::detail::array_proxy(array);
    if (nbytes >= pool_min_bytes_) return empty_like_(py::handle(array));
    auto& api = py::detail::npy_api::get();
    Py_INCREF(a->descr);  // (stolen by the call)
    PyObject* out = api.PyArray_NewFromDescr_(api.PyArray_Type_, a->descr, a->nd, a->dimensions,
                                              nullptr, nullptr, 0, nullptr);
    if (out == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(out);
  }

  // A new array of an allgather plan's result (its dtype and shape), as output_like makes it.
  py::object output_shaped(const Plan& plan) const {
    size_t nbytes = plan.itemsize;
    for (Py_ssize_t d : plan.out_shape) nbytes *= static_cast<size_t>(d);
    if (nbytes >= pool_min_bytes_) return empty_(py::cast(plan.out_shape), plan.dtype);
    auto& api = py::detail::npy_api::get();
    Py_INCREF(plan.dtype.ptr());  // (stolen by the call)
    PyObject* out = api.PyArray_NewFromDescr_(
        api.PyArray_Type_, plan.dtype.ptr(), static_cast<int>(plan.out_shape.size()),
        const_cast<Py_intptr_t*>(plan.out_shape.data()), nullptr, nullptr, 0, nullptr);
    if (out == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(out);
  }

  py::object control_, engine_, agreement_, gate_, getsignal_;
  unsigned long main_thread_;
  py::dict timeline_;
  py::object global_set_;
  double wait_s_, timeout_s_;
  size_t pool_min_bytes_;
  py::object empty_like_, empty_;
  PyShm* control_shm_;
  py::object queue_, local_, control_items_, bit_pending_, ready_, joined_, pending_, tombstones_,
      cache_by_id_, acquire_, release_, sigint_;
  py::str active_key_, broken_key_, stopping_key_, last_cycle_key_, depth_key_,
      counter_key_;
  StopHook stop_;
  std::array<py::dict, kKinds> plans_;  // by kind: name -> index in plans_list_
  std::vector<Plan> plans_list_;
  std::array<int64_t, kKinds> runs_{};  // ops run, by kind
  int calls_ = 0;  // calls inside now
  bool closed_ = false;
};

// The global process set's table, and its Python object (a strong reference; raw, so that
// nothing is released at exit after the interpreter is gone). nullptr: none.
ExpressTable* g_default = nullptr;
PyObject* g_default_obj = nullptr;

void set_default(ExpressTable* table, PyObject* obj) {
  Py_XINCREF(obj);
  PyObject* old = g_default_obj;
  g_default = table;
  g_default_obj = obj;
  Py_XDECREF(old);
}

// Call one of the default table's fast paths (METH_FASTCALL: ~1 us less than pybind11's
// dispatch); `usage` is the TypeError for another number of arguments.
template <class Fast>
PyObject* entry(Py_ssize_t nargs, Py_ssize_t want, const char* usage, Fast fast) {
  if (nargs != want) {
    PyErr_SetString(PyExc_TypeError, usage);
    return nullptr;
  }
  if (g_default == nullptr) Py_RETURN_NONE;
  // alive for the call, even if another thread lets it go while the op waits
  py::object keep = py::reinterpret_borrow<py::object>(g_default_obj);
  try {
    return fast(*g_default).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyObject* express_allreduce_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return entry(nargs, 7,
               "express_allreduce(array, op, name, prescale, postscale, process_set, inplace)",
               [&](ExpressTable& t) {
                 return t.allreduce(args[0], args[1], args[2], args[3], args[4], args[5],
                                    args[6] == Py_True);
               });
}

PyObject* express_allgather_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return entry(nargs, 3, "express_allgather(array, name, process_set)",
               [&](ExpressTable& t) { return t.allgather(args[0], args[1], args[2]); });
}

PyObject* express_broadcast_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return entry(nargs, 5, "express_broadcast(array, root_rank, name, process_set, inplace)",
               [&](ExpressTable& t) {
                 return t.broadcast(args[0], args[1], args[2], args[3], args[4] == Py_True);
               });
}

PyCFunction fast_call(PyObject* (*f)(PyObject*, PyObject* const*, Py_ssize_t)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(f));
}

const char* const kReturns =
    ": the default express table's fast path (see ExpressTable):\n"
    "None, the result, or a tuple for Python to finish (the agreement lock held).";
const std::string allreduce_doc =
    std::string("express_allreduce(array, op, name, prescale, postscale, process_set, inplace)") +
    kReturns;
const std::string allgather_doc = std::string("express_allgather(array, name, process_set)") + kReturns;
const std::string broadcast_doc =
    std::string("express_broadcast(array, root_rank, name, process_set, inplace)") + kReturns;

PyMethodDef express_defs[] = {
    {"express_allreduce", fast_call(&express_allreduce_entry), METH_FASTCALL, allreduce_doc.c_str()},
    {"express_allgather", fast_call(&express_allgather_entry), METH_FASTCALL, allgather_doc.c_str()},
    {"express_broadcast", fast_call(&express_broadcast_entry), METH_FASTCALL, broadcast_doc.c_str()},
};

}  // namespace

void bind_express(py::module_& m) {
  py::class_<ExpressTable>(m, "ExpressTable",
                           "The plans of cached synchronous ops that run in one native call.")
      .def(py::init<py::object, py::object, py::object, py::object, py::object, unsigned long,
                    py::dict, py::object, double, double, size_t, py::object, py::object,
                    std::string>(),
           py::arg("control"), py::arg("engine"), py::arg("agreement"), py::arg("gate"),
           py::arg("getsignal"), py::arg("main_thread"), py::arg("timeline"),
           py::arg("global_set"), py::arg("wait_s"), py::arg("timeout_s"),
           py::arg("pool_min_bytes"), py::arg("empty_like"), py::arg("empty"),
           py::arg("stop_reason"))
      .def("enter", &ExpressTable::enter, py::arg("name"), py::arg("cid"), py::arg("dtype"),
           py::arg("shape"), py::arg("op"), py::arg("postscale"), py::arg("data"),
           py::arg("dtype_code"), py::arg("op_code"), py::arg("factor"),
           "Enter (or replace) the plan of the allreduce named `name`.")
      .def("enter_allgather", &ExpressTable::enter_allgather, py::arg("name"), py::arg("cid"),
           py::arg("dtype"), py::arg("shape"), py::arg("data"), py::arg("byte_counts"),
           py::arg("out_shape"), "Enter (or replace) the plan of the allgather named `name`.")
      .def("enter_broadcast", &ExpressTable::enter_broadcast, py::arg("name"), py::arg("cid"),
           py::arg("dtype"), py::arg("shape"), py::arg("data"), py::arg("root"), py::arg("own"),
           "Enter (or replace) the plan of the broadcast named `name` (`own`: from this rank).")
      .def("forget", &ExpressTable::forget, py::arg("name"))
      .def(
          "make_default", [](py::object self) { set_default(&self.cast<ExpressTable&>(), self.ptr()); },
          "Make this the table the module's express_* functions use (the global process set's).")
      .def(
          "close",
          [](ExpressTable& t) {
            t.close();
            if (g_default == &t) set_default(nullptr, nullptr);
          },
          "No op goes through this table from now on.")
      .def_property_readonly("runs", &ExpressTable::runs, "Ops run by the fast paths.")
      .def_property_readonly("allreduce_runs", &ExpressTable::allreduce_runs,
                             "Allreduces run by the fast path.");
  for (PyMethodDef& def : express_defs)
    m.add_object(def.ml_name, py::reinterpret_steal<py::object>(PyCFunction_New(&def, nullptr)));
}

}  // namespace nbdist
