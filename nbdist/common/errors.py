"""The runtime's exceptions: each names the op, the ranks involved and what to do."""
from __future__ import annotations


class NbdistError(RuntimeError):
    """Base of every error the nbdist runtime raises."""


class NotInitializedError(NbdistError, ValueError):
    """A call that needs init() came before it (ValueError, as Horovod raises)."""


class CollectiveError(NbdistError):
    """A collective op failed on this rank; the runtime stays usable."""


class MismatchError(CollectiveError):
    """Ranks disagreed on an op (kind, shape, dtype, reduction, root)."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """An op did not become ready on every rank within NBDIST_TIMEOUT_S."""


class AbortedError(CollectiveError):
    """Some rank aborted (raised, was interrupted) while this op was in flight."""


class RuntimeBrokenError(NbdistError):
    """A transport failed mid-op; the runtime must be shut down and started again."""


# Horovod code catches this name around collectives.
HorovodInternalError = CollectiveError
