"""The timeline (run under mpiexec): each rank's Chrome trace holds every op's phases."""
import json
import os

import numpy as np

import nbdist.common as hvd
from _common_setup import runtime  # noqa: F401 (the autouse fixture starts nbdist)
from nbdist.common import timeline


def _shared_dir(tmp_path_factory):
    # one directory for all ranks: rank 0's, broadcast
    base = str(tmp_path_factory.mktemp("tl")) if hvd.rank() == 0 else None
    return hvd.broadcast_object(base, 0, name="timeline.dir")


def test_timeline_records_phases_of_every_op(tmp_path_factory):
    path = os.path.join(_shared_dir(tmp_path_factory), "trace.json")
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(np.ones(8, np.float32), name="tl.single")
    handles = [hvd.allreduce_async(np.ones(4, np.float32), name=f"tl.fused.{i}") for i in range(3)]
    for h in handles:
        hvd.synchronize(h)
    hvd.allgather(np.ones((2, 2), np.float32), name="tl.gather")
    hvd.broadcast(np.ones(3, np.int32), 0, name="tl.bcast")
    hvd.stop_timeline()
    hvd.barrier()
    mine = timeline.rank_path(path, hvd.rank())
    with open(mine) as f:
        events = json.load(f)  # stop_timeline leaves valid JSON
    tracks = {e["pid"]: e["args"]["name"] for e in events
              if e.get("ph") == "M" and e["name"] == "process_name"}
    phases = {}
    for e in events:
        if e.get("ph") == "B":
            phases.setdefault(tracks[e["pid"]], []).append(e["name"])
    assert phases["allreduce.tl.single"][:3] == ["NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE"]
    assert any(p.endswith("_ALLREDUCE") and p != "NEGOTIATE_ALLREDUCE" and p != "ALLREDUCE"
               for p in phases["allreduce.tl.single"])
    assert "ALLGATHER" in phases["allgather.tl.gather"]
    assert "BROADCAST" in phases["broadcast.tl.bcast"]
    begins = sum(e.get("ph") == "B" for e in events)
    assert begins == sum(e.get("ph") == "E" for e in events), "every phase is closed"
    assert any(e.get("name") == "CYCLE_START" for e in events)
    assert any("start_time_since_epoch_in_micros" in e.get("args", {}) for e in events)
    if hvd.size() > 1 and hvd.rank() == 0:
        merged = timeline.merge(path, hvd.size())
        assert {e["tid"] for e in merged} == set(range(hvd.size()))


def _burst_phases(tmp_path_factory, tag: str, **kwargs) -> set:
    """The phase names of a timeline over bursts of small named allreduces (fused)."""
    path = os.path.join(_shared_dir(tmp_path_factory), tag + "{rank}.json")
    hvd.start_timeline(path)
    for _step in range(5):  # a burst of small named ops: the engine fuses some of them
        hs = [hvd.allreduce_async(np.ones(16, np.float32), name=f"tl.{tag}.{i}", **kwargs)
              for i in range(8)]
        for h in hs:
            np.testing.assert_allclose(hvd.synchronize(h), kwargs.get("prescale_factor", 1.0))
    hvd.stop_timeline()
    with open(path.format(rank=hvd.rank())) as f:
        return {e.get("name") for e in json.load(f)}


def test_fused_allreduces_packed_by_the_transport_show_its_phase(tmp_path_factory):
    names = _burst_phases(tmp_path_factory, "packed")
    if hvd.size() > 1:
        # The shm transport packs fused pieces straight into its segment: no fusion buffer.
        assert "SHM_ALLREDUCE" in names or "MPI_ALLREDUCE" in names
        if "SHM_ALLREDUCE" in names:
            assert "MEMCPY_IN_FUSION_BUFFER" not in names
    assert "CYCLE_START" not in names  # mark_cycles off


def test_fused_allreduces_through_the_fusion_buffer_show_the_copies(tmp_path_factory):
    # A prescale is applied in the engine's fusion buffer, as Horovod's CPU ops do.
    names = _burst_phases(tmp_path_factory, "buffered", prescale_factor=0.5)
    if hvd.size() > 1:
        assert "MEMCPY_IN_FUSION_BUFFER" in names and "MEMCPY_OUT_FUSION_BUFFER" in names


def test_stopped_timeline_records_nothing_more(tmp_path_factory):
    path = os.path.join(_shared_dir(tmp_path_factory), "stopped.json")
    hvd.start_timeline(path)
    hvd.stop_timeline()
    hvd.allreduce(np.ones(2, np.float32), name="tl.after")
    with open(timeline.rank_path(path, hvd.rank())) as f:
        assert "tl.after" not in f.read()
    hvd.stop_timeline()  # harmless twice
