"""The teaching notebooks run top to bottom in a real kernel (headless, as `make demo` does)."""
from __future__ import annotations

import subprocess
import sys

import pytest

import nbharness as h

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("name, expect", [
    ("quickstart", ["hello from rank 0 of 4", "test accuracy", "stopped the cluster of 4 ranks"]),
    ("errors", ["rank 1 raised ValueError: corrupt batch on rank 1", "longer than --timeout 3 s",
                # (the status may come too late on a loaded machine: see test_notebook_faults)
                ("rank 1 died (exit status 1)", "rank 1 died (exit status not reported in time)"),
                "fresh rank 0 of 2", "-n must be at least 1"]),
])
def test_notebook_runs_headless(name, expect):
    proc = subprocess.run([sys.executable, "-m", "nbdist.cli.run_notebook", f"notebooks/{name}.ipynb"],
                          cwd=h.ROOT, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for text in expect:  # (a tuple: one of its texts)
        texts = text if isinstance(text, tuple) else (text,)
        assert any(t in proc.stdout for t in texts), \
            f"{text!r} not in the output:\n{proc.stdout[-4000:]}"
    assert "every cell ran" in proc.stdout
