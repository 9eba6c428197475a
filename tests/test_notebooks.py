"""The teaching notebooks run top to bottom (on CPU at their small sizes), draw their plots, check their exercises,
and are committed with outputs whose origin they name: a GPU run in notebooks/, a labelled CPU run in
notebooks/pending/."""

import base64
import importlib.util
import json
import pathlib
import re

import pytest

from conftest import ON_GPU
from jaxfuse import lesson

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PENDING = sorted((ROOT / "notebooks" / "pending").glob("*.ipynb"))  # written, awaiting their GPU run
_spec = importlib.util.spec_from_file_location("notebook_execute", ROOT / "notebooks" / "execute.py")
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)
PNG = b"\x89PNG\r\n\x1a\n"


def _load(path):
    with open(path) as f:
        return json.load(f)


def _code_cells(notebook):
    return [c for c in notebook["cells"] if c["cell_type"] == "code"]


def _text(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _outputs_text(cell, name="stdout"):
    return "".join("".join(o["text"]) for o in cell["outputs"] if o.get("name") == name)


def test_there_are_six_notebooks_with_their_sizes():
    names = [p.stem for p in NOTEBOOKS + PENDING]
    assert len(names) >= 6, names
    assert len(set(names)) == len(names), f"a notebook is both published and pending: {names}"
    assert set(names) <= set(lesson.SIZES), f"notebooks without sizes in jaxfuse.lesson.SIZES: " \
                                            f"{set(names) - set(lesson.SIZES)}"


@pytest.mark.parametrize("path", NOTEBOOKS + PENDING, ids=lambda p: p.name)
def test_notebook_structure(path):
    """Starts with lesson.start (its sizes, the device line), has a plot and at least two exercises, each answered
    by a hidden solution cell that runs in CI."""
    notebook = _load(path)
    code = [c for c in _code_cells(notebook)]
    assert f'lesson.start("{path.stem}")' in _text(code[0])
    assert any("plt." in _text(c) or "ax." in _text(c) for c in code), "no plot"
    exercises = [c for c in notebook["cells"] if c["cell_type"] == "markdown"
                 and re.search(r"\*\*Exercise \d+\.\*\*", _text(c))]
    solutions = [c for c in code if "solution" in c["metadata"].get("tags", [])]
    assert len(exercises) >= 2 and len(solutions) == len(exercises), (len(exercises), len(solutions))
    assert all(c["metadata"].get("jupyter", {}).get("source_hidden") for c in solutions)


@pytest.mark.parametrize("path", [p if i == 0 else pytest.param(p, marks=pytest.mark.slow)  # the first in the fast set
                                  for i, p in enumerate(NOTEBOOKS + PENDING)], ids=lambda p: p.name)
def test_notebook_runs(path):
    executed = execute.run(_load(path), echo=False)
    cells = _code_cells(executed)
    assert all(c["execution_count"] for c in cells)
    assert _outputs_text(cells[0]).startswith("device ")
    images = [o for c in cells for o in c["outputs"] if o["output_type"] == "display_data"]
    assert images and all(base64.b64decode(o["data"]["image/png"]).startswith(PNG) for o in images)
    warnings = [_outputs_text(c, "stderr") for c in cells if _outputs_text(c, "stderr")]
    assert not warnings, f"cells wrote to stderr (it would be stored): {warnings[0][:500]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_published_outputs_come_from_a_gpu_run(path):
    notebook = _load(path)
    cells = _code_cells(notebook)
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1)), \
        "stored after one run top to bottom (notebooks/execute.py)"
    assert cells[0]["outputs"] and cells[-1]["outputs"]
    first = _outputs_text(cells[0])
    assert first.startswith("device ") and not first.startswith("device cpu"), first
    assert notebook["metadata"].get("jaxfuse", {}).get("outputs", {}).get("backend") == "gpu"
    assert not any(c.get("metadata", {}).get("jaxfuse") == execute.CPU_BANNER for c in notebook["cells"])
    assert not any(o.get("name") == "stderr" for c in cells for o in c["outputs"]), "stored output has warnings"


# With notebooks/pending/ empty, one skipped case that says so (pytest's own reason would be "got empty parameter set").
_PENDING_CASES = PENDING or [pytest.param(None, id="none", marks=pytest.mark.skip(
    reason="notebooks/pending/ holds no notebook: every notebook is stored with the outputs of a GPU run"))]


@pytest.mark.parametrize("path", _PENDING_CASES, ids=lambda p: p.name)
def test_pending_outputs_are_labelled_cpu_outputs(path):
    """A pending notebook stores the outputs of one CPU run, labelled as such (so they cannot pass for GPU
    measurements), or none at all."""
    notebook = _load(path)
    cells = _code_cells(notebook)
    if all(not c["outputs"] and c["execution_count"] is None for c in cells):
        return
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1))
    assert notebook["cells"][0]["metadata"].get("jaxfuse") == execute.CPU_BANNER
    assert "Outputs from a CPU run" in _text(notebook["cells"][0])
    assert notebook["metadata"]["jaxfuse"]["outputs"]["backend"] == "cpu"
    assert _outputs_text(cells[0]).startswith("device cpu")


def test_execute_names_the_failing_cell_and_keeps_outputs():
    cell = lambda src: {"cell_type": "code", "source": src, "metadata": {}, "outputs": [], "execution_count": None}
    notebook = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
                "cells": [cell("a = 2\nprint(a * 21)"), {"cell_type": "markdown", "source": "x", "metadata": {}},
                          cell(["b = a + 1\n", "print(b)"])]}
    out = execute.run(notebook, echo=False)
    assert [c.get("outputs") for c in out["cells"] if c["cell_type"] == "code"] == [
        [{"output_type": "stream", "name": "stdout", "text": ["42\n"]}],
        [{"output_type": "stream", "name": "stdout", "text": ["3\n"]}]]
    assert notebook["cells"][0]["outputs"] == []  # the input is not modified
    notebook["cells"].append(cell("print('before')\nraise KeyError('boom')"))
    with pytest.raises(execute.CellError, match=r"(?s)cell 3 failed:\nbefore\n.*KeyError: 'boom'"):
        execute.run(notebook, echo=False)
    with pytest.raises(ValueError, match="nbformat 4"):
        execute.run({"nbformat": 3, "cells": []})


def test_execute_keeps_figures_and_labels_cpu_outputs():
    cell = lambda src: {"cell_type": "code", "source": src, "metadata": {}, "outputs": [], "execution_count": None}
    notebook = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
                "cells": [cell("import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 2])\n"
                               "print('drawn')"), cell("print(len(plt.get_fignums()))")]}
    out = execute.run(notebook, echo=False)
    first, second = _code_cells(out)
    assert [o["output_type"] for o in first["outputs"]] == ["stream", "display_data"]
    assert base64.b64decode(first["outputs"][1]["data"]["image/png"]).startswith(PNG)
    assert second["outputs"][0]["text"] == ["0\n"]  # figures are closed after the cell that drew them
    env = {"device": "cpu", "backend": "cpu", "jax": "0.10.2", "commit": "abc1234", "date": "2026-11-23T00:00:00Z"}
    labelled = execute.label_outputs(out, env)
    assert labelled["cells"][0]["metadata"]["jaxfuse"] == execute.CPU_BANNER
    assert "commit abc1234" in _text(labelled["cells"][0]) and labelled["metadata"]["jaxfuse"]["outputs"] == env
    assert execute.label_outputs(labelled, env)["cells"][1:] == labelled["cells"][1:]  # one banner, not two
    on_gpu = execute.label_outputs(labelled, {**env, "device": "NVIDIA H100 80GB HBM3", "backend": "gpu"})
    assert on_gpu["cells"] == out["cells"] and on_gpu["metadata"]["jaxfuse"]["outputs"]["backend"] == "gpu"


# What the notebooks rely on: jaxfuse.lesson, the two ridges of costmodel, measure.launch_cost / wall_us.
def test_lesson_sizes_and_checks(capsys, monkeypatch):
    monkeypatch.setenv("JAXFUSE_LESSON_SIZES", "full")
    run = lesson.start("05_cross_entropy_memory")
    assert run.sizes == run.full == lesson.SIZES["05_cross_entropy_memory"]["full"] and run.mode == "full"
    assert capsys.readouterr().out.startswith("device ")
    monkeypatch.setenv("JAXFUSE_LESSON_SIZES", "huge")
    with pytest.raises(ValueError, match="JAXFUSE_LESSON_SIZES"):
        lesson.start("05_cross_entropy_memory")
    with pytest.raises(ValueError, match="unknown 'nope'"):
        lesson.start("nope")
    assert lesson.check("e", None, 2.0) is None
    assert lesson.check("e", 2.1, 2.0, rtol=0.1) is True and lesson.check("e", 3.0, 2.0, rtol=0.1) is False
    lesson.box(say="a", measured="b " * 80, why="c")
    lines = capsys.readouterr().out.splitlines()
    assert any("the articles say │ a" in line for line in lines) and max(map(len, lines)) <= 112


def test_two_ridges_and_a_measured_launch():
    from jaxfuse import costmodel, measure

    h100 = costmodel.device("h100")
    assert h100.ridge() == pytest.approx(805e12 / 2.94e12) and h100.ridge("cuda") == pytest.approx(67e12 / 2.94e12)
    with pytest.raises(ValueError, match="no cuda-core peak"):
        costmodel.device("cpu").ridge("cuda")
    with pytest.raises(ValueError, match="'tensor' or 'cuda'"):
        h100.ridge("sfu")
    cost = measure.launch_cost(ops=4, iterations=3)
    if ON_GPU:
        assert cost["device_us"] > 0 and cost["eager_device_us_per_op"] > 0
    else:
        assert cost["device_us"] is None and cost["eager_device_us_per_op"] is None  # CPU: no device time
    assert 0 < cost["eager_wall_us_per_op"] < 1e5 and 0 < cost["jit_wall_us"] < 1e5
    with pytest.raises(ValueError, match="arg_sets"):
        measure.wall_us(lambda x: x, [])
