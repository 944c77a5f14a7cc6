"""The shm transport on every rank of this mpiexec run (all on one node), against numpy.

Run by tests/test_native.py under mpiexec -n 2 and -n 4. Every rank runs the same
tests in the same order, so the collectives line up.
"""
import functools
import os
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from nbdist.common.ops_base import BFLOAT16, ReduceOp
from nbdist.common.transport import TransportError
from nbdist.common.transports.shm import ShmTransport

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
          np.uint8, np.uint16, np.uint32, np.uint64]
if BFLOAT16 is not None:
    DTYPES.insert(1, BFLOAT16)
OPS = [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product]
# 0, 1, odd, larger than a 64 KiB slot (chunked, pipelined) for every dtype.
SIZES = [0, 1, 1001, 70_001]


@pytest.fixture(scope="module")
def shm():
    """Small slots, so modest arrays already take many pipelined chunks."""
    t = ShmTransport(COMM, RANK, timeout_s=60, slot_bytes=64 * 1024, nsets=3)
    yield t
    t.close()


def transport_with_env(key: str, value: str) -> ShmTransport:
    """A transport made while the environment variable `key` is `value` (then put back)."""
    saved = os.environ.get(key)
    os.environ[key] = value
    try:
        return ShmTransport(COMM, RANK, timeout_s=60)
    finally:
        if saved is None:
            del os.environ[key]
        else:
            os.environ[key] = saved


@pytest.fixture(scope="module")
def shm_single_copy():
    """Every allgather and broadcast single-copy (process_vm_readv), where that works here."""
    t = transport_with_env("NBDIST_SHM_CMA_BYTES", "1")
    yield t
    t.close()


@pytest.fixture(scope="module")
def shm_single_copy_allreduce():
    """Every allreduce that is not small single-copy: each rank reduces its slice from the
    peers' buffers (process_vm_readv), where that works here."""
    t = transport_with_env("NBDIST_SHM_CMA_ALLREDUCE_BYTES", "1")
    if not t.single_copy_bytes[2]:
        t.close()
        pytest.skip("process_vm_readv is not allowed here")
    yield t
    t.close()


@pytest.fixture(scope="module")
def shm_default():
    t = ShmTransport(COMM, RANK, timeout_s=60)
    yield t
    t.close()


def contribution(rank, n, dtype, op):
    """Rank `rank`'s input: small values, so sums and products neither overflow floats nor lose bits."""
    rng = np.random.default_rng(1000 * rank + n)
    if op == ReduceOp.Product:
        if np.dtype(dtype).kind == "f":
            return rng.choice([0.5, 1.0, 1.5, 2.0], n).astype(dtype)
        return rng.integers(1, 4, n).astype(dtype)
    if np.dtype(dtype).kind == "f" or np.dtype(dtype) == BFLOAT16:
        return (rng.integers(-64, 64, n) / 8).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, endpoint=True, dtype=dtype)


def reference(n, dtype, op):
    """The reduction numpy computes, in rank order; 16-bit floats accumulate in float32."""
    parts = [contribution(r, n, dtype, op) for r in range(SIZE)]
    wide = np.dtype(dtype).itemsize == 2 and np.dtype(dtype).kind not in "iu"
    if wide:
        parts = [p.astype(np.float32) for p in parts]
    ufunc = {ReduceOp.Sum: np.add, ReduceOp.Min: np.minimum, ReduceOp.Max: np.maximum,
             ReduceOp.Product: np.multiply}[op]
    with np.errstate(over="ignore"):
        out = functools.reduce(ufunc, parts)
    return out.astype(dtype)


def same(got, want):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_segment_is_unlinked_once_attached(shm, shm_default):
    for t in (shm, shm_default):
        assert not os.path.exists("/dev/shm" + t._native.name)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("n", SIZES)
def test_allreduce(shm, dtype, op, n):
    buf = contribution(RANK, n, dtype, op)
    shm.allreduce(buf, op)
    same(buf, reference(n, dtype, op))


@pytest.mark.parametrize("n", [5, 1 << 20, (3 << 20) + 7])
def test_allreduce_default_slots_float32(shm_default, n):
    buf = contribution(RANK, n, np.float32, ReduceOp.Sum)
    shm_default.allreduce(buf, ReduceOp.Sum)
    same(buf, reference(n, np.float32, ReduceOp.Sum))


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [0, 1001, 70_001])  # small (one slot) and chunked
def test_allreduce_into_leaves_the_input_alone(shm, dtype, n):
    src = contribution(RANK, n, dtype, ReduceOp.Sum)
    before = src.copy()
    dst = np.full(n, 77, dtype)
    shm.allreduce_into(src, dst, ReduceOp.Sum)
    same(dst, reference(n, dtype, ReduceOp.Sum))
    same(src, before)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_allreduce_into_scales_as_numpy_does(shm, dtype):
    src = contribution(RANK, 70_001, dtype, ReduceOp.Sum)
    factor = 1.0 / 3.0  # not exact in float32: must round to float32 once, as numpy does
    want = reference(70_001, dtype, ReduceOp.Sum)
    want *= np.dtype(dtype).type(factor)
    shm.allreduce_into(src, src, ReduceOp.Sum, factor)
    same(src, want)
    with pytest.raises(ValueError, match="float32 or float64"):
        shm.allreduce_into(np.ones(3, np.int32), np.ones(3, np.int32), ReduceOp.Sum, 0.5)


@pytest.mark.parametrize("sizes", [[1, 0, 1001, 17], [30_000, 5, 40_000]],  # packed; via fusion
                         ids=["packed", "fusion-buffer"])
def test_allreduce_pieces_reduces_each_piece(shm, sizes):
    srcs = [contribution(RANK, n, np.float32, ReduceOp.Sum) for n in sizes]
    before = [s.copy() for s in srcs]
    dsts = [np.empty(n, np.float32) for n in sizes]
    dsts[1] = srcs[1]  # one piece in place
    shm.allreduce_pieces(srcs, dsts, ReduceOp.Sum, 0.5)
    for i, (n, dst) in enumerate(zip(sizes, dsts)):
        want = reference(n, np.float32, ReduceOp.Sum) * np.float32(0.5)
        same(dst, want)
        if i != 1:
            same(srcs[i], before[i])


@pytest.mark.parametrize("dtype", [np.int8, np.float16, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", [ReduceOp.Sum, ReduceOp.Max, ReduceOp.Product])
def test_a_unit_bigger_than_a_slot_is_reduced_in_its_pieces(shm, dtype, op):
    # A fused unit larger than a slot runs chunk by chunk, each chunk gathered from and
    # scattered back to the pieces: pieces and each rank's slice of a chunk start and end
    # anywhere, some pieces are empty, some reduced in place, the rest left as they were.
    item = np.dtype(dtype).itemsize
    chunk = 64 * 1024 // item
    sizes = [0, chunk // 3, 0, 1, chunk + 7, 3, chunk // SIZE + 1, 0, 2 * chunk - 5, 0]
    srcs = [contribution(RANK, n, dtype, op) for n in sizes]
    before = [s.copy() for s in srcs]
    dsts = [s if i % 3 == 1 else np.full(n, 9, dtype) for i, (n, s) in enumerate(zip(sizes, srcs))]
    shm.allreduce_pieces(srcs, dsts, op, 1.0)
    for i, (n, dst) in enumerate(zip(sizes, dsts)):
        same(dst, reference(n, dtype, op))
        if i % 3 != 1:
            same(srcs[i], before[i])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_single_copy_allreduce(shm_single_copy_allreduce, dtype, op):
    # 70_001 elements: past the small path, so single copy; slices of every rank start
    # on a cache line, and the last one is short
    t = shm_single_copy_allreduce
    buf = contribution(RANK, 70_001, dtype, op)
    t.allreduce(buf, op)
    same(buf, reference(70_001, dtype, op))
    src = contribution(RANK, 70_001, dtype, op)
    before = src.copy()
    dst = np.full(70_001, 3, dtype)
    t.allreduce_into(src, dst, op)
    same(dst, reference(70_001, dtype, op))
    same(src, before)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_single_copy_allreduce_scales_each_slice(shm_single_copy_allreduce, dtype):
    src = contribution(RANK, 300_007, dtype, ReduceOp.Sum)  # more than one 256 KiB step
    want = reference(300_007, dtype, ReduceOp.Sum)
    want *= np.dtype(dtype).type(1.0 / 3.0)
    shm_single_copy_allreduce.allreduce_into(src, src, ReduceOp.Sum, 1.0 / 3.0)
    same(src, want)


def test_single_copy_allreduce_in_place_while_ranks_run_steps_apart(shm_single_copy_allreduce):
    # Each rank reads a peer's reduced 256 KiB steps as the peer posts them, into its own
    # buffer, which (in place) is its src that the peer's later steps still read. Here the
    # last rank's slice has one step fewer than the others', and the ranks arrive at
    # staggered times, a different one last in each round.
    step = 256 * 1024 // 4
    count = SIZE * 2 * step + (SIZE - 1) * 16
    for round_ in range(3):
        time.sleep(0.02 * ((RANK + round_) % SIZE))
        buf = contribution(RANK, count, np.float32, ReduceOp.Sum) + round_
        shm_single_copy_allreduce.allreduce(buf, ReduceOp.Sum)
        same(buf, reference(count, np.float32, ReduceOp.Sum) + np.float32(SIZE * round_))


def test_single_copy_allreduce_of_many_pieces(shm_single_copy_allreduce):
    # A fused unit of 2500 pieces, most of 3 elements (more runs per step than one
    # process_vm_readv takes), some empty, some in place, one bigger than a step.
    sizes = [3] * 2500
    sizes[7] = sizes[1000] = sizes[2499] = 0
    sizes[1500] = 100_003
    srcs = [contribution(RANK, n, np.float32, ReduceOp.Sum) + i for i, n in enumerate(sizes)]
    want = [functools.reduce(np.add, [contribution(r, n, np.float32, ReduceOp.Sum) + i
                                      for r in range(SIZE)]) * np.float32(0.5)
            for i, n in enumerate(sizes)]
    before = [s.copy() for s in srcs]
    dsts = [s if i % 5 == 0 else np.full(n, 9, np.float32) for i, (n, s) in enumerate(zip(sizes, srcs))]
    shm_single_copy_allreduce.allreduce_pieces(srcs, dsts, ReduceOp.Sum, 0.5)
    for i in range(len(sizes)):
        same(dsts[i], want[i].astype(np.float32))
        if i % 5:
            same(srcs[i], before[i])


def test_single_copy_allreduce_of_a_partly_overlapping_result(shm_single_copy_allreduce):
    # dst starts one element into src: the input is read as it was before the call
    n = 100_000
    buf = np.zeros(n + 1, np.float64)
    buf[:n] = contribution(RANK, n, np.float64, ReduceOp.Sum)
    shm_single_copy_allreduce.allreduce_into(buf[:n], buf[1:], ReduceOp.Sum)
    same(buf[1:], reference(n, np.float64, ReduceOp.Sum))


def test_single_copy_allgatherv_of_big_parts_at_odd_addresses(shm_single_copy):
    # Parts above the streaming size (4 MiB), a receive buffer one byte off alignment:
    # the own part's streaming copy has a head and a tail to do plainly.
    counts = [(4 << 20) + 5 + 3 * r for r in range(SIZE)]
    parts = [np.random.default_rng(r).integers(0, 256, c, dtype=np.uint8) for r, c in enumerate(counts)]
    space = np.zeros(sum(counts) + 1, np.uint8)
    recv = space[1:]
    shm_single_copy.allgatherv(parts[RANK], recv, counts)
    same(recv, np.concatenate(parts))


def test_vote_carried_allreduce_of_a_partly_overlapping_result(shm_single_copy_allreduce):
    # The same through an agreement vote that carries the op (ShmComm::vote_allreduce): one
    # cached op, ready on every rank, runs in the vote's native call (None), its input read
    # from a copy as allreduce_cma reads it.
    control = ShmTransport(COMM, RANK, timeout_s=60, slot_bytes=64 * 1024, nsets=2, single_copy=False)
    try:
        n = 100_000
        buf = np.zeros(n + 1, np.float64)
        buf[:n] = contribution(RANK, n, np.float64, ReduceOp.Sum)
        assert control.agree_allreduce(0, 1, shm_single_copy_allreduce, buf[:n], buf[1:],
                                       ReduceOp.Sum, 0.5) is None
        same(buf[1:], reference(n, np.float64, ReduceOp.Sum) * 0.5)
    finally:
        control.close()


def test_allreduce_2d_and_bool_rejected(shm):
    buf = np.full((3, 5), RANK + 1, np.int32)
    shm.allreduce(buf, ReduceOp.Sum)
    assert (buf == SIZE * (SIZE + 1) // 2).all()
    with pytest.raises(TypeError, match="bool"):
        shm.allreduce(np.ones(3, bool), ReduceOp.Sum)
    with pytest.raises(ValueError, match="Average"):
        shm.allreduce(np.ones(3), ReduceOp.Average)


@pytest.mark.parametrize("root", range(SIZE))
@pytest.mark.parametrize("n", [1, 999, 70_001])
def test_reduce_to_root(shm, root, n):
    mine = contribution(RANK, n, np.float32, ReduceOp.Sum)
    buf = mine.copy()
    shm.reduce(buf, ReduceOp.Sum, root)
    same(buf, reference(n, np.float32, ReduceOp.Sum) if RANK == root else mine)


@pytest.mark.parametrize("root", range(SIZE))
@pytest.mark.parametrize("nbytes", [0, 1, 4097, 64 * 1024 * SIZE * 3 + 5])
def test_broadcast(shm, root, nbytes):
    want = np.random.default_rng(nbytes + root).integers(0, 256, nbytes, dtype=np.uint8)
    buf = want.copy() if RANK == root else np.zeros(nbytes, np.uint8)
    shm.broadcast(buf, root)
    same(buf, want)


@pytest.mark.parametrize("scale", [0, 1, 17, 40_000])
def test_allgatherv_uneven(shm, scale):
    counts = [(r % 3) * scale + (1 if scale else 0) * (r == 0) for r in range(SIZE)]
    parts = [np.arange(c, dtype=np.float64) + 1000 * r for r, c in enumerate(counts)]
    recv = np.empty(sum(counts), np.float64)
    shm.allgatherv(parts[RANK], recv, counts)
    same(recv, np.concatenate(parts))


@pytest.mark.parametrize("single_copy", [False, True], ids=["through-slots", "single-copy"])
@pytest.mark.parametrize("shift", [0, 1, -3])
def test_allgatherv_from_inside_the_receive_buffer(shm, shm_single_copy, shift, single_copy):
    # This rank's part already where it goes (shift 0: in place), or overlapping that
    # place: it must land whole, as from a separate buffer, across several chunks (or
    # read by the peers from where it was, single-copy).
    if single_copy:
        shm = shm_single_copy
    count = 3 * 64 * 1024 // 8 + 11
    want = np.concatenate([np.arange(count, dtype=np.float64) + 1000 * r for r in range(SIZE)])
    recv = np.zeros(SIZE * count + 8, np.float64)
    start = RANK * count + 4 + shift
    recv[start:start + count] = want[RANK * count:(RANK + 1) * count]
    out = recv[4:4 + SIZE * count]
    shm.allgatherv(recv[start:start + count], out, [count] * SIZE)
    same(out, want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int64, np.uint8],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("total", [0, 7, 50_003])
def test_reducescatter_uneven(shm, dtype, op, total):
    counts = [total // SIZE + (1 if r < total % SIZE else 0) for r in range(SIZE)]
    send = contribution(RANK, total, dtype, op)
    recv = np.empty(counts[RANK], dtype)
    shm.reducescatter(send, recv, counts, op)
    start = sum(counts[:RANK])
    same(recv, reference(total, dtype, op)[start:start + counts[RANK]])


@pytest.mark.parametrize("scale", [0, 3, 30_000])
def test_alltoallv(shm, scale):
    def splits(src):  # what rank src sends to each rank
        return [((src + 2 * dst) % 3) * scale for dst in range(SIZE)]

    send_counts = splits(RANK)
    recv_counts = [splits(src)[RANK] for src in range(SIZE)]
    send = np.concatenate([np.full(c, 100 * RANK + dst, np.int32)
                           for dst, c in enumerate(send_counts)] or [np.empty(0, np.int32)])
    recv = np.empty(sum(recv_counts), np.int32)
    shm.alltoallv(send, send_counts, recv, recv_counts)
    want = np.concatenate([np.full(c, 100 * src + RANK, np.int32)
                           for src, c in enumerate(recv_counts)] or [np.empty(0, np.int32)])
    same(recv, want)


def test_abort_releases_peers_within_a_second(shm):
    """The last rank aborts instead of joining; the others leave their wait promptly."""
    COMM.Barrier()
    if RANK == SIZE - 1:
        time.sleep(0.3)
        aborted_at = time.monotonic()  # CLOCK_MONOTONIC: one clock for the whole machine
        shm.abort(f"rank {RANK} raised ZeroDivisionError (test)")
        released_at = None
    else:
        aborted_at = None
        with pytest.raises(TransportError, match=r"aborted by rank \d+.*ZeroDivisionError"):
            shm.allreduce(np.ones(1 << 18, np.float32), ReduceOp.Sum)
        released_at = time.monotonic()
    times = COMM.allgather((aborted_at, released_at))
    shm.reset()
    t_abort = times[SIZE - 1][0]
    for r, (_, released) in enumerate(times[:-1]):
        assert released - t_abort < 1.0, f"rank {r} was released {released - t_abort:.2f} s after the abort"
    test_allreduce(shm, np.float32, ReduceOp.Sum, 1001)  # usable again


def test_abort_from_another_thread_while_waiting(shm):
    """An interrupted rank: its main thread aborts while its own op waits in another thread."""
    COMM.Barrier()
    errors = []
    if RANK == 0:
        def op():
            try:
                shm.allreduce(np.ones(10, np.float64), ReduceOp.Sum)
            except TransportError as exc:
                errors.append(str(exc))
        worker = threading.Thread(target=op)
        worker.start()
        time.sleep(0.3)
        shm.abort("KeyboardInterrupt on rank 0 (test)")
        worker.join(2)
        assert not worker.is_alive() and errors and "KeyboardInterrupt" in errors[0]
    COMM.Barrier()  # the others never entered: they see the flag at their next op
    if RANK != 0:
        with pytest.raises(TransportError, match="KeyboardInterrupt"):
            shm.allreduce(np.ones(10, np.float64), ReduceOp.Sum)
    shm.reset()
    test_allreduce(shm, np.float64, ReduceOp.Max, 70_001)


def test_timeout_names_missing_rank():
    t = ShmTransport(COMM, RANK, timeout_s=0.5)
    try:
        COMM.Barrier()
        if RANK != 0:
            start = time.monotonic()
            with pytest.raises(TransportError, match=r"(timed out|aborted).*"):
                t.allreduce(np.ones(4, np.float32), ReduceOp.Sum)
            assert time.monotonic() - start < 2.0
        COMM.Barrier()
        assert "waiting for rank(s) 0" in t.abort_reason()
        t.reset()
        buf = np.ones(4, np.float32)
        t.allreduce(buf, ReduceOp.Sum)
        assert (buf == SIZE).all()
    finally:
        t.close()


def test_should_stop_hook_is_polled():
    """The engine's should_stop (e.g. shutting down) ends a wait that no peer will end."""
    stop_at = time.monotonic() + 0.3
    t = ShmTransport(COMM, RANK, timeout_s=30,
                     should_stop=lambda: "nbdist is shutting down" if time.monotonic() > stop_at else None)
    try:
        COMM.Barrier()
        if RANK == 0:
            with pytest.raises(TransportError, match="shutting down"):
                t.allreduce(np.ones(4, np.float32), ReduceOp.Sum)
            assert time.monotonic() - stop_at < 1.0
        COMM.Barrier()
        t.reset()
    finally:
        t.close()


def test_close_then_use_is_a_clear_error():
    t = ShmTransport(COMM, RANK)
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.allreduce(np.ones(2), ReduceOp.Sum)


def test_no_room_in_dev_shm_falls_back_to_mpi(monkeypatch):
    """A segment bigger than /dev/shm (a small container tmpfs) fails cleanly, on every rank."""
    import warnings

    from nbdist.common.config import Config
    from nbdist.common.topology import Topology
    from nbdist.common.transports.select import TransportSet

    st = os.statvfs("/dev/shm")
    # More than the whole tmpfs: the kernel refuses the reservation at once (no swap storm).
    slot = (st.f_blocks * st.f_frsize) // (2 * SIZE) + (1 << 30)
    monkeypatch.setenv("NBDIST_SHM_SLOT_BYTES", str(slot // 4096 * 4096))
    monkeypatch.delenv("NBDIST_CPU_OPERATIONS", raising=False)
    topology = Topology.from_mpi(COMM)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ts = TransportSet(Config.from_environment(), topology, should_stop=None)
        assert ts.for_op("cpu", "allreduce").name == "mpi"
        if RANK == 0:
            assert any("shared memory unavailable" in str(w.message) and "/dev/shm" in str(w.message)
                       for w in caught), [str(w.message) for w in caught]
        ts.close()
        monkeypatch.setenv("NBDIST_CPU_OPERATIONS", "shm")
        with pytest.raises(RuntimeError, match="NBDIST_CPU_OPERATIONS=shm.*could not start"):
            TransportSet(Config.from_environment(), topology, should_stop=None)
    finally:
        topology.free()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"nbdist-{os.getuid()}-") and
                os.stat("/dev/shm/" + f).st_size > slot]


def test_streaming_copy_out_gives_the_same_result(monkeypatch):
    """NBDIST_SHM_STREAM_BYTES: big allreduces write back with non-temporal stores."""
    monkeypatch.setenv("NBDIST_SHM_STREAM_BYTES", "1")
    t = ShmTransport(COMM, RANK, timeout_s=60, slot_bytes=64 * 1024)
    try:
        for n in (70_001, 1_000_003):
            whole = np.zeros(n + 1, np.float32)
            buf = whole[1:]  # not 32-byte aligned: the streaming copy's unaligned head
            buf[...] = contribution(RANK, n, np.float32, ReduceOp.Sum)
            t.allreduce(buf, ReduceOp.Sum)
            same(buf, reference(n, np.float32, ReduceOp.Sum))
    finally:
        t.close()


@pytest.mark.parametrize("env", [{"NBDIST_SHM_CMA_BYTES": "0"}, {"NBDIST_SHM_CMA_BYTES": "1"},
                                 {"NBDIST_SHM_CMA_BYTES": "0", "NBDIST_SHM_CMA_ALLGATHER_BYTES": "1"}],
                         ids=["through-slots", "single-copy", "single-copy-allgather-only"])
def test_allgather_and_broadcast_with_and_without_single_copy(monkeypatch, env):
    """NBDIST_SHM_CMA_BYTES (and _ALLGATHER_BYTES): peers' buffers read directly
    (process_vm_readv) or through the slots."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    t = ShmTransport(COMM, RANK, timeout_s=60, slot_bytes=64 * 1024)
    try:
        for scale in (1, 3, 50_001):
            counts = [scale * (r + 1) for r in range(SIZE)]
            parts = [np.arange(c, dtype=np.float64) * (r + 2) for r, c in enumerate(counts)]
            want = np.concatenate(parts)
            recv = np.empty(want.size, np.float64)
            t.allgatherv(parts[RANK], recv, counts)
            same(recv, want)
            # in place: this rank's part already sits in the output
            start = sum(counts[:RANK])
            inplace = np.zeros(want.size, np.float64)
            inplace[start:start + counts[RANK]] = parts[RANK]
            t.allgatherv(inplace[start:start + counts[RANK]], inplace, counts)
            same(inplace, want)
        for root in range(SIZE):
            for nbytes in (5, 300_001):
                data = np.random.default_rng(nbytes + root).integers(0, 256, nbytes, dtype=np.uint8)
                buf = data.copy() if RANK == root else np.zeros(nbytes, np.uint8)
                t.broadcast(buf, root)
                same(buf, data)
    finally:
        t.close()


def _tuned_transport(**kwargs) -> ShmTransport:
    t = ShmTransport(COMM, RANK, timeout_s=60, **kwargs)
    if not t.single_copy_bytes[2]:
        t.close()
        pytest.skip("process_vm_readv is not allowed here: there is no second path to choose")
    return t


def test_paths_chosen_by_measurement_stay_the_same_on_every_rank():
    # Local rank 0 alone times the transfers and picks each size class's path; every
    # allreduce, allgather and broadcast from rank 0 carries its latest plan to all ranks.
    # Mixed ops and sizes, ranks arriving apart, in and out of place, fused pieces,
    # broadcasts from every root: every result is right (a rank on another path than its
    # peers would hang or garble), every rank ends with the same plan, and rank 0 has timed
    # both paths of the classes it ran.
    t = _tuned_transport()
    try:
        assert set(t.tuned_paths) == {"broadcast", "allgather", "allreduce"}
        rng = np.random.default_rng(7)  # the same sequence on every rank
        for i in range(240):
            if rng.random() < 0.1:
                time.sleep(0.002 * ((RANK + i) % SIZE))
            count = int(rng.choice([64 * 1024, 300_000, 1 << 20]))
            kind = rng.choice(["allreduce", "allreduce_into", "pieces", "allgather", "broadcast"])
            if kind == "allreduce":
                buf = contribution(RANK, count, np.float32, ReduceOp.Sum)
                t.allreduce(buf, ReduceOp.Sum)
                same(buf, reference(count, np.float32, ReduceOp.Sum))
            elif kind == "allreduce_into":
                out = np.empty(count, np.float32)
                t.allreduce_into(contribution(RANK, count, np.float32, ReduceOp.Sum), out, ReduceOp.Sum)
                same(out, reference(count, np.float32, ReduceOp.Sum))
            elif kind == "pieces":
                sizes = [count // 3, 7, count - count // 3 - 7]
                srcs = [contribution(RANK, n, np.float32, ReduceOp.Sum) for n in sizes]
                t.allreduce_pieces(srcs, srcs, ReduceOp.Sum, 1.0)
                for n, got in zip(sizes, srcs):
                    same(got, reference(n, np.float32, ReduceOp.Sum))
            elif kind == "allgather":
                recv = np.empty(count * SIZE, np.float32)
                t.allgatherv(np.full(count, RANK + i, np.float32), recv, [count] * SIZE)
                same(recv, np.repeat(np.arange(SIZE, dtype=np.float32) + i, count))
            else:
                root = i % SIZE
                buf = np.full(count, RANK + 0.5, np.float32)
                t.broadcast(buf, root)
                same(buf, np.full(count, root + 0.5, np.float32))
        plans = COMM.allgather(t._native.path_plan())
        assert all(p == plans[0] for p in plans), plans
        assert plans[0][3] > 0  # allreduces carried it
        if RANK == 0:
            timed = {(kind, size): (slots, single) for kind, size, _, slots, single, _ in t._native.path_timings()}
            for size in (1 << 20, 4 << 20):  # 300_000 and 1 << 20 float32 elements
                slots, single = timed[("allreduce", size)]
                assert slots > 0 and single > 0, timed
    finally:
        t.close()


def test_a_much_slower_path_is_left_for_the_faster_one(monkeypatch):
    # With 4 KiB slots a 4 MiB allreduce through them takes two thousand synchronisations,
    # each a futex sleep here (no spinning, no yielding); single copy takes about ten.
    # Whatever the thresholds said first, the tuner keeps single copy for that class once
    # it has timed both, on every rank.
    monkeypatch.setenv("NBDIST_SHM_SPIN", "0")
    monkeypatch.setenv("NBDIST_SHM_YIELDS", "0")
    t = _tuned_transport(slot_bytes=4096)
    try:
        t.set_single_copy(t.single_copy_bytes[:2] + (64 << 20,), t.tuned_paths)  # start on the slow path
        buf = np.zeros(1 << 20, np.float32)
        for _ in range(12):
            buf[:] = RANK + 1
            t.allreduce(buf, ReduceOp.Sum)
            same(buf, np.full(1 << 20, SIZE * (SIZE + 1) / 2, np.float32))
        plans = COMM.allgather(t._native.path_plan())
        assert all(p == plans[0] for p in plans), plans
        assert plans[0][2] >> 22 & 1, f"4 MiB allreduces still go through the slots: {plans[0]}"
        if RANK == 0:
            row = [r for r in t._native.path_timings() if r[:2] == ("allreduce", 4 << 20)][0]
            assert row[5] and 0 < row[4] < row[3], row
    finally:
        t.close()


def test_broadcasts_from_rank_0_alone_carry_the_plan():
    # A program of broadcasts alone is tuned too: in a broadcast from rank 0 every reader
    # waits for rank 0's posts, so it carries rank 0's plan as an allreduce does. Starting
    # on the slots, the tuner's try of single copy reaches every rank through those
    # broadcasts alone (rank 0 has timed both paths; which one wins is the machine's
    # business: at 4 ranks on 2 cores either can); broadcasts from other roots in between
    # carry none, and every rank ends with the same plan.
    t = _tuned_transport()
    try:
        t.set_single_copy((64 << 20,) + t.single_copy_bytes[1:], t.tuned_paths)  # start on the slots
        carried = t._native.path_plan()[3]
        buf = np.zeros(1 << 20, np.float32)
        roots = [0 if i % 4 else (i // 4) % SIZE for i in range(16)]
        for i, root in enumerate(roots):
            buf[:] = RANK + i
            t.broadcast(buf, root)
            same(buf, np.full(1 << 20, root + i, np.float32))
        plans = COMM.allgather(t._native.path_plan())
        assert all(p == plans[0] for p in plans), plans
        assert plans[0][3] - carried == roots.count(0)
        if RANK == 0:
            row = [r for r in t._native.path_timings() if r[:2] == ("broadcast", 4 << 20)][0]
            assert row[3] > 0 and row[4] > 0, f"4 MiB broadcasts did not take both paths: {row}"
    finally:
        t.close()


def test_rank_0_running_ahead_in_broadcasts_leaves_every_rank_the_same_plan():
    # In the slots a broadcast's root waits for no reader: rank 0 can finish a broadcast
    # (and start the next) before a slow reader has taken the plan the last one carried.
    # It then leaves that plan's entry as it was (plans_taken), so every rank takes the same
    # plans in the same order: results stay right through the tuner's tries, readers late
    # by turns.
    t = _tuned_transport()
    try:
        rng = np.random.default_rng(11)  # the same sequence on every rank
        for i in range(150):
            nbytes = int(rng.choice([300_000, 700_000, 1_500_000]))
            late = rng.random() < 0.3  # (drawn on every rank: the sequence stays the same)
            if RANK and late:
                time.sleep(0.001 * (1 + (RANK + i) % SIZE))
            data = np.full(nbytes, i % 251, np.uint8)
            buf = data.copy() if RANK == 0 else np.zeros(nbytes, np.uint8)
            t.broadcast(buf, 0)
            same(buf, data)
        plans = COMM.allgather(t._native.path_plan())
        assert all(p == plans[0] for p in plans), plans
        assert plans[0][3] >= 150
    finally:
        t.close()


def test_a_threshold_from_the_environment_is_not_tuned(monkeypatch):
    monkeypatch.setenv("NBDIST_SHM_CMA_ALLREDUCE_BYTES", str(1 << 20))
    t = _tuned_transport()
    try:
        assert t.tuned_paths == ("broadcast", "allgather")
        plan = t._native.path_plan()
        buf = np.zeros(1 << 20, np.float32)
        for _ in range(40):
            t.allreduce(buf, ReduceOp.Sum)
        assert t._native.path_plan()[2] == plan[2]  # the allreduce mask never moved
        assert not [r for r in t._native.path_timings() if r[0] == "allreduce"]
    finally:
        t.close()
