// PyShm: the Python side of a ShmComm, shared by the bindings (module.cpp) and the express
// table (express_table.cpp), and the agreement calls the table makes.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <utility>

#include "py_hooks.hpp"
#include "shm_comm.hpp"

namespace nbdist {

// The Python side of a ShmComm: counts ops in flight, so that close() from
// another thread never unmaps memory a running op still uses.
class PyShm {
 public:
  explicit PyShm(std::unique_ptr<ShmComm> comm) : comm_(std::move(comm)) {}

  // Runs `body` on the comm with the GIL released. `should_stop` (None or a
  // callable returning a reason or None) is polled about every 100 ms once asleep.
  template <class Body>
  void run(const char* what, double timeout_s, const pybind11::object& should_stop, Body&& body) {
    run(what, timeout_s, make_stop_hook(should_stop), std::forward<Body>(body));
  }

  // The same with the hook already made (the express table's reads no Python code).
  template <class Body>
  void run(const char* what, double timeout_s, StopHook should_stop, Body&& body) {
    WaitContext ctx;
    ctx.what = what;
    ctx.timeout_s = timeout_s;
    ctx.should_stop = std::move(should_stop);
    active_.fetch_add(1);
    struct Leave {
      std::atomic<int>& a;
      ~Leave() { a.fetch_sub(1); }
    } leave{active_};
    if (!comm_) throw ShmError(std::string("shm ") + what + ": the transport is closed");
    pybind11::gil_scoped_release release;
    body(*comm_, ctx);
  }

  ShmComm& comm() {
    if (!comm_) throw ShmError("shm: the transport is closed");
    return *comm_;
  }

  // Aborts ops still running in other threads, waits for them to leave, unmaps.
  void close() {
    if (!comm_) return;
    {
      pybind11::gil_scoped_release release;
      if (active_.load() > 0) {
        comm_->abort("the shm transport was closed while an op was running");
        for (int i = 0; i < 200 && active_.load() > 0; ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    if (active_.load() > 0) {
      comm_.release();  // an op is stuck inside: leak the mapping rather than crash it
      return;
    }
    comm_->unlink();
    comm_.reset();
  }

 private:
  std::unique_ptr<ShmComm> comm_;
  std::atomic<int> active_{0};
};

// peers_came, then one agreement cycle that runs this rank's one cached allreduce when every
// rank is ready for it (module.cpp, agree_then): False, None (ran) or the vote's answer.
pybind11::object express_allreduce(PyShm& s, int64_t bit, int64_t nbits, double wait_s, PyShm& data,
                                   const pybind11::array& src, const pybind11::array& dst,
                                   size_t count, int dtype, int op, double factor, double timeout_s,
                                   const StopHook& stop);

// The same for one cached allgatherv (bytes from each rank) and one cached broadcast.
pybind11::object express_allgather(PyShm& s, int64_t bit, int64_t nbits, double wait_s, PyShm& data,
                                   const pybind11::array& send, const pybind11::array& recv,
                                   const std::vector<int64_t>& byte_counts, double timeout_s,
                                   const StopHook& stop);
pybind11::object express_broadcast(PyShm& s, int64_t bit, int64_t nbits, double wait_s, PyShm& data,
                                   const pybind11::array& buf, size_t nbytes, int root,
                                   double timeout_s, const StopHook& stop, const void* src);

void bind_express(pybind11::module_& m);  // express_table.cpp

}  // namespace nbdist
