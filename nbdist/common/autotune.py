"""A size chosen by measurement over training steps (NBDIST_AUTOTUNE, Horovod's HOROVOD_AUTOTUNE).

Horovod's autotune tunes the fusion threshold and cycle time of its background loop.
What decides how nbdist fuses a step's gradients differs by framework, so that is what
each tunes, with this one tuner:

  torch        the DistributedOptimizer's gradient bucket size (its fusion unit), laid out
               again when the candidate changes (nbdist/torch/optimizer.py);
  TensorFlow   the engine's fusion threshold, which fuses the step's gradient allreduces
               (nbdist/tensorflow/gradients.py; Engine.set_fusion_threshold). The cycle
               time has nothing to tune on one node: the ranks agree through shared memory
               as soon as the ops are there, with no cycle to wait out.

After `warmup` steps not measured (a new size's ops negotiate anew), each candidate (the
configured size, then the framework's list) trains `steps` steps in two rounds, the second
in reverse order (a machine that speeds up or slows down during the tuning then favours no
candidate); the fastest is kept for good. Big units cost one agreement per step; small
ones let the first gradients reduce while backward still runs, which pays where compute
and communication do not share the same cores (a GPU node).

Every rank measures its own steps; the score of a candidate is the slowest rank's median
step time, agreed by an allreduce (Max), so every rank picks the same size at the same
step. The caller changes the size only between steps (with nothing in flight).
"""
from __future__ import annotations

import functools
import statistics
import sys
import time
from typing import Callable

import numpy as np

from .ops import allreduce
from .ops_base import Max
from .sizes import format_bytes


def slowest_rank(seconds: float, name: str, process_set=None) -> float:
    """The largest of the ranks' `seconds` (a tuner's score of its candidate): an allreduce
    Max named `name` over `process_set`'s ranks."""
    return float(allreduce(np.array([seconds]), op=Max, name=name, process_set=process_set)[0])


def agree_by(name: str, process_set=None) -> Callable[[float], float]:
    """SizeTuner's `agree`: slowest_rank under the name `name`."""
    return functools.partial(slowest_rank, name=name, process_set=process_set)


class SizeTuner:
    """Which size the caller uses now (`size`); step_done() after each step."""

    def __init__(self, what: str, configured: int, sizes: tuple[int, ...], steps: int,
                 warmup: int, agree: Callable[[float], float], log_path: str | None,
                 is_root: bool, zero_label: str = "0"):
        """`what` names the setting in the report and the log ("DistributedOptimizer
        bucket_bytes"; its last word heads the log's first column); `sizes` are tried
        besides `configured`; `zero_label` says what a size of 0 means."""
        self.what = what
        self.zero_label = zero_label
        self.candidates = sorted({int(configured), *sizes}, reverse=True)
        self._schedule = self.candidates + self.candidates[::-1]  # two rounds: down, then up
        self.steps = max(1, int(steps))  # measured per candidate and round
        self.warmup = max(0, int(warmup))  # not measured: a new layout's ops negotiate anew
        self._agree = agree  # local seconds -> the slowest rank's (a collective)
        self._log_path = log_path
        self._is_root = is_root
        self.samples: dict[int, list[float]] = {}  # size -> agreed median step seconds
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
    def size(self) -> int:
        return self.chosen if self.chosen is not None else self._schedule[self._index]

    @property
    def scores(self) -> dict[int, float]:
        """Each size measured so far -> its mean over rounds of the slowest rank's median
        seconds per step."""
        return {size: statistics.fmean(times) for size, times in self.samples.items()}

    def step_done(self) -> bool:
        """A step ended (its gradients are averaged). True when the size changed: the
        caller takes `size` before its next step."""
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
        # the fastest; on a tie the bigger size (fewer ops)
        self.chosen = min(self.candidates, key=lambda s: (scores[s], -s))
        self._report(scores)
        return self.chosen != size

    def _report(self, scores: dict[int, float]) -> None:
        if not self._is_root:
            return
        tried = ", ".join(f"{self._label(s)} {1e3 * scores[s]:.2f}" for s in self.candidates)
        print(f"nbdist autotune: {self.what}={self.chosen} ({self._label(self.chosen or 0)}); "
              f"mean of the rounds' median ms per step: {tried}", file=sys.stderr, flush=True)
        if self._log_path:
            with open(self._log_path, "w") as log:
                log.write(f"{self.what.split()[-1]},round,median_step_ms,chosen\n")
                for size in self.candidates:
                    for n, seconds in enumerate(self.samples[size]):
                        log.write(f"{size},{n},{1e3 * seconds:.3f},{int(size == self.chosen)}\n")

    def _label(self, size: int) -> str:
        return self.zero_label if size == 0 else format_bytes(size)
