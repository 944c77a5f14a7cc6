"""`make demo`: real distributed work on N ranks with nbdist.common, checked.

Each rank builds an array that depends on its rank; allreduce (Sum and Average),
allgather and broadcast combine them, and every rank checks the result against
what the formula says. Rank 0 prints the result. Run with any N:

    nbdist run -n 4 examples/demo.py
"""
import time

import numpy as np

import nbdist.common as hvd


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    n = 1_000_000
    local = np.arange(n, dtype=np.float64) * (rank + 1)  # rank r holds (r+1) * [0, 1, ..., n-1]

    t0 = time.perf_counter()
    total = hvd.allreduce(local, op=hvd.Sum, name="demo.sum")
    elapsed = time.perf_counter() - t0
    expected = np.arange(n, dtype=np.float64) * (size * (size + 1) / 2)
    assert np.allclose(total, expected), f"rank {rank}: allreduce(Sum) is wrong"

    mean = hvd.allreduce(local, op=hvd.Average, name="demo.avg")
    assert np.allclose(mean, expected / size), f"rank {rank}: allreduce(Average) is wrong"

    ranks = hvd.allgather(np.array([rank], dtype=np.int64), name="demo.gather")
    assert ranks.tolist() == list(range(size)), f"rank {rank}: allgather gave {ranks.tolist()}"

    seed = hvd.broadcast(np.array([1234 + rank]), root_rank=0, name="demo.bcast")
    assert int(seed[0]) == 1234, f"rank {rank}: broadcast gave {seed}"

    if rank == 0:
        mb = local.nbytes / 1e6
        print(f"nbdist demo on {size} ranks (local size {hvd.local_size()}):")
        print(f"  allreduce(Sum) of {n:,} float64 per rank ({mb:.0f} MB): "
              f"element[{n - 1}] = {total[-1]:,.0f} = {n - 1} * {size * (size + 1) // 2}  "
              f"[{elapsed * 1e3:.1f} ms]")
        print(f"  allreduce(Average): element[{n - 1}] = {mean[-1]:,.1f}")
        print(f"  allgather of ranks: {ranks.tolist()}")
        print(f"  broadcast from rank 0: {int(seed[0])}")
        print("  all results checked on every rank: OK")
    hvd.shutdown()


if __name__ == "__main__":
    main()
