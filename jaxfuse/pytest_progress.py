"""A pytest plugin for ``jaxfuse.gpu_run``: which tests were collected and which finished, written as they happen,
so that a run cut by its time limit still says which tests it never ran.

    pytest -p jaxfuse.pytest_progress ...   # with JAXFUSE_PYTEST_PROGRESS=PATH in the environment

Appends to PATH one line per event, tab-separated: ``collected<TAB>nodeid`` for each test collected, then
``finished<TAB>nodeid`` once its outcome is known (passed, failed, skipped or an error in setup or teardown).
Node ids are written absolute (pytest's are relative to its rootdir), so that they run again from any directory.
Under pytest-xdist only the controlling process writes (the workers' reports reach it), from the first worker's
collection. ``not_run(PATH)`` reads the file back: the collected node ids without an outcome, in collection
order. Without the variable the plugin does nothing.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["ENV", "not_run"]

ENV = "JAXFUSE_PYTEST_PROGRESS"
_in_worker = False  # an xdist worker (its config has workerinput): the controlling process writes instead
_rootdir = ""  # node ids are relative to it; written absolute, so that they run again from any directory
_xdist_collection_written = False


def pytest_configure(config) -> None:
    global _in_worker, _rootdir
    _in_worker = hasattr(config, "workerinput")
    _rootdir = str(config.rootpath)


def _absolute(nodeid: str) -> str:
    path, sep, rest = nodeid.partition("::")
    return os.path.join(_rootdir, path) + sep + rest


def _write(kind: str, nodeids) -> None:
    path = os.environ.get(ENV)
    if not path or _in_worker:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(f"{kind}\t{_absolute(nodeid)}\n" for nodeid in nodeids)


def pytest_collection_finish(session) -> None:
    """Without xdist: the session's own collection."""
    _write("collected", (item.nodeid for item in session.items))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    """With xdist: the first worker's collection (every worker collects the same tests)."""
    global _xdist_collection_written
    if not _xdist_collection_written:
        _write("collected", ids)
        _xdist_collection_written = True


def pytest_runtest_logreport(report) -> None:
    """A test has an outcome once its call ran, or once a setup or teardown failed or skipped it."""
    if report.when == "call" or report.outcome != "passed":
        _write("finished", [report.nodeid])


def not_run(path: str) -> list[str]:
    """The node ids collected in ``path`` that have no outcome there, in collection order ([] if none)."""
    if not os.path.exists(path):
        return []
    collected, finished = [], set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            kind, _, nodeid = line.rstrip("\n").partition("\t")
            if kind == "collected":
                collected.append(nodeid)
            elif kind == "finished":
                finished.add(nodeid)
    return list(dict.fromkeys(nodeid for nodeid in collected if nodeid not in finished))
