"""Run notebooks' code cells in order, in one namespace, as a Jupyter kernel would; optionally keep the outputs.

    python notebooks/execute.py notebooks/pending/01_pointwise_roofline.ipynb            # run one and print
    python notebooks/execute.py --write notebooks/pending/01_pointwise_roofline.ipynb    # also store its outputs
    python notebooks/execute.py --all --out-dir $OUT/notebooks                           # run every notebook

A cell's outputs are its stdout, its stderr and the matplotlib figures it leaves open (PNG, as Jupyter's inline
backend shows them; figures are drawn with the Agg backend and closed after the cell). A failing cell stops its
notebook: exit status 1 and the cell's number and traceback. No Jupyter needed; in Jupyter the notebooks run as
they are.

Where outputs go: ``--write`` stores them in the notebook itself, ``--out-dir DIR`` in ``DIR/<name>`` (the GPU
run writes there and the notebooks are copied into ``notebooks/`` from it). Outputs from a CPU run are labelled
as such: a first markdown cell says so (removed again by a GPU run), and the notebook's metadata records the
device, jax version, commit and date of the run that produced them (``metadata["jaxfuse"]["outputs"]``).
``--all`` runs ``notebooks/*.ipynb`` and ``notebooks/pending/*.ipynb`` in name order, stores each as soon as it
has run, and goes on past a failing one (exit status 1 at the end).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import pathlib
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
CPU_BANNER = "cpu-outputs"  # metadata["jaxfuse"] of the markdown cell that labels CPU outputs


class CellError(RuntimeError):
    """A code cell raised; the message names the cell (1-based, code cells only) and carries the traceback."""


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _lines(text: str) -> list[str]:
    """nbformat stores multi-line strings as a list of lines that keep their newlines."""
    return text.splitlines(keepends=True)


def _use_agg() -> None:
    """Figures render off screen (the Agg backend), whatever the environment asks for."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")


def _figures() -> list[dict]:
    """display_data outputs (PNG) of the open matplotlib figures, which are then closed."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    outputs = []
    for number in plt.get_fignums():
        figure = plt.figure(number)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=80, bbox_inches="tight", metadata={"Software": None})
        outputs.append({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": base64.b64encode(buffer.getvalue()).decode("ascii"),
                                 "text/plain": [f"<Figure {number}>"]}})
    plt.close("all")
    return outputs


def run(notebook: dict, *, echo: bool = True) -> dict:
    """Executes the code cells of an nbformat-4 notebook dict; returns a copy with the outputs filled in."""
    if notebook.get("nbformat") != 4:
        raise ValueError(f"notebook: nbformat 4 expected, got {notebook.get('nbformat')!r}")
    _use_agg()
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
            _figures()  # close what the failing cell opened
            raise CellError(f"cell {count} failed:\n{stdout.getvalue()}{stderr.getvalue()}"
                            f"{traceback.format_exc()}") from e
        cell["execution_count"] = count
        cell["outputs"] = [{"output_type": "stream", "name": name, "text": _lines(stream.getvalue())}
                           for name, stream in (("stdout", stdout), ("stderr", stderr)) if stream.getvalue()]
        cell["outputs"] += _figures()
        if echo:
            shown = sum(o["output_type"] == "display_data" for o in cell["outputs"])
            print(f"--- cell {count}\n{stdout.getvalue()}" + (f"[{shown} figure(s)]\n" if shown else ""),
                  end="", flush=True)
    return out


def label_outputs(notebook: dict, env: dict[str, str]) -> dict:
    """The executed notebook with its outputs' origin recorded: metadata["jaxfuse"]["outputs"] = env, and, when
    they come from a CPU, a first markdown cell that says so (a GPU run removes it)."""
    out = dict(notebook)
    cells = [c for c in out["cells"] if c.get("metadata", {}).get("jaxfuse") != CPU_BANNER]
    if env["backend"] == "cpu":
        text = (f"> **Outputs from a CPU run** ({env['device']}, jax {env['jax']}, commit {env['commit']}, "
                f"{env['date']}): every cell ran, at the notebook's small sizes; timings are the CPU's wall clock "
                "and cells that need a GPU say so. These are not H100 measurements: the GPU run "
                "(notebooks/pending/README.md) replaces these outputs and removes this note.")
        cells.insert(0, {"cell_type": "markdown", "metadata": {"jaxfuse": CPU_BANNER}, "source": _lines(text)})
    out["cells"] = cells
    out["metadata"] = {**out.get("metadata", {}), "jaxfuse": {"outputs": dict(env)}}
    return out


def _write(notebook: dict, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(notebook, f, indent=1, ensure_ascii=False)
        f.write("\n")


def all_notebooks() -> list[pathlib.Path]:
    """The published notebooks, then the pending ones, each set in name order."""
    return sorted(HERE.glob("*.ipynb")) + sorted((HERE / "pending").glob("*.ipynb"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="notebook files (or --all)")
    parser.add_argument("--all", action="store_true", help="every notebook in notebooks/ and notebooks/pending/")
    parser.add_argument("--write", action="store_true", help="store the outputs in the notebook file")
    parser.add_argument("--out-dir", help="store the executed notebooks in this folder instead (implies storing)")
    args = parser.parse_args(argv)
    paths = [pathlib.Path(p) for p in args.notebooks] + (all_notebooks() if args.all else [])
    if not paths:
        parser.error("name notebooks or pass --all")

    sys.path.insert(0, str(HERE.parent))  # the repository's packages, as from its root
    from jaxfuse import bench

    os.environ.setdefault("JAXFUSE_COMMIT", bench.environment()["commit"])  # one commit for the whole run
    failed = []
    for path in paths:
        with open(path) as f:
            notebook = json.load(f)
        start = time.perf_counter()
        try:
            executed = run(notebook)
        except CellError as e:
            print(f"=== {path.name}: FAILED after {time.perf_counter() - start:.1f} s\n{e}", file=sys.stderr)
            failed.append(path.name)
            continue
        print(f"=== {path.name}: ran in {time.perf_counter() - start:.1f} s", flush=True)
        if args.write or args.out_dir:
            labelled = label_outputs(executed, bench.environment())
            _write(labelled, pathlib.Path(args.out_dir) / path.name if args.out_dir else path)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
