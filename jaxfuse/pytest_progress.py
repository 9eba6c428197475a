"""A pytest plugin for ``jaxfuse.gpu_run``: which tests were collected and which finished, written as they happen,
so that a run cut by its time limit still says which tests it never ran.

    pytest -p jaxfuse.pytest_progress ...   # with JAXFUSE_PYTEST_PROGRESS=PATH in the environment

Appends to PATH one line per event, tab-separated: ``collected<TAB>nodeid`` for each test collected, then
``finished<TAB>nodeid<TAB>outcome<TAB>seconds`` once its outcome is known (passed, failed, skipped, or an error in
setup or teardown; seconds: its setup and call so far, as pytest's ``--durations`` counts them).
Node ids are written absolute (pytest's are relative to its rootdir), so that they run again from any directory.
Under pytest-xdist only the controlling process writes (the workers' reports reach it), from the first worker's
collection. ``not_run(PATH)`` reads the file back: the collected node ids without an outcome, in collection
order; ``slowest(PATH, n)`` the n finished tests that took longest, even from a run that was cut. Without the
variable the plugin does nothing.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["ENV", "not_run", "slowest"]

ENV = "JAXFUSE_PYTEST_PROGRESS"
_in_worker = False  # an xdist worker (its config has workerinput): the controlling process writes instead
_rootdir = ""  # node ids are relative to it; written absolute, so that they run again from any directory
_xdist_collection_written = False
_seconds: dict[str, float] = {}  # node id -> seconds of its phases reported so far


def pytest_configure(config) -> None:
    global _in_worker, _rootdir
    _in_worker = hasattr(config, "workerinput")
    _rootdir = str(config.rootpath)


def _absolute(nodeid: str) -> str:
    path, sep, rest = nodeid.partition("::")
    return os.path.join(_rootdir, path) + sep + rest


def _write(kind: str, nodeids, *fields: str) -> None:
    path = os.environ.get(ENV)
    if not path or _in_worker:
        return
    tail = "".join(f"\t{field}" for field in fields)
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(f"{kind}\t{_absolute(nodeid)}{tail}\n" for nodeid in nodeids)


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
    seconds = _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    if report.when == "call" or report.outcome != "passed":
        outcome = report.outcome if report.when == "call" else f"{report.outcome} in {report.when}"
        _write("finished", [report.nodeid], outcome, f"{seconds:.2f}")


def not_run(path: str) -> list[str]:
    """The node ids collected in ``path`` that have no outcome there, in collection order ([] if none)."""
    collected, finished = [], set()
    for kind, nodeid, *_ in _events(path):
        if kind == "collected":
            collected.append(nodeid)
        elif kind == "finished":
            finished.add(nodeid)
    return list(dict.fromkeys(nodeid for nodeid in collected if nodeid not in finished))


def slowest(path: str, n: int = 15) -> list[tuple[float, str, str]]:
    """The ``n`` finished tests of ``path`` that took longest: (seconds, outcome, node id), slowest first ([] if
    none finished). A test reported twice (a teardown error after its call) counts once, with its last report."""
    last = {}
    for kind, nodeid, *fields in _events(path):
        if kind == "finished" and len(fields) == 2:
            last[nodeid] = (float(fields[1]), fields[0], nodeid)
    return sorted(last.values(), key=lambda row: -row[0])[:n]


def _events(path: str) -> list[list[str]]:
    """The whole lines of ``path`` split at their tabs ([] without the file). A last line without its newline (a
    run killed while writing it) is left out."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [line[:-1].split("\t") for line in f if line.endswith("\n") and "\t" in line]
