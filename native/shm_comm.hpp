// Collectives among the ranks of one node through a shared-memory segment.
//
// Synchronisation: every rank owns a monotonically increasing counter (seq) in
// the segment. All ranks run the same ops in the same order (the engine agrees
// on them first), so they step through the same sequence of phases; a rank
// publishes "I finished phase g" by storing g, and waits for "everyone finished
// phase g" by waiting until every counter is >= g. No counter is ever reset
// while ops run, so there is no ABA problem and no per-op handshake.
//
// Data: nsets rotating sets of one slot per rank. A step writes into one set;
// before a set is written again every rank must have finished reading it (its
// "free" phase), so with >= 2 sets a fast rank copies the next chunk in while
// slower ones still reduce the current one: copying and reducing overlap.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "path_tuner.hpp"
#include "shm_segment.hpp"

namespace nbdist {

// An op could not complete: a peer aborted, died, or the deadline passed.
class ShmError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a wait needs besides the segment: which op, until when, and a hook that
// returns true (and a reason) when the caller wants to give up.
struct WaitContext {
  const char* what = "op";
  double timeout_s = 0.0;  // 0: no deadline
  std::function<bool(std::string&)> should_stop;  // polled every ~100 ms once asleep
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  // Polls and yields before a wait sleeps, when not the comm's own (-1): a vote that
  // carries a data op waits with the data segment's (see vote_allgatherv).
  int spin_iters = -1;
  int yield_iters = -1;
};

class ShmComm {
 public:
  ShmComm(Segment seg, int local_rank, int global_rank);
  ~ShmComm();

  int rank() const { return rank_; }
  int size() const { return n_; }
  size_t slot_bytes() const { return slot_bytes_; }
  const std::string& name() const { return seg_.name(); }
  bool register_rank() { return seg_.register_rank(rank_, global_rank_); }
  void unlink() { seg_.unlink(); }
  void close() { seg_.unmap(); }

  // Marks the segment aborted with `reason` and wakes every waiter (any thread).
  void abort(const std::string& reason);
  // The abort reason, or "" when not aborted.
  std::string abort_reason() const;
  // Recovery after an abort, in two steps with an MPI barrier before and between:
  // clear_shared() on local rank 0 only, then reset_local() on every rank.
  void clear_shared();
  void reset_local();

  // The collectives; pointers are host memory of `count` elements of `dtype`.
  void allreduce(void* buf, size_t count, int dtype, int op, WaitContext& ctx) {
    allreduce(buf, buf, count, dtype, op, ctx);
  }
  // Out of place: reads `src` (which may be `dst`), writes the result to `dst` only, scaled
  // by `factor` (float32 and float64 only; single copy scales each slice as it is reduced).
  void allreduce(const void* src, void* dst, size_t count, int dtype, int op, WaitContext& ctx,
                 double factor = 1.0);
  // One allreduce over several buffers of one dtype (a fused unit of the engine): each
  // piece's src is reduced into its dst. Pieces that fit a slot together are packed
  // straight into it and reduced from it into each dst; a bigger unit is reduced chunk by
  // chunk as one buffer would be, each chunk gathered from the pieces and scattered back
  // to them: no fusion buffer, so no copy of the unit in and out of one.
  struct Piece {
    const void* src;
    void* dst;
    size_t count;
  };
  // A result scaled by a factor other than 1 must be float32 or float64 (else throws):
  // scaling after a reduction is done natively for those (Horovod multiplies them in their
  // own type); other dtypes come with factor 1 and are scaled by the Python side.
  static void check_factor(int dtype, double factor) {
    if (factor != 1.0 && dtype != kF32 && dtype != kF64)
      throw std::invalid_argument("allreduce: a factor other than 1 needs float32 or float64");
  }
  // From cma_reduce_bytes_ (set_cma_allreduce_bytes) a unit goes single-copy (allreduce_cma).
  void allreduce_pieces(const std::vector<Piece>& pieces, int dtype, int op, WaitContext& ctx,
                        double factor = 1.0);
  void reduce(void* buf, size_t count, int dtype, int op, int root, WaitContext& ctx);
  // `src` (the root's, else ignored): the root sends src and copies it into buf as well,
  // while the peers read where the path allows (an out-of-place broadcast's result).
  void broadcast(void* buf, size_t bytes, int root, WaitContext& ctx, const void* src = nullptr);
  void allgatherv(const void* send, void* recv, const std::vector<int64_t>& byte_counts,
                  WaitContext& ctx);
  void reducescatter(const void* send, void* recv, const std::vector<int64_t>& counts,
                     int dtype, int op, WaitContext& ctx);
  void alltoallv(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                 const std::vector<int64_t>& recv_bytes, WaitContext& ctx);
  void barrier(WaitContext& ctx);

  // The engine agreement's vote: a Min over `words` int32 words (`vec`, replaced by the
  // result), in one synchronisation. This rank may pack its data for one allreduce behind
  // the words (`src`, `count` elements of `dtype`; nullptr: none): the last word is each
  // rank's "packed" flag, so its Min is 1 only when every rank packed. Then, when
  // `may_run(result)` says the vote lets that allreduce run, it is reduced from the
  // slots into `dst` in the same synchronisation (in rank order, as a small allreduce):
  // the vote and the bytes of a cached op cost one round instead of two. Returns
  // whether it ran. Every rank must call this (or allreduce of the same words) alike.
  bool vote(int32_t* vec, size_t words, const void* src, void* dst, size_t count, int dtype,
            int op, const std::function<bool(const int32_t*)>& may_run, WaitContext& ctx);
  // Bytes of data vote() can pack behind `words` words.
  size_t vote_room(size_t words) const;
  // vote() with a single-copy (CMA) allgatherv or broadcast behind it: each rank packs its
  // buffer's address behind the words (a broadcast: the root's), and when the vote lets the
  // op run, the peers read straight from it in the same call. The vote's synchronisation
  // is then the op's first one as well (the address is out once every rank has voted), so
  // the op costs one wait for the readers after it instead of two syncs on the data
  // segment (address out, reads done). The call's waits use `data`'s spin tuning (the data
  // segment's comm: the peers are already here, as for any data op after its vote). Same
  // calling rules as vote(); pack only where `data` would move the op single-copy
  // (wants_cma_*), so that no rank without CMA takes part in a CMA op.
  bool vote_allgatherv(int32_t* vec, size_t words, const void* send, void* recv,
                       const std::vector<int64_t>& byte_counts,
                       const std::function<bool(const int32_t*)>& may_run, ShmComm& data,
                       WaitContext& ctx);
  bool vote_broadcast(int32_t* vec, size_t words, void* buf, size_t bytes, int root,
                      const void* src, const std::function<bool(const int32_t*)>& may_run,
                      ShmComm& data, WaitContext& ctx);
  // On an agreement comm: whether its votes carry single-copy ops (vote_allgatherv,
  // vote_broadcast) at all; off, those ops run on their data segment after the vote, as
  // before 2026-12-07 (benchmarks/cma_threshold.py measures both). The same on every rank.
  void set_vote_carries(bool on) { vote_carries_ = on; }
  bool vote_carries() const { return vote_carries_; }
  // The same for an allreduce (src into dst, which may be src): each rank packs both
  // addresses; when the vote lets it run, each rank reduces its slice of the buffer from
  // every rank's src (the peers' parts read by CMA, a cache-sized piece at a time), all
  // sync once, and each reads the other slices' results from their owners' dst. Three
  // synchronisations in all (vote, reduced, read) where the slots take two per slot-sized
  // chunk after the vote, and each byte crosses once instead of in and out of a slot.
  // `factor` (float32/float64 only, else 1) scales each slice as its owner reduces it, so
  // an Average costs no pass over the whole result afterwards.
  bool vote_allreduce(int32_t* vec, size_t words, const void* src, void* dst, size_t count,
                      int dtype, int op, double factor,
                      const std::function<bool(const int32_t*)>& may_run, ShmComm& data,
                      WaitContext& ctx);
  // Whether an allreduce of `bytes` goes single-copy (vote_allreduce, allreduce_cma): by
  // size and the plan in force (single_copy), so every rank decides alike.
  bool cma_reduces(size_t bytes) const { return single_copy(kPathAllreduce, bytes, cma_reduce_bytes_); }
  // The pieces as the single-copy reduction reads them: a piece whose src partly overlaps
  // its dst (no API path passes one; in place is fine) is read from a copy kept in
  // `copies`, so that whether an allreduce goes single-copy stays the same on every rank.
  static std::vector<Piece> readable_pieces(const std::vector<Piece>& given, size_t item,
                                            std::vector<std::vector<char>>& copies);
  // Whether this comm moves an allgatherv of these counts, or a broadcast of `bytes`, by CMA.
  bool wants_cma_allgatherv(const std::vector<int64_t>& byte_counts) const;
  bool wants_cma_broadcast(size_t bytes) const { return single_copy(kPathBroadcast, bytes, cma_bytes_); }
  // Whether a transfer of `bytes` of `kind` goes single-copy: never without a threshold
  // (CMA off or not allowed here); from 256 KiB, where the path of that kind is tuned, as
  // the plan in force says (the same on every rank); else from the threshold.
  bool single_copy(PathKind kind, size_t bytes, size_t threshold) const {
    if (n_ <= 1 || threshold == 0) return false;
    if (tuning_[kind] && PathTuner::size_class(bytes) >= PathTuner::kMinClass)
      return PathTuner::in_plan(plan_, kind, bytes);
    return bytes >= threshold;
  }

  // Path tuning (path_tuner.hpp), per kind, from the thresholds set before (set_cma_bytes,
  // set_cma_allreduce_bytes): local rank 0 times its transfers, and each allreduce,
  // allgather and broadcast from rank 0 carries its latest plan to every rank
  // (plan_publish). Off for a kind, its threshold alone decides. The same on every rank, with no op in flight; it starts the
  // tuning afresh.
  void set_path_tuning(bool broadcast, bool allgather, bool allreduce);
  // The plan in force, and how many ops (allreduces, allgathers, broadcasts from rank 0)
  // have carried one.
  const PathPlan& path_plan() const { return plan_; }
  uint64_t plans_carried() const { return plans_carried_; }
  // Local rank 0's timings (other ranks time nothing).
  const PathTuner& path_tuner() const { return tuner_; }

  // The engine's agreement loop uses one segment of its own and, between its
  // cycles, sleeps here (GIL released) instead of polling: until a peer has started
  // an op this rank has not (its counter passed ours: the peer began a cycle), ring()
  // was called (this process queued work), the segment was aborted, or timeout_s
  // passed. Returns 1 (peer), 2 (rung), 3 (aborted) or 0 (timeout).
  int wait_activity(double timeout_s);
  // Wakes this process's wait_activity (any thread; a futex wake only if it sleeps).
  void ring();
  // ring() for an op the ringing thread will likely drive itself in a moment (an async
  // submit, then its synchronize): wait_activity, woken, first yields a few times for a
  // thread of this process to hold the watch, and returns 2 only if none does
  // (SOFT_RING_YIELDS, shm_wait.cpp). A ring it leaves to the holder is rung again
  // when the holder lets go, unless the holder took the queue since (clear_absorbed).
  void ring_soon();
  void clear_absorbed() { absorbed_.store(0, std::memory_order_seq_cst); }
  // While another thread of this process runs the agreement's cycles itself (it joins
  // peers' cycles), wait_activity stops watching the peers: it does not count as a
  // sleeper on the shared wake word, so the peers' every step does not wake it (a
  // futex wake and a context switch each, on cores the ranks need), and it looks
  // again after 1 ms, backing off to 16 ms while the watch stays held
  // (HELD_RECHECK_NS, shm_wait.cpp). ring() and an abort still end its wait.
  void hold_activity(bool on);
  // The agreement's "I have ops queued" word (the scratch word; its segment runs no
  // collective that uses scratch): publish this rank's, and ask whether every peer's
  // is non-zero. seq_cst on both sides: of two ranks publishing at once, at least one
  // sees the other's.
  void publish_queued(int64_t v) { hdr_->ranks[rank_].scratch.store(v, std::memory_order_seq_cst); }
  bool peers_queued() const {
    for (int r = 0; r < n_; ++r)
      if (r != rank_ && hdr_->ranks[r].scratch.load(std::memory_order_seq_cst) == 0) return false;
    return true;
  }

  // True when a peer has started an op on this segment that this rank has not (the
  // condition wait_activity returns 1 on): a thread that runs the agreement's cycle
  // outside wait_activity asks this before joining one. Call it while no op of this
  // rank runs on the segment (the agreement's cycle lock makes sure).
  bool peer_ahead() const {
    for (int r = 0; r < n_; ++r)
      if (r != rank_ && hdr_->ranks[r].seq.load(std::memory_order_acquire) > gen_) return true;
    return false;
  }

  // Tuning (set from Python before the first op).
  void set_spin(int spin_iters, int yield_iters) { spin_iters_ = spin_iters; yield_iters_ = yield_iters; }
  void set_small_bytes(size_t b) { small_bytes_ = b; }
  void set_stream_bytes(size_t b) { stream_bytes_ = b; }
  // Broadcasts of at least `broadcast` bytes, and allgathers moving at least `allgather`
  // bytes (all ranks' parts), read peers' buffers directly (Linux CMA, process_vm_readv:
  // one copy instead of two through the slots); 0: never. The same values on every rank
  // (the Python side probes that CMA works first, and picks them: see shm.py).
  void set_cma_bytes(size_t broadcast, size_t allgather) {
    cma_bytes_ = broadcast;
    cma_gather_bytes_ = allgather;
  }
  // Allreduces of at least `bytes` go single-copy: those an agreement's vote carries
  // (vote_allreduce), and those run on this segment (allreduce, allreduce_pieces:
  // allreduce_cma); 0: never. As set_cma_bytes: the same on every rank, after the probe.
  void set_cma_allreduce_bytes(size_t bytes) { cma_reduce_bytes_ = bytes; }

 private:
  uint64_t next_phase() { return ++gen_; }
  void post(uint64_t phase);
  void wait_all(uint64_t phase, WaitContext& ctx);
  void wait_rank(int who, uint64_t phase, WaitContext& ctx);
  void wait_for(int who, uint64_t phase, WaitContext& ctx);  // who < 0: all ranks
  // Whether local rank `who` has posted `phase` (no wait).
  bool posted(int who, uint64_t phase) const {
    return hdr_->ranks[who].seq.load(std::memory_order_acquire) >= phase;
  }
  [[noreturn]] void fail_aborted(const WaitContext& ctx);
  void check_slow(int who, uint64_t phase, WaitContext& ctx, bool& stop);
  // "rank G (pid P) died during shm <op>" when local rank r's process is gone (or is known
  // to be: `gone`), else "".
  std::string death_of(int r, const WaitContext& ctx, bool gone = false) const;
  int acquire_set(bool writer, WaitContext& ctx);
  void release_set(int set, uint64_t phase) { free_phase_[set] = phase; }
  void check_not_aborted(const WaitContext& ctx);

  // vote()'s body: `pack` (pack_bytes; nullptr: nothing packed) goes behind the words, and
  // when every rank packed and may_run says so, run(each rank's packed bytes) runs before
  // the slots are let go; with wait_read, the call returns only once every rank has run,
  // and `meanwhile` (if set) runs first, while the slower ranks still do.
  using PackedRun = std::function<void(const std::vector<const void*>&)>;
  bool vote_with(int32_t* vec, size_t words, const void* pack, size_t pack_bytes,
                 const std::function<bool(const int32_t*)>& may_run, const PackedRun& run,
                 bool wait_read, WaitContext& ctx, const std::function<void()>& meanwhile = {});
  // CMA: `send`, or a copy of it when it overlaps `recv` but not at this rank's place there
  // (the peers read `send` while this rank writes `recv`; no API path passes one).
  const char* readable_send(const char* send, const char* recv, const std::vector<int64_t>& byte_counts,
                            const std::vector<size_t>& displ, std::vector<char>& copy) const;
  // CMA: every peer's part of an allgatherv, read from the addresses the peers published.
  void read_parts(char* recv, const std::vector<int64_t>& byte_counts, const std::vector<size_t>& displ,
                  const std::function<uintptr_t(int)>& address_of, WaitContext& ctx);
  void allgatherv_cma(const char* send, char* recv, const std::vector<int64_t>& byte_counts,
                      WaitContext& ctx);
  void allgatherv_slots(const char* send, char* recv, const std::vector<int64_t>& byte_counts,
                        WaitContext& ctx);
  void broadcast_cma(char* buf, size_t bytes, int root, WaitContext& ctx, const char* src);
  // The root copies chunks into a whole slot set; the others copy them out.
  void broadcast_slots(char* buf, size_t bytes, int root, WaitContext& ctx, const char* src);
  void read_peer(int q, char* dst, uintptr_t src, size_t len, WaitContext& ctx);
  // Runs of rank q's memory, remote[i] into local[i] (equal lengths), in as few
  // process_vm_readv calls as the iovec limit allows.
  void read_peer_runs(int q, const std::vector<struct iovec>& local,
                      const std::vector<struct iovec>& remote, WaitContext& ctx);
  // The plan's way from rank 0 to every rank: on entry to an op that carries one (before
  // its first post), rank 0 writes its tuner's next plan into plans[n % 2] of the header
  // (n: such ops so far, the same count on every rank); on the way out, once it has seen
  // rank 0's posts of this op, each rank takes plans[n % 2] as its plan and counts it
  // (plans_taken). Rank 0 writes an entry only once every rank has taken what it last
  // wrote there; else it leaves the entry as it was, which every rank then takes again.
  // The ops that carry one are those where every rank waits for rank 0's posts: an
  // allreduce, an allgather that moves bytes, a broadcast from rank 0, and a vote that
  // carries one of these (its root any rank: every rank waits for every vote). In a
  // broadcast from another root, a reader may leave before rank 0 has come at all.
  // (The guard matters after broadcasts: their root, rank 0, waits for no reader in the
  // slots, so it can run an op or two ahead; in the other ops it waits for everyone.)
  void plan_publish();
  void plan_adopt();
  bool tuning_any() const { return tuning_[0] || tuning_[1] || tuning_[2]; }
  // Rank 0, path tuning on for `kind`: a transfer that started at `t0` is done.
  void plan_note(PathKind kind, size_t bytes, bool cma, std::chrono::steady_clock::time_point t0);
  // Single-copy allreduce of a unit with syncs of its own: each rank's (src, dst) per
  // piece goes into its slot, then reduce_cma, then one sync before any buffer may change.
  void allreduce_cma(const std::vector<Piece>& pieces, int dtype, ReduceFn fn, double factor,
                     WaitContext& ctx);
  // The single-copy reduction once every rank's addresses are out (address(q, 2i) is rank
  // q's src of piece i, address(q, 2i + 1) its dst): each rank reduces its slice of the
  // unit from every rank's src (the peers' parts read by CMA a step at a time into
  // cma_scratch_), posting each step it has reduced, and reads the other slices from their
  // owners' dst a step at a time as they are posted.
  // The caller syncs once more before any rank's buffers may change.
  void reduce_cma(const std::vector<Piece>& pieces, int dtype, ReduceFn fn, double factor,
                  const std::function<uintptr_t(int, size_t)>& address, WaitContext& ctx);
  void allreduce_small(const char* src, char* dst, size_t bytes, size_t count, int dtype, int op,
                       WaitContext& ctx);
  // A unit that fits a slot: its pieces packed into the slot and reduced out of it.
  void allreduce_packed(const std::vector<Piece>& pieces, int dtype, ReduceFn fn, double factor,
                        WaitContext& ctx);
  void reduce_chunked(const std::vector<Piece>& pieces, int dtype, int op, int root,
                      WaitContext& ctx);

  Segment seg_;
  Header* hdr_;
  int rank_, global_rank_, n_, nsets_;
  size_t slot_bytes_;
  uint64_t gen_ = 0;
  int next_set_ = 0;
  std::vector<uint64_t> free_phase_;
  uint64_t scratch_free_ = 0;  // phase after which every rank has read the scratch words
  int spin_iters_ = 2000;
  int yield_iters_ = 200;
  size_t small_bytes_ = 64 * 1024;
  size_t stream_bytes_ = SIZE_MAX;
  size_t cma_bytes_ = 0;         // broadcast
  size_t cma_gather_bytes_ = 0;  // allgather
  size_t cma_reduce_bytes_ = 0;  // allreduce
  std::vector<char> cma_scratch_;  // reduce_cma's peer pieces
  bool tuning_[kPathKinds] = {false, false, false};
  PathPlan initial_plan_{};  // from the thresholds
  PathPlan plan_{};          // in force (every rank)
  uint64_t plans_carried_ = 0;  // ops that carried a plan (every rank alike; plan_publish)
  PathTuner tuner_;          // local rank 0's
  bool vote_carries_ = true;
  std::atomic<uint64_t> doorbell_{0};  // ring() count (this process only)
  std::atomic<int> idle_sleeping_{0};  // wait_activity is (about to be) in FUTEX_WAIT
  std::atomic<int> held_{0};           // hold_activity(true): another thread watches peers
  std::atomic<uint32_t> held_word_{0};  // wait_activity's futex word while held (ring's)
  uint64_t doorbell_seen_ = 0;         // the count wait_activity last returned on
  std::atomic<uint64_t> hard_rings_{0};  // ring() count (not ring_soon())
  uint64_t hard_rings_seen_ = 0;
  std::atomic<int> absorbed_{0};  // a ring_soon() left to the holder of the watch
};

}  // namespace nbdist
