"""The README's notebook cells, exactly as printed, run in a real kernel on the ranks they ask for."""
from __future__ import annotations

import re

import pytest

import nbharness as h

pytestmark = pytest.mark.timeout(600)


def readme_cells() -> list[str]:
    """Every ```python block of the README that is a notebook cell (a magic on its first line)."""
    text = (h.ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [b.rstrip("\n") for b in blocks if b.lstrip().startswith(("%load_ext", "%%distributed"))]


def test_readme_has_the_cell_example():
    cells = readme_cells()
    assert cells[0] == "%load_ext nbdist"
    assert any(c.startswith("%%distributed") and "nbdist.progress" in c for c in cells)


def test_readme_cells_run_as_printed():
    cells = readme_cells()
    # After them, what the README promises: the names live on in the engines.
    nb = h.notebook(*cells, "%%distributed\nprint('still here:', type(model).__name__, type(opt).__name__)",
                    "%dist_stop")
    h.execute(nb, timeout=420)
    for cell in nb.cells:
        assert h.error_of(cell) is None, f"{cell.source[:80]!r} failed:\n{h.text_of(cell)}"
    assert "still here: Linear DistributedOptimizer" in h.text_of(nb.cells[-2]) or \
        "still here: Linear" in h.text_of(nb.cells[-2]), h.text_of(nb.cells[-2])
