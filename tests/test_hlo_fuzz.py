"""Seeded mutations of the captured modules in tests/data, through every stage of hlo_inspect: each must end in
a report or in HloParseError, within a couple of seconds. `python -m hlo_inspect.fuzz --runs N` runs any number.

A failure names the run; reproduce it with
    python -c "import random; from hlo_inspect import fuzz; s = fuzz.load_seeds(fuzz.default_corpus());
               t, _, _ = fuzz.mutate(s, random.Random('SEED:RUN')); fuzz.run_stages(t)"
HLO_FUZZ_SEED picks another seed (CI uses 0).
"""

import os

from hlo_inspect import fuzz

RUNS = 1000
PER_RUN_LIMIT_S = 2.0


def test_mutated_modules_end_in_a_report_or_a_parse_error():
    seed = int(os.environ.get("HLO_FUZZ_SEED", "0"))
    seeds = fuzz.load_seeds(fuzz.default_corpus())
    assert len(seeds) >= 10, "the captured modules in tests/data are the fuzz corpus"
    result = fuzz.fuzz(seeds, RUNS, seed=seed, limit_s=10 * PER_RUN_LIMIT_S, slow_s=PER_RUN_LIMIT_S)
    outcomes = result["outcomes"]
    assert set(outcomes) <= {fuzz.OK, fuzz.PARSE_ERROR}, (outcomes, result["failures"])
    assert result["over_slow_s"] == 0, result["slowest"]
    # both outcomes in number: the mutations reach every stage, not only the parser
    assert outcomes.get(fuzz.OK, 0) >= RUNS // 5 and outcomes.get(fuzz.PARSE_ERROR, 0) >= RUNS // 5, outcomes
    assert set(result["by_mutation"]) == set(fuzz.MUTATIONS)


def test_a_run_counts_as_slow_only_when_its_second_timing_is_slow_too(monkeypatch):
    """A stall of the machine slows one timing of a run; a slow parse slows both. Only the latter fails the fuzz."""
    seeds = fuzz.load_seeds(fuzz.default_corpus())
    for times, slow in (([3.0, 0.1], 0), ([3.0, 3.0], 1)):
        timings = iter(times + [0.1] * 10)
        monkeypatch.setattr(fuzz, "run_one", lambda text, limit_s: fuzz.Outcome(fuzz.OK, next(timings), ""))
        result = fuzz.fuzz(seeds, 3, slow_s=PER_RUN_LIMIT_S)
        assert result["over_slow_s"] == slow, result
        assert [r["seconds_again"] for r in result["slowest"]] == [3.0] * slow
