"""Horovod's process-set names; nbdist runs every collective over all ranks.

Code written for Horovod passes `process_set=hvd.global_process_set` explicitly; that
works. Any other set is refused with a clear error rather than silently widened to
every rank (which would deadlock the ranks outside the intended set).
"""
from __future__ import annotations


class ProcessSet:
    """All ranks; the only process set nbdist has."""

    process_set_id = 0

    def __init__(self, ranks=None):
        self.ranks = ranks

    def size(self) -> int:
        from nbdist import common
        return common.size()

    def rank(self) -> int:
        from nbdist import common
        return common.rank()

    def included(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = ProcessSet()


def check_process_set(process_set, what: str) -> None:
    """Refuse any process set other than the global one (nbdist has no sub-communicators)."""
    if process_set is None or process_set is global_process_set:
        return
    if isinstance(process_set, ProcessSet) and process_set.ranks is None:
        return
    raise NotImplementedError(
        f"{what}: nbdist supports only the global process set (got {process_set!r}); "
        "drop the process_set argument or pass hvd.global_process_set")


def add_process_set(process_set):
    """Horovod's dynamic process sets are not available in nbdist."""
    raise NotImplementedError("nbdist does not support process sets other than the global one")


def remove_process_set(process_set):
    """Horovod's dynamic process sets are not available in nbdist."""
    raise NotImplementedError("nbdist does not support process sets other than the global one")
