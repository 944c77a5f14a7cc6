"""One small synchronous collective through each API users call, beside mpi4py, in one run.

    mpiexec -n 2 .venv/bin/python benchmarks/small_ops.py [--bytes 4096] [--iters 2000]

The calls a training loop makes between steps (a loss, an accuracy, a flag), each
repeated: nbdist.common on numpy (in place and not), nbdist.torch's `allreduce` and
`allreduce_`, nbdist.tensorflow's eager `allreduce`, each named and unnamed (Horovod
numbers unnamed ops in call order), and mpi4py's `comm.Allreduce` on the same bytes;
then numpy `allgather` and `broadcast`/`broadcast_` beside mpi4py's `Allgather` and
`Bcast`. The cases run in alternating rounds; reported: the slowest rank's mean µs per
call (median of rounds) and its ratio to mpi4py's same collective from the same rounds. torch and
TensorFlow rows appear when the framework imports.

With `--layers`, one cached `allreduce_` instead, each layer of the express path
called directly (docs/common-api.md, "Where the microseconds go"): the user call,
`Engine.express`, `ShmAgreement.express` (agreement lock held), the shm transport's
`express_allreduce`, the native `express_allreduce` (vote and bytes in one call) and
the native allreduce alone (`allreduce_into`, no vote). The difference between two
rows is what that layer costs.

With `--tf-layers`, the same for TensorFlow's eager `hvd.allreduce(x, name=...)`
(Average, as Horovod's default): the numpy allreduce of an array, of the tensor's own
buffer (`EagerTensor._numpy`), that plus the result tensor (`_bridge.eager_result`), and
the whole call (docs/tensorflow.md).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bytes", type=int, default=4096, help="bytes per allreduce (float32)")
    p.add_argument("--iters", type=int, default=2000, help="calls per case per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", action="store_true",
                   help="the express path of one cached allreduce_, layer by layer")
    p.add_argument("--tf-layers", action="store_true",
                   help="TensorFlow's eager allreduce, layer by layer")
    args = p.parse_args(argv)

    import nbdist.common as nb
    from mpi4py import MPI

    nb.init()
    comm = MPI.COMM_WORLD
    a = np.ones(max(1, args.bytes // 4), np.float32)
    out = np.empty_like(a)
    cases = {"mpi4py Allreduce": lambda: comm.Allreduce(a, out)}
    bases: dict[str, str] = {}  # case -> the mpi4py case it is compared with (else Allreduce)
    locked: set[str] = set()  # cases run with the agreement lock held (--layers)
    if args.layers:
        if not _layer_cases(nb, a, cases, locked):
            nb.shutdown()
            return 1
    elif args.tf_layers:
        _tf_layer_cases(nb, a, cases)
    else:
        _api_cases(nb, a, cases)
        _other_cases(nb, comm, a, cases, bases)

    def timed(fn) -> float:
        for _ in range(max(20, args.iters // 20)):
            fn()
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        return comm.allreduce((time.perf_counter() - start) / args.iters * 1e6, op=MPI.MAX)

    agreement = nb.basics.engine().agreement
    rows: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            if name in locked:  # as Engine.express holds it; the engine thread waits meanwhile
                agreement.lock.acquire()
            try:
                rows[name].append(timed(fn))
            finally:
                if name in locked:
                    agreement.hold(False)
                    agreement.lock.release()
    if comm.rank == 0:
        print(f"small_ops: {comm.size} ranks, {a.nbytes} B float32 per rank, "
              f"{args.rounds} rounds x {args.iters} calls (median)")
        print(f"{'':30s} {'µs per call':>12s} {'/ mpi4py':>9s}")
        for name, times in rows.items():
            base = rows[bases.get(name, "mpi4py Allreduce")]
            ratio = statistics.median(t / b for t, b in zip(times, base))
            print(f"{name:30s} {statistics.median(times):12.2f} {ratio:8.2f}x")
    nb.shutdown()
    return 0


def _api_cases(nb, a: np.ndarray, cases: dict) -> None:
    """One small allreduce through each user API (the default run)."""
    cases.update({
        "numpy allreduce_ named": lambda: nb.allreduce_(a, op=nb.Sum, name="np.inplace"),
        "numpy allreduce named": lambda: nb.allreduce(a, op=nb.Sum, name="np.out"),
        "numpy allreduce unnamed": lambda: nb.allreduce(a, op=nb.Sum),
    })
    try:
        import torch

        import nbdist.torch as th

        t = torch.from_numpy(a.copy())
        cases["torch allreduce_ named"] = lambda: th.allreduce_(t, op=th.Sum, name="t.inplace")
        cases["torch allreduce named"] = lambda: th.allreduce(t, op=th.Sum, name="t.out")
        cases["torch allreduce unnamed"] = lambda: th.allreduce(t, op=th.Sum)
    except ImportError:
        pass
    try:
        import tensorflow as tf

        import nbdist.tensorflow as tfh

        x = tf.constant(a)
        cases["tf eager allreduce named"] = lambda: tfh.allreduce(x, op=tfh.Sum, name="tf.x")
        cases["tf eager allreduce unnamed"] = lambda: tfh.allreduce(x, op=tfh.Sum)
    except ImportError:
        pass


def _other_cases(nb, comm, a: np.ndarray, cases: dict, bases: dict) -> None:
    """numpy allgather and broadcast, each beside mpi4py's own collective."""
    gathered = np.empty(a.size * comm.size, a.dtype)
    b = a.copy()
    mine = {
        "mpi4py Allgather": {
            "numpy allgather named": lambda: nb.allgather(a, name="np.gather"),
            "numpy allgather unnamed": lambda: nb.allgather(a),
        },
        "mpi4py Bcast": {
            "numpy broadcast_ named": lambda: nb.broadcast_(b, 0, name="np.bcast_"),
            "numpy broadcast named": lambda: nb.broadcast(a, 0, name="np.bcast"),
        },
    }
    cases["mpi4py Allgather"] = lambda: comm.Allgather(a, gathered)
    cases["mpi4py Bcast"] = lambda: comm.Bcast(b, root=0)
    for base, ours in mine.items():
        cases.update(ours)
        bases.update(dict.fromkeys(ours, base), **{base: base})


def _tf_layer_cases(nb, a: np.ndarray, cases: dict) -> None:
    """TensorFlow's eager allreduce of one small tensor, layer by layer (--tf-layers)."""
    import tensorflow as tf

    import nbdist.tensorflow as tfh
    from nbdist.tensorflow import _bridge

    x = tf.constant(a)
    avg = nb.Average
    cases.update({
        "numpy allreduce Average": lambda: nb.allreduce(a, op=avg, name="tfl.np"),
        "  of the tensor's _numpy()": lambda: nb.allreduce(x._numpy(), op=avg, name="tfl.view"),
        "  + eager_result": lambda: _bridge.eager_result(
            nb.allreduce(x._numpy(), op=avg, name="tfl.result"), tf.float32),
        "tf eager allreduce named": lambda: tfh.allreduce(x, name="tfl.tf"),
    })


def _layer_cases(nb, a: np.ndarray, cases: dict, locked: set) -> bool:
    """Each layer of one cached allreduce_'s express path (--layers); False when this run
    has no shm agreement (ranks on more than one node)."""
    from nbdist.common.requests import ALLREDUCE, Handle

    eng = nb.basics.engine()
    agreement = eng.agreement
    if agreement is None:
        print("small_ops --layers: no shm agreement here (ranks on more than one node?)")
        return False
    op = nb.Sum
    for _ in range(50):  # cached, and its express plan worked out
        nb.allreduce_(a, op=op, name="layers")
    plan = agreement._express_plans["layers"]
    seg, nbits = agreement.seg, agreement._vote_slots()
    native, data = seg._native, plan.transport._native
    dtype, op_code, factor = plan.args
    timeout_s, stop = seg.timeout_s, seg.should_stop
    # Below Engine.express nothing drives an op that did not run at once (a peer late by
    # more than Engine.express's 1 ms wait, on a loaded machine): wait for the peers as
    # long as it takes instead, and stop on any other answer rather than hang.
    wait_s = 30.0

    def ran(call):  # (one frame more on each of these four rows alike)
        def checked():
            result = call()
            if result is False or result.__class__ in (tuple, Handle):
                raise RuntimeError("small_ops --layers: the op did not run at once")
        return checked

    held = {  # run with the agreement lock held, as Engine.express holds it
        "ShmAgreement.express": ran(lambda: agreement.express(
            ALLREDUCE, "layers", a, True, op, 1.0, -1, wait_s)),
        "transport express_allreduce": ran(lambda: seg.express_allreduce(
            plan.cid, nbits, wait_s, plan.transport, a, a, *plan.args)),
        "native express_allreduce": ran(lambda: native.express_allreduce(
            plan.cid, nbits, wait_s, data, a, a, a.size, dtype, op_code, factor, timeout_s,
            stop)),
        "native allreduce_into": ran(lambda: data.allreduce_into(
            a, a, a.size, dtype, op_code, 1.0, timeout_s, stop)),
    }
    cases["user allreduce_"] = lambda: nb.allreduce_(a, op=op, name="layers")
    cases["Engine.express"] = lambda: eng.express(ALLREDUCE, "layers", a, True, op)
    cases.update(held)
    locked.update(held)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
