"""Ranks that may not read each other's memory (run by tests/test_native.py): with
NBDIST_TEST_NOT_DUMPABLE=1 each rank makes itself non-dumpable before nbdist starts, as a
hardened process is, and the test drops CAP_SYS_PTRACE from the ranks (setpriv), so
process_vm_readv between them fails for real. Every collective must still be right (through
the slots), and the node's first rank says once why single copy is off."""
import ctypes
import os
import sys
import warnings

PR_SET_DUMPABLE = 4
if os.environ.get("NBDIST_TEST_NOT_DUMPABLE") == "1":
    assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0

warnings.simplefilter("always")  # not once per process: the test counts them

if sys.argv[1:] == ["doctor"]:  # `nbdist doctor` in the same conditions
    from nbdist.cli.doctor import main

    sys.exit(main())

import torch  # noqa: E402

import nbdist.torch as hvd  # noqa: E402

hvd.init()
n = 1 << 20  # past every single-copy threshold (4 MiB of float32)
parts = hvd.allgather(torch.arange(n, dtype=torch.float32) + hvd.rank(), name="parts")
want = torch.cat([torch.arange(n, dtype=torch.float32) + r for r in range(hvd.size())])
assert torch.equal(parts, want)
total = hvd.allreduce(torch.full((n,), float(hvd.rank() + 1)), op=hvd.Sum, name="total")
assert torch.equal(total, torch.full((n,), float(hvd.size() * (hvd.size() + 1) // 2)))
root = hvd.broadcast(torch.arange(n, dtype=torch.float32) * (hvd.rank() + 1), root_rank=1, name="root")
assert torch.equal(root, torch.arange(n, dtype=torch.float32) * 2)
print(f"rank {hvd.rank()} ok", flush=True)
hvd.shutdown()
