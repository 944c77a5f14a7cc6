"""nbdist.common on 2 and 4 ranks under mpiexec, as a lone process, and its option parsing."""
import subprocess
import sys

import pytest

from conftest import ROOT, run_rank_tests

RANKS = [2, 4]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", RANKS)
def test_collectives(n):
    run_rank_tests(n, "common_collectives.py", timeout=840)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", RANKS)
def test_stall_warning_and_timeout(n):
    run_rank_tests(n, "common_stall.py", timeout=240,
                   extra_env={"NBDIST_STALL_WARNING_S": "1", "NBDIST_TIMEOUT_S": "3"})


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", RANKS)
def test_last_op_then_shutdown(n):
    run_rank_tests(n, "common_shutdown.py", timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", RANKS)
def test_process_sets(n):
    run_rank_tests(n, "common_process_sets.py", timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", RANKS)
def test_adasum(n):
    run_rank_tests(n, "common_adasum.py", timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", RANKS)
def test_timeline(n):
    run_rank_tests(n, "common_timeline.py", timeout=200)


@pytest.mark.timeout(120)
def test_timeline_from_the_environment(tmp_path):
    """HOROVOD_TIMELINE at init starts it; shutdown leaves a complete JSON file."""
    import json

    path = tmp_path / "env.json"
    code = ("import numpy as np, nbdist.common as hvd\n"
            "hvd.init(); hvd.allreduce(np.ones(2), name='x'); hvd.shutdown()\n")
    env = {"HOROVOD_TIMELINE": str(path), "HOROVOD_TIMELINE_MARK_CYCLES": "1",
           "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=100, cwd=ROOT, env=env)
    names = {e.get("name") for e in json.loads(path.read_text())}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"} <= names


@pytest.mark.timeout(120)
def test_lone_process_without_mpiexec():
    code = (
        "import numpy as np, nbdist.common as hvd\n"
        "hvd.init(); hvd.init()\n"
        "assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)\n"
        "assert (hvd.allreduce(np.arange(4.0)) == np.arange(4.0)).all()\n"
        "assert hvd.allgather(np.ones((2, 3))).shape == (2, 3)\n"
        "assert hvd.broadcast_object('x') == 'x' and hvd.allgather_object(5) == [5]\n"
        "got, splits = hvd.alltoall(np.arange(3)); assert list(splits) == [3]\n"
        "hvd.barrier(); assert hvd.join() == 0\n"
        "hvd.shutdown(); print('lone ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "lone ok" in out.stdout


def test_options_and_horovod_aliases(monkeypatch):
    from nbdist.common.config import Config

    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    monkeypatch.setenv("NBDIST_CYCLE_TIME", "2")
    config = Config.from_environment()
    assert config.fusion_threshold == 1024 and config.cycle_time_ms == 2.0
    assert Config().fusion_threshold == 64 * 1024 * 1024
    monkeypatch.setenv("NBDIST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="NBDIST_TIMEOUT_S"):
        Config.from_environment()
    monkeypatch.delenv("NBDIST_TIMEOUT_S")
    monkeypatch.setenv("NBDIST_CPU_OPERATIONS", "carrier-pigeon")
    with pytest.raises(ValueError, match="CPU_OPERATIONS"):
        Config.from_environment()
    monkeypatch.delenv("NBDIST_CPU_OPERATIONS")
    assert not Config.from_environment().autotune
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "1")
    monkeypatch.setenv("HOROVOD_AUTOTUNE_LOG", "/tmp/tune.csv")
    monkeypatch.setenv("NBDIST_AUTOTUNE_STEPS_PER_SAMPLE", "4")
    config = Config.from_environment()
    assert config.autotune and config.autotune_log == "/tmp/tune.csv" and config.autotune_steps == 4
    monkeypatch.setenv("NBDIST_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="NBDIST_AUTOTUNE='maybe': expected 1 or 0"):
        Config.from_environment()
    monkeypatch.delenv("NBDIST_AUTOTUNE")
    monkeypatch.delenv("HOROVOD_AUTOTUNE")
    # sizes in bytes also as nbdist prints them
    monkeypatch.setenv("NBDIST_FUSION_THRESHOLD", "16M")
    monkeypatch.setenv("NBDIST_BUCKET_BYTES", "1.5 MiB")
    config = Config.from_environment()
    assert config.fusion_threshold == 16 << 20 and config.bucket_bytes == 1536 << 10
    monkeypatch.setenv("NBDIST_BUCKET_BYTES", "lots")
    with pytest.raises(ValueError, match=r"NBDIST_BUCKET_BYTES='lots' is not a size in bytes \(e.g. 4096"):
        Config.from_environment()


def test_uninitialized_calls_say_so():
    import nbdist.common as hvd

    with pytest.raises(ValueError, match="init"):
        hvd.rank()


@pytest.mark.timeout(120)
def test_timeline_plot_of_every_rank(tmp_path):
    """%dist_timeline's drawing: the ranks' files become one row per rank."""
    import json

    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from nbdist.common import timeline

    path = str(tmp_path / "t.json")
    for rank in range(2):  # two ranks' files, as start_timeline writes them
        events = [{"name": "process_name", "ph": "M", "pid": 7, "tid": rank,
                   "args": {"name": "allreduce.w"}},
                  {"name": "NEGOTIATE_ALLREDUCE", "ph": "B", "ts": 0, "pid": 7, "tid": rank},
                  {"ph": "E", "ts": 50 + rank, "pid": 7, "tid": rank},
                  {"name": "SHM_ALLREDUCE", "ph": "B", "ts": 60, "pid": 7, "tid": rank},
                  {"ph": "E", "ts": 90, "pid": 7, "tid": rank}]
        with open(timeline.rank_path(path, rank), "w") as f:
            json.dump(events, f)
    assert timeline.rank_files(path) == [path, path + ".rank1"]
    spans = timeline.phase_spans(timeline.merge(path, 2))
    assert (1, "NEGOTIATE_ALLREDUCE", 0, 51) in spans and len(spans) == 4
    figure = timeline.plot(path)
    ax = figure.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"NEGOTIATE", "SHM_ALLREDUCE"}


def test_pooled_results_never_alias_a_live_array():
    """Large results reuse memory (no page faults per call), but only memory that no array,
    nor any view of one, still uses."""
    import numpy as np

    from nbdist.common import buffers

    shape = (buffers.POOL_MIN_BYTES // 4 + 8,)
    first = buffers.empty(shape, np.float32)
    assert first.shape == shape and first.dtype == np.float32 and first.flags.writeable
    view = first[8:].view(np.int32)
    address = first.ctypes.data
    del first
    second = buffers.empty(shape, np.float32)  # `view` still holds the first block
    assert second.ctypes.data != address
    del view
    third = buffers.empty(shape, np.float32)  # now free: reused
    assert third.ctypes.data == address
    small = buffers.empty((3, 2), np.float64)  # below the pool's size: plain np.empty
    assert small.flags.owndata and small.shape == (3, 2)
    del second, third
    buffers.clear_pool()
    assert buffers.pool_stats()["free_bytes"] == 0


def test_a_result_that_dies_in_a_collection_under_the_pool_lock_is_returned():
    """A result in a reference cycle is freed by the garbage collector, which may run on an
    allocation the pool makes under its own lock: its block still goes back, no deadlock."""
    import gc

    import numpy as np

    from nbdist.common import buffers

    buffers.clear_pool()

    class Holder:
        pass

    holder = Holder()
    holder.me, holder.result = holder, buffers.empty(buffers.POOL_MIN_BYTES, np.uint8)
    del holder
    with buffers._lock:
        gc.collect()
    assert buffers.pool_stats()["free_bytes"] == buffers.POOL_MIN_BYTES
    buffers.clear_pool()


def test_a_full_pool_keeps_the_blocks_returned_last(monkeypatch):
    """When a program's sizes change, its new sizes get pooled: a full pool lets the
    blocks that waited longest go."""
    import numpy as np

    from nbdist.common import buffers

    buffers.clear_pool()
    small, big = buffers.POOL_MIN_BYTES, 2 * buffers.POOL_MIN_BYTES
    monkeypatch.setattr(buffers, "POOL_MAX_FREE_BYTES", 3 * small)
    first, second, last = (buffers.empty(small, np.uint8) for _ in range(3))
    last_address = last.ctypes.data
    del first, second, last  # returned in that order: the pool is full
    assert buffers.pool_stats()["free_bytes"] == 3 * small
    new = buffers.empty(big, np.uint8)
    address = new.ctypes.data
    del new  # room is made: the two oldest small blocks go
    assert buffers.pool_stats()["free_bytes"] == small + big
    assert buffers.empty(big, np.uint8).ctypes.data == address
    assert buffers.empty(small, np.uint8).ctypes.data == last_address
    too_big = buffers.empty(4 * small, np.uint8)
    del too_big  # bigger than the whole pool: never kept
    assert buffers.pool_stats()["free_bytes"] <= 3 * small
    buffers.clear_pool()


def test_sizes_print_as_people_read_them_and_read_back():
    from nbdist.common.sizes import format_bytes, parse_bytes

    printed = {0: "0 B", 512: "512 B", 16 << 10: "16 KiB", 1536 << 10: "1.5 MiB", 64 << 20: "64 MiB",
               3 << 30: "3 GiB"}
    for n, text in printed.items():
        assert format_bytes(n) == text
        assert parse_bytes(text) == n
    for text, n in {"4096": 4096, "4K": 4096, "64k": 64 << 10, "4MiB": 4 << 20, "1.5M": 1536 << 10,
                    "2 GiB": 2 << 30}.items():
        assert parse_bytes(text) == n
    with pytest.raises(ValueError, match=r"not a size in bytes: '4X'"):
        parse_bytes("4X")
    with pytest.raises(ValueError, match="cannot be negative"):
        parse_bytes("-1M")
