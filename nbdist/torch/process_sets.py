"""Horovod's process sets for nbdist.torch: the runtime's own (nbdist.common.process_sets)."""
from __future__ import annotations

from nbdist.common.process_sets import (ProcessSet, add_process_set, global_process_set,
                                        remove_process_set, resolve)

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set",
           "check_process_set"]


def check_process_set(process_set, what: str):
    """The process set an op runs on (a clear error for an unknown one or a non-member)."""
    resolve(process_set, what)
    return process_set
