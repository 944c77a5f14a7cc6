"""Helpers for the notebook tests: build a notebook, execute it in a real kernel, inspect it.

The kernel is the venv's python (jupyter_client maps the kernelspec's "python"
to sys.executable), so the engines it starts use the venv's mpiexec and nbdist.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import nbformat
import psutil
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent

# A cell that prints every process of the cluster (controller, mpiexec and all below)
# and every /dev/shm segment the ranks map, as one JSON line the test reads back.
FOOTPRINT = r'''
import json as _json, psutil as _ps
_c = get_ipython().magics_manager.registry["DistributedMagics"].cluster
_pids = []
if _c.cluster is not None:
    _roots = [_c.cluster.controller.process.pid] + [p.pid for p in _c._mpiexec_procs()]
    for _r in _roots:
        _p = _ps.Process(_r)
        _pids += [(_q.pid, _q.create_time()) for _q in [_p] + _p.children(recursive=True)]
    _shm = _c.client[:].apply_sync(lambda: sorted({l[l.index("/dev/shm/"):].split()[0]
                                                   for l in open("/proc/self/maps") if "/dev/shm/" in l}))
    _shm = sorted({s for per_rank in _shm for s in per_rank})
else:
    _shm = []
print("FOOTPRINT " + _json.dumps({"pids": _pids, "shm": _shm}))
'''


def notebook(*cells, kernel: str = "python3") -> nbformat.NotebookNode:
    """A notebook from code cells; a cell is a source string or (source, metadata)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": "Python 3", "language": "python"}
    for cell in cells:
        src, meta = (cell, {}) if isinstance(cell, str) else cell
        c = nbformat.v4.new_code_cell(src)
        c.metadata.update(meta)
        nb.cells.append(c)
    return nb


def execute(nb, timeout: int = 240, cwd: Path = ROOT):
    """Execute in a fresh kernel; a cell with metadata interrupt_after=S is interrupted after S s."""
    def timeout_func(cell):
        return cell.metadata.get("interrupt_after", timeout)

    client = NotebookClient(nb, timeout=timeout, timeout_func=timeout_func, interrupt_on_timeout=True,
                            allow_errors=True, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def text_of(cell) -> str:
    """Everything a cell showed, as plain text (streams, text/plain of displays, tracebacks)."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(str(out.data.get("text/plain", "")))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}\n" + "\n".join(out.traceback))
    from nbdist.failure import strip_ansi

    return strip_ansi("\n".join(parts))


def error_of(cell):
    """The cell's error output (ename, evalue, traceback text) or None."""
    for out in cell.get("outputs", []):
        if out.output_type == "error":
            from nbdist.failure import strip_ansi

            return out.ename, out.evalue, strip_ansi("\n".join(out.traceback))
    return None


def footprints(nb) -> list[dict]:
    found = []
    for cell in nb.cells:
        for line in text_of(cell).splitlines():
            if line.startswith("FOOTPRINT "):
                found.append(json.loads(line[len("FOOTPRINT "):]))
    return found


def alive(pids_with_times, wait_s: float = 10.0) -> list[str]:
    """Processes (pid, create_time) still running after wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for pid, created in pids_with_times:
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def processes_with_kernel_pid(kernel_pid: int) -> list[str]:
    """Engines (and children) started for one kernel: they carry NBDIST_KERNEL_PID."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("NBDIST_KERNEL_PID") == str(kernel_pid):
                found.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            continue
    return found


def shm_left(paths, wait_s: float = 30.0) -> list[str]:
    """Segments still in /dev/shm after wait_s: the reaper removes them once the ranks it
    killed are gone, a moment after the processes themselves (it scans /proc first)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [p for p in paths if os.path.exists(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)
