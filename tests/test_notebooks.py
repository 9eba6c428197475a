"""The teaching notebooks run top to bottom (on CPU at their tiny shapes), and are committed with GPU outputs."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PENDING = sorted((ROOT / "notebooks" / "pending").glob("*.ipynb"))  # written, awaiting their GPU run
_spec = importlib.util.spec_from_file_location("notebook_execute", ROOT / "notebooks" / "execute.py")
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)


def _load(path):
    with open(path) as f:
        return json.load(f)


def _code_cells(notebook):
    return [c for c in notebook["cells"] if c["cell_type"] == "code"]


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/*.ipynb: none found"


@pytest.mark.parametrize("path", [p if i == 0 else pytest.param(p, marks=pytest.mark.slow)  # the first in the fast set
                                  for i, p in enumerate(NOTEBOOKS + PENDING)], ids=lambda p: p.name)
def test_notebook_runs(path):
    executed = execute.run(_load(path), echo=False)
    assert all(c["execution_count"] for c in _code_cells(executed))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_outputs_come_from_a_gpu_run(path):
    cells = _code_cells(_load(path))
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1)), \
        "stored after one run top to bottom (notebooks/execute.py --write)"
    assert cells[0]["outputs"] and cells[-1]["outputs"]
    first = "".join(cells[0]["outputs"][0]["text"])
    assert first.startswith("device ") and not first.startswith("device cpu"), first
    assert not any(o["name"] == "stderr" for c in cells for o in c["outputs"]), "stored output has warnings"


# With notebooks/pending/ empty, one skipped case that says so (pytest's own reason would be "got empty parameter set").
_PENDING_CASES = PENDING or [pytest.param(None, id="none", marks=pytest.mark.skip(
    reason="notebooks/pending/ holds no notebook: every notebook is stored with the outputs of a GPU run"))]


@pytest.mark.parametrize("path", _PENDING_CASES, ids=lambda p: p.name)
def test_pending_notebooks_store_no_outputs(path):
    """A notebook moves to notebooks/ with the outputs of its GPU run; until then it stores none (no CPU outputs
    that could pass for measurements)."""
    assert all(not c["outputs"] and c["execution_count"] is None for c in _code_cells(_load(path)))


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
