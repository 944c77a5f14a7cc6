"""The transports that move bytes: MPI (always), shared memory and NCCL (native)."""
