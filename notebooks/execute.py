"""Run a notebook's code cells in order, in one namespace, as a Jupyter kernel would; optionally keep the outputs.

    python notebooks/execute.py notebooks/01_rmsnorm_matmul_round_trip.ipynb           # run and print
    python notebooks/execute.py --write notebooks/01_rmsnorm_matmul_round_trip.ipynb   # also store the outputs

CI runs every notebook this way on the CPU (tests/test_notebooks.py), and the committed outputs come from a GPU
run with ``--write``. The notebooks print their results (no rich display), so a cell's output is its stdout and
stderr. A failing cell stops the run: exit status 1 and the cell's number and traceback. No Jupyter needed; in
Jupyter the notebooks run as they are.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import traceback


class CellError(RuntimeError):
    """A code cell raised; the message names the cell (1-based, code cells only) and carries the traceback."""


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _lines(text: str) -> list[str]:
    """nbformat stores multi-line strings as a list of lines that keep their newlines."""
    return text.splitlines(keepends=True)


def run(notebook: dict, *, echo: bool = True) -> dict:
    """Executes the code cells of an nbformat-4 notebook dict; returns a copy with stream outputs filled in."""
    if notebook.get("nbformat") != 4:
        raise ValueError(f"notebook: nbformat 4 expected, got {notebook.get('nbformat')!r}")
    namespace: dict = {"__name__": "__main__"}
    out = json.loads(json.dumps(notebook))
    count = 0
    for cell in out["cells"]:
        if cell["cell_type"] != "code":
            continue
        count += 1
        stdout, stderr = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                exec(compile(_source(cell), f"<cell {count}>", "exec"), namespace)
        except Exception as e:
            raise CellError(f"cell {count} failed:\n{stdout.getvalue()}{stderr.getvalue()}"
                            f"{traceback.format_exc()}") from e
        cell["execution_count"] = count
        cell["outputs"] = [{"output_type": "stream", "name": name, "text": _lines(stream.getvalue())}
                           for name, stream in (("stdout", stdout), ("stderr", stderr)) if stream.getvalue()]
        if echo:
            print(f"--- cell {count}\n{stdout.getvalue()}", end="", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("--write", action="store_true", help="store the outputs in the notebook file")
    args = parser.parse_args(argv)
    with open(args.notebook) as f:
        notebook = json.load(f)
    try:
        executed = run(notebook)
    except CellError as e:
        print(e, file=sys.stderr)
        return 1
    if args.write:
        with open(args.notebook, "w") as f:
            json.dump(executed, f, indent=1, ensure_ascii=False)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
