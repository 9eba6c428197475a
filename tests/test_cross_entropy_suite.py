"""jaxfuse.suites.cross_entropy on CPU at the "cpu" smoke shape (interpret mode): every implementation and mode is
recorded with its temporary memory and its error against the float32 reference; a failure is recorded, not
raised."""

import math

import pytest

from jaxfuse import suites
from jaxfuse.suites import cross_entropy as suite


@pytest.fixture(scope="module")
def records():
    return suite.run(["cpu"], iterations=1, progress=lambda msg: None)


def test_registered():
    assert suites.get("cross_entropy") is suite
    assert set(suite.DEFAULT_SHAPES) <= set(suite.SHAPES)


def test_records_carry_time_memory_and_error(records):
    assert {(r.implementation, r.mode) for r in records} == {(i, m) for i in ("xla", "pallas")
                                                             for m in ("fwd", "fwd+bwd")}
    for r in records:
        assert r.method != "failed", r.extra.get("error")
        assert math.isfinite(r.time_us) and r.time_us > 0
        assert r.extra["temp_bytes"] >= 0
        assert 0 <= r.extra["rel_error"] < 1e-2, (r.implementation, r.mode, r.extra["rel_errors"])
        assert set(r.extra["rel_errors"]) == ({"loss"} if r.mode == "fwd" else {"loss", "dh", "dw"})
        assert r.speedup_vs["xla"] > 0


def test_a_failing_implementation_is_recorded_not_raised():
    def broken(h, w, labels):
        raise RuntimeError("boom")

    recs = suite.run(["cpu"], iterations=1, impls={"broken": broken}, progress=lambda msg: None)
    assert [(r.implementation, r.method) for r in recs] == [("broken", "failed")] * 2
    assert all("boom" in r.extra["error"] for r in recs)
