// Publishing progress and waiting for peers: spin briefly, then yield, then sleep
// on a futex, so 4 ranks on 2 cores hand the CPU to the rank that has work
// instead of burning it. Every waiter also watches the abort flag, a deadline,
// the liveness of the ranks it waits for, and the caller's should_stop hook.
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <string>

#include "shm_comm.hpp"

namespace nbdist {
namespace {

// While another thread holds the activity watch (hold_activity), wait_activity looks
// again after 1 ms, then twice as long each time it finds the watch still held, up to
// 16 ms: after the holder lets go, a peer's cycle start is noticed within that. (A
// holder that leaves ops queued, or a Handle not done, rings instead: Engine.drive and
// _express_locked.) A fixed 1 ms woke this thread twice in each 2 ms synchronous
// allreduce, and each wake-up took the core from the op's copies: 2 ranks, 16 MiB
// in place, 5-13 % slower than the same reduction called on the transport directly.
constexpr long HELD_RECHECK_NS = 1000000L;       // 1 ms
constexpr long HELD_RECHECK_MAX_NS = 16000000L;  // 16 ms

// How many times wait_activity, woken by ring_soon() (an async op's submit), yields for a
// thread of this process to start driving that op (hold_activity: its synchronize, which
// most code calls right after) before it takes the op itself. Taking it at once made the
// two threads contend for the GIL and the agreement's lock: `engine_overhead.py --ops 1
// --bytes 262144`, 2 ranks, 54-56 us per async op and synchronize against 44-46 with a
// window of 20 or 100 yields (a synchronous op: 25). A few microseconds when no one
// drives: the op overlaps with the caller's work as before.
constexpr int SOFT_RING_YIELDS = 20;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, long timeout_ns) {
  struct timespec ts;
  ts.tv_sec = timeout_ns / 1000000000L;
  ts.tv_nsec = timeout_ns % 1000000000L;
  // Shared (not FUTEX_PRIVATE): the word lives in memory mapped by several processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// True when `pid` is gone or a zombie (killed, not yet reaped by mpiexec).
bool process_dead(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return errno == ENOENT;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close_paren = std::strrchr(buf, ')');  // the command name may hold spaces
  if (close_paren == nullptr || close_paren[1] == '\0') return false;
  char state = close_paren[2];
  return state == 'Z' || state == 'X';
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

void ShmComm::post(uint64_t phase) {
  hdr_->ranks[rank_].seq.store(phase, std::memory_order_seq_cst);
  // Pairs with the waiter's sleepers increment (both seq_cst): either the waiter
  // sees the new counter before sleeping, or we see it counted and wake it.
  if (hdr_->sleepers.load(std::memory_order_seq_cst) != 0) {
    hdr_->wake_word.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&hdr_->wake_word);
  }
}

void ShmComm::abort(const std::string& reason) {
  AbortState& a = hdr_->abort;
  uint32_t expected = 0;
  if (a.state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    a.local_rank = rank_;
    a.global_rank = global_rank_;
    std::snprintf(a.reason, kReasonBytes, "%s", reason.c_str());
    a.state.store(2, std::memory_order_release);
  }
  hdr_->wake_word.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&hdr_->wake_word);
}

std::string ShmComm::abort_reason() const {
  if (hdr_ == nullptr) return "";
  const AbortState& a = hdr_->abort;
  uint32_t s = a.state.load(std::memory_order_acquire);
  if (s == 0) return "";
  for (int i = 0; i < 100000 && s == 1; ++i) {  // the aborting rank is writing the reason
    sched_yield();
    s = a.state.load(std::memory_order_acquire);
  }
  if (s != 2) return "aborted by a peer (reason not recorded)";
  return "aborted by rank " + std::to_string(a.global_rank) + " (local rank " +
         std::to_string(a.local_rank) + "): " + std::string(a.reason);
}

void ShmComm::fail_aborted(const WaitContext& ctx) {
  throw ShmError(std::string("shm ") + ctx.what + " on rank " + std::to_string(global_rank_) + ": " +
                 abort_reason());
}

void ShmComm::check_not_aborted(const WaitContext& ctx) {
  if (hdr_ == nullptr) throw ShmError(std::string("shm ") + ctx.what + ": the transport is closed");
  if (hdr_->abort.state.load(std::memory_order_acquire) != 0) fail_aborted(ctx);
}

void ShmComm::clear_shared() {
  for (int r = 0; r < n_; ++r) {
    hdr_->ranks[r].seq.store(0, std::memory_order_relaxed);
    hdr_->ranks[r].plans_taken.store(0, std::memory_order_relaxed);  // (reset_local: 0 carried)
  }
  hdr_->abort.reason[0] = '\0';
  hdr_->abort.state.store(0, std::memory_order_seq_cst);
}

void ShmComm::reset_local() {
  gen_ = 0;
  next_set_ = 0;
  scratch_free_ = 0;
  std::fill(free_phase_.begin(), free_phase_.end(), 0);
  // Path tuning starts again from the thresholds on every rank (the count of allreduces
  // that carried a plan restarts with it, so both stay alike across ranks).
  plan_ = initial_plan_;
  plans_carried_ = 0;
  tuner_.start(initial_plan_);
}

std::string ShmComm::death_of(int r, const WaitContext& ctx, bool gone) const {
  const int pid = hdr_->ranks[r].pid;
  if (!gone && !process_dead(pid)) return "";
  return "rank " + std::to_string(hdr_->ranks[r].global_rank) + " (pid " + std::to_string(pid) +
         ") died during shm " + ctx.what;
}

// The slow checks, done about every 100 ms while asleep: deadline, dead peers,
// the caller's hook. Each failure aborts the segment too, so peers are released.
void ShmComm::check_slow(int who, uint64_t phase, WaitContext& ctx, bool& stop) {
  std::string reason;
  const std::string me = "rank " + std::to_string(global_rank_);
  if (ctx.timeout_s > 0 && seconds_since(ctx.start) > ctx.timeout_s) {
    std::string missing;
    for (int r = 0; r < n_; ++r) {
      if ((who < 0 || who == r) && hdr_->ranks[r].seq.load(std::memory_order_acquire) < phase)
        missing += (missing.empty() ? "" : ", ") + std::to_string(hdr_->ranks[r].global_rank);
    }
    char t[32];
    std::snprintf(t, sizeof(t), "%g", ctx.timeout_s);
    reason = me + " timed out after " + t + " s in shm " + ctx.what + " waiting for rank(s) " + missing;
  }
  for (int r = 0; reason.empty() && r < n_; ++r) {
    if (r == rank_ || (who >= 0 && who != r)) continue;
    if (hdr_->ranks[r].seq.load(std::memory_order_acquire) >= phase) continue;
    reason = death_of(r, ctx);
  }
  if (reason.empty() && ctx.should_stop && ctx.should_stop(reason)) {
    reason = me + " gave up shm " + ctx.what + ": " + reason;
  }
  if (!reason.empty()) {
    abort(reason);
    stop = true;
  }
}

void ShmComm::wait_all(uint64_t phase, WaitContext& ctx) { wait_for(-1, phase, ctx); }
void ShmComm::wait_rank(int who, uint64_t phase, WaitContext& ctx) { wait_for(who, phase, ctx); }

void ShmComm::wait_for(int who, uint64_t phase, WaitContext& ctx) {
  RankState* ranks = hdr_->ranks;
  auto done = [&]() {
    if (who >= 0) return ranks[who].seq.load(std::memory_order_acquire) >= phase;
    for (int r = 0; r < n_; ++r)
      if (ranks[r].seq.load(std::memory_order_acquire) < phase) return false;
    return true;
  };
  auto aborted = [&]() { return hdr_->abort.state.load(std::memory_order_relaxed) != 0; };

  const int spins = ctx.spin_iters >= 0 ? ctx.spin_iters : spin_iters_;
  const int yields = ctx.yield_iters >= 0 ? ctx.yield_iters : yield_iters_;
  for (int i = 0; i < spins; ++i) {
    if (done()) return;
    if (aborted()) fail_aborted(ctx);
    cpu_relax();
  }
  for (int i = 0; i < yields; ++i) {
    if (done()) return;
    if (aborted()) fail_aborted(ctx);
    sched_yield();
  }
  auto last_check = std::chrono::steady_clock::now();
  long sleep_ns = 50000;  // 50 µs, doubling to 10 ms: a lost wake-up costs little
  while (true) {
    hdr_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t word = hdr_->wake_word.load(std::memory_order_seq_cst);
    bool ready = done();
    if (!ready && !aborted()) futex_wait(&hdr_->wake_word, word, sleep_ns);
    hdr_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (ready || done()) return;
    if (aborted()) fail_aborted(ctx);
    sleep_ns = std::min(sleep_ns * 2, 10000000L);
    if (seconds_since(last_check) > 0.1) {
      last_check = std::chrono::steady_clock::now();
      bool stop = false;
      check_slow(who, phase, ctx, stop);
      if (stop) fail_aborted(ctx);
    }
  }
}

void ShmComm::hold_activity(bool on) {
  held_.store(on ? 1 : 0, std::memory_order_seq_cst);
  if (!on && absorbed_.exchange(0, std::memory_order_seq_cst) != 0) ring();
}

void ShmComm::ring() {
  hard_rings_.fetch_add(1, std::memory_order_seq_cst);
  ring_soon();
}

void ShmComm::ring_soon() {
  doorbell_.fetch_add(1, std::memory_order_seq_cst);
  // Only when this process's own engine thread sleeps: `sleepers` counts every rank's
  // waiters, and a wake-up of the shared word also wakes the peers' threads for nothing
  // (a burst of gradient hooks rang once per tensor, each a syscall and a context switch).
  if (hdr_ != nullptr && idle_sleeping_.load(std::memory_order_seq_cst) != 0) {
    hdr_->wake_word.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&hdr_->wake_word);
    held_word_.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&held_word_);
  }
}

int ShmComm::wait_activity(double timeout_s) {
  if (hdr_ == nullptr) return 3;
  RankState* ranks = hdr_->ranks;
  auto state = [&]() -> int {
    if (hdr_->abort.state.load(std::memory_order_acquire) != 0) return 3;
    uint64_t rung = doorbell_.load(std::memory_order_seq_cst);
    if (rung != doorbell_seen_) {
      doorbell_seen_ = rung;
      const uint64_t hard = hard_rings_.load(std::memory_order_seq_cst);
      if (hard != hard_rings_seen_) {
        hard_rings_seen_ = hard;
        return 2;
      }
      for (int i = 0; i <= SOFT_RING_YIELDS; ++i) {  // ring_soon() alone
        if (held_.load(std::memory_order_seq_cst) != 0) {
          // The holder runs it; if it leaves the watch with the ring unanswered (the
          // holder's own queue drained before it), hold_activity(false) rings again.
          absorbed_.store(1, std::memory_order_seq_cst);
          if (held_.load(std::memory_order_seq_cst) != 0) return 0;
          break;
        }
        if (i < SOFT_RING_YIELDS) sched_yield();
      }
      return 2;
    }
    if (held_.load(std::memory_order_seq_cst) != 0) return 0;  // the holder joins peers
    for (int r = 0; r < n_; ++r)
      if (r != rank_ && ranks[r].seq.load(std::memory_order_acquire) > gen_) return 1;
    return 0;
  };
  int s = state();
  if (s != 0) return s;
  // A short yield phase first: a peer's cycle usually follows within microseconds
  // of our own (both ranks submit the same step), and a futex round trip costs more.
  for (int i = 0; i < yield_iters_ / 4; ++i) {
    sched_yield();
    if ((s = state()) != 0) return s;
  }
  const auto start = std::chrono::steady_clock::now();
  long recheck_ns = HELD_RECHECK_NS;
  while (true) {
    double left = timeout_s - seconds_since(start);
    if (left <= 0) return 0;
    idle_sleeping_.store(1, std::memory_order_seq_cst);  // before reading the doorbell (ring's pair)
    if (held_.load(std::memory_order_seq_cst) != 0) {
      // Not a sleeper on the shared word: the peers' steps do not wake this thread.
      uint32_t word = held_word_.load(std::memory_order_seq_cst);
      s = state();
      if (s == 0) futex_wait(&held_word_, word, std::min(static_cast<long>(left * 1e9), recheck_ns));
      idle_sleeping_.store(0, std::memory_order_seq_cst);
      if (s != 0 || (s = state()) != 0) return s;
      recheck_ns = std::min(recheck_ns * 2, HELD_RECHECK_MAX_NS);
      continue;
    }
    hdr_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t word = hdr_->wake_word.load(std::memory_order_seq_cst);
    s = state();
    if (s == 0) futex_wait(&hdr_->wake_word, word, static_cast<long>(std::min(left, 1.0) * 1e9));
    hdr_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    idle_sleeping_.store(0, std::memory_order_seq_cst);
    if (s != 0 || (s = state()) != 0) return s;
  }
}

}  // namespace nbdist
