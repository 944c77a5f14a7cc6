"""Which rank this process is, from the launcher's environment (before or without MPI init)."""
from __future__ import annotations

import os

# MPICH/hydra, Open MPI, PMIx and Slurm name the same thing differently.
_WORLD_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
_LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "PMI_LOCAL_RANK")
_UNDER_MPI_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def env_rank() -> int | None:
    """The world rank the launcher gave this process, or None when not started by one."""
    for var in _WORLD_RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def env_local_rank() -> int:
    """This process's rank among the ranks on its host (0 when the launcher does not say)."""
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def under_mpi_launcher() -> bool:
    """True when an MPI launcher (mpiexec, srun) started this process."""
    return any(os.environ.get(var) for var in _UNDER_MPI_VARS)
