"""The runtime's exceptions: each names the op, the ranks involved and what to do."""
from __future__ import annotations


class NbdistError(RuntimeError):
    """Base of every error the nbdist runtime raises."""


class NotInitializedError(NbdistError, ValueError):
    """A call that needs init() came before it (ValueError, as Horovod raises)."""


class CollectiveError(NbdistError):
    """A collective op failed on this rank (Horovod's HorovodInternalError)."""


class MismatchError(CollectiveError):
    """Ranks disagreed on an op (kind, shape, dtype, reduction, root)."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """An op did not become ready on every rank within NBDIST_TIMEOUT_S."""


class AbortedError(CollectiveError):
    """Some rank aborted (raised, was interrupted) while this op was in flight."""


class RuntimeBrokenError(CollectiveError):
    """A transport failed mid-op (e.g. a peer died); the runtime must be shut down and started
    again. A CollectiveError, so Horovod's HorovodInternalError catches it: hvd.elastic.run
    rebuilds the world on it."""


class HostsUpdatedInterrupt(RuntimeError):
    """The elastic world changes at this commit (ranks joined or left): reset and go on.

    skip_sync: True when no rank joined, so every rank already holds the committed state.
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__("the elastic world changed")
        self.skip_sync = skip_sync


# Horovod code catches this name around collectives.
HorovodInternalError = CollectiveError
