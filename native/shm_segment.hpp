// A shared-memory segment shared by the ranks of one node: a header (per-rank
// progress counters, the abort flag, the futex word) followed by the data slots.
//
// Lifetime: local rank 0 creates it under a random name with mode 0600; the name
// goes to the other ranks over MPI; each attaches and counts itself in, and the
// rank that completes the count unlinks the name. From then on the memory lives
// only as long as some rank maps it, so nothing is left in /dev/shm even when
// ranks are killed with SIGKILL.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "path_tuner.hpp"

namespace nbdist {

constexpr uint64_t kShmMagic = 0x6e62646973747368ull;  // "nbdistsh"
constexpr uint32_t kShmVersion = 3;  // 2: the path plans; 3: plans taken, per rank
constexpr int kMaxRanks = 256;
constexpr size_t kReasonBytes = 480;

// One cache-line pair per rank, so one rank's stores never slow another's reads.
struct alignas(128) RankState {
  std::atomic<uint64_t> seq;     // the last phase this rank has finished
  std::atomic<int64_t> scratch;  // a small value exchanged by some collectives
  int32_t pid;
  int32_t global_rank;
  std::atomic<uint64_t> plans_taken;  // path plans this rank has taken (ShmComm::plan_adopt)
};

struct alignas(128) AbortState {
  std::atomic<uint32_t> state;  // 0: fine, 1: being written, 2: aborted (reason valid)
  int32_t local_rank;
  int32_t global_rank;
  char reason[kReasonBytes];
};

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t nranks;
  uint64_t slot_bytes;  // bytes of one rank's slot in one set
  uint32_t nsets;       // slot sets in rotation (pipelining depth)
  uint32_t owner_uid;
  uint64_t data_offset;
  uint64_t total_bytes;
  alignas(128) std::atomic<uint32_t> attached;
  alignas(128) AbortState abort;
  alignas(128) std::atomic<uint32_t> wake_word;  // futex: bumped to wake sleepers
  std::atomic<uint32_t> sleepers;                // waiters that may be in FUTEX_WAIT
  // Local rank 0's path plans (path_tuner.hpp), two in turn: the n-th op that carries
  // one (an allreduce, an allgather, a broadcast from rank 0) publishes plans[n % 2] on
  // entry and every rank takes it on its way out (ShmComm::plan_publish).
  alignas(128) PathPlan plans[2];
  alignas(128) RankState ranks[1];               // nranks entries (flexible)
};

size_t header_bytes(int nranks);

// A mapping of the segment; closes (unmaps) on destruction.
class Segment {
 public:
  // Creates a fresh segment under a random name (local rank 0).
  static Segment create(int nranks, size_t slot_bytes, int nsets);
  // Attaches to a segment created by create(); checks owner, size and layout.
  static Segment attach(const std::string& name, int nranks);

  Segment() = default;
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  // Records this rank (pid, global rank) and counts it in; the rank that
  // completes the count unlinks the name. Returns true if this call unlinked it.
  bool register_rank(int local_rank, int global_rank);
  // Removes the name from /dev/shm (harmless if already gone).
  void unlink();
  void unmap();

  Header* header() const { return hdr_; }
  char* slot(int set, int rank) const {
    return base_ + hdr_->data_offset + (static_cast<size_t>(set) * hdr_->nranks + rank) * hdr_->slot_bytes;
  }
  const std::string& name() const { return name_; }
  bool mapped() const { return hdr_ != nullptr; }

 private:
  std::string name_;
  char* base_ = nullptr;
  Header* hdr_ = nullptr;
  size_t length_ = 0;
};

}  // namespace nbdist
