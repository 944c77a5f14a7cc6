"""Execute a notebook headless in a real kernel and print what each cell showed.

    python -m nbdist.cli.run_notebook notebooks/quickstart.ipynb [--out executed.ipynb] [--timeout 600]

Cells tagged `raises-exception` may fail (that is what they demonstrate); any other
failing cell stops the run with a nonzero exit status, as nbclient does.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cell_text(cell) -> str:
    from ..failure import strip_ansi

    parts = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            parts.append(out.get("text", ""))
        elif kind in ("display_data", "execute_result"):
            data = out.get("data", {})
            if "text/plain" in data:
                parts.append(str(data["text/plain"]) + "\n")
            elif data:
                parts.append(f"<{', '.join(sorted(data))}>\n")
        elif kind == "error":
            parts.append("\n".join(out.get("traceback", [])) + "\n")
    return strip_ansi("".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbdist.cli.run_notebook", description=__doc__.splitlines()[0])
    parser.add_argument("notebook", help="the .ipynb to execute")
    parser.add_argument("--out", help="also save the executed notebook here (outputs and widget state)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a cell may run (default 600)")
    args = parser.parse_args(argv)

    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = Path(args.notebook)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    status = 0
    failure: CellExecutionError | None = None
    try:
        client.execute()
    except CellExecutionError as exc:
        status = 1
        failure = exc
    for _i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.get("outputs") and cell.get("execution_count") is None:
            continue
        print(f"--- In [{cell.get('execution_count') or ' '}]: {cell.source.splitlines()[0] if cell.source else ''}")
        text = _cell_text(cell)
        if text:
            print(text.rstrip("\n"))
    if args.out:
        nbformat.write(nb, args.out)
    if failure is not None:
        print(f"\nnbdist.cli.run_notebook: {path} failed:\n{failure}", file=sys.stderr)
    else:
        print(f"\nnbdist.cli.run_notebook: {path}: every cell ran")
    return status


if __name__ == "__main__":
    sys.exit(main())
