// NCCL collectives on device buffers, enqueued on the caller's stream.
//
// Only the few entry points used are declared here (the ABI is stable C), and
// resolved with dlsym, so no CUDA or NCCL headers are needed at build time.
// Each op records an event after it on the stream and polls it with back-off,
// watching NCCL's asynchronous error, an abort flag, a deadline and the
// should_stop hook; on any of those the communicator is aborted (ncclCommAbort)
// so that the peers' kernels fail too instead of hanging.
#include "nccl.hpp"

#include <dlfcn.h>
#include <pybind11/stl.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels.hpp"
#include "py_hooks.hpp"

namespace py = pybind11;

namespace nbdist {
namespace {

// --- the C ABI of the parts of NCCL and the CUDA runtime we use ------------------
using ncclComm_t = void*;
using cudaStream_t = void*;
using cudaEvent_t = void*;
constexpr int kNcclUniqueIdBytes = 128;
struct ncclUniqueId { char internal[kNcclUniqueIdBytes]; };
constexpr int ncclSuccess = 0, ncclInProgress = 7;
constexpr int cudaSuccess = 0, cudaErrorNotReady = 600;
constexpr unsigned cudaEventDisableTiming = 2;
enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3 };

struct Api {
  void* nccl = nullptr;
  void* cudart = nullptr;
  std::string error;
  int (*GetVersion)(int*);
  int (*GetUniqueId)(ncclUniqueId*);
  int (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
  int (*CommAbort)(ncclComm_t);
  int (*CommDestroy)(ncclComm_t);
  int (*CommGetAsyncError)(ncclComm_t, int*);
  const char* (*GetErrorString)(int);
  int (*AllReduce)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
  int (*Broadcast)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
  int (*Reduce)(const void*, void*, size_t, int, int, int, ncclComm_t, cudaStream_t);
  int (*AllGather)(const void*, void*, size_t, int, ncclComm_t, cudaStream_t);
  int (*ReduceScatter)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
  int (*Send)(const void*, size_t, int, int, ncclComm_t, cudaStream_t);
  int (*Recv)(void*, size_t, int, int, ncclComm_t, cudaStream_t);
  int (*GroupStart)();
  int (*GroupEnd)();
  int (*cudaGetDeviceCount)(int*);
  int (*cudaSetDevice)(int);
  int (*cudaEventCreateWithFlags)(cudaEvent_t*, unsigned);
  int (*cudaEventRecord)(cudaEvent_t, cudaStream_t);
  int (*cudaEventQuery)(cudaEvent_t);
  int (*cudaEventDestroy)(cudaEvent_t);
  const char* (*cudaGetErrorString)(int);
  int (*cudaPointerGetAttributes)(void*, const void*);
  int (*cudaDeviceGetPCIBusId)(char*, int, int);
  bool ok() const { return nccl != nullptr && cudart != nullptr && error.empty(); }
};

std::mutex g_api_mutex;
Api g_api;
bool g_api_tried = false;

template <class F>
bool resolve(void* lib, const char* name, F& out, std::string& error) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  if (out == nullptr && error.empty()) error = std::string("symbol ") + name + " not found";
  return out != nullptr;
}

void* open_first(const std::vector<std::string>& candidates, std::string& tried) {
  tried.clear();
  for (const auto& path : candidates) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h != nullptr) return h;
    const char* e = dlerror();
    std::string why = e ? e : "not found";
    // dlerror repeats the name: "libx.so: libx.so: cannot open ..."; keep the reason only.
    size_t colon = why.rfind(": ");
    tried += (tried.empty() ? "" : "; ") + path + " (" + (colon == std::string::npos ? why : why.substr(colon + 2)) + ")";
  }
  return nullptr;
}

// Loads both libraries once; later calls return the first outcome.
const Api& load_api(const std::vector<std::string>& nccl_paths, const std::vector<std::string>& cudart_paths) {
  std::lock_guard<std::mutex> lock(g_api_mutex);
  if (g_api_tried) return g_api;
  g_api_tried = true;
  Api& a = g_api;
  std::string tried;
  a.cudart = open_first(cudart_paths, tried);
  if (a.cudart == nullptr) {
    a.error = "the CUDA runtime could not be loaded, tried " + tried;
    return a;
  }
  a.nccl = open_first(nccl_paths, tried);
  if (a.nccl == nullptr) {
    a.error = "libnccl could not be loaded, tried " + tried;
    return a;
  }
  std::string& e = a.error;
  resolve(a.nccl, "ncclGetVersion", a.GetVersion, e);
  resolve(a.nccl, "ncclGetUniqueId", a.GetUniqueId, e);
  resolve(a.nccl, "ncclCommInitRank", a.CommInitRank, e);
  resolve(a.nccl, "ncclCommAbort", a.CommAbort, e);
  resolve(a.nccl, "ncclCommDestroy", a.CommDestroy, e);
  resolve(a.nccl, "ncclCommGetAsyncError", a.CommGetAsyncError, e);
  resolve(a.nccl, "ncclGetErrorString", a.GetErrorString, e);
  resolve(a.nccl, "ncclAllReduce", a.AllReduce, e);
  resolve(a.nccl, "ncclBroadcast", a.Broadcast, e);
  resolve(a.nccl, "ncclReduce", a.Reduce, e);
  resolve(a.nccl, "ncclAllGather", a.AllGather, e);
  resolve(a.nccl, "ncclReduceScatter", a.ReduceScatter, e);
  resolve(a.nccl, "ncclSend", a.Send, e);
  resolve(a.nccl, "ncclRecv", a.Recv, e);
  resolve(a.nccl, "ncclGroupStart", a.GroupStart, e);
  resolve(a.nccl, "ncclGroupEnd", a.GroupEnd, e);
  resolve(a.cudart, "cudaGetDeviceCount", a.cudaGetDeviceCount, e);
  resolve(a.cudart, "cudaSetDevice", a.cudaSetDevice, e);
  resolve(a.cudart, "cudaEventCreateWithFlags", a.cudaEventCreateWithFlags, e);
  resolve(a.cudart, "cudaEventRecord", a.cudaEventRecord, e);
  resolve(a.cudart, "cudaEventQuery", a.cudaEventQuery, e);
  resolve(a.cudart, "cudaEventDestroy", a.cudaEventDestroy, e);
  resolve(a.cudart, "cudaGetErrorString", a.cudaGetErrorString, e);
  resolve(a.cudart, "cudaPointerGetAttributes", a.cudaPointerGetAttributes, e);
  resolve(a.cudart, "cudaDeviceGetPCIBusId", a.cudaDeviceGetPCIBusId, e);
  return a;
}

const Api& api() {
  if (!g_api_tried) throw std::runtime_error("NCCL: nccl_load() was not called");
  if (!g_api.ok()) throw std::runtime_error("NCCL is not available: " + g_api.error);
  return g_api;
}

void check_nccl(int r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress)
    throw std::runtime_error(std::string("NCCL ") + what + " failed: " + api().GetErrorString(r));
}

void check_cuda(int r, const char* what) {
  if (r != cudaSuccess)
    throw std::runtime_error(std::string("CUDA ") + what + " failed: " + api().cudaGetErrorString(r));
}

int nccl_dtype(int dtype) {
  switch (dtype) {
    case kI8: return 0;
    case kU8: return 1;
    case kI32: return 2;
    case kU32: return 3;
    case kI64: return 4;
    case kU64: return 5;
    case kF16: return 6;
    case kF32: return 7;
    case kF64: return 8;
    case kBF16: return 9;
    default:
      throw std::invalid_argument(std::string("NCCL has no ") + dtype_name(dtype) + " type");
  }
}

int nccl_op(int op) {
  switch (op) {
    case kSum: return ncclSum;
    case kProd: return ncclProd;
    case kMax: return ncclMax;
    case kMin: return ncclMin;
    default: throw std::invalid_argument("NCCL: unsupported reduction op " + std::to_string(op));
  }
}

// One communicator over every rank, bound to one device.
class NcclComm {
 public:
  NcclComm(const py::bytes& uid, int nranks, int rank, int device)
      : nranks_(nranks), rank_(rank), device_(device) {
    std::string raw = uid;
    if (raw.size() != kNcclUniqueIdBytes) throw std::invalid_argument("NCCL: bad unique id");
    ncclUniqueId id;
    std::memcpy(id.internal, raw.data(), kNcclUniqueIdBytes);
    const Api& a = api();
    py::gil_scoped_release release;
    check_cuda(a.cudaSetDevice(device_), "cudaSetDevice");
    check_nccl(a.CommInitRank(&comm_, nranks_, id, rank_), "ncclCommInitRank");
    check_cuda(a.cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~NcclComm() { close(); }

  int device() const { return device_; }

  void abort(const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(reason_mutex_);
      if (abort_reason_.empty()) abort_reason_ = reason;
    }
    aborted_.store(true);
  }

  void close() {
    if (comm_ == nullptr && event_ == nullptr) return;
    const Api& a = api();
    a.cudaSetDevice(device_);
    if (comm_ != nullptr) {
      if (broken_) a.CommAbort(comm_); else a.CommDestroy(comm_);
    }
    if (event_ != nullptr) a.cudaEventDestroy(event_);
    comm_ = nullptr;
    event_ = nullptr;
  }

  // Runs `enqueue` (NCCL calls on `stream`), then waits for the stream to pass them.
  template <class F>
  void run(const char* what, uintptr_t stream, double timeout_s, const py::object& stop, F&& enqueue) {
    if (comm_ == nullptr || broken_)
      throw std::runtime_error(std::string("NCCL ") + what + ": the communicator is closed or was aborted");
    auto hook = make_stop_hook(stop);
    const Api& a = api();
    std::string failure;
    {
      py::gil_scoped_release release;
      check_cuda(a.cudaSetDevice(device_), "cudaSetDevice");
      cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
      enqueue(a, s);
      check_cuda(a.cudaEventRecord(event_, s), "cudaEventRecord");
      failure = wait(a, what, timeout_s, hook);
    }
    if (!failure.empty()) throw std::runtime_error(failure);
  }

  void allreduce(uintptr_t send, uintptr_t recv, size_t count, int dtype, int op, uintptr_t stream,
                 double timeout_s, const py::object& stop) {
    int t = nccl_dtype(dtype), o = nccl_op(op);
    run("allreduce", stream, timeout_s, stop, [&](const Api& a, cudaStream_t s) {
      check_nccl(a.AllReduce(p(send), p(recv), count, t, o, comm_, s), "allreduce");
    });
  }

  void broadcast(uintptr_t buf, size_t count, int dtype, int root, uintptr_t stream, double timeout_s,
                 const py::object& stop) {
    int t = nccl_dtype(dtype);
    run("broadcast", stream, timeout_s, stop, [&](const Api& a, cudaStream_t s) {
      check_nccl(a.Broadcast(p(buf), p(buf), count, t, root, comm_, s), "broadcast");
    });
  }

  // Uneven counts: one broadcast per rank inside a group (NCCL's allgather is even).
  void allgatherv(uintptr_t send, uintptr_t recv, const std::vector<int64_t>& counts, int dtype,
                  uintptr_t stream, double timeout_s, const py::object& stop) {
    check_size(counts);
    int t = nccl_dtype(dtype);
    const size_t item = dtype_size(dtype);
    bool even = true;
    for (auto c : counts) even = even && c == counts[0];
    run("allgather", stream, timeout_s, stop, [&](const Api& a, cudaStream_t s) {
      if (even) {
        check_nccl(a.AllGather(p(send), p(recv), counts[0], t, comm_, s), "allgather");
        return;
      }
      check_nccl(a.GroupStart(), "group start");
      size_t off = 0;
      for (int r = 0; r < nranks_; ++r) {
        const void* src = r == rank_ ? p(send) : p(recv + off * item);
        if (counts[r]) check_nccl(a.Broadcast(src, p(recv + off * item), counts[r], t, r, comm_, s), "broadcast");
        off += static_cast<size_t>(counts[r]);
      }
      check_nccl(a.GroupEnd(), "group end");
    });
  }

  // Uneven counts: one reduce per rank (rooted at that rank) inside a group.
  void reducescatter(uintptr_t send, uintptr_t recv, const std::vector<int64_t>& counts, int dtype, int op,
                     uintptr_t stream, double timeout_s, const py::object& stop) {
    check_size(counts);
    int t = nccl_dtype(dtype), o = nccl_op(op);
    const size_t item = dtype_size(dtype);
    bool even = true;
    for (auto c : counts) even = even && c == counts[0];
    run("reducescatter", stream, timeout_s, stop, [&](const Api& a, cudaStream_t s) {
      if (even) {
        check_nccl(a.ReduceScatter(p(send), p(recv), counts[0], t, o, comm_, s), "reducescatter");
        return;
      }
      check_nccl(a.GroupStart(), "group start");
      size_t off = 0;
      for (int r = 0; r < nranks_; ++r) {
        if (counts[r]) check_nccl(a.Reduce(p(send + off * item), p(recv), counts[r], t, o, r, comm_, s), "reduce");
        off += static_cast<size_t>(counts[r]);
      }
      check_nccl(a.GroupEnd(), "group end");
    });
  }

  void alltoallv(uintptr_t send, const std::vector<int64_t>& send_counts, uintptr_t recv,
                 const std::vector<int64_t>& recv_counts, int dtype, uintptr_t stream, double timeout_s,
                 const py::object& stop) {
    check_size(send_counts);
    check_size(recv_counts);
    int t = nccl_dtype(dtype);
    const size_t item = dtype_size(dtype);
    run("alltoall", stream, timeout_s, stop, [&](const Api& a, cudaStream_t s) {
      check_nccl(a.GroupStart(), "group start");
      size_t soff = 0, roff = 0;
      for (int r = 0; r < nranks_; ++r) {
        if (send_counts[r]) check_nccl(a.Send(p(send + soff * item), send_counts[r], t, r, comm_, s), "send");
        if (recv_counts[r]) check_nccl(a.Recv(p(recv + roff * item), recv_counts[r], t, r, comm_, s), "recv");
        soff += static_cast<size_t>(send_counts[r]);
        roff += static_cast<size_t>(recv_counts[r]);
      }
      check_nccl(a.GroupEnd(), "group end");
    });
  }

 private:
  static void* p(uintptr_t a) { return reinterpret_cast<void*>(a); }
  void check_size(const std::vector<int64_t>& v) const {
    if (static_cast<int>(v.size()) != nranks_) throw std::invalid_argument("NCCL: one count per rank expected");
  }

  // Spin, yield, then sleep up to 1 ms between polls; returns "" or why it failed.
  std::string wait(const Api& a, const char* what, double timeout_s,
                   const std::function<bool(std::string&)>& hook) {
    auto start = std::chrono::steady_clock::now();
    auto last_hook = start;
    long sleep_us = 0;
    for (long i = 0;; ++i) {
      int q = a.cudaEventQuery(event_);
      if (q == cudaSuccess) return "";
      if (q != cudaErrorNotReady) return give_up(std::string("CUDA error in NCCL ") + what + ": " + a.cudaGetErrorString(q));
      int async = ncclSuccess;
      a.CommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        return give_up(std::string("NCCL ") + what + " failed on rank " + std::to_string(rank_) + ": " +
                       a.GetErrorString(async));
      if (aborted_.load()) {
        std::lock_guard<std::mutex> lock(reason_mutex_);
        return give_up(std::string("NCCL ") + what + " aborted: " + abort_reason_);
      }
      auto now = std::chrono::steady_clock::now();
      double waited = std::chrono::duration<double>(now - start).count();
      if (timeout_s > 0 && waited > timeout_s)
        return give_up(std::string("NCCL ") + what + " on rank " + std::to_string(rank_) + " did not complete within " +
                       std::to_string(timeout_s) + " s");
      if (hook && std::chrono::duration<double>(now - last_hook).count() > 0.1) {
        last_hook = now;
        std::string reason;
        if (hook(reason)) return give_up(std::string("NCCL ") + what + " abandoned: " + reason);
      }
      if (i < 1000) continue;
      if (i < 1200) { sched_yield(); continue; }
      sleep_us = sleep_us == 0 ? 20 : std::min(sleep_us * 2, 1000L);
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    }
  }

  // Aborting the communicator makes the peers' pending NCCL kernels fail too.
  std::string give_up(const std::string& why) {
    broken_ = true;
    api().CommAbort(comm_);
    comm_ = nullptr;
    return why;
  }

  int nranks_, rank_, device_;
  ncclComm_t comm_ = nullptr;
  cudaEvent_t event_ = nullptr;
  bool broken_ = false;
  std::atomic<bool> aborted_{false};
  std::mutex reason_mutex_;
  std::string abort_reason_;
};

}  // namespace

void bind_nccl(py::module_& m) {
  m.def(
      "nccl_load",
      [](std::vector<std::string> nccl_paths, std::vector<std::string> cudart_paths) {
        const Api& a = load_api(nccl_paths, cudart_paths);
        return a.ok() ? std::string() : a.error;
      },
      py::arg("nccl_paths"), py::arg("cudart_paths"),
      "Open libnccl and libcudart (first that loads of each list); '' on success, else why not. "
      "Only the first call loads; later calls return its outcome.");
  m.def("nccl_built", []() { return g_api_tried && g_api.ok(); },
        "True when nccl_load() succeeded: libnccl and the CUDA runtime are usable here.");
  m.def("nccl_version", []() {
    int v = 0;
    check_nccl(api().GetVersion(&v), "ncclGetVersion");
    return v;
  });
  m.def("cuda_device_count", []() {
    if (!g_api_tried || g_api.cudart == nullptr || g_api.cudaGetDeviceCount == nullptr) return 0;
    int n = 0;
    return g_api.cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
  m.def("nccl_unique_id", []() {
    ncclUniqueId id;
    check_nccl(api().GetUniqueId(&id), "ncclGetUniqueId");
    return py::bytes(id.internal, kNcclUniqueIdBytes);
  });
  m.def("cuda_pointer_device", [](uintptr_t address) {
    // cudaPointerAttributes: {int type; int device; void* devicePointer; void* hostPointer;}
    struct { int type; int device; void* dptr; void* hptr; } attr{};
    check_cuda(api().cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(address)), "cudaPointerGetAttributes");
    return attr.device;
  });
  m.def(
      "cuda_pci_bus_id",
      [](int device) {
        char id[64] = {0};
        check_cuda(api().cudaDeviceGetPCIBusId(id, sizeof id, device), "cudaDeviceGetPCIBusId");
        return std::string(id);
      },
      py::arg("device"), "The PCI bus id of CUDA device `device` (what NCCL tells GPUs apart by).");
  py::class_<NcclComm>(m, "NcclComm", "An NCCL communicator over all ranks, bound to one GPU.")
      .def(py::init<const py::bytes&, int, int, int>(), py::arg("unique_id"), py::arg("nranks"), py::arg("rank"),
           py::arg("device"))
      .def_property_readonly("device", &NcclComm::device)
      .def("abort", &NcclComm::abort)
      .def("close", &NcclComm::close)
      .def("allreduce", &NcclComm::allreduce, py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"),
           py::arg("op"), py::arg("stream"), py::arg("timeout_s") = 0.0, py::arg("should_stop") = py::none())
      .def("broadcast", &NcclComm::broadcast, py::arg("buf"), py::arg("count"), py::arg("dtype"), py::arg("root"),
           py::arg("stream"), py::arg("timeout_s") = 0.0, py::arg("should_stop") = py::none())
      .def("allgatherv", &NcclComm::allgatherv, py::arg("send"), py::arg("recv"), py::arg("counts"),
           py::arg("dtype"), py::arg("stream"), py::arg("timeout_s") = 0.0, py::arg("should_stop") = py::none())
      .def("reducescatter", &NcclComm::reducescatter, py::arg("send"), py::arg("recv"), py::arg("counts"),
           py::arg("dtype"), py::arg("op"), py::arg("stream"), py::arg("timeout_s") = 0.0,
           py::arg("should_stop") = py::none())
      .def("alltoallv", &NcclComm::alltoallv, py::arg("send"), py::arg("send_counts"), py::arg("recv"),
           py::arg("recv_counts"), py::arg("dtype"), py::arg("stream"), py::arg("timeout_s") = 0.0,
           py::arg("should_stop") = py::none());
}

}  // namespace nbdist
