// nbdist._native: the C++ data path (shared memory on one node, NCCL on GPUs).
//
// The shm collectives take the numpy arrays themselves (reading an address in Python,
// __array_interface__, costs ~1 us an array, on every small op); the Python side checks
// dtype, contiguity and sizes, and the call keeps the arrays alive. Every op runs with
// the GIL released: addresses are read before it is let go.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "kernels.hpp"
#include "nccl.hpp"
#include "py_hooks.hpp"
#include "py_shm.hpp"
#include "shm_comm.hpp"

namespace py = pybind11;
using nbdist::PyShm;
using nbdist::ShmComm;
using nbdist::StopHook;
using nbdist::WaitContext;

namespace {

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

// An array's data (the Python side has checked the array: C-contiguous, writeable where
// written). Read while the GIL is held, before an op lets it go.
void* data_of(const py::array& a) { return const_cast<void*>(a.data()); }

// The words of an agreement vote (ShmComm::vote): one per rank, one per cache slot, and
// the "packed" flag last.
size_t vote_word_count(int n, int64_t nbits) { return static_cast<size_t>(n + nbits + 1); }
std::vector<int32_t> vote_words(int n, int64_t nbits) {
  return std::vector<int32_t>(vote_word_count(n, nbits), 0);
}

// Quiet: no rank has items, and the op of cache bit `bit` is ready on every rank.
bool quiet_vote(const int32_t* v, int n, int64_t bit) {
  if (v[n + bit] == 0) return false;
  for (int r = 0; r < n; ++r)
    if (v[r] != 0) return false;
  return true;
}

// A whole agreement cycle for the commonest case (nbdist/common/agreement.py): this rank's
// only queued op is one cached op (cache bit `bit`). The vote is agree()'s; when it finds no
// rank with items and that op ready everywhere, every rank runs that one op next (a rank with
// more queued ops finds the same unit in Python), so it runs here, with no return to Python
// between the vote and the bytes: in the vote itself when vote() packed it (a small
// allreduce's data, or a single-copy op's address: one synchronisation for the vote and the
// op's start), else run_data() on the data segment. vote(comm, words, may_run, ctx) is
// ShmComm::vote or a twin, returning whether it ran the op; `what` names the call in its
// errors. Returns None when the op ran; else the vote's answer, as agree() returns it.
template <class Vote, class RunData>
py::object agree_then(PyShm& s, int64_t bit, int64_t nbits, const char* what, Vote vote,
                      RunData run_data, double timeout_s, const StopHook& stop) {
  const int n = s.comm().size();
  if (bit < 0 || bit >= nbits) throw py::value_error("agreement: cache bit out of range");
  std::vector<int32_t> vec = vote_words(n, nbits);
  vec[n + bit] = 1;
  bool ran = false;
  // This rank's one queued op is in the vote from now: a peer that finishes first and
  // submits its next op must not count it as still queued (it would start a cycle this
  // rank is not in). When the vote does not run the op, the caller publishes it again
  // (agreement.py, _after_vote).
  s.comm().publish_queued(0);
  s.run(what, timeout_s, stop, [&](ShmComm& c, WaitContext& ctx) {
    ran = vote(c, vec, [&](const int32_t* v) { return quiet_vote(v, n, bit); }, ctx);
  });
  if (ran) return py::none();
  if (!quiet_vote(vec.data(), n, bit)) {
    py::list lengths(n);
    for (int r = 0; r < n; ++r) lengths[r] = -static_cast<int64_t>(vec[r]);
    py::list ready;
    if (vec[n + bit] != 0) ready.append(bit);
    return py::make_tuple(lengths, ready);
  }
  // Quiet, but not carried by the vote (too big, or a rank that runs it through Python's
  // executor did not pack it): on the data segment.
  run_data();
  return py::none();
}

using MayRun = std::function<bool(const int32_t*)>;

// The vote alone: nothing packed.
bool plain_vote(ShmComm& c, std::vector<int32_t>& vec, const MayRun& may_run, WaitContext& ctx) {
  return c.vote(vec.data(), vec.size(), nullptr, nullptr, 0, nbdist::kI32, nbdist::kMin, may_run, ctx);
}

py::object agree_allreduce(PyShm& s, int64_t bit, int64_t nbits, PyShm& data, const py::array& src,
                           const py::array& dst, size_t count, int dtype, int op, double factor,
                           double timeout_s, const StopHook& stop) {
  ShmComm::check_factor(dtype, factor);
  void* const from = data_of(src);
  void* const to = data_of(dst);
  const size_t nbytes = count * nbdist::dtype_size(dtype);
  // Small enough to travel with the vote: then one synchronisation does both. Big enough
  // for single copy: the vote carries the addresses, and the bytes move in the same call.
  const bool packs = nbytes <= s.comm().vote_room(vote_word_count(s.comm().size(), nbits));
  ShmComm& bytes = data.comm();
  const bool single = !packs && s.comm().vote_carries() && bytes.cma_reduces(nbytes);
  return agree_then(s, bit, nbits, single ? "allreduce" : "agreement",
      [&](ShmComm& c, std::vector<int32_t>& vec, const MayRun& may_run, WaitContext& ctx) {
        if (single)  // (scaled slice by slice, as it is reduced)
          return c.vote_allreduce(vec.data(), vec.size(), from, to, count, dtype, op, factor,
                                  may_run, bytes, ctx);
        if (!packs) return plain_vote(c, vec, may_run, ctx);
        const bool ran = c.vote(vec.data(), vec.size(), from, to, count, dtype, op, may_run, ctx);
        if (ran && factor != 1.0) nbdist::scale_in_place(to, count, dtype, factor);
        return ran;
      },
      [&]() {
        data.run("allreduce", timeout_s, stop, [&](ShmComm& c, WaitContext& ctx) {
          c.allreduce(from, to, count, dtype, op, ctx, factor);
        });
      }, timeout_s, stop);
}

// An allgather or broadcast after its vote (agree_then): carried by the vote (`carried`,
// ShmComm::vote_allgatherv or vote_broadcast) when this rank's data segment moves it
// single-copy, else the plain vote and then `data_op` on the data segment. Every rank
// decides alike: the vote's "packed" flag is 1 only when all of them packed.
template <class Carried, class DataOp>
py::object agree_carried(PyShm& s, int64_t bit, int64_t nbits, PyShm& data, bool wants_cma,
                         const char* what, Carried carried, DataOp data_op, double timeout_s,
                         const StopHook& stop) {
  const bool packs = s.comm().vote_carries() && wants_cma;
  return agree_then(s, bit, nbits, packs ? what : "agreement",
      [&](ShmComm& c, std::vector<int32_t>& vec, const MayRun& may_run, WaitContext& ctx) {
        if (!packs) return plain_vote(c, vec, may_run, ctx);
        return carried(c, vec, may_run, ctx);
      },
      [&]() { data.run(what, timeout_s, stop, data_op); }, timeout_s, stop);
}

py::object agree_allgather(PyShm& s, int64_t bit, int64_t nbits, PyShm& data, const py::array& send,
                           const py::array& recv, const std::vector<int64_t>& byte_counts,
                           double timeout_s, const StopHook& stop) {
  const void* const from = data_of(send);
  void* const to = data_of(recv);
  ShmComm& bytes = data.comm();
  // Single-copy: the vote carries this rank's address, and the peers read once it is out.
  return agree_carried(s, bit, nbits, data, bytes.wants_cma_allgatherv(byte_counts), "allgather",
      [&](ShmComm& c, std::vector<int32_t>& vec, const MayRun& may_run, WaitContext& ctx) {
        return c.vote_allgatherv(vec.data(), vec.size(), from, to, byte_counts, may_run, bytes, ctx);
      },
      [&](ShmComm& c, WaitContext& ctx) { c.allgatherv(from, to, byte_counts, ctx); },
      timeout_s, stop);
}

py::object agree_broadcast(PyShm& s, int64_t bit, int64_t nbits, PyShm& data, const py::array& buf,
                           size_t nbytes, int root, double timeout_s, const StopHook& stop,
                           const void* src) {
  void* const p = data_of(buf);
  ShmComm& bytes = data.comm();
  return agree_carried(s, bit, nbits, data, bytes.wants_cma_broadcast(nbytes), "broadcast",
      [&](ShmComm& c, std::vector<int32_t>& vec, const MayRun& may_run, WaitContext& ctx) {
        return c.vote_broadcast(vec.data(), vec.size(), p, nbytes, root, src, may_run, bytes, ctx);
      },
      [&](ShmComm& c, WaitContext& ctx) { c.broadcast(p, nbytes, root, ctx, src); },
      timeout_s, stop);
}

// The express path's start (a synchronous cached op from the thread that waits for it,
// nbdist/common/agreement.py): hold the engine thread's activity watch (this thread joins
// the peers' cycles now; let go once the op ran, else by the caller), publish the op as
// queued, and wait up to wait_s for every peer to have ops queued too (or to have started
// a cycle). False when they did not come: the op stays published as queued.
bool peers_came(ShmComm& c, double wait_s) {
  c.hold_activity(true);
  c.publish_queued(1);
  if (c.peers_queued() || c.peer_ahead()) return true;
  py::gil_scoped_release release;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  // Yield at once: a peer sharing this core gets to submit, and polling the peers' words
  // in a tight loop would slow the peer's write to them.
  while (!c.peers_queued() && !c.peer_ahead()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// peers_came, then the op's agreement cycle; False, None (ran) or the vote's answer.
template <class Agree>
py::object express(PyShm& s, double wait_s, Agree agree) {
  ShmComm& c = s.comm();
  if (!peers_came(c, wait_s)) return py::bool_(false);
  py::object voted = agree();
  if (voted.is_none()) c.hold_activity(false);
  return voted;
}

void bind_shm(py::module_& m) {
  py::class_<PyShm>(m, "ShmComm", "Collectives among the ranks of one node through shared memory.")
      .def_static(
          "create",
          [](int nranks, int global_rank, size_t slot_bytes, int nsets) {
            auto seg = nbdist::Segment::create(nranks, slot_bytes, nsets);
            return std::make_unique<PyShm>(std::make_unique<ShmComm>(std::move(seg), 0, global_rank));
          },
          py::arg("nranks"), py::arg("global_rank"), py::arg("slot_bytes"), py::arg("nsets"),
          "Create a fresh segment (local rank 0).")
      .def_static(
          "attach",
          [](const std::string& name, int nranks, int local_rank, int global_rank) {
            auto seg = nbdist::Segment::attach(name, nranks);
            return std::make_unique<PyShm>(
                std::make_unique<ShmComm>(std::move(seg), local_rank, global_rank));
          },
          py::arg("name"), py::arg("nranks"), py::arg("local_rank"), py::arg("global_rank"),
          "Attach to the segment local rank 0 created.")
      .def_property_readonly("name", [](PyShm& s) { return s.comm().name(); })
      .def_property_readonly("slot_bytes", [](PyShm& s) { return s.comm().slot_bytes(); })
      .def("register_rank", [](PyShm& s) { return s.comm().register_rank(); },
           "Count this rank in; the last one unlinks the name. True if this call unlinked it.")
      .def("unlink", [](PyShm& s) { s.comm().unlink(); })
      .def("close", &PyShm::close)
      .def("set_tuning",
           [](PyShm& s, int spin, int yields, size_t small_bytes, size_t stream_bytes) {
             s.comm().set_spin(spin, yields);
             s.comm().set_small_bytes(small_bytes);
             s.comm().set_stream_bytes(stream_bytes ? stream_bytes : SIZE_MAX);
           })
      .def("abort", [](PyShm& s, const std::string& reason) { s.comm().abort(reason); },
           py::call_guard<py::gil_scoped_release>())
      .def("abort_reason", [](PyShm& s) { return s.comm().abort_reason(); })
      .def("set_cma_bytes", [](PyShm& s, size_t broadcast, size_t allgather) {
        s.comm().set_cma_bytes(broadcast, allgather);
      })
      .def("set_cma_allreduce_bytes", [](PyShm& s, size_t bytes) {
        s.comm().set_cma_allreduce_bytes(bytes);
      })
      .def("set_path_tuning",
           [](PyShm& s, bool broadcast, bool allgather, bool allreduce) {
             s.comm().set_path_tuning(broadcast, allgather, allreduce);
           },
           py::arg("broadcast"), py::arg("allgather"), py::arg("allreduce"),
           "Choose single copy or the slots by measurement for these kinds, from 256 KiB "
           "(after set_cma_bytes and set_cma_allreduce_bytes; the same on every rank).")
      .def("path_plan",
           [](PyShm& s) {
             const nbdist::ShmComm& c = s.comm();
             const nbdist::PathPlan& p = c.path_plan();
             return py::make_tuple(p.cma[nbdist::kPathBroadcast], p.cma[nbdist::kPathAllgather],
                                   p.cma[nbdist::kPathAllreduce], c.plans_carried());
           },
           "The plan in force: (broadcast, allgather, allreduce) bit masks, where bit c sends "
           "[2^c, 2^(c+1)) bytes single-copy, and the ops (allreduces, allgathers, broadcasts from rank 0) that carried a plan so far.")
      .def("path_timings",
           [](PyShm& s) {
             const nbdist::ShmComm& c = s.comm();
             const nbdist::PathTuner& t = c.path_tuner();
             static const char* const kinds[] = {"broadcast", "allgather", "allreduce"};
             py::list rows;
             for (int k = 0; k < nbdist::kPathKinds; ++k) {
               const auto kind = static_cast<nbdist::PathKind>(k);
               for (int cls = nbdist::PathTuner::kMinClass; cls < nbdist::PathTuner::kClasses; ++cls) {
                 if (t.timed(kind, cls) == 0) continue;
                 rows.append(py::make_tuple(kinds[k], uint64_t{1} << cls, t.timed(kind, cls),
                                            t.median_ns_per_byte(kind, cls, false),
                                            t.median_ns_per_byte(kind, cls, true),
                                            t.prefers_cma(kind, cls)));
               }
             }
             return rows;
           },
           "Local rank 0's path timings: (kind, class bytes, transfers timed, median ns per "
           "byte through the slots, single-copy (-1: none yet), whether single copy is the "
           "one kept) per class timed.")
      .def("set_vote_carries", [](PyShm& s, bool on) { s.comm().set_vote_carries(on); },
           "An agreement segment's votes carry single-copy ops' addresses (default on).")
      .def("publish_queued", [](PyShm& s, int64_t v) { s.comm().publish_queued(v); })
      .def("peers_queued", [](PyShm& s) { return s.comm().peers_queued(); })
      .def("hold_activity", [](PyShm& s, bool on) { s.comm().hold_activity(on); },
           "While on, wait_activity ignores the peers (another thread joins their cycles).")
      .def("peer_ahead", [](PyShm& s) { return s.comm().peer_ahead(); },
           "True when a peer has started an op on the segment that this rank has not.")
      .def("ring", [](PyShm& s) { s.comm().ring(); },
           "Wake this process's wait_activity (any thread).")
      .def("ring_soon", [](PyShm& s) { s.comm().ring_soon(); },
           "ring(), for an op this thread will likely drive in a moment: wait_activity "
           "leaves it to a thread that holds the watch within a few yields.")
      .def("clear_absorbed", [](PyShm& s) { s.comm().clear_absorbed(); },
           "The holder of the watch took the queue: a ring_soon() left to it is answered.")
      .def("wait_activity", [](PyShm& s, double timeout_s) { return s.comm().wait_activity(timeout_s); },
           py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
           "Sleep until a peer starts an op, ring(), an abort, or the timeout: 1, 2, 3 or 0.")
      .def("clear_shared", [](PyShm& s) { s.comm().clear_shared(); })
      .def("reset_local", [](PyShm& s) { s.comm().reset_local(); })
      .def("barrier",
           [](PyShm& s, double timeout_s, py::object stop) {
             s.run("barrier", timeout_s, stop, [&](ShmComm& c, WaitContext& ctx) { c.barrier(ctx); });
           },
           py::arg("timeout_s") = 0.0, py::arg("should_stop") = py::none())
      .def("agree",
           [](PyShm& s, int64_t payload_bytes, const std::vector<int64_t>& bits, int64_t nbits,
              double timeout_s, py::object stop) {
             // One agreement cycle's first step (nbdist/common/agreement.py): a Min over
             // [-payload bytes per rank..., one word per cached op: 1 if queued here, the
             // "packed" word (ShmComm::vote)]. Built and read here, not in numpy: it runs
             // once per cycle, on the small-op latency path.
             const int n = s.comm().size();
             std::vector<int32_t> vec = vote_words(n, nbits);
             vec[s.comm().rank()] = static_cast<int32_t>(-payload_bytes);
             for (int64_t b : bits) {
               if (b < 0 || b >= nbits) throw py::value_error("agree: cache bit out of range");
               vec[n + b] = 1;
             }
             s.run("agreement", timeout_s, stop, [&](ShmComm& c, WaitContext& ctx) {
               c.vote(vec.data(), vec.size(), nullptr, nullptr, 0, nbdist::kI32, nbdist::kMin,
                      {}, ctx);
             });
             py::list lengths(n);
             for (int r = 0; r < n; ++r) lengths[r] = -static_cast<int64_t>(vec[r]);
             std::vector<int64_t> ready;
             for (int64_t b : bits)
               if (vec[n + b] != 0) ready.push_back(b);
             std::sort(ready.begin(), ready.end());
             return py::make_tuple(lengths, py::cast(ready));
           },
           py::arg("payload_bytes"), py::arg("bits"), py::arg("nbits"), py::arg("timeout_s") = 0.0,
           py::arg("should_stop") = py::none(),
           "An agreement cycle's vote: (payload bytes per rank, the cache bits set on every rank).")
      .def("allreduce",
           [](PyShm& s, const py::array& buf, size_t count, int dtype, int op, double timeout_s,
              py::object stop) {
             s.run("allreduce", timeout_s, stop, [&, p = data_of(buf)](ShmComm& c, WaitContext& ctx) {
               c.allreduce(p, count, dtype, op, ctx);
             });
           },
           py::arg("buf").noconvert(), py::arg("count"), py::arg("dtype"), py::arg("op"),
           py::arg("timeout_s") = 0.0,
           py::arg("should_stop") = py::none())
      .def("allreduce_into",
           [](PyShm& s, const py::array& src, const py::array& dst, size_t count, int dtype, int op,
              double factor, double timeout_s, py::object stop) {
             ShmComm::check_factor(dtype, factor);
             s.run("allreduce", timeout_s, stop, [&, from = data_of(src), to = data_of(dst)](
                                                     ShmComm& c, WaitContext& ctx) {
               c.allreduce(from, to, count, dtype, op, ctx, factor);
             });
           },
           py::arg("src").noconvert(), py::arg("dst").noconvert(), py::arg("count"),
           py::arg("dtype"), py::arg("op"),
           py::arg("factor") = 1.0, py::arg("timeout_s") = 0.0, py::arg("should_stop") = py::none(),
           "Allreduce `src` into `dst` (the same address for in place), then dst *= factor\n"
           "(float32 and float64 only): one call, no copy of the input first.")
      .def("allreduce_pieces",
           [](PyShm& s, const std::vector<py::array>& srcs, const std::vector<py::array>& dsts,
              const std::vector<size_t>& counts, int dtype, int op, double factor, double timeout_s,
              py::object stop) {
             if (srcs.size() != dsts.size() || srcs.size() != counts.size())
               throw py::value_error("allreduce_pieces: srcs, dsts and counts differ in length");
             ShmComm::check_factor(dtype, factor);
             std::vector<ShmComm::Piece> pieces(srcs.size());
             for (size_t i = 0; i < srcs.size(); ++i)
               pieces[i] = {data_of(srcs[i]), data_of(dsts[i]), counts[i]};
             s.run("allreduce", timeout_s, stop, [&](ShmComm& c, WaitContext& ctx) {
               c.allreduce_pieces(pieces, dtype, op, ctx, factor);
             });
           },
           py::arg("srcs").noconvert(), py::arg("dsts").noconvert(), py::arg("counts"),
           py::arg("dtype"), py::arg("op"),
           py::arg("factor") = 1.0, py::arg("timeout_s") = 0.0, py::arg("should_stop") = py::none(),
           "One allreduce over several buffers (a fused unit): srcs[i] reduced into dsts[i],\n"
           "then each dst *= factor (float32 and float64 only).")
      .def("agree_allreduce",
           [](PyShm& s, int64_t bit, int64_t nbits, PyShm& data, const py::array& src,
              const py::array& dst, size_t count, int dtype, int op, double factor, double timeout_s,
              py::object stop) {
             return agree_allreduce(s, bit, nbits, data, src, dst, count, dtype, op, factor,
                                    timeout_s, nbdist::make_stop_hook(stop));
           },
           py::arg("bit"), py::arg("nbits"), py::arg("data"),
           py::arg("src").noconvert(), py::arg("dst").noconvert(), py::arg("count"),
           py::arg("dtype"), py::arg("op"), py::arg("factor") = 1.0, py::arg("timeout_s") = 0.0,
           py::arg("should_stop") = py::none(),
           "An agreement cycle that runs this rank's one cached allreduce when every rank is\n"
           "ready for it and none has items: None then; else agree()'s (lengths, ready).")
      .def("express_allreduce",
           [](PyShm& s, int64_t bit, int64_t nbits, double wait_s, PyShm& data, const py::array& src,
              const py::array& dst, size_t count, int dtype, int op, double factor, double timeout_s,
              py::object stop) {
             return nbdist::express_allreduce(s, bit, nbits, wait_s, data, src, dst, count, dtype,
                                              op, factor, timeout_s, nbdist::make_stop_hook(stop));
           },
           py::arg("bit"), py::arg("nbits"), py::arg("wait_s"), py::arg("data"),
           py::arg("src").noconvert(), py::arg("dst").noconvert(), py::arg("count"),
           py::arg("dtype"), py::arg("op"), py::arg("factor") = 1.0, py::arg("timeout_s") = 0.0,
           py::arg("should_stop") = py::none(),
           "agree_allreduce once every peer has ops queued, waiting up to wait_s for that:\n"
           "False when they did not (the op is published as queued), else agree_allreduce's.\n"
           "Holds the activity watch (hold_activity) from the start; lets go when the op ran.")
      .def("express_allgather",
           [](PyShm& s, int64_t bit, int64_t nbits, double wait_s, PyShm& data, const py::array& send,
              const py::array& recv, const std::vector<int64_t>& byte_counts, double timeout_s,
              py::object stop) {
             return nbdist::express_allgather(s, bit, nbits, wait_s, data, send, recv, byte_counts,
                                              timeout_s, nbdist::make_stop_hook(stop));
           },
           py::arg("bit"), py::arg("nbits"), py::arg("wait_s"), py::arg("data"),
           py::arg("send").noconvert(), py::arg("recv").noconvert(), py::arg("byte_counts"),
           py::arg("timeout_s") = 0.0, py::arg("should_stop") = py::none(),
           "express_allreduce's path for one cached allgatherv (bytes per rank).")
      .def("express_broadcast",
           [](PyShm& s, int64_t bit, int64_t nbits, double wait_s, PyShm& data, const py::array& buf,
              size_t nbytes, int root, double timeout_s, py::object stop) {
             return nbdist::express_broadcast(s, bit, nbits, wait_s, data, buf, nbytes, root,
                                              timeout_s, nbdist::make_stop_hook(stop), nullptr);
           },
           py::arg("bit"), py::arg("nbits"), py::arg("wait_s"), py::arg("data"),
           py::arg("buf").noconvert(), py::arg("nbytes"), py::arg("root"),
           py::arg("timeout_s") = 0.0, py::arg("should_stop") = py::none(),
           "express_allreduce's path for one cached broadcast of `buf` from `root`.")
      .def("reduce",
           [](PyShm& s, const py::array& buf, size_t count, int dtype, int op, int root,
              double timeout_s, py::object stop) {
             s.run("reduce", timeout_s, stop, [&, p = data_of(buf)](ShmComm& c, WaitContext& ctx) {
               c.reduce(p, count, dtype, op, root, ctx);
             });
           },
           py::arg("buf").noconvert(), py::arg("count"), py::arg("dtype"), py::arg("op"),
           py::arg("root"),
           py::arg("timeout_s") = 0.0, py::arg("should_stop") = py::none())
      .def("broadcast",
           [](PyShm& s, const py::array& buf, size_t nbytes, int root, double timeout_s,
              py::object stop) {
             s.run("broadcast", timeout_s, stop, [&, p = data_of(buf)](ShmComm& c, WaitContext& ctx) {
               c.broadcast(p, nbytes, root, ctx);
             });
           },
           py::arg("buf").noconvert(), py::arg("nbytes"), py::arg("root"), py::arg("timeout_s") = 0.0,
           py::arg("should_stop") = py::none())
      .def("allgatherv",
           [](PyShm& s, const py::array& send, const py::array& recv, std::vector<int64_t> byte_counts,
              double timeout_s, py::object stop) {
             s.run("allgather", timeout_s, stop, [&, from = data_of(send), to = data_of(recv)](
                                                     ShmComm& c, WaitContext& ctx) {
               c.allgatherv(from, to, byte_counts, ctx);
             });
           },
           py::arg("send").noconvert(), py::arg("recv").noconvert(), py::arg("byte_counts"),
           py::arg("timeout_s") = 0.0,
           py::arg("should_stop") = py::none())
      .def("reducescatter",
           [](PyShm& s, const py::array& send, const py::array& recv, std::vector<int64_t> counts,
              int dtype, int op, double timeout_s, py::object stop) {
             s.run("reducescatter", timeout_s, stop, [&, from = data_of(send), to = data_of(recv)](
                                                         ShmComm& c, WaitContext& ctx) {
               c.reducescatter(from, to, counts, dtype, op, ctx);
             });
           },
           py::arg("send").noconvert(), py::arg("recv").noconvert(), py::arg("counts"),
           py::arg("dtype"), py::arg("op"),
           py::arg("timeout_s") = 0.0, py::arg("should_stop") = py::none())
      .def("alltoallv",
           [](PyShm& s, const py::array& send, std::vector<int64_t> send_bytes, const py::array& recv,
              std::vector<int64_t> recv_bytes, double timeout_s, py::object stop) {
             s.run("alltoall", timeout_s, stop, [&, from = data_of(send), to = data_of(recv)](
                                                    ShmComm& c, WaitContext& ctx) {
               c.alltoallv(from, send_bytes, to, recv_bytes, ctx);
             });
           },
           py::arg("send").noconvert(), py::arg("send_bytes"), py::arg("recv").noconvert(),
           py::arg("recv_bytes"),
           py::arg("timeout_s") = 0.0, py::arg("should_stop") = py::none());
}

}  // namespace

py::object nbdist::express_allreduce(PyShm& s, int64_t bit, int64_t nbits, double wait_s,
                                     PyShm& data, const py::array& src, const py::array& dst,
                                     size_t count, int dtype, int op, double factor,
                                     double timeout_s, const StopHook& stop) {
  return express(s, wait_s, [&]() {
    return agree_allreduce(s, bit, nbits, data, src, dst, count, dtype, op, factor, timeout_s, stop);
  });
}

py::object nbdist::express_allgather(PyShm& s, int64_t bit, int64_t nbits, double wait_s,
                                     PyShm& data, const py::array& send, const py::array& recv,
                                     const std::vector<int64_t>& byte_counts, double timeout_s,
                                     const StopHook& stop) {
  return express(s, wait_s, [&]() {
    return agree_allgather(s, bit, nbits, data, send, recv, byte_counts, timeout_s, stop);
  });
}

py::object nbdist::express_broadcast(PyShm& s, int64_t bit, int64_t nbits, double wait_s,
                                     PyShm& data, const py::array& buf, size_t nbytes, int root,
                                     double timeout_s, const StopHook& stop, const void* src) {
  return express(s, wait_s, [&]() {
    return agree_broadcast(s, bit, nbits, data, buf, nbytes, root, timeout_s, stop, src);
  });
}

PYBIND11_MODULE(_native, m) {
  m.doc() = "nbdist native data path: shared-memory collectives and a dlopen'ed NCCL path";
  py::register_exception<nbdist::ShmError>(m, "ShmError", PyExc_RuntimeError);
  m.def("shm_built", []() { return true; }, "True when the shared-memory collectives are built.");
  m.def("kernel_isa", []() { return std::string(nbdist::kernel_isa()); },
        "The instruction-set variant of the reduction kernels chosen for this CPU.");
  m.def(
      "reduce_local",
      [](uintptr_t dst, std::vector<uintptr_t> srcs, size_t count, int dtype, int op) {
        auto fn = nbdist::reduce_kernel(dtype, op);
        if (!fn) throw std::invalid_argument("reduce_local: unsupported dtype/op");
        std::vector<const void*> p(srcs.size());
        for (size_t i = 0; i < srcs.size(); ++i) p[i] = ptr(srcs[i]);
        py::gil_scoped_release release;
        fn(ptr(dst), p.data(), static_cast<int>(p.size()), count);
      },
      "Reduce arrays of one process element-wise (tests and benchmarks of the kernels).");
  bind_shm(m);
  nbdist::bind_express(m);
  nbdist::bind_nccl(m);
}
