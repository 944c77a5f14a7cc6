"""Runtime options read from the environment, with Horovod's names accepted as aliases.

One place for every knob, so the docs, `nbdist doctor` and the runtime agree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .sizes import MiB, parse_bytes


def _env(name: str, horovod_name: str | None = None) -> str | None:
    """The value of NBDIST_<name>, else HOROVOD_<name> (or the given Horovod alias)."""
    value = os.environ.get("NBDIST_" + name)
    if value is None or value == "":
        value = os.environ.get(horovod_name or ("HOROVOD_" + name))
    return value if value not in ("",) else None


def _number(name: str, default: float, horovod_name: str | None = None, cast=float,
            what: str = "a number"):
    raw = _env(name, horovod_name)
    if raw is None:
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"environment variable NBDIST_{name}={raw!r} is not {what}") from None


def _bytes(name: str, default: int, horovod_name: str | None = None) -> int:
    """NBDIST_<name> as a size in bytes: 4096, or with a unit as nbdist prints sizes (64K,
    1.5M, 2GiB); Horovod's names take plain bytes, which this reads alike."""
    return int(_number(name, default, horovod_name, cast=parse_bytes,
                       what="a size in bytes (e.g. 4096, 64K, 1.5M)"))


def _flag(name: str) -> bool:
    """NBDIST_<name> (or HOROVOD_<name>) as a switch: 1/true/yes/on, 0/false/no/off."""
    raw = _env(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable NBDIST_{name}={raw!r}: expected 1 or 0")


@dataclass(frozen=True)
class Config:
    """The runtime's options, read once at init()."""

    fusion_threshold: int = 64 * MiB  # bytes; NBDIST_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD
    # bytes per gradient bucket of torch's DistributedOptimizer (DDP's 25 MiB default);
    # NBDIST_BUCKET_BYTES, 0: one allreduce per gradient tensor
    bucket_bytes: int = 25 * MiB
    cycle_time_ms: float = 1.0  # NBDIST_CYCLE_TIME / HOROVOD_CYCLE_TIME (milliseconds)
    cache_capacity: int = 1024  # NBDIST_CACHE_CAPACITY / HOROVOD_CACHE_CAPACITY (0 disables)
    # NBDIST_ASYNC_EXPRESS_BYTES: an async allreduce, allgather or broadcast of a cached name
    # up to this size runs as it is submitted when every rank is there (docs/common-api.md);
    # 0: always queued
    async_express_bytes: int = 64 * 1024
    stall_warning_s: float = 60.0  # NBDIST_STALL_WARNING_S (HOROVOD_STALL_CHECK_TIME_SECONDS)
    timeout_s: float = 600.0  # NBDIST_TIMEOUT_S (0: wait for ever); HOROVOD_STALL_SHUTDOWN_TIME_SECONDS
    cpu_operations: str = "auto"  # NBDIST_CPU_OPERATIONS / HOROVOD_CPU_OPERATIONS: auto|mpi|shm
    local_size: int = 0  # NBDIST_LOCAL_SIZE: pretend nodes of this many ranks (1: each rank its own node)
    # NBDIST_AUTOTUNE / HOROVOD_AUTOTUNE: the unit of gradient fusion is chosen by measurement
    # (nbdist/common/autotune.py): torch's DistributedOptimizer bucket size, TensorFlow's
    # engine fusion threshold; AUTOTUNE_STEPS_PER_SAMPLE steps per candidate after
    # NBDIST_AUTOTUNE_WARMUP_STEPS; the scores go to AUTOTUNE_LOG (CSV)
    autotune: bool = False
    autotune_steps: int = 10
    autotune_warmup: int = 2
    autotune_log: str | None = None

    @classmethod
    def from_environment(cls) -> "Config":
        cpu_ops = (_env("CPU_OPERATIONS") or "auto").lower()
        if cpu_ops not in ("auto", "mpi", "shm", "hierarchical"):
            raise ValueError(
                f"NBDIST_CPU_OPERATIONS={cpu_ops!r}: expected one of auto, mpi, shm, hierarchical")
        config = cls(
            fusion_threshold=_bytes("FUSION_THRESHOLD", 64 * MiB),
            bucket_bytes=_bytes("BUCKET_BYTES", 25 * MiB, "NBDIST_BUCKET_BYTES"),
            cycle_time_ms=_number("CYCLE_TIME", 1.0),
            cache_capacity=int(_number("CACHE_CAPACITY", 1024, cast=int)),
            async_express_bytes=_bytes("ASYNC_EXPRESS_BYTES", 64 * 1024, "NBDIST_ASYNC_EXPRESS_BYTES"),
            stall_warning_s=_number("STALL_WARNING_S", 60.0, "HOROVOD_STALL_CHECK_TIME_SECONDS"),
            timeout_s=_number("TIMEOUT_S", 600.0, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),
            cpu_operations=cpu_ops,
            local_size=int(_number("LOCAL_SIZE", 0, cast=int)),
            autotune=_flag("AUTOTUNE"),
            autotune_steps=int(_number("AUTOTUNE_STEPS_PER_SAMPLE", 10, cast=int)),
            autotune_warmup=int(_number("AUTOTUNE_WARMUP_STEPS", 2, "NBDIST_AUTOTUNE_WARMUP_STEPS",
                                        cast=int)),
            autotune_log=_env("AUTOTUNE_LOG"),
        )
        if (config.fusion_threshold < 0 or config.bucket_bytes < 0 or config.cycle_time_ms < 0
                or config.async_express_bytes < 0
                or config.local_size < 0 or config.autotune_steps < 1 or config.autotune_warmup < 0):
            raise ValueError(f"negative value in nbdist options: {config}")
        return config

    def describe(self) -> dict:
        """The options as a dict, for `nbdist doctor` and %dist_status."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ---- knobs read where they are used (not per init): still named and parsed only here ---------

def env_str(name: str, default: str | None = None) -> str | None:
    """NBDIST_<name>, else Horovod's HOROVOD_<name>, else default (TIMELINE, AGREEMENT ...)."""
    value = _env(name)
    return value if value is not None else default


def env_int(name: str, default: int) -> int:
    """NBDIST_<name> as a whole number (tuning knobs of the transports, e.g. SHM_SLOT_BYTES)."""
    raw = _env(name, horovod_name="NBDIST_" + name)
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        raise ValueError(f"environment variable NBDIST_{name}={raw!r} is not an integer") from None


def env_bytes(name: str, default: int) -> int:
    """NBDIST_<name> as a size in bytes (the transports' *_BYTES knobs): 4096, 64K, 1.5M."""
    return _bytes(name, default, horovod_name="NBDIST_" + name)


def env_seconds(name: str, default: float) -> float:
    """NBDIST_<name> as a non-negative number of seconds (REPORT_INTERVAL, TEXT_INTERVAL)."""
    raw = _env(name, horovod_name="NBDIST_" + name)
    try:
        return max(0.0, float(raw)) if raw is not None else default
    except ValueError:
        raise ValueError(f"environment variable NBDIST_{name}={raw!r} is not a number of seconds") from None


def env_flag(name: str) -> bool | None:
    """NBDIST_<name>=1/0 (e.g. WIDGETS): True, False, or None when unset or anything else."""
    raw = (_env(name, horovod_name="NBDIST_" + name) or "").strip()
    return {"1": True, "0": False}.get(raw)


def env_path(name: str) -> str | None:
    """NBDIST_<name> as a path (NCCL_LIB, CUDART_LIB, REPORT_DIR), or None when unset."""
    return _env(name, horovod_name="NBDIST_" + name)


# Set by the notebook kernel in every engine's environment (engines exit when it is gone).
KERNEL_PID_ENV = "NBDIST_KERNEL_PID"
