"""MPI plumbing shared by the notebook's cluster and `nbdist run`: which mpiexec, which rank, the reaper.

Nothing here imports IPython or the runtime: both the notebook kernel and the batch
launcher use it, and ranks use `ranks` before MPI is initialized.
"""
