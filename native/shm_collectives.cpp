// The shared-memory collectives. Each op is a sequence of steps over chunks that
// fit one slot set; see shm_comm.hpp for the phase counters. Every rank runs the
// same number of steps and phases, whatever its own share of the data.
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "kernels.hpp"
#include "shm_comm.hpp"

namespace nbdist {
namespace {

size_t clamp_len(int64_t total, size_t off, size_t cap) {
  if (total <= 0 || static_cast<size_t>(total) <= off) return 0;
  return std::min(cap, static_cast<size_t>(total) - off);
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// A rank's own part of an allgather, or a broadcast root's own result: copied while the
// peers read by CMA, and not read again by this op. From 4 MiB it goes with streaming
// stores, which skip the read-for-ownership of every line and leave the cache to the
// peers' reads. In-process A/B through hvd.allgather (docs/native.md): 2 ranks, 4 MiB
// parts 2-3 % faster, 8 MiB 5 %, 16 MiB 22-28 %, 64 MiB 11-12 %, 1 MiB alike; 4 ranks on
// 2 cores, 4 MiB 15-21 %, 2 MiB alike.
constexpr size_t kStreamOwnBytes = size_t{4} << 20;
void copy_own(void* dst, const void* src, size_t bytes) {
  if (bytes >= kStreamOwnBytes)
    stream_copy()(dst, src, bytes);
  else
    std::memcpy(dst, src, bytes);
}

// How `count` elements split into the slices each rank reduces (reduce_chunked, and
// vote_allreduce): equal parts, each starting on a cache line, so no two owners write
// one line; the last ones may be short or empty.
struct Slices {
  size_t count, size;
  Slices(size_t count_, int n, size_t item)
      : count(count_), size(round_up((count_ + n - 1) / n, 64 / item)) {}
  std::pair<size_t, size_t> of(int r) const {
    const size_t lo = std::min(count, static_cast<size_t>(r) * size);
    return {lo, std::min(count, lo + size)};
  }
};

// The i-th address a rank packed behind its vote words, or wrote in its slot.
uintptr_t packed_address(const void* packed, size_t i = 0) {
  uintptr_t a;
  std::memcpy(&a, static_cast<const char*>(packed) + i * sizeof a, sizeof a);
  return a;
}

void check_counts(const std::vector<int64_t>& v, int n, const char* what) {
  if (static_cast<int>(v.size()) != n)
    throw std::invalid_argument(std::string("shm ") + what + ": expected " + std::to_string(n) +
                                " counts, got " + std::to_string(v.size()));
  for (int64_t c : v)
    if (c < 0) throw std::invalid_argument(std::string("shm ") + what + ": negative count");
}

// A fused unit's pieces laid end to end, as one buffer of `count()` elements: a range
// of that buffer is visited as runs, each within one piece.
class PieceRuns {
 public:
  PieceRuns(const std::vector<ShmComm::Piece>& pieces, size_t item)
      : pieces_(pieces), item_(item), first_(pieces.size() + 1, 0) {
    for (size_t i = 0; i < pieces.size(); ++i) first_[i + 1] = first_[i] + pieces[i].count;
  }
  size_t count() const { return first_.back(); }

  // f(i, from, at, len) for each run of elements [begin, end) of the unit: the run starts
  // at element `at` of the unit, which is element `from` of piece i; len elements stay in
  // that piece.
  template <class F>
  void spans(size_t begin, size_t end, F&& f) const {
    if (begin >= end) return;
    // the last piece starting at or before `begin` that is not empty
    size_t i = static_cast<size_t>(std::upper_bound(first_.begin(), first_.end(), begin) -
                                   first_.begin()) - 1;
    for (; begin < end; ++i) {
      const size_t stop = std::min(end, first_[i + 1]);
      if (stop <= begin) continue;  // an empty piece
      f(i, begin - first_[i], begin, stop - begin);
      begin = stop;
    }
  }

  // f(src, dst, at, len) for each run: spans(), with src and dst pointing at the run in
  // its piece.
  template <class F>
  void runs(size_t begin, size_t end, F&& f) const {
    spans(begin, end, [&](size_t i, size_t from, size_t at, size_t len) {
      f(static_cast<const char*>(pieces_[i].src) + from * item_,
        static_cast<char*>(pieces_[i].dst) + from * item_, at, len);
    });
  }

 private:
  const std::vector<ShmComm::Piece>& pieces_;
  size_t item_;
  std::vector<size_t> first_;  // the unit's element index where each piece starts
};

std::vector<size_t> prefix(const std::vector<int64_t>& v, size_t scale = 1) {
  std::vector<size_t> out(v.size(), 0);
  for (size_t i = 1; i < v.size(); ++i) out[i] = out[i - 1] + static_cast<size_t>(v[i - 1]) * scale;
  return out;
}

ReduceFn kernel_or_throw(int dtype, int op, const char* what) {
  ReduceFn fn = reduce_kernel(dtype, op);
  if (fn == nullptr)
    throw std::invalid_argument(std::string("shm ") + what + ": cannot reduce " + dtype_name(dtype) +
                                " with op " + std::to_string(op));
  return fn;
}

}  // namespace

ShmComm::ShmComm(Segment seg, int local_rank, int global_rank)
    : seg_(std::move(seg)), hdr_(seg_.header()), rank_(local_rank), global_rank_(global_rank),
      n_(static_cast<int>(hdr_->nranks)), nsets_(static_cast<int>(hdr_->nsets)),
      slot_bytes_(hdr_->slot_bytes), free_phase_(hdr_->nsets, 0) {
  if (local_rank < 0 || local_rank >= n_) throw std::invalid_argument("shm: local rank out of range");
}

ShmComm::~ShmComm() = default;

int ShmComm::acquire_set(bool writer, WaitContext& ctx) {
  int s = next_set_;
  next_set_ = (next_set_ + 1) % nsets_;
  if (writer) wait_all(free_phase_[s], ctx);  // everyone has finished reading it
  return s;
}

void ShmComm::barrier(WaitContext& ctx) {
  check_not_aborted(ctx);
  uint64_t g = next_phase();
  post(g);
  wait_all(g, ctx);
}

namespace {
void scale_pieces(const std::vector<ShmComm::Piece>& pieces, int dtype, double factor) {
  if (factor != 1.0)
    for (const ShmComm::Piece& p : pieces) scale_in_place(p.dst, p.count, dtype, factor);
}
}  // namespace

void ShmComm::allreduce(const void* src, void* dst, size_t count, int dtype, int op, WaitContext& ctx,
                        double factor) {
  const size_t bytes = count * dtype_size(dtype);
  if (n_ > 1 && count && bytes <= small_bytes_ && bytes <= slot_bytes_) {  // (no vector here)
    kernel_or_throw(dtype, op, ctx.what);
    check_factor(dtype, factor);
    check_not_aborted(ctx);
    allreduce_small(static_cast<const char*>(src), static_cast<char*>(dst), bytes, count, dtype, op, ctx);
    if (factor != 1.0) scale_in_place(dst, count, dtype, factor);
    return;
  }
  allreduce_pieces({Piece{src, dst, count}}, dtype, op, ctx, factor);
}

void ShmComm::allreduce_pieces(const std::vector<Piece>& pieces, int dtype, int op, WaitContext& ctx,
                               double factor) {
  ReduceFn fn = kernel_or_throw(dtype, op, ctx.what);
  check_factor(dtype, factor);
  check_not_aborted(ctx);
  const size_t item = dtype_size(dtype);
  size_t total = 0;
  for (const Piece& p : pieces) total += p.count;
  if (total == 0) return;
  if (n_ == 1) {
    for (const Piece& p : pieces)
      if (p.src != p.dst && p.count) std::memcpy(p.dst, p.src, p.count * item);
    return scale_pieces(pieces, dtype, factor);
  }
  const size_t bytes = total * item;
  // Chosen by sizes and the plan in force (the same on every rank): single copy, each
  // rank's (src, dst) table in its slot.
  const bool single = cma_reduces(bytes) && pieces.size() * 2 * sizeof(uintptr_t) <= slot_bytes_;
  plan_publish();
  const auto t0 = std::chrono::steady_clock::now();
  if (single) {
    allreduce_cma(pieces, dtype, fn, factor, ctx);
  } else if (bytes > small_bytes_ || bytes > slot_bytes_) {
    reduce_chunked(pieces, dtype, op, -1, ctx);
    scale_pieces(pieces, dtype, factor);
  } else {
    allreduce_packed(pieces, dtype, fn, factor, ctx);
  }
  plan_note(kPathAllreduce, bytes, single, t0);
  plan_adopt();
}

void ShmComm::plan_publish() {
  if (!tuning_any() || n_ <= 1 || rank_ != 0) return;
  // plans[n % 2] was last written for op n - 2 (n: plans_carried_), and a rank has read
  // it once it has taken n - 1 plans.
  for (int r = 1; r < n_; ++r)
    if (hdr_->ranks[r].plans_taken.load(std::memory_order_acquire) + 1 < plans_carried_) return;
  hdr_->plans[plans_carried_ % 2] = tuner_.next();
}

void ShmComm::plan_adopt() {
  if (!tuning_any() || n_ <= 1) return;
  plan_ = hdr_->plans[plans_carried_ % 2];
  ++plans_carried_;
  hdr_->ranks[rank_].plans_taken.store(plans_carried_, std::memory_order_release);
}

void ShmComm::plan_note(PathKind kind, size_t bytes, bool cma, std::chrono::steady_clock::time_point t0) {
  if (!tuning_[kind] || rank_ != 0) return;
  const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - t0;
  tuner_.record(kind, bytes, cma, took.count());
}

void ShmComm::set_path_tuning(bool broadcast, bool allgather, bool allreduce) {
  tuning_[kPathBroadcast] = broadcast;
  tuning_[kPathAllgather] = allgather;
  tuning_[kPathAllreduce] = allreduce;
  initial_plan_.cma[kPathBroadcast] = PathTuner::plan_bits(cma_bytes_);
  initial_plan_.cma[kPathAllgather] = PathTuner::plan_bits(cma_gather_bytes_);
  initial_plan_.cma[kPathAllreduce] = PathTuner::plan_bits(cma_reduce_bytes_);
  plan_ = initial_plan_;
  // (plans_carried_ counts on: a rank still finishing a broadcast from rank 0 takes its
  // plan after this call on rank 0, and plan_publish's guard needs the count to go on)
  tuner_.start(initial_plan_);
}

// As allreduce_small, with the pieces packed into the slot and reduced out of it.
void ShmComm::allreduce_packed(const std::vector<Piece>& pieces, int dtype, ReduceFn fn, double factor,
                               WaitContext& ctx) {
  const size_t item = dtype_size(dtype);
  int s = acquire_set(true, ctx);
  char* slot = seg_.slot(s, rank_);
  for (const Piece& p : pieces) {
    std::memcpy(slot, p.src, p.count * item);
    slot += p.count * item;
  }
  uint64_t copied = next_phase();
  post(copied);
  wait_all(copied, ctx);
  std::vector<const void*> srcs(n_);
  size_t off = 0;
  for (const Piece& p : pieces) {
    for (int q = 0; q < n_; ++q) srcs[q] = seg_.slot(s, q) + off;
    if (p.count) fn(p.dst, srcs.data(), n_, p.count);
    off += p.count * item;
  }
  uint64_t read = next_phase();
  post(read);
  release_set(s, read);
  scale_pieces(pieces, dtype, factor);
}

std::vector<ShmComm::Piece> ShmComm::readable_pieces(const std::vector<Piece>& given, size_t item,
                                                     std::vector<std::vector<char>>& copies) {
  std::vector<Piece> pieces = given;
  for (Piece& p : pieces) {
    const char* const from = static_cast<const char*>(p.src);
    const char* const to = static_cast<const char*>(p.dst);
    const size_t bytes = p.count * item;
    if (from != to && from < to + bytes && to < from + bytes)
      p.src = copies.emplace_back(from, from + bytes).data();
  }
  return pieces;
}

void ShmComm::allreduce_cma(const std::vector<Piece>& given, int dtype, ReduceFn fn, double factor,
                            WaitContext& ctx) {
  std::vector<std::vector<char>> copies;
  const std::vector<Piece> pieces = readable_pieces(given, dtype_size(dtype), copies);
  int s = acquire_set(true, ctx);
  char* const table = seg_.slot(s, rank_);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const uintptr_t pair[2] = {reinterpret_cast<uintptr_t>(pieces[i].src),
                               reinterpret_cast<uintptr_t>(pieces[i].dst)};
    std::memcpy(table + i * sizeof pair, pair, sizeof pair);
  }
  uint64_t published = next_phase();
  post(published);
  wait_all(published, ctx);
  reduce_cma(pieces, dtype, fn, factor, [&](int q, size_t k) { return packed_address(seg_.slot(s, q), k); },
             ctx);
  uint64_t read = next_phase();  // every rank's buffers and table read: they may change now
  post(read);
  wait_all(read, ctx);
  release_set(s, read);
}

void ShmComm::reduce(void* buf, size_t count, int dtype, int op, int root, WaitContext& ctx) {
  kernel_or_throw(dtype, op, ctx.what);
  if (root < 0 || root >= n_) throw std::invalid_argument("shm reduce: root out of range");
  check_not_aborted(ctx);
  if (count == 0 || n_ == 1) return;
  reduce_chunked({Piece{buf, buf, count}}, dtype, op, root, ctx);
}

// Small buffers: one synchronisation. Everyone copies in, then everyone reduces
// the whole buffer from all slots (in rank order, so all get the same bits).
void ShmComm::allreduce_small(const char* src, char* dst, size_t bytes, size_t count, int dtype,
                              int op, WaitContext& ctx) {
  ReduceFn fn = reduce_kernel(dtype, op);
  int s = acquire_set(true, ctx);
  std::memcpy(seg_.slot(s, rank_), src, bytes);
  uint64_t copied = next_phase();
  post(copied);
  wait_all(copied, ctx);
  std::vector<const void*> srcs(n_);
  for (int p = 0; p < n_; ++p) srcs[p] = seg_.slot(s, p);
  fn(dst, srcs.data(), n_, count);
  uint64_t read = next_phase();
  post(read);
  release_set(s, read);
}

namespace {
// Where the data packed behind a vote's words starts in a slot (a cache line of its own).
size_t vote_head(size_t words) { return round_up(words * sizeof(int32_t), 64); }
}  // namespace

size_t ShmComm::vote_room(size_t words) const {
  const size_t head = vote_head(words);
  const size_t cap = std::min(slot_bytes_, small_bytes_);
  return head < cap ? cap - head : 0;
}

bool ShmComm::vote(int32_t* vec, size_t words, const void* src, void* dst, size_t count,
                   int dtype, int op, const std::function<bool(const int32_t*)>& may_run,
                   WaitContext& ctx) {
  const size_t bytes = src ? count * dtype_size(dtype) : 0;
  ReduceFn fn = src ? kernel_or_throw(dtype, op, ctx.what) : nullptr;
  return vote_with(vec, words, src, bytes, may_run, [&](const std::vector<const void*>& packed) {
    if (n_ == 1) {
      if (src != dst) std::memcpy(dst, src, bytes);
    } else if (count) {
      fn(dst, packed.data(), n_, count);
    }
  }, false, ctx);
}

bool ShmComm::vote_with(int32_t* vec, size_t words, const void* pack, size_t pack_bytes,
                        const std::function<bool(const int32_t*)>& may_run, const PackedRun& run,
                        bool wait_read, WaitContext& ctx, const std::function<void()>& meanwhile) {
  const size_t head = vote_head(words);
  if (words == 0 || words * sizeof(int32_t) > std::min(slot_bytes_, small_bytes_))
    throw std::invalid_argument("shm vote: the words do not fit a slot");
  if (pack && pack_bytes > vote_room(words))
    throw std::invalid_argument("shm vote: the packed data does not fit behind the words");
  check_not_aborted(ctx);
  vec[words - 1] = pack ? 1 : 0;  // the "packed" flag (the caller leaves the last word for it)
  if (n_ == 1) {
    if (!pack || !may_run(vec)) return false;
    run({pack});
    if (meanwhile) meanwhile();
    return true;
  }
  int s = acquire_set(true, ctx);
  char* slot = seg_.slot(s, rank_);
  std::memcpy(slot, vec, words * sizeof(int32_t));
  if (pack && pack_bytes) std::memcpy(slot + head, pack, pack_bytes);
  uint64_t copied = next_phase();
  post(copied);
  wait_all(copied, ctx);
  std::vector<const void*> srcs(n_);
  for (int p = 0; p < n_; ++p) srcs[p] = seg_.slot(s, p);
  reduce_kernel(kI32, kMin)(vec, srcs.data(), n_, words);
  bool ran = false;
  if (pack && vec[words - 1] == 1 && may_run(vec)) {
    for (int p = 0; p < n_; ++p) srcs[p] = seg_.slot(s, p) + head;  // (no second vector)
    run(srcs);
    ran = true;
  }
  uint64_t read = next_phase();
  post(read);
  release_set(s, read);
  if (ran && meanwhile) meanwhile();
  if (ran && wait_read) wait_all(read, ctx);
  return ran;
}

namespace {
// The waits of a vote that carries an op poll and yield as the data segment's comm does
// (the peers are already here, as for any data op after its vote). The context is the
// calling thread's own and lives for this one call, so nothing needs restoring.
void poll_as(WaitContext& ctx, int spin_iters, int yield_iters) {
  ctx.spin_iters = spin_iters;
  ctx.yield_iters = yield_iters;
}

}  // namespace

bool ShmComm::vote_allgatherv(int32_t* vec, size_t words, const void* send_, void* recv_,
                              const std::vector<int64_t>& byte_counts,
                              const std::function<bool(const int32_t*)>& may_run,
                              ShmComm& data, WaitContext& ctx) {
  check_counts(byte_counts, n_, ctx.what);
  char* recv = static_cast<char*>(recv_);
  const std::vector<size_t> displ = prefix(byte_counts);
  std::vector<char> copy;
  const char* send = readable_send(static_cast<const char*>(send_), recv, byte_counts, displ, copy);
  const size_t mine = static_cast<size_t>(byte_counts[rank_]);
  char* const own = recv + displ[rank_];
  const uintptr_t address = reinterpret_cast<uintptr_t>(send);
  poll_as(ctx, data.spin_iters_, data.yield_iters_);
  data.plan_publish();  // (before this rank's vote posts: see plan_publish)
  // The peers' parts first, then the own part while the slower peers still read from this
  // rank (they wait for none of it; copied before the vote, it would hold up their reads).
  std::chrono::steady_clock::time_point t0;  // once the vote is through: the transfer's time
  const bool ran = vote_with(vec, words, &address, sizeof address, may_run,
                   [&](const std::vector<const void*>& packed) {
                     t0 = std::chrono::steady_clock::now();
                     read_parts(recv, byte_counts, displ,
                                [&](int q) { return packed_address(packed[q]); }, ctx);
                   }, true, ctx, [&]() {
                     if (mine && send != own) copy_own(own, send, mine);
                   });
  if (ran) {  // an allgather every rank ran: it carries the plan (not run, the data op will)
    data.plan_note(kPathAllgather, displ.back() + static_cast<size_t>(byte_counts.back()), true, t0);
    data.plan_adopt();
  }
  return ran;
}

bool ShmComm::vote_broadcast(int32_t* vec, size_t words, void* buf_, size_t bytes, int root,
                             const void* src_, const std::function<bool(const int32_t*)>& may_run,
                             ShmComm& data, WaitContext& ctx) {
  if (root < 0 || root >= n_) throw std::invalid_argument("shm broadcast: root out of range");
  char* buf = static_cast<char*>(buf_);
  const char* src = rank_ == root && src_ != buf_ ? static_cast<const char*>(src_) : nullptr;
  const uintptr_t address = rank_ == root ? reinterpret_cast<uintptr_t>(src ? src : buf) : 0;
  poll_as(ctx, data.spin_iters_, data.yield_iters_);
  data.plan_publish();  // (before this rank's vote posts: see plan_publish)
  // Only the root waits for the readers (its buffer may change once it returns), making
  // its own result from `src` meanwhile.
  std::chrono::steady_clock::time_point t0;
  const bool ran = vote_with(vec, words, &address, sizeof address, may_run,
                   [&](const std::vector<const void*>& packed) {
                     t0 = std::chrono::steady_clock::now();
                     if (rank_ != root) read_peer(root, buf, packed_address(packed[root]), bytes, ctx);
                   }, rank_ == root, ctx, [&]() {
                     if (src) copy_own(buf, src, bytes);
                   });
  if (ran) {  // a broadcast every rank ran with the vote: it carries the plan (any root)
    data.plan_note(kPathBroadcast, bytes, true, t0);
    data.plan_adopt();
  }
  return ran;
}

bool ShmComm::vote_allreduce(int32_t* vec, size_t words, const void* src_, void* dst_, size_t count,
                             int dtype, int op, double factor,
                             const std::function<bool(const int32_t*)>& may_run,
                             ShmComm& data, WaitContext& ctx) {
  ReduceFn fn = kernel_or_throw(dtype, op, ctx.what);
  check_factor(dtype, factor);
  std::vector<std::vector<char>> copies;
  const std::vector<Piece> one = readable_pieces({Piece{src_, dst_, count}}, dtype_size(dtype), copies);
  const uintptr_t addresses[2] = {reinterpret_cast<uintptr_t>(one[0].src), reinterpret_cast<uintptr_t>(dst_)};
  poll_as(ctx, data.spin_iters_, data.yield_iters_);
  data.plan_publish();  // (before this rank's vote posts: see plan_publish)
  std::chrono::steady_clock::time_point t0;
  const bool ran = vote_with(vec, words, addresses, sizeof addresses, may_run,
                   [&](const std::vector<const void*>& packed) {
                     t0 = std::chrono::steady_clock::now();
                     reduce_cma(one, dtype, fn, factor,
                                [&](int q, size_t k) { return packed_address(packed[q], k); }, ctx);
                   }, true, ctx);  // (and every rank's dst read by all before it returns)
  if (ran) {  // an allreduce every rank ran: it carries the plan (not run, the data op will)
    data.plan_note(kPathAllreduce, count * dtype_size(dtype), true, t0);
    data.plan_adopt();
  }
  return ran;
}

void ShmComm::reduce_cma(const std::vector<Piece>& pieces, int dtype, ReduceFn fn, double factor,
                         const std::function<uintptr_t(int, size_t)>& address, WaitContext& ctx) {
  const size_t item = dtype_size(dtype);
  const PieceRuns unit(pieces, item);
  const Slices slices(unit.count(), n_, item);
  // Steps of 256 KiB: the peers' pieces of one step stay in cache between their read and
  // the reduction (128 KiB and 512 KiB were no faster, docs/native.md).
  const size_t line = 64 / item;
  const size_t step = std::max<size_t>(line, (256 * 1024 / item) / line * line);
  // Each rank posts a phase per reduced step of its slice, base + 1, base + 2, ..., and
  // base + steps once its slice is done: every rank counts the same `steps` (those of the
  // largest slice), so all leave at the same phase.
  const size_t steps = (slices.size + step - 1) / step;
  const uint64_t base = gen_;
  gen_ += steps;
  std::vector<const void*> srcs(n_);
  std::vector<const char*> theirs(n_);  // each peer's part of the current step, in the scratch
  std::vector<struct iovec> local, remote;
  // Steps of peer q's reduced slice, read from its dst into mine: those it has posted
  // (all of them when `wait`). Step j of q is rank q's to read only once q has reduced it,
  // and so read every rank's src there: an in-place op's src is its dst, which this
  // overwrites.
  std::vector<size_t> copied(n_, 0);
  auto read_reduced = [&](int q, bool wait) {
    const auto [qlo, qhi] = slices.of(q);
    const size_t qsteps = (qhi - qlo + step - 1) / step;
    while (copied[q] < qsteps) {
      if (wait) wait_rank(q, base + copied[q] + 1, ctx);
      const size_t from_step = copied[q];  // the next step, and every later one posted since
      while (copied[q] < qsteps && posted(q, base + copied[q] + 1)) ++copied[q];
      if (copied[q] == from_step) return;  // (not waiting: q has not posted its next step)
      local.clear();
      remote.clear();
      unit.spans(qlo + from_step * step, std::min(qhi, qlo + copied[q] * step),
                 [&](size_t i, size_t from, size_t, size_t len) {
                   local.push_back({static_cast<char*>(pieces[i].dst) + from * item, len * item});
                   remote.push_back({reinterpret_cast<void*>(address(q, 2 * i + 1) + from * item), len * item});
                 });
      read_peer_runs(q, local, remote, ctx);
    }
  };
  // My slice, a step at a time: every rank's src (mine in place, the peers' read here),
  // reduced in rank order into my dst (the same bits whoever reduces), scaled while it is
  // in cache. Between steps, the peers' reduced steps that are ready, while they are
  // still in cache on their side.
  const auto [lo, hi] = slices.of(rank_);
  if (hi > lo) {
    const size_t piece = std::min(step, hi - lo);
    if (cma_scratch_.size() < (n_ - 1) * piece * item) cma_scratch_.resize((n_ - 1) * piece * item);
    uint64_t done = base;
    for (size_t off = lo; off < hi; off += piece) {
      const size_t end = std::min(hi, off + piece);
      char* at = cma_scratch_.data();
      for (int k = 1; k < n_; ++k) {  // start at a different peer on each rank
        const int q = (rank_ + k) % n_;
        local.clear();
        remote.clear();
        theirs[q] = at;
        unit.spans(off, end, [&](size_t i, size_t from, size_t, size_t len) {
          local.push_back({at, len * item});
          remote.push_back({reinterpret_cast<void*>(address(q, 2 * i) + from * item), len * item});
          at += len * item;
        });
        read_peer_runs(q, local, remote, ctx);
      }
      unit.spans(off, end, [&](size_t i, size_t from, size_t u, size_t len) {
        for (int q = 0; q < n_; ++q)
          srcs[q] = q == rank_ ? static_cast<const char*>(pieces[i].src) + from * item
                               : theirs[q] + (u - off) * item;
        char* const out = static_cast<char*>(pieces[i].dst) + from * item;
        fn(out, srcs.data(), n_, len);
        if (factor != 1.0) scale_in_place(out, len, dtype, factor);
      });
      post(++done);
      for (int k = 1; k < n_; ++k) read_reduced((rank_ + k) % n_, false);
    }
  }
  post(gen_);
  for (int k = 1; k < n_; ++k) read_reduced((rank_ + k) % n_, true);
}

bool ShmComm::wants_cma_allgatherv(const std::vector<int64_t>& byte_counts) const {
  const int64_t total = std::accumulate(byte_counts.begin(), byte_counts.end(), int64_t{0});
  return single_copy(kPathAllgather, static_cast<size_t>(total), cma_gather_bytes_);
}

// Large buffers: per chunk, copy in; each rank reduces its own slice (a
// reduce-scatter); then the reduced slices are copied out (an allgather, or to
// `root` only when root >= 0). The input is read from each piece's src and the result
// written to its dst (the same buffer for an in-place op): an out-of-place allreduce
// costs no copy of the input first, and a fused unit none into a buffer of its own.
void ShmComm::reduce_chunked(const std::vector<Piece>& pieces, int dtype, int op, int root,
                             WaitContext& ctx) {
  ReduceFn fn = reduce_kernel(dtype, op);
  const size_t item = dtype_size(dtype);
  const PieceRuns unit(pieces, item);
  const size_t count = unit.count();
  const size_t chunk = slot_bytes_ / item;
  // A buffer far bigger than the caches is written back with streaming stores.
  CopyFn plain = [](void* d, const void* s, size_t b) { std::memcpy(d, s, b); };
  CopyFn copy_out = count * item >= stream_bytes_ ? stream_copy() : plain;
  std::vector<const void*> srcs(n_);
  for (size_t off = 0; off < count; off += chunk) {
    const size_t c = std::min(chunk, count - off);
    const Slices slices(c, n_, item);
    const auto [lo, hi] = slices.of(rank_);
    int s = acquire_set(true, ctx);
    char* const slot = seg_.slot(s, rank_);
    // Only the slices other ranks reduce go through shared memory; my own slice
    // is read straight from my buffer, which saves a copy of 1/n of the data.
    auto copy_in = [&](const char* src, char*, size_t at, size_t len) {
      std::memcpy(slot + (at - off) * item, src, len * item);
    };
    unit.runs(off, off + lo, copy_in);
    unit.runs(off + hi, off + c, copy_in);
    uint64_t copied = next_phase();
    post(copied);
    wait_all(copied, ctx);
    unit.runs(off + lo, off + hi, [&](const char* src, char* out, size_t at, size_t len) {
      char* const mine = slot + (at - off) * item;
      for (int p = 0; p < n_; ++p) srcs[p] = p == rank_ ? src : seg_.slot(s, p) + (at - off) * item;
      if (root < 0) {
        fn(out, srcs.data(), n_, len);           // the result lands in my buffer...
        std::memcpy(mine, out, len * item);      // ...and where others read it
      } else if (root == rank_) {
        fn(out, srcs.data(), n_, len);
      } else {
        fn(mine, srcs.data(), n_, len);  // a non-root's buffer stays as it was
      }
    });
    uint64_t reduced = next_phase();
    post(reduced);
    if (root < 0 || root == rank_) {
      wait_all(reduced, ctx);
      for (int q = 0; q < n_; ++q) {
        if (q == rank_) continue;
        const auto [qlo, qhi] = slices.of(q);
        const char* const theirs = seg_.slot(s, q);
        unit.runs(off + qlo, off + qhi, [&](const char*, char* out, size_t at, size_t len) {
          copy_out(out, theirs + (at - off) * item, len * item);
        });
      }
    }
    uint64_t read = next_phase();
    post(read);
    release_set(s, read);
  }
}

// Single copy or the slots, by size and the plan in force; from rank 0 it carries a plan.
void ShmComm::broadcast(void* buf_, size_t bytes, int root, WaitContext& ctx, const void* src_) {
  if (root < 0 || root >= n_) throw std::invalid_argument("shm broadcast: root out of range");
  check_not_aborted(ctx);
  char* buf = static_cast<char*>(buf_);
  const char* src = rank_ == root && src_ != buf_ ? static_cast<const char*>(src_) : nullptr;
  if (bytes == 0 || n_ == 1) {
    if (src) copy_own(buf, src, bytes);
    return;
  }
  // From rank 0 every reader waits for rank 0's posts: the broadcast carries the plan.
  const bool carries = root == 0;
  if (carries) plan_publish();
  const bool single = wants_cma_broadcast(bytes);
  const auto t0 = std::chrono::steady_clock::now();
  if (single)
    broadcast_cma(buf, bytes, root, ctx, src);
  else
    broadcast_slots(buf, bytes, root, ctx, src);
  plan_note(kPathBroadcast, bytes, single, t0);
  if (carries) plan_adopt();
}

// The root copies chunks into a whole slot set (n slots, contiguous); the others
// copy them out. With several sets the root runs ahead by up to nsets-1 chunks.
void ShmComm::broadcast_slots(char* buf, size_t bytes, int root, WaitContext& ctx, const char* src) {
  // (the root's two copies run while the peers copy out anyway)
  if (src) copy_own(buf, src, bytes);
  const size_t cap = slot_bytes_ * n_;
  for (size_t off = 0; off < bytes; off += cap) {
    const size_t c = std::min(cap, bytes - off);
    int s = acquire_set(rank_ == root, ctx);
    uint64_t written = next_phase();
    if (rank_ == root) {
      std::memcpy(seg_.slot(s, 0), buf + off, c);
      uint64_t read = next_phase();  // the root reads nothing back: done at once
      post(read);
      release_set(s, read);
    } else {
      wait_rank(root, written, ctx);
      std::memcpy(buf + off, seg_.slot(s, 0), c);
      uint64_t read = next_phase();
      post(read);
      release_set(s, read);
    }
  }
}

void ShmComm::allgatherv(const void* send_, void* recv_, const std::vector<int64_t>& byte_counts,
                         WaitContext& ctx) {
  check_counts(byte_counts, n_, ctx.what);
  check_not_aborted(ctx);
  const char* send = static_cast<const char*>(send_);
  char* recv = static_cast<char*>(recv_);
  const size_t total = static_cast<size_t>(std::accumulate(byte_counts.begin(), byte_counts.end(), int64_t{0}));
  const bool single = single_copy(kPathAllgather, total, cma_gather_bytes_);  // (wants_cma_allgatherv)
  if (total) plan_publish();  // (an empty one syncs nothing, so it cannot carry a plan)
  const auto t0 = std::chrono::steady_clock::now();
  if (single)
    allgatherv_cma(send, recv, byte_counts, ctx);
  else
    allgatherv_slots(send, recv, byte_counts, ctx);
  plan_note(kPathAllgather, total, single, t0);
  if (total) plan_adopt();
}

void ShmComm::allgatherv_slots(const char* send, char* recv, const std::vector<int64_t>& byte_counts,
                               WaitContext& ctx) {
  const std::vector<size_t> displ = prefix(byte_counts);
  const size_t mine = static_cast<size_t>(byte_counts[rank_]);
  char* const own = recv + displ[rank_];
  // My part goes to its place in `recv` from my slot, chunk by chunk, right after I copy
  // the chunk in: while the peers copy theirs in (I would wait for them otherwise), and
  // from the slot while it is in cache, instead of one pass over `send` up front (1-4 MiB
  // parts, 2 ranks: 6-12 % faster). Unless `send` overlaps that place (in place): it
  // moves first.
  const bool apart = own + mine <= send || send + mine <= own;
  if (mine && (!apart || n_ == 1)) std::memmove(own, send, mine);
  const char* const src = apart ? send : own;  // (a moved part is read from where it went)
  const size_t longest = static_cast<size_t>(*std::max_element(byte_counts.begin(), byte_counts.end()));
  if (longest == 0 || n_ == 1) return;
  for (size_t off = 0; off < longest; off += slot_bytes_) {
    int s = acquire_set(true, ctx);
    size_t len = clamp_len(byte_counts[rank_], off, slot_bytes_);
    char* const slot = seg_.slot(s, rank_);
    if (len) std::memcpy(slot, src + off, len);
    uint64_t copied = next_phase();
    post(copied);
    if (apart && len) std::memcpy(own + off, slot, len);  // while the peers copy theirs in
    wait_all(copied, ctx);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      size_t qlen = clamp_len(byte_counts[q], off, slot_bytes_);
      if (qlen) std::memcpy(recv + displ[q] + off, seg_.slot(s, q), qlen);
    }
    uint64_t read = next_phase();
    post(read);
    release_set(s, read);
  }
}

// Each step moves up to `part` elements of every rank's share: rank r puts the
// piece destined to q at region q of its slot, and q reduces region q of all slots.
void ShmComm::reducescatter(const void* send_, void* recv_, const std::vector<int64_t>& counts,
                            int dtype, int op, WaitContext& ctx) {
  ReduceFn fn = kernel_or_throw(dtype, op, ctx.what);
  check_counts(counts, n_, ctx.what);
  check_not_aborted(ctx);
  const size_t item = dtype_size(dtype);
  const char* send = static_cast<const char*>(send_);
  char* recv = static_cast<char*>(recv_);
  const std::vector<size_t> first = prefix(counts);
  const size_t longest = static_cast<size_t>(*std::max_element(counts.begin(), counts.end()));
  if (longest == 0) return;
  if (n_ == 1) {
    std::memmove(recv, send, static_cast<size_t>(counts[0]) * item);
    return;
  }
  size_t part = slot_bytes_ / n_ / item;
  if (part >= 64 / item) part -= part % (64 / item);
  if (part == 0) throw std::invalid_argument("shm reducescatter: slots too small for this many ranks");
  std::vector<const void*> srcs(n_);
  for (size_t off = 0; off < longest; off += part) {
    int s = acquire_set(true, ctx);
    char* myslot = seg_.slot(s, rank_);
    for (int q = 0; q < n_; ++q) {
      size_t len = clamp_len(counts[q], off, part);
      if (len) std::memcpy(myslot + q * part * item, send + (first[q] + off) * item, len * item);
    }
    uint64_t copied = next_phase();
    post(copied);
    wait_all(copied, ctx);
    size_t mylen = clamp_len(counts[rank_], off, part);
    if (mylen) {
      for (int p = 0; p < n_; ++p) srcs[p] = seg_.slot(s, p) + rank_ * part * item;
      fn(recv + off * item, srcs.data(), n_, mylen);
    }
    uint64_t read = next_phase();
    post(read);
    release_set(s, read);
  }
}

// Ranks know only their own counts, so they first agree (through each rank's
// scratch word) on the longest piece any pair exchanges: that fixes the steps.
void ShmComm::alltoallv(const void* send_, const std::vector<int64_t>& send_bytes, void* recv_,
                        const std::vector<int64_t>& recv_bytes, WaitContext& ctx) {
  check_counts(send_bytes, n_, ctx.what);
  check_counts(recv_bytes, n_, ctx.what);
  check_not_aborted(ctx);
  const char* send = static_cast<const char*>(send_);
  char* recv = static_cast<char*>(recv_);
  const std::vector<size_t> sdispl = prefix(send_bytes), rdispl = prefix(recv_bytes);
  if (n_ == 1) {
    std::memmove(recv, send, static_cast<size_t>(send_bytes[0]));
    return;
  }
  int64_t local_max = std::max(*std::max_element(send_bytes.begin(), send_bytes.end()),
                               *std::max_element(recv_bytes.begin(), recv_bytes.end()));
  wait_all(scratch_free_, ctx);  // every rank has read my previous scratch value
  hdr_->ranks[rank_].scratch.store(local_max, std::memory_order_relaxed);
  uint64_t shared = next_phase();
  post(shared);
  wait_all(shared, ctx);
  size_t longest = 0;
  for (int p = 0; p < n_; ++p)
    longest = std::max(longest, static_cast<size_t>(hdr_->ranks[p].scratch.load(std::memory_order_relaxed)));
  scratch_free_ = next_phase();
  post(scratch_free_);
  size_t part = slot_bytes_ / n_;
  part -= part % 64;
  if (part == 0) throw std::invalid_argument("shm alltoallv: slots too small for this many ranks");
  for (size_t off = 0; off < longest; off += part) {
    int s = acquire_set(true, ctx);
    char* myslot = seg_.slot(s, rank_);
    for (int q = 0; q < n_; ++q) {
      size_t len = clamp_len(send_bytes[q], off, part);
      if (len) std::memcpy(myslot + q * part, send + sdispl[q] + off, len);
    }
    uint64_t copied = next_phase();
    post(copied);
    wait_all(copied, ctx);
    for (int p = 0; p < n_; ++p) {
      size_t len = clamp_len(recv_bytes[p], off, part);
      if (len) std::memcpy(recv + rdispl[p] + off, seg_.slot(s, p) + rank_ * part, len);
    }
    uint64_t read = next_phase();
    post(read);
    release_set(s, read);
  }
}

// Single-copy transfers (Linux CMA): a rank publishes its buffer's address in its
// scratch word, peers read it with process_vm_readv, and the owner waits until all
// have read before returning (its buffer may change right after).
void ShmComm::read_peer(int q, char* dst, uintptr_t src, size_t len, WaitContext& ctx) {
  while (len > 0) {
    struct iovec local{dst, len}, remote{reinterpret_cast<void*>(src), len};
    ssize_t got = process_vm_readv(hdr_->ranks[q].pid, &local, 1, &remote, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      // A peer that died mid-op is the cause to name, as the waits name it. ESRCH says so
      // before /proc does: a SIGKILLed process loses its memory before it is a zombie. Any
      // other failure (EPERM: ptrace rules) is about single-copy transfers themselves.
      const int err = errno;
      std::string died = death_of(q, ctx, err == ESRCH);
      abort(!died.empty() ? died
                          : "rank " + std::to_string(global_rank_) + " could not read rank " +
                                std::to_string(hdr_->ranks[q].global_rank) +
                                "'s buffer (process_vm_readv: " + std::strerror(err) +
                                "); NBDIST_SHM_CMA_BYTES=0 turns single-copy transfers off");
      fail_aborted(ctx);
    }
    dst += got;
    src += static_cast<uintptr_t>(got);
    len -= static_cast<size_t>(got);
  }
}

void ShmComm::read_peer_runs(int q, const std::vector<struct iovec>& local,
                             const std::vector<struct iovec>& remote, WaitContext& ctx) {
  constexpr size_t kBatch = 1024;  // IOV_MAX on Linux
  for (size_t b = 0; b < local.size(); b += kBatch) {
    const size_t k = std::min(kBatch, local.size() - b);
    size_t want = 0;
    for (size_t i = b; i < b + k; ++i) want += local[i].iov_len;
    ssize_t got;
    do {
      got = process_vm_readv(hdr_->ranks[q].pid, &local[b], k, &remote[b], k, 0);
    } while (got < 0 && errno == EINTR);
    if (got == static_cast<ssize_t>(want)) continue;
    // Short, or failed: the rest run by run (read_peer names a dead peer, or the error).
    size_t done = got > 0 ? static_cast<size_t>(got) : 0;
    for (size_t i = b; i < b + k; ++i) {
      const size_t len = local[i].iov_len, skip = std::min(done, len);
      done -= skip;
      if (skip < len)
        read_peer(q, static_cast<char*>(local[i].iov_base) + skip,
                  reinterpret_cast<uintptr_t>(remote[i].iov_base) + skip, len - skip, ctx);
    }
  }
}

const char* ShmComm::readable_send(const char* send, const char* recv,
                                   const std::vector<int64_t>& byte_counts,
                                   const std::vector<size_t>& displ, std::vector<char>& copy) const {
  const size_t mine = static_cast<size_t>(byte_counts[rank_]);
  const char* const own = recv + displ[rank_];
  const size_t total = displ[n_ - 1] + static_cast<size_t>(byte_counts[n_ - 1]);
  if (send == own || send >= recv + total || recv >= send + mine) return send;
  copy.assign(send, send + mine);
  return copy.data();
}

void ShmComm::read_parts(char* recv, const std::vector<int64_t>& byte_counts,
                         const std::vector<size_t>& displ,
                         const std::function<uintptr_t(int)>& address_of, WaitContext& ctx) {
  for (int k = 1; k < n_; ++k) {  // start at a different peer on each rank
    int q = (rank_ + k) % n_;
    size_t len = static_cast<size_t>(byte_counts[q]);
    if (len) read_peer(q, recv + displ[q], address_of(q), len, ctx);
  }
}

void ShmComm::allgatherv_cma(const char* send, char* recv, const std::vector<int64_t>& byte_counts,
                             WaitContext& ctx) {
  const std::vector<size_t> displ = prefix(byte_counts);
  const size_t mine = static_cast<size_t>(byte_counts[rank_]);
  char* const own = recv + displ[rank_];
  std::vector<char> copy;
  send = readable_send(send, recv, byte_counts, displ, copy);
  wait_all(scratch_free_, ctx);  // every rank has read my previous scratch value
  hdr_->ranks[rank_].scratch.store(static_cast<int64_t>(reinterpret_cast<uintptr_t>(send)),
                                   std::memory_order_relaxed);
  uint64_t shared = next_phase();
  post(shared);  // seq_cst: publishes the address too
  if (mine && send != own) copy_own(own, send, mine);  // while the peers publish theirs
  wait_all(shared, ctx);
  read_parts(recv, byte_counts, displ, [&](int q) {
    return static_cast<uintptr_t>(hdr_->ranks[q].scratch.load(std::memory_order_relaxed));
  }, ctx);
  uint64_t done = next_phase();
  post(done);
  wait_all(done, ctx);
  scratch_free_ = done;
}

void ShmComm::broadcast_cma(char* buf, size_t bytes, int root, WaitContext& ctx, const char* src) {
  wait_all(scratch_free_, ctx);
  if (rank_ == root)
    hdr_->ranks[rank_].scratch.store(static_cast<int64_t>(reinterpret_cast<uintptr_t>(src ? src : buf)),
                                     std::memory_order_relaxed);
  uint64_t shared = next_phase();
  post(shared);
  if (src) copy_own(buf, src, bytes);  // the root's own result, while the peers read src
  if (rank_ != root) {
    wait_rank(root, shared, ctx);
    read_peer(root, buf, static_cast<uintptr_t>(hdr_->ranks[root].scratch.load(std::memory_order_relaxed)),
              bytes, ctx);
  }
  uint64_t done = next_phase();
  post(done);
  if (rank_ == root) wait_all(done, ctx);  // the root's buffer is read by all before it returns
  scratch_free_ = done;
}

}  // namespace nbdist
