"""Argument parsing and bad input of the magics: a clear UsageError, nothing started, nothing lost."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbdist.notebook import magics
from nbdist.mpi.hydra import culprits, decode_wait_status, parse_exit_codes

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbdist")
    yield ip
    ip.run_line_magic("unload_ext", "nbdist")


@pytest.fixture
def dist(shell):
    return magics._loaded[id(shell)]


@pytest.mark.parametrize("value, message", [
    ("0", "at least 1"), ("-1", "at least 1"), ("abc", "whole number"), ("2.5", "whole number"),
    ("100000", "more ranks than"),
])
def test_parse_n_rejects(value, message):
    with pytest.raises(UsageError, match=message):
        magics.parse_n(value)


def test_parse_n_accepts_small_counts():
    assert magics.parse_n("4") == 4
    assert magics.parse_n(" 1 ") == 1


def test_parse_targets():
    assert magics.parse_targets(None, 4) is None
    assert magics.parse_targets("0", 4) == [0]
    assert magics.parse_targets("0,2-3", 4) == [0, 2, 3]
    with pytest.raises(UsageError, match="outside 0..3"):
        magics.parse_targets("1,4", 4)
    with pytest.raises(UsageError, match="ranks like"):
        magics.parse_targets("a-b", 4)
    with pytest.raises(UsageError, match="ranks like"):
        magics.parse_targets("3-1", 4)


def test_parse_timeout_and_env():
    assert magics.parse_timeout(None) is None
    assert magics.parse_timeout("2.5") == 2.5
    for bad in ("0", "-3", "soon"):
        with pytest.raises(UsageError, match="--timeout"):
            magics.parse_timeout(bad)
    assert magics.parse_env(["A=1", "B_C=x=y"]) == {"A": "1", "B_C": "x=y"}
    with pytest.raises(UsageError, match="K=V"):
        magics.parse_env(["novalue"])
    assert magics.parse_hosts(["a,b", "c:2"]) == ["a:1", "b:1", "c:2"]
    with pytest.raises(UsageError, match="slots"):
        magics.parse_hosts(["a:0"])


@pytest.mark.parametrize("line", ["-n 0", "-n -1", "-n abc", "-n 100000", "--bogus", "-n 2 --output maybe",
                                  "-n 2 --timeout 0", "-n 2 --targets 5"])
def test_bad_cell_arguments_start_nothing(shell, dist, line):
    with pytest.raises(UsageError):
        shell.run_cell_magic("distributed", line, "x = 1")
    assert dist.cluster.cluster is None, "a bad argument must not start a cluster"
    assert not dist._busy.locked()


def test_a_misspelt_option_gets_a_suggestion(shell, dist):
    with pytest.raises(UsageError, match=r"arguments: --timout 3 \(did you mean: --timout -> --timeout\?\)"):
        shell.run_cell_magic("distributed", "-n 2 --timout 3", "x = 1")
    with pytest.raises(UsageError, match=r"--lanucher -> --launcher"):
        shell.run_line_magic("dist_start", "-n 2 --lanucher local")
    with pytest.raises(UsageError) as info:  # nothing close: the plain message
        shell.run_cell_magic("distributed", "--zzz", "x = 1")
    assert "did you mean" not in str(info.value)
    assert dist.cluster.cluster is None


@pytest.mark.parametrize("body", ["", "   \n\t\n"])
def test_empty_cell_is_an_error(shell, dist, body):
    with pytest.raises(UsageError, match="empty"):
        shell.run_cell_magic("distributed", "-n 2", body)
    assert dist.cluster.cluster is None


def test_cell_while_another_runs_is_refused(shell, dist):
    dist._busy.acquire()  # what a running %%distributed cell holds
    try:
        with pytest.raises(UsageError, match="another %%distributed cell is still running"):
            shell.run_cell_magic("distributed", "-n 2", "x = 1")
        with pytest.raises(UsageError, match="still running"):
            shell.run_line_magic("dist_start", "-n 2")
    finally:
        dist._busy.release()
    assert dist.cluster.cluster is None


def test_line_magics_bad_input(shell, dist, tmp_path):
    with pytest.raises(UsageError, match="needs -n"):
        shell.run_line_magic("dist_start", "")
    with pytest.raises(UsageError):
        shell.run_line_magic("dist_start", "-n 2 --launcher pigeon")
    with pytest.raises(UsageError, match="no cluster is running"):
        shell.run_line_magic("dist_pull", "x")
    with pytest.raises(UsageError, match="no cluster is running"):
        shell.run_line_magic("dist_push", "x")
    with pytest.raises(UsageError, match="no such file"):
        shell.run_line_magic("dist_run", str(tmp_path / "missing.py"))
    with pytest.raises(UsageError, match="takes no arguments"):
        shell.run_line_magic("dist_stop", "now")
    assert dist.cluster.cluster is None


def test_stop_and_status_without_cluster(shell, dist, capsys):
    shell.run_line_magic("dist_stop", "")
    shell.run_line_magic("dist_status", "")
    out = capsys.readouterr().out
    assert "no cluster is running" in out


def test_help_documents_the_options():
    doc = magics.DistributedMagics.distributed.__doc__
    for option in ("-n", "--timeout", "--targets", "--output", "--no-widgets", "--gpus"):
        assert option in doc
    assert "--launcher" in magics.DistributedMagics.dist_start.__doc__


def test_exit_code_parsing():
    out = "[mpiexec@vm] Exit codes: [vm] 0,768,9\n"
    codes = parse_exit_codes(out)
    assert codes == {0: 0, 1: 768, 2: 9}
    assert culprits(codes) == {1: 768}  # MPI's SIGKILL of the peers is not a cause
    assert culprits({0: 0, 1: 0, 2: 9}) == {2: 9}
    assert decode_wait_status(768) == "exit status 3"
    assert decode_wait_status(11).startswith("killed by signal 11 (SIGSEGV)")
    assert parse_exit_codes("[mpiexec@a] Exit codes: [a] 0,0\n[mpiexec@a] Exit codes: [b] 256\n",
                            {"a": [0, 2], "b": [1]}) == {0: 0, 2: 0, 1: 256}


def test_plain_cell_reuses_and_restarts_the_cluster_the_way_it_was_started(monkeypatch):
    """After `%dist_start -n 2 --launcher ssh --hosts a b`, a plain %%distributed keeps ssh on a, b."""
    from nbdist.notebook.cluster import DistCluster

    started = []
    c = DistCluster(notify=lambda text, level="info": None)
    monkeypatch.setattr(c, "start", lambda n, launcher="local", hosts=None, env=None, elastic=False: (
        started.append((n, launcher, hosts, env)),
        setattr(c, "cluster", object()),
        c.__dict__.update(n=n, launcher=launcher, hosts=list(hosts or []), env=dict(env or {}))))
    monkeypatch.setattr(c, "stop", lambda quiet=False: setattr(c, "cluster", None))
    running = {"yes": True}
    monkeypatch.setattr(c, "is_running", lambda: running["yes"])

    assert c.ensure(2, "ssh", ["a", "b"], {"K": "V"}) == "started"
    assert c.shape(2) == (2, "ssh", ["a", "b"], {"K": "V"})
    assert c.plan(2) == "reuse" and c.ensure(2) == "reused"
    running["yes"] = False  # a fault killed it: restarted the same way, not locally
    assert c.ensure(2) == "restarted"
    assert started[-1] == (2, "ssh", ["a", "b"], {"K": "V"})
    running["yes"] = True
    assert c.ensure(4) == "restarted" and started[-1] == (4, "ssh", ["a", "b"], {"K": "V"})
    assert c.ensure(4, "local") == "restarted" and started[-1] == (4, "local", [], {"K": "V"})
    fresh = DistCluster(notify=lambda text, level="info": None)
    assert fresh.shape(3) == (3, "local", [], {})


def test_usage_line_names_the_cell_magic():
    """`%%distributed?` shows `%%distributed [-n N] ...`, the way the user types it."""
    doc = magics.DistributedMagics.distributed.__doc__
    assert "%%distributed [-n N]" in doc.replace("\n", " ").replace("  ", " ")
    assert "%dist_run [-n N]" in magics.DistributedMagics.dist_run.__doc__.replace("\n", " ")
