"""The README's notebook cells, and docs/elastic.md's, exactly as printed, run in a real kernel
on the ranks they ask for."""
from __future__ import annotations

import re

import pytest

import nbharness as h

pytestmark = pytest.mark.timeout(600)


def notebook_cells(page: str = "README.md") -> list[str]:
    """Every ```python block of a page that is a notebook cell (a magic on its first line)."""
    text = (h.ROOT / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [b.rstrip("\n") for b in blocks if b.lstrip().startswith(("%load_ext", "%%distributed"))]


def test_readme_has_the_cell_example():
    cells = notebook_cells()
    assert cells[0] == "%load_ext nbdist"
    assert any(c.startswith("%%distributed") and "nbdist.progress" in c for c in cells)


def test_readme_cells_run_as_printed():
    cells = notebook_cells()
    # After them, what the README promises: the names live on in the engines.
    nb = h.notebook(*cells, "%%distributed\nprint('still here:', type(model).__name__, type(opt).__name__)",
                    "%dist_stop")
    h.execute(nb, timeout=420)
    for cell in nb.cells:
        assert h.error_of(cell) is None, f"{cell.source[:80]!r} failed:\n{h.text_of(cell)}"
    assert "still here: Linear DistributedOptimizer" in h.text_of(nb.cells[-2]) or \
        "still here: Linear" in h.text_of(nb.cells[-2]), h.text_of(nb.cells[-2])


def test_elastic_page_cell_runs_as_printed():
    """docs/elastic.md's cell: rank 2 kills itself, the run finishes on 3 ranks in the same cell."""
    cells = notebook_cells("docs/elastic.md")
    assert cells and cells[0].startswith("%%distributed -n 4 --elastic"), cells
    nb = h.notebook("%load_ext nbdist", cells[0], "%dist_stop")
    h.execute(nb, timeout=420)
    out = h.text_of(nb.cells[1])
    assert h.error_of(nb.cells[1]) is None, out
    assert "lost rank 2" in out and "resized 4 -> 3 ranks" in out, out
    finals = re.findall(r"rank (\d) of 3: (\d+) steps, weight\[0\] (\S+)", out)
    assert sorted(r for r, _, _ in finals) == ["0", "1", "2"], out
    assert len({(steps, w) for _, steps, w in finals}) == 1, f"ranks differ at the end:\n{out}"
    assert "call shutdown() and init()" not in out, out  # a recovered loss is not a fault to fix
