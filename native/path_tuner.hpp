// Which transfers go single-copy (CMA, process_vm_readv) and which through the slots,
// chosen by measurement.
//
// Neither path wins everywhere, and on one machine the winner moves with the memory
// system's state: on the 2-core test VM a 4 MiB allreduce took 175-345 µs through the
// slots and 290-310 µs single-copy, flipping between runs minutes apart (the slots' two
// copies are cheap while both ranks' data sit in one shared cache, single copy pays page
// pinning per 4 KiB but crosses once; docs/native.md). So local rank 0 times every
// transfer it runs, by op kind and size class (a power of two), keeps the faster path of
// each class by the median of its last three timings, and tries the other one now and
// then so that a change of regime is seen: after kExploreEvery transfers of that class,
// twice as many each time the try confirms the choice (up to kExploreMost), and
// kExploreEvery again once the choice changes. A try of a path twice as slow costs 3 %
// at first and 0.1 % once the choice has held a few times.
//
// Every rank must take the same path for the same op, so rank 0 alone decides, and the
// decision travels as a PathPlan through the segment (ShmComm: published on entry to an
// allreduce, an allgather or a broadcast from rank 0, taken by every rank on its way out;
// see ShmComm::plan_publish).
#pragma once

#include <cstddef>
#include <cstdint>

namespace nbdist {

enum PathKind : int { kPathBroadcast = 0, kPathAllgather = 1, kPathAllreduce = 2, kPathKinds = 3 };

// Bit c of cma[kind]: transfers of [2^c, 2^(c+1)) bytes of that kind go single-copy. Plain
// data, so that it can live in the segment's header.
struct PathPlan {
  uint64_t cma[kPathKinds];
};

class PathTuner {
 public:
  static constexpr int kMinClass = 18;  // from 256 KiB; smaller transfers keep the thresholds
  static constexpr int kClasses = 64;
  static constexpr int kExploreEvery = 32;  // transfers of a class per try of the other path...
  static constexpr int kExploreMost = 1024;  // ...doubling up to this while the choice holds
  static constexpr int kSamples = 3;

  static int size_class(size_t bytes);
  static bool in_plan(const PathPlan& plan, PathKind kind, size_t bytes) {
    const int c = size_class(bytes);
    return (plan.cma[kind] >> c) & 1u;
  }
  // The plan that sends [2^c, 2^(c+1)) single-copy where 2^c reaches `threshold` (0: none).
  static uint64_t plan_bits(size_t threshold);

  // Forget every timing; `best` is where to start from (the thresholds').
  void start(const PathPlan& best);
  // A transfer of `bytes` of `kind` took `ns`, single-copy or not.
  void record(PathKind kind, size_t bytes, bool cma, double ns);
  // The plan to publish next: each class's faster path, or the other where it is due a try.
  PathPlan next();

  // The median ns per byte of a class's recent timings on a path (< 0: none), and how many
  // transfers of the class have been timed.
  double median_ns_per_byte(PathKind kind, int size_class, bool cma) const;
  uint64_t timed(PathKind kind, int size_class) const { return classes_[kind][size_class].timed; }
  // Whether a class's faster path so far is single copy (what next() keeps between tries).
  bool prefers_cma(PathKind kind, int size_class) const { return (best_.cma[kind] >> size_class) & 1u; }

 private:
  struct Path {
    double ns_per_byte[kSamples] = {0, 0, 0};
    int n = 0;      // samples held (up to kSamples)
    int next = 0;   // where the next one goes
    double median() const;
    double last() const { return n == 0 ? -1 : ns_per_byte[(next + kSamples - 1) % kSamples]; }
  };
  struct Class {
    Path path[2];         // [0]: slots, [1]: single copy
    int since_other = 0;  // transfers on the preferred path since the other was tried
    int every = kExploreEvery;  // ...and how many of those make it due again
    uint64_t timed = 0;
  };
  Class classes_[kPathKinds][kClasses];
  PathPlan best_{};
};

}  // namespace nbdist
