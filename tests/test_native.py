"""The native data path: shm collectives, abort and SIGKILL behaviour, the hierarchical
path with pretend nodes, and the foundation's collectives with each CPU transport forced.

Multi-rank work runs in tests/ranks/ under mpiexec -n 2 and -n 4.
"""
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import MPIEXEC, ROOT, rank_env, run_rank_tests, run_ranks

RANKS = [2, 4]
native = pytest.importorskip("nbdist._native", reason="the native module is not built")


def test_module_reports_what_it_was_built_with():
    assert native.shm_built() is True
    assert native.kernel_isa() in ("avx2", "baseline")
    from nbdist.common.transports.nccl import load_nccl

    reason = load_nccl()
    assert native.nccl_built() == (reason == "" or reason.startswith("NCCL loaded"))


@pytest.mark.parametrize("scope", ["0", "1", "2", None])
def test_ranks_let_their_peers_read_them_under_yama_scope_1(tmp_path, scope):
    """Ubuntu's default Yama ptrace_scope 1 forbids reading a sibling's memory: each rank
    names any process as its ptracer there (a real prctl, in a child process; a kernel
    without Yama refuses it, and the answer says so), and touches nothing otherwise."""
    path = tmp_path / "ptrace_scope"
    if scope is not None:
        path.write_text(scope + "\n")
    code = ("import sys; from nbdist.common.transports.shm import allow_peer_reads; "
            "print(allow_peer_reads(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    if scope is None:
        assert out == "no Yama"
    elif scope == "1":
        assert out in ("ptrace_scope 1: peers allowed",
                       "ptrace_scope 1: prctl(PR_SET_PTRACER) failed: Invalid argument"), out
    else:
        assert out == f"ptrace_scope {scope}"


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int8, np.uint64])
def test_local_reduce_kernel_matches_numpy(dtype):
    from nbdist.common.transports._dtypes import dtype_code

    rng = np.random.default_rng(0)
    srcs = [rng.integers(0, 50, 4099).astype(dtype) for _ in range(3)]
    dst = np.empty_like(srcs[0])
    addr = [s.__array_interface__["data"][0] for s in srcs]
    native.reduce_local(dst.__array_interface__["data"][0], addr, dst.size, dtype_code(dtype), 1)
    wide = np.float32 if dtype == np.float16 else dtype
    want = (srcs[0].astype(wide) + srcs[1].astype(wide) + srcs[2].astype(wide)).astype(dtype)
    np.testing.assert_array_equal(dst, want)


@pytest.mark.timeout(120)
def test_baseline_kernels_agree_with_the_vectorized_ones():
    """The portable kernels (chosen on CPUs without AVX2/F16C) give the same bits."""
    code = (
        "import numpy as np, nbdist._native as nat\n"
        "from nbdist.common.transports._dtypes import dtype_code\n"
        "from nbdist.common.ops_base import BFLOAT16\n"
        "rng = np.random.default_rng(1)\n"
        "for dt in [np.float16, BFLOAT16, np.float32, np.int16, np.uint32]:\n"
        "    for op in (1, 3, 4, 5):\n"
        "        srcs = [(rng.standard_normal(3001) * 4).astype(dt) for _ in range(3)]\n"
        "        dst = np.empty_like(srcs[0])\n"
        "        nat.reduce_local(dst.ctypes.data, [s.ctypes.data for s in srcs], dst.size, dtype_code(dt), op)\n"
        "        print(nat.kernel_isa(), dst.view(np.uint8).tobytes().hex())\n")
    outs = {}
    for isa in ("baseline", "auto"):
        env = dict(os.environ, NBDIST_KERNELS=isa)
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=100)
        assert proc.returncode == 0, proc.stderr
        outs[isa] = [line.split(" ", 1) for line in proc.stdout.splitlines()]
    assert {isa for isa, _ in outs["baseline"]} == {"baseline"}
    assert [h for _, h in outs["baseline"]] == [h for _, h in outs["auto"]]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", RANKS)
def test_shm_collectives(n):
    run_rank_tests(n, "native_collectives.py", timeout=540)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("local_size", [1, 2])
@pytest.mark.parametrize("n", RANKS)
def test_hierarchical_with_pretend_nodes(n, local_size):
    run_rank_tests(n, "native_hierarchical.py", timeout=360,
                   extra_env={"NBDIST_LOCAL_SIZE": str(local_size)})


@pytest.mark.timeout(200)
@pytest.mark.parametrize("readable", [False, True], ids=["ranks-not-readable", "ranks-readable"])
def test_a_node_without_single_copy_says_why_once_and_still_computes(readable):
    """Where the ranks may not read each other's memory (non-dumpable processes without
    CAP_SYS_PTRACE: a real refusal by the kernel), every collective still gives the right
    result through the slots, and the node's first rank warns once, naming the rank and
    the reason. Where they may, nothing is said."""
    wrapper: tuple[str, ...] = ()
    if os.geteuid() == 0:  # root reads anyone through CAP_SYS_PTRACE: drop it
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv (util-linux) is needed to drop CAP_SYS_PTRACE as root")
        wrapper = ("setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace", "--")
    env = rank_env(NBDIST_TEST_NOT_DUMPABLE="0" if readable else "1")
    out = run_ranks(2, [str(ROOT / "tests" / "ranks" / "native_single_copy_off.py")], timeout=120,
                    env=env, wrapper=wrapper).stdout
    assert "rank 0 ok" in out and "rank 1 ok" in out, out[-4000:]
    said = re.findall(r"single copy is off on this node: rank (\d) cannot read rank (\d)'s memory "
                      r"\(process_vm_readv: ([^;]+); Yama: ([^)]+)\)", out)
    if readable:
        assert said == [], out[-4000:]
    else:
        assert len(said) == 1, out[-4000:]
        rank, peer, error, _ = said[0]
        assert {rank, peer} == {"0", "1"} and error == os.strerror(errno.EPERM), said
        doctor = run_ranks(2, [str(ROOT / "tests" / "ranks" / "native_single_copy_off.py"), "doctor"],
                           timeout=120, env=env, wrapper=wrapper).stdout
        assert re.search(r"single copy +off \(rank \d cannot read rank \d's memory", doctor), doctor[-4000:]


@pytest.mark.parametrize("path", ["transport", "api", "api-allgather", "api-broadcast", "api-async",
                                  "api-allreduce-midop", "api-allgather-midop",
                                  "api-broadcast-midop", "api-fused-midop"])
@pytest.mark.parametrize("n", RANKS)
def test_sigkill_releases_peers_and_leaves_no_segment(n, path, tmp_path):
    script = ROOT / "tests" / "ranks" / "native_sigkill.py"
    # A shell between mpiexec and each rank takes mpiexec's clean-up signals, and each
    # rank moves to a session of its own so that hydra's kill(-pgid) misses it (see the script).
    cmd = [MPIEXEC, "-disable-auto-cleanup", "-n", str(n), "sh", "-c", f'"{sys.executable}" "{script}"']
    env = rank_env(NBDIST_SIGKILL_DIR=str(tmp_path), NBDIST_SIGKILL_PATH=path)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    report = {}
    try:
        out, _ = proc.communicate(timeout=120)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(list(tmp_path.glob("released.*"))) < n - 1:
            time.sleep(0.1)
        report = _sigkill_rank_report(tmp_path, n)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid_file in tmp_path.glob("pid.*"):  # ranks behind the shells, if any is left
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        # No rank finalizes MPI (a dead peer), so MPICH's segments stay unless removed: the
        # ranks' own clean-up is what is tested below, MPICH's is this test's to do.
        mapped = tmp_path / "mapped"
        for path in (mapped.read_text().split() if mapped.exists() else []):
            if os.path.basename(path).startswith("mpich"):
                try:
                    os.unlink(path)  # unlinking a segment a dying rank still maps is safe
                except FileNotFoundError:
                    pass
    files = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert "segment" in files and "killed" in files, (report, out[-4000:])
    segments, killed_at = files["segment"].split(), float(files["killed"])
    released = {int(k.split(".")[1]): v for k, v in files.items() if k.startswith("released.")}
    assert sorted(released) == list(range(n - 1)), (report, out[-4000:])
    for rank, text in released.items():
        at, message = text.split(" ", 1)
        assert float(at) - killed_at < 1.0, f"rank {rank} released {float(at) - killed_at:.2f} s late"
        assert f"rank {n - 1}" in message and "died" in message, message
    for segment in segments:
        assert not os.path.exists("/dev/shm" + segment), segment


def _sigkill_rank_report(d, n: int) -> dict:
    """What happened to each surviving rank that did not write released.R: its files,
    whether it still runs (state, kernel wait channel, a Python stack dump)."""
    report = {}
    for rank in range(n - 1):
        if (d / f"released.{rank}").exists():
            continue
        entry = {name: (d / f"{name}.{rank}").read_text()[-2000:]
                 for name in ("started", "error") if (d / f"{name}.{rank}").exists()}
        try:
            pid = int((d / f"pid.{rank}").read_text())
        except (FileNotFoundError, ValueError):
            entry["process"] = "never wrote its pid (did not reach MPI init)"
            report[rank] = entry
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
            wchan = open(f"/proc/{pid}/wchan").read()
            entry["process"] = f"still there: state {stat.rsplit(')', 1)[1].split()[0]}, wchan {wchan}"
            os.kill(pid, signal.SIGUSR2)  # faulthandler dumps its Python stacks to stack.R
            time.sleep(0.5)
            entry["stack"] = (d / f"stack.{rank}").read_text()[-3000:]
        except (FileNotFoundError, ProcessLookupError):
            entry["process"] = "gone without writing released/error: killed by a signal"
        report[rank] = entry
    return report


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("transport", ["mpi", "shm", "hierarchical"])
@pytest.mark.parametrize("n", RANKS)
def test_common_collectives_with_each_cpu_transport(n, transport):
    """The foundation's own collective tests, with the CPU transport forced."""
    if not (ROOT / "tests" / "ranks" / "common_collectives.py").exists():
        pytest.skip("the engine's tests/ranks/common_collectives.py is not there yet")
    run_rank_tests(n, "common_collectives.py", timeout=1100,
                   extra_env={"NBDIST_CPU_OPERATIONS": transport})
