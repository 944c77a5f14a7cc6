#include "path_tuner.hpp"

#include <algorithm>

namespace nbdist {

int PathTuner::size_class(size_t bytes) {
  return bytes == 0 ? 0 : 63 - __builtin_clzll(static_cast<unsigned long long>(bytes));
}

uint64_t PathTuner::plan_bits(size_t threshold) {
  uint64_t bits = 0;
  if (threshold == 0) return 0;
  for (int c = 0; c < kClasses; ++c)
    if ((uint64_t{1} << c) >= threshold) bits |= uint64_t{1} << c;
  return bits;
}

double PathTuner::Path::median() const {
  if (n == 0) return -1;
  double v[kSamples];
  std::copy(ns_per_byte, ns_per_byte + n, v);
  std::sort(v, v + n);
  return n == 2 ? (v[0] + v[1]) / 2 : v[n / 2];
}

void PathTuner::start(const PathPlan& best) {
  for (auto& kind : classes_)
    for (Class& c : kind) c = Class{};
  best_ = best;
}

void PathTuner::record(PathKind kind, size_t bytes, bool cma, double ns) {
  const int c = size_class(bytes);
  if (c < kMinClass) return;
  Class& k = classes_[kind][c];
  Path& p = k.path[cma ? 1 : 0];
  p.ns_per_byte[p.next] = ns / static_cast<double>(bytes);
  p.next = (p.next + 1) % kSamples;
  p.n = std::min(p.n + 1, kSamples);
  ++k.timed;
  const bool on_cma = (best_.cma[kind] >> c) & 1u;
  if (on_cma == cma) {
    ++k.since_other;
  } else if (k.path[on_cma ? 1 : 0].n > 0) {  // a try of the other path: did it confirm?
    const bool confirmed = k.path[on_cma ? 1 : 0].median() <= p.last();
    k.every = confirmed ? std::min(k.every * 2, kExploreMost) : kExploreEvery;
  }
}

PathPlan PathTuner::next() {
  PathPlan plan = best_;
  for (int kind = 0; kind < kPathKinds; ++kind) {
    for (int c = kMinClass; c < kClasses; ++c) {
      Class& k = classes_[kind][c];
      if (k.timed == 0) continue;
      const uint64_t bit = uint64_t{1} << c;
      // Both timed: the other path takes over when its latest try beat the kept one's
      // median (its older timings may predate a change of regime; a try that was only
      // lucky costs a few transfers, as the kept path's median then shows it slower).
      bool on_cma = (best_.cma[kind] & bit) != 0;
      const Path& kept = k.path[on_cma ? 1 : 0];
      const Path& tried = k.path[on_cma ? 0 : 1];
      if (kept.n > 0 && tried.n > 0 && tried.last() < kept.median()) {
        on_cma = !on_cma;
        best_.cma[kind] ^= bit;
      }
      const Path& other = k.path[on_cma ? 0 : 1];
      // The other path: once the preferred one has two timings (the first is often a
      // cold start), and then every kExploreEvery transfers.
      const bool due = other.n == 0 ? k.path[on_cma ? 1 : 0].n >= 2 : k.since_other >= k.every;
      const bool use_cma = due ? !on_cma : on_cma;
      plan.cma[kind] = use_cma ? plan.cma[kind] | bit : plan.cma[kind] & ~bit;
      if (due) k.since_other = 0;
    }
  }
  return plan;
}

double PathTuner::median_ns_per_byte(PathKind kind, int size_class, bool cma) const {
  if (size_class < 0 || size_class >= kClasses) return -1;
  return classes_[kind][size_class].path[cma ? 1 : 0].median();
}

}  // namespace nbdist
