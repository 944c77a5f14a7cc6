"""The DistributedOptimizer's bucket size, chosen by measurement (NBDIST_AUTOTUNE).

Horovod's HOROVOD_AUTOTUNE tunes the fusion threshold and cycle time of its background
loop. nbdist's fusion unit for training is the gradient bucket, so that is what this
tunes: after the first step lays the buckets out, the optimizer trains a few steps with
each candidate size (the configured one, 25, 4 and 1 MiB, and 0: one op per gradient) in
two rounds, the second in reverse order (a machine that speeds up or slows down during
the tuning then favours no candidate), keeps the one whose steps were fastest, and stays
with it. Big buckets cost one agreement per step; small ones let the first buckets
reduce while backward still runs, which pays where compute and communication do not
share the same cores (a GPU node).

Every rank measures its own steps; the score of a candidate is the slowest rank's median
step time, agreed by an allreduce (Max), so every rank picks the same size at the same
step. Candidates change only between steps (in synchronize(), with nothing in flight).
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

MiB = 1024 * 1024
SIZES = (25 * MiB, 4 * MiB, 1 * MiB, 0)  # tried besides the configured size; 0: no buckets


class BucketTuner:
    """Which bucket size the optimizer uses now; step_done() after each synchronize()."""

    def __init__(self, configured: int, steps: int, warmup: int,
                 agree: Callable[[float], float], log_path: str | None, is_root: bool):
        self.candidates = sorted({int(configured), *SIZES}, reverse=True)
        self._schedule = self.candidates + self.candidates[::-1]  # two rounds: down, then up
        self.steps = max(1, int(steps))  # measured per candidate and round
        self.warmup = max(0, int(warmup))  # not measured: a new layout's ops negotiate anew
        self._agree = agree  # local seconds -> the slowest rank's (a collective)
        self._log_path = log_path
        self._is_root = is_root
        self.samples: dict[int, list[float]] = {}  # bucket bytes -> agreed median step seconds
        self.chosen: int | None = None
        self.reset()

    def reset(self) -> None:
        """Start over (an elastic world changed before the tuning ended)."""
        if self.chosen is not None:
            return
        self.samples.clear()
        self._index = 0
        self._seen = 0
        self._times: list[float] = []
        self._last: float | None = None

    @property
    def bucket_bytes(self) -> int:
        return self.chosen if self.chosen is not None else self._schedule[self._index]

    @property
    def scores(self) -> dict[int, float]:
        """Each size measured so far -> its mean over rounds of the slowest rank's median
        seconds per step."""
        return {size: statistics.fmean(times) for size, times in self.samples.items()}

    def step_done(self) -> bool:
        """A step ended (its gradients are averaged). True when the bucket size changed:
        the caller lays the buckets out again with `bucket_bytes`."""
        if self.chosen is not None:
            return False
        now = time.perf_counter()
        last, self._last = self._last, now
        if last is None:  # the first step of the run: nothing to time it from
            return False
        self._seen += 1
        if self._seen <= self.warmup:
            return False
        self._times.append(now - last)
        if len(self._times) < self.steps:
            return False
        size = self._schedule[self._index]
        self.samples.setdefault(size, []).append(self._agree(statistics.median(self._times)))
        self._times, self._seen = [], 0
        if self._index + 1 < len(self._schedule):
            self._index += 1
            return self._schedule[self._index] != size
        scores = self.scores
        # the fastest; on a tie the bigger buckets (fewer ops)
        self.chosen = min(self.candidates, key=lambda s: (scores[s], -s))
        self._report(scores)
        return self.chosen != size

    def _report(self, scores: dict[int, float]) -> None:
        if not self._is_root:
            return
        tried = ", ".join(f"{_label(s)} {1e3 * scores[s]:.2f}" for s in self.candidates)
        print(f"nbdist autotune: DistributedOptimizer bucket_bytes={self.chosen} "
              f"({_label(self.chosen or 0)}); mean of the rounds' median ms per step: {tried}",
              file=sys.stderr, flush=True)
        if self._log_path:
            with open(self._log_path, "w") as log:
                log.write("bucket_bytes,round,median_step_ms,chosen\n")
                for size in self.candidates:
                    for n, seconds in enumerate(self.samples[size]):
                        log.write(f"{size},{n},{1e3 * seconds:.3f},{int(size == self.chosen)}\n")


def _label(size: int) -> str:
    return "one op per gradient" if size == 0 else f"{size / MiB:g} MiB"
