"""Horovod's elastic API, framework-neutral: State, ObjectState, run_fn, with the notebook as driver.

`@hvd.elastic.run` calls the training function in a loop. When a collective fails (a
rank died: the survivors' runtime raises HorovodInternalError within ~0.1 s, see
engine.py), every surviving rank restores its last commit, shuts the runtime down,
builds the next world the driver published (nbdist.common.world: the survivors, and
later new ranks), starts the runtime again, calls the reset callbacks, broadcasts the
state from the new rank 0 (sync) and calls the function again: training resumes
from the last commit in the same cell. `commit()` also checks for a newer world (ranks
that joined) and raises HostsUpdatedInterrupt on every rank at the same commit.

Every rank keeps its own copy of each commit (the ranks hold the same state after a
sync), so the state of a killed rank - rank 0 too - is never the only copy.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable

from . import basics, errors, world
from .errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["State", "ObjectState", "run_fn", "reset_world", "HorovodInternalError",
           "HostsUpdatedInterrupt"]


class State:
    """State kept in step across ranks: commit() saves it, restore() returns to the last
    commit, sync() copies rank 0's to every rank, on_reset() runs the reset callbacks."""

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int]):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._known_generation = world.generation()
        self.commits = 0

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions to call after every reset (a rank lost or added), before the next sync."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._known_generation = world.generation()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (every rank keeps a copy), then raise HostsUpdatedInterrupt if the
        world changes here."""
        self.save()
        self.commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt, on every rank at once, when the driver published a newer
        world (ranks joined). Rank 0 reads the plan and broadcasts what it saw, so no rank can
        see the update one commit later than its peers."""
        seen = world.published_generation() if self._rank() == 0 else 0
        seen = int(self._bcast_object(seen))
        if seen > self._known_generation:
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a reset, before sync: rebuild what depends on the world (e.g. samplers)."""


class ObjectState(State):
    """Plain Python values, given as keyword arguments and kept as attributes."""

    def __init__(self, bcast_object: Callable | None = None, get_rank: Callable | None = None,
                 **kwargs):
        from .ops import broadcast_object

        self._saved_state = {k: copy.deepcopy(v) for k, v in kwargs.items()}
        self._set_attrs()
        super().__init__(bcast_object=bcast_object or broadcast_object,
                         get_rank=get_rank or basics.rank)

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


def reset_world() -> None:
    """Shut the runtime down, move to the driver's next world (if any), start the runtime again."""
    plan = world.next_world()
    basics.shutdown()
    if plan is not None:
        world.rebuild(plan)
    basics.init()


def _retryable(exc: BaseException) -> bool:
    """A failure a new world can cure: a broken runtime (a peer died). Not a mismatch (the
    same code would fail again), an abort (a peer's code raised: the cell fails with its
    error) or a timeout (a peer hangs, it did not leave)."""
    return not isinstance(exc, (errors.MismatchError, errors.AbortedError,
                                errors.CollectiveTimeoutError))


def run_fn(func: Callable, reset: Callable[[], None]) -> Callable:
    """Horovod's elastic retry loop around `func(state, ...)`; `reset` rebuilds the runtime."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                if not _retryable(exc):
                    raise
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            reset()
            state.on_reset()

    return wrapper

