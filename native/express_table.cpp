// The express table: the one native call under a synchronous hvd.allreduce / allreduce_ of
// a CPU op that the response cache knows (nbdist/common/agreement.py, ShmAgreement).
//
// Python works an op's plan out once (ShmAgreement._express_plan: cache id, transport,
// native codes) and enters it here under the op's name (None: the unnamed ops' template of
// that signature, numbered here as Engine.auto_name numbers them). From then on
// express_allreduce(), called first thing by nbdist.common's allreduce and allreduce_
// (ops._allreduce), checks in C++ what the Python path would check (the user's arguments
// against the plan, the engine with nothing else in flight), takes the agreement lock
// without waiting, and runs the vote and the bytes in one call (nbdist::express_allreduce).
// It returns:
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

#include <chrono>
#include <csignal>
#include <string>
#include <vector>

#include "py_shm.hpp"

namespace py = pybind11;

namespace nbdist {
namespace {

// What the Python path checks of a call, worked out once for one name.
struct Plan {
  int64_t cid = 0;
  py::object dtype;  // the array's dtype object: numpy's are singletons
  std::vector<Py_ssize_t> shape;
  py::object op;  // the resolved ReduceOp member the call passes
  double postscale = 1.0;
  py::object data;  // the data transport's PyShm (kept alive by this reference)
  PyShm* data_shm = nullptr;
  size_t itemsize = 0;
  int dtype_code = 0, op_code = 0;
  double factor = 1.0;
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
               py::object empty_like, std::string stop_reason)
      : control_(std::move(control)), engine_(std::move(engine)), agreement_(std::move(agreement)),
        gate_(std::move(gate)), getsignal_(std::move(getsignal)), main_thread_(main_thread),
        timeline_(std::move(timeline)), global_set_(std::move(global_set)), wait_s_(wait_s),
        timeout_s_(timeout_s), pool_min_bytes_(pool_min_bytes), empty_like_(std::move(empty_like)) {
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

  // Enter (or replace) the plan of the op named `name`; None: of the next unnamed op.
  void enter(py::object name, int64_t cid, py::object dtype, std::vector<Py_ssize_t> shape,
             py::object op, double postscale, py::object data, int dtype_code, int op_code,
             double factor) {
    PyShm* shm = &data.cast<PyShm&>();
    const size_t itemsize = dtype.attr("itemsize").cast<size_t>();
    Plan plan{cid, std::move(dtype), std::move(shape), std::move(op), postscale, std::move(data),
              shm, itemsize, dtype_code, op_code, factor};
    PyObject* at = PyDict_GetItemWithError(plans_.ptr(), name.ptr());
    if (at != nullptr) {
      plans_list_[PyLong_AsSsize_t(at)] = std::move(plan);
      return;
    }
    if (PyErr_Occurred()) throw py::error_already_set();
    plans_[name] = py::int_(plans_list_.size());
    plans_list_.push_back(std::move(plan));
  }

  void forget(py::object name) {
    if (PyDict_DelItem(plans_.ptr(), name.ptr()) != 0) PyErr_Clear();
  }

  // From now on no op goes through this table; its references to the engine go once no
  // call is inside (they would keep the engine alive: Python's collector cannot see them).
  void close() {
    closed_ = true;
    if (calls_ == 0) let_go();
  }
  int64_t runs() const { return runs_; }

  // The fast path (see the top of this file); arguments as the user passed them.
  py::object allreduce(PyObject* array, PyObject* op, PyObject* name, PyObject* prescale,
                       PyObject* postscale, PyObject* process_set, bool inplace) {
    struct Inside {  // (the GIL is held whenever calls_ changes)
      ExpressTable& t;
      explicit Inside(ExpressTable& table) : t(table) { ++t.calls_; }
      ~Inside() {
        if (--t.calls_ == 0 && t.closed_) t.let_go();
      }
    } inside(*this);
    const Plan* plan = plan_for(array, op, name, prescale, postscale, process_set, inplace);
    if (plan == nullptr || !idle(name)) return py::none();
    const bool main = PyThread_get_thread_ident() == main_thread_;
    if (main && !gate_installed()) return py::none();  // the Python path installs it
    auto* a = py::detail::array_proxy(array);
    size_t count = 1;
    for (int i = 0; i < a->nd; ++i) count *= static_cast<size_t>(a->dimensions[i]);
    py::object out = inplace ? py::reinterpret_borrow<py::object>(array)
                             : output_like(array, count * plan->itemsize);
    if (!try_lock()) return py::none();
    // From here on the lock is held: whatever fails is handed to Python with it (below),
    // which releases it and breaks the runtime with the rank named (Engine.express_resume).
    const int64_t nbits = (PyDict_GET_SIZE(cache_by_id_.ptr()) + 15) / 16 * 16;
    // (read now: the table may change while the op lets the GIL go)
    const int64_t cid = plan->cid;
    const int dtype_code = plan->dtype_code, op_code = plan->op_code;
    const double factor = plan->factor;
    const py::object data = plan->data;
    PyShm& data_shm = *plan->data_shm;
    py::object voted;
    py::object error = py::none();
    try {
      // An unnamed op is numbered as Engine.auto_name numbers it (Python gives the name
      // itself only to an op that must wait: Engine.last_auto_name).
      if (name == Py_None) count_unnamed();
      voted = express_allreduce(*control_shm_, cid, nbits, wait_s_, data_shm,
                                py::reinterpret_borrow<py::array>(array),
                                py::reinterpret_borrow<py::array>(out.ptr()), count, dtype_code,
                                op_code, factor, timeout_s_, stop_);
    } catch (py::error_already_set& e) {
      error = py::str(e.what());
    } catch (std::exception& e) {
      error = py::str(e.what());
    }
    if (error.is_none() && voted.is_none()) {  // ran
      ++runs_;
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
    return py::make_tuple(voted.is_none() ? py::none() : voted, out, error, py::bool_(main));
  }

 private:
  void let_go() {
    plans_list_.clear();
    plans_ = py::dict();
    for (py::object* o : {&control_, &engine_, &agreement_, &gate_, &getsignal_, &global_set_,
                          &empty_like_, &queue_, &local_, &control_items_, &bit_pending_, &ready_,
                          &joined_, &pending_, &tombstones_, &cache_by_id_, &acquire_, &release_})
      *o = py::none();
    timeline_ = py::dict();
    stop_ = nullptr;
    control_shm_ = nullptr;
  }

  // The plan whose checks this call passes, or nullptr.
  const Plan* plan_for(PyObject* array, PyObject* op, PyObject* name, PyObject* prescale,
                       PyObject* postscale, PyObject* process_set, bool inplace) {
    auto& api = py::detail::npy_api::get();
    if (closed_ || Py_TYPE(array) != api.PyArray_Type_ || (!PyUnicode_CheckExact(name) && name != Py_None))
      return nullptr;
    if (process_set != Py_None && process_set != global_set_.ptr()) return nullptr;
    double pre = 0.0, post = 0.0;
    if (!number_of(prescale, pre) || pre != 1.0 || !number_of(postscale, post)) return nullptr;
    PyObject* at = PyDict_GetItemWithError(plans_.ptr(), name);
    if (at == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    const Plan& plan = plans_list_[PyLong_AsSsize_t(at)];
    auto* a = py::detail::array_proxy(array);
    const int need = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ |
                     (inplace ? py::detail::npy_api::NPY_ARRAY_WRITEABLE_ : 0);
    if ((a->flags & need) != need || a->descr != plan.dtype.ptr() || op != plan.op.ptr() ||
        post != plan.postscale || static_cast<size_t>(a->nd) != plan.shape.size())
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

  py::object control_, engine_, agreement_, gate_, getsignal_;
  unsigned long main_thread_;
  py::dict timeline_;
  py::object global_set_;
  double wait_s_, timeout_s_;
  size_t pool_min_bytes_;
  py::object empty_like_;
  PyShm* control_shm_;
  py::object queue_, local_, control_items_, bit_pending_, ready_, joined_, pending_, tombstones_,
      cache_by_id_, acquire_, release_, sigint_;
  py::str active_key_, broken_key_, stopping_key_, last_cycle_key_, depth_key_,
      counter_key_;
  StopHook stop_;
  py::dict plans_;  // name -> index in plans_list_
  std::vector<Plan> plans_list_;
  int64_t runs_ = 0;
  int calls_ = 0;  // calls of allreduce() inside now
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

PyObject* express_allreduce_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError,
                    "express_allreduce(array, op, name, prescale, postscale, process_set, inplace)");
    return nullptr;
  }
  if (g_default == nullptr) Py_RETURN_NONE;
  // alive for the call, even if another thread lets it go while the op waits
  py::object keep = py::reinterpret_borrow<py::object>(g_default_obj);
  try {
    return g_default
        ->allreduce(args[0], args[1], args[2], args[3], args[4], args[5], args[6] == Py_True)
        .release()
        .ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef express_allreduce_def = {
    "express_allreduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&express_allreduce_entry)),
    METH_FASTCALL,
    "express_allreduce(array, op, name, prescale, postscale, process_set, inplace): the\n"
    "default express table's fast path (see ExpressTable): None, the result, or a tuple\n"
    "for Python to finish (the agreement lock held)."};

}  // namespace

void bind_express(py::module_& m) {
  py::class_<ExpressTable>(m, "ExpressTable",
                           "The plans of cached allreduces that run in one native call.")
      .def(py::init<py::object, py::object, py::object, py::object, py::object, unsigned long,
                    py::dict, py::object, double, double, size_t, py::object, std::string>(),
           py::arg("control"), py::arg("engine"), py::arg("agreement"), py::arg("gate"),
           py::arg("getsignal"), py::arg("main_thread"), py::arg("timeline"),
           py::arg("global_set"), py::arg("wait_s"), py::arg("timeout_s"),
           py::arg("pool_min_bytes"), py::arg("empty_like"), py::arg("stop_reason"))
      .def("enter", &ExpressTable::enter, py::arg("name"), py::arg("cid"), py::arg("dtype"),
           py::arg("shape"), py::arg("op"), py::arg("postscale"), py::arg("data"),
           py::arg("dtype_code"), py::arg("op_code"), py::arg("factor"),
           "Enter (or replace) the plan of the allreduce named `name`.")
      .def("forget", &ExpressTable::forget, py::arg("name"))
      .def(
          "make_default", [](py::object self) { set_default(&self.cast<ExpressTable&>(), self.ptr()); },
          "Make this the table express_allreduce() uses (the global process set's).")
      .def(
          "close",
          [](ExpressTable& t) {
            t.close();
            if (g_default == &t) set_default(nullptr, nullptr);
          },
          "No op goes through this table from now on.")
      .def_property_readonly("runs", &ExpressTable::runs, "Ops run by the fast path.");
  m.add_object("express_allreduce",
               py::reinterpret_steal<py::object>(PyCFunction_New(&express_allreduce_def, nullptr)));
}

}  // namespace nbdist
