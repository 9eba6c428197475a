"""Seeded mutations of real HLO text, run through every stage of hlo_inspect: it must end in a report or in
`HloParseError`, quickly, whatever the text.

    python -m hlo_inspect.fuzz --runs 20000 --seed 0                 # the captured modules in tests/data
    python -m hlo_inspect.fuzz --runs 500 dump1.txt dump2.txt --json fuzz.json

Each run takes one seed module, applies one to three mutations (`MUTATIONS`: lines deleted or duplicated, the text
cut short, characters swapped, bytes inserted, numbers and shapes replaced, opcodes renamed, called computations
and operands re-pointed, cycles included) and runs `run_stages` on the result: parse, kernels, the report's table,
JSON, ledger and HTML (rendered to a string), the diff of the report with itself and the unfused counterfactual.
The outcome is "ok", "HloParseError", the name of any other exception, or "over time limit". A run that does not
end within the limit is interrupted (SIGALRM), so a hang is counted, not waited for.

Run `i` of seed `s` is reproducible on its own: `mutate(texts, random.Random(f"{s}:{i}"))`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import glob
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from typing import Callable, Iterable

from hlo_inspect.parser import DTYPE_BITS, OPCODES, HloParseError

__all__ = ["MUTATIONS", "Seed", "mutate", "run_stages", "run_one", "fuzz", "default_corpus", "load_seeds",
           "Outcome", "environment"]

OK = "ok"
OVER_TIME = "over time limit"
PARSE_ERROR = "HloParseError"


@dataclasses.dataclass(frozen=True)
class Seed:
    """One module's text and where its parts are, so that mutations can aim at them."""

    name: str
    text: str
    lines: tuple[str, ...]
    instruction_lines: tuple[int, ...]  # indices into lines
    computations: tuple[str, ...]
    names_by_computation: dict[str, tuple[str, ...]]
    computation_of_line: dict[int, str]

    @classmethod
    def of(cls, name: str, text: str) -> "Seed":
        lines = tuple(text.split("\n"))
        inst_lines, comps, names, comp_of = [], [], collections.defaultdict(list), {}
        current = None
        for i, line in enumerate(lines):
            head = _COMPUTATION_RE.match(line)
            if head:
                current = head.group(1)
                comps.append(current)
                continue
            if line.strip() == "}":
                current = None
                continue
            inst = _DEFINITION_RE.match(line)
            if current is not None and inst:
                inst_lines.append(i)
                names[current].append(inst.group(1))
                comp_of[i] = current
        return cls(name=name, text=text, lines=lines, instruction_lines=tuple(inst_lines),
                   computations=tuple(comps), names_by_computation={k: tuple(v) for k, v in names.items()},
                   computation_of_line=comp_of)


_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")
_DEFINITION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=")
_OPERAND_RE = re.compile(r"%([\w.\-]+)")
_CALL_RE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_OPCODE_RE = re.compile(r"(\]|\}|\))\s+([a-z][a-z0-9\-]*)\(")
_NUMBER_RE = re.compile(r"-?\d+")
_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")

# Replacements that a hostile or careless edit produces.
_NUMBERS = ("0", "-1", "1", "2", "7", "65536", "2147483648", "9223372036854775808", "99999999999999999999999",
            "1e3", "2.5", "?", "", "0x10", "-0")
_DIMS = ("?", "", "2,,3", "1e3", "<=8", "-1", "0", "1", "99999999999999999999", "4611686018427387904",
         "3037000500,3037000500", "2,", ",", "1,1,1,1,1,1,1,1", "<=?", "?,?")
_INSERTS = ("{", "}", "(", ")", "[", "]", '"', "\\", "%", ",", "=", "\n", "\x00", "\xff", "é", "/*", "*/", "//",
            " ", "ROOT ", "#1", "\\303\\251", "}\n", "\nHloModule m2\n", "-start", "\t", "\r")
_OPCODE_NAMES = tuple(sorted(OPCODES)) + ("clz", "frobnicate", "all-reduce-start", "reduce-scatter-start",
                                          "all-to-all-done", "fusion-start", "async-start")


def _pick_line(seed: Seed, rng: random.Random, instruction: bool = True) -> int:
    if instruction and seed.instruction_lines:
        return rng.choice(seed.instruction_lines)
    return rng.randrange(len(seed.lines))


def _replace_match(text: str, pattern: re.Pattern, rng: random.Random, make: Callable[[re.Match], str],
                   group: int = 0) -> str:
    """Replace one random match of `pattern` (its `group`) in `text` by `make(match)`."""
    matches = list(pattern.finditer(text))
    if not matches:
        return text
    m = rng.choice(matches)
    return text[:m.start(group)] + make(m) + text[m.end(group):]


# Each mutation takes (seed, lines as a list, rng) and edits the lines in place.

def _delete_lines(seed, lines, rng):
    i = rng.randrange(len(lines))
    del lines[i:i + rng.choice((1, 1, 1, 2, 5))]


def _duplicate_lines(seed, lines, rng):
    i = rng.randrange(len(lines))
    n = rng.choice((1, 1, 3))
    lines[i:i] = lines[i:i + n]


def _truncate(seed, lines, rng):
    text = "\n".join(lines)
    cut = rng.randrange(len(text) + 1)
    lines[:] = text[:cut].split("\n")


def _swap_characters(seed, lines, rng):
    i = _pick_line(seed, rng, instruction=rng.random() < 0.7) if len(seed.lines) == len(lines) else \
        rng.randrange(len(lines))
    line = lines[i]
    if len(line) < 2:
        return
    j = rng.randrange(len(line) - 1)
    lines[i] = line[:j] + line[j + 1] + line[j] + line[j + 2:]


def _insert_bytes(seed, lines, rng):
    i = rng.randrange(len(lines))
    line = lines[i]
    j = rng.randrange(len(line) + 1)
    lines[i] = line[:j] + rng.choice(_INSERTS) + line[j:]


def _replace_number(seed, lines, rng):
    i = rng.randrange(len(lines))
    lines[i] = _replace_match(lines[i], _NUMBER_RE, rng, lambda m: rng.choice(_NUMBERS))


def _replace_shape(seed, lines, rng):
    i = _pick_line(seed, rng) if len(seed.lines) == len(lines) else rng.randrange(len(lines))

    def make(m):
        if rng.random() < 0.25:
            return rng.choice(tuple(DTYPE_BITS) + ("q99", "f32x")) + "[" + m.group(2) + "]"
        return m.group(1) + "[" + rng.choice(_DIMS) + "]"
    lines[i] = _replace_match(lines[i], _SHAPE_RE, rng, make)


def _rename_opcode(seed, lines, rng):
    i = _pick_line(seed, rng) if len(seed.lines) == len(lines) else rng.randrange(len(lines))
    lines[i] = _replace_match(lines[i], _OPCODE_RE, rng, lambda m: rng.choice(_OPCODE_NAMES), group=2)


def _repoint_call(seed, lines, rng):
    if not seed.computations:
        return
    i = _pick_line(seed, rng) if len(seed.lines) == len(lines) else rng.randrange(len(lines))
    own = seed.computation_of_line.get(i) if len(seed.lines) == len(lines) else None
    targets = list(seed.computations) + [own] * 3 if own else list(seed.computations)
    lines[i] = _replace_match(lines[i], _CALL_RE, rng, lambda m: "%" + rng.choice(targets), group=2)


def _repoint_operand(seed, lines, rng):
    if len(seed.lines) != len(lines) or not seed.instruction_lines:
        return
    i = rng.choice(seed.instruction_lines)
    head = _DEFINITION_RE.match(lines[i])
    own = head.group(1) if head else ""
    names = list(seed.names_by_computation.get(seed.computation_of_line[i], ())) + [own] * 3
    line = lines[i]
    eq = line.find("=")
    rest = line[eq + 1:]
    lines[i] = line[:eq + 1] + _replace_match(rest, _OPERAND_RE, rng, lambda m: rng.choice(names), group=1)


MUTATIONS: dict[str, Callable] = {
    "delete_lines": _delete_lines,
    "duplicate_lines": _duplicate_lines,
    "truncate": _truncate,
    "swap_characters": _swap_characters,
    "insert_bytes": _insert_bytes,
    "replace_number": _replace_number,
    "replace_shape": _replace_shape,
    "rename_opcode": _rename_opcode,
    "repoint_call": _repoint_call,
    "repoint_operand": _repoint_operand,
}


def mutate(seeds: list[Seed], rng: random.Random) -> tuple[str, str, list[str]]:
    """(mutated text, seed name, mutation names): one to three mutations of one seed, chosen by `rng`."""
    seed = rng.choice(seeds)
    lines = list(seed.lines)
    names = [rng.choice(tuple(MUTATIONS)) for _ in range(rng.choice((1, 1, 1, 2, 3)))]
    for name in names:
        if not lines:
            break
        MUTATIONS[name](seed, lines, rng)
    return "\n".join(lines), seed.name, names


def run_stages(text: str) -> None:
    """Everything a user can do with a text: parse, kernels, table, JSON, ledger, HTML, diff, counterfactual."""
    from hlo_inspect.diff import diff
    from hlo_inspect.report import from_text
    from hlo_inspect.unfused import counterfactual

    report = from_text(text, title="fuzz")
    report.table()
    report.to_json()
    report.ledger_table(hbm_bytes_per_s=3.35e12)
    report.to_html()
    d = diff(report, report)
    d.table()
    json.dumps(d.to_dict())
    counterfactual(report.module)


class _OverTime(BaseException):
    """Raised by the alarm inside a run that went past its limit (a BaseException: no `except Exception` eats it)."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    kind: str  # OK, PARSE_ERROR, OVER_TIME or another exception's type name
    seconds: float
    detail: str = ""


def run_one(text: str, limit_s: float) -> Outcome:
    """Run every stage on `text`; interrupt it after `limit_s` seconds (SIGALRM: main thread, Unix only)."""
    def on_alarm(signum, frame):
        raise _OverTime()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    start = time.perf_counter()
    try:
        try:
            run_stages(text)
            kind, detail = OK, ""
        except HloParseError as e:
            kind, detail = PARSE_ERROR, str(e).split("\n")[0][:200]
        except _OverTime:
            kind, detail = OVER_TIME, ""
        except Exception as e:  # noqa: BLE001 - every other exception is a finding, counted by type
            kind, detail = type(e).__name__, f"{type(e).__name__}: {e}"[:300]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _OverTime:  # the alarm fired between the stages' end and the timer being cleared
        kind, detail = OVER_TIME, ""
    finally:
        signal.signal(signal.SIGALRM, previous)
    return Outcome(kind, time.perf_counter() - start, detail)


def default_corpus() -> list[str]:
    """The captured modules in tests/data (next to this package in a checkout)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return sorted(glob.glob(os.path.join(here, "tests", "data", "*.hlo.txt")))


def load_seeds(paths: Iterable[str]) -> list[Seed]:
    seeds = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            seeds.append(Seed.of(os.path.basename(path), f.read()))
    return seeds


def fuzz(seeds: list[Seed], runs: int, seed: int = 0, limit_s: float = 10.0, slow_s: float = 2.0,
         progress: Callable[[int, collections.Counter], None] | None = None) -> dict:
    """Run `runs` mutations; returns counts by outcome, the slowest runs and one example of each failure. A run
    over ``slow_s`` is timed again, and counts as slow ("over_slow_s", "slowest") only when both times are."""
    counts: collections.Counter = collections.Counter()
    by_mutation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    examples: dict[str, dict] = {}
    slow: list[dict] = []
    max_s, total_s = 0.0, 0.0
    for i in range(runs):
        rng = random.Random(f"{seed}:{i}")
        text, seed_name, names = mutate(seeds, rng)
        outcome = run_one(text, limit_s)
        counts[outcome.kind] += 1
        for name in set(names):
            by_mutation[name][outcome.kind] += 1
        max_s = max(max_s, outcome.seconds)
        total_s += outcome.seconds
        record = {"run": i, "seed_module": seed_name, "mutations": names, "outcome": outcome.kind,
                  "seconds": round(outcome.seconds, 4), "detail": outcome.detail}
        if outcome.kind not in (OK, PARSE_ERROR) and outcome.kind not in examples:
            examples[outcome.kind] = record
        if outcome.seconds > slow_s:  # once more: a stall of the machine (other processes, a swap) passes the
            record["seconds_again"] = round(run_one(text, limit_s).seconds, 4)  # second run; a slow parse does not
            if record["seconds_again"] > slow_s:
                slow.append(record)
        if progress is not None and (i + 1) % 1000 == 0:
            progress(i + 1, counts)
    return {"runs": runs, "seed": seed, "limit_s": limit_s, "slow_s": slow_s, "outcomes": dict(counts.most_common()),
            "over_slow_s": len(slow), "max_seconds": round(max_s, 4), "mean_seconds": round(total_s / max(runs, 1), 5),
            "by_mutation": {k: dict(v.most_common()) for k, v in sorted(by_mutation.items())},
            "failures": examples, "slowest": sorted(slow, key=lambda r: -r["seconds"])[:20]}


def environment() -> dict[str, str]:
    """Where a run happened: machine, CPU, Python, git commit (+dirty) and UTC date, without importing JAX."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = os.environ.get("JAXFUSE_COMMIT") or git("rev-parse", "--short", "HEAD") or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "cpu_count": str(os.cpu_count()),
            "cpu": _cpu_model(), "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "python": platform.python_version(), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlo_inspect.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="HLO text files to mutate (default: tests/data/*.hlo.txt)")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-s", type=float, default=10.0, help="interrupt a run after this long")
    parser.add_argument("--slow-s", type=float, default=2.0, help="count runs slower than this")
    parser.add_argument("--json", help="write the counts, failures and environment to this file")
    parser.add_argument("--before", help="the --json of a run on an older checkout, kept beside this run's")
    args = parser.parse_args(argv)
    paths = args.files or default_corpus()
    if not paths:
        print("no HLO text files given and none found in tests/data", file=sys.stderr)
        return 2
    seeds = load_seeds(paths)
    env, start = environment(), time.perf_counter()
    result = fuzz(seeds, args.runs, args.seed, args.limit_s, args.slow_s,
                  progress=lambda n, c: print(f"{n} runs: {dict(c.most_common())}", file=sys.stderr, flush=True))
    result = {"environment": env, "corpus": [s.name for s in seeds],
              "wall_seconds": round(time.perf_counter() - start, 1)} | result
    if args.before:
        with open(args.before, encoding="utf-8") as f:
            result["before"] = json.load(f)
    print(f"{result['runs']} runs in {result['wall_seconds']} s (seed {args.seed}); outcomes:")
    for kind, n in result["outcomes"].items():
        print(f"  {kind:24s} {n:7d}")
    print(f"max {result['max_seconds']} s per run, {result['over_slow_s']} over {args.slow_s} s")
    for kind, record in result["failures"].items():
        print(f"  first {kind}: run {record['run']} ({record['seed_module']}, {'+'.join(record['mutations'])}): "
              f"{record['detail']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    bad = sum(n for kind, n in result["outcomes"].items() if kind not in (OK, PARSE_ERROR))
    return 1 if bad or result["over_slow_s"] else 0


if __name__ == "__main__":
    sys.exit(main())
