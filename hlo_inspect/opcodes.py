"""HLO opcodes as XLA prints them, with their operand counts, and the printer's async syntax sugar.

`ARITY` is XLA's `HLO_OPCODE_LIST` (xla/hlo/ir/hlo_opcode.h, openxla/xla at 0725a3a9, 2026): every opcode name
with its fixed number of operands, or None where the opcode is variadic. An opcode outside it is a parse error.

Async syntax sugar: an `async-start` / `async-update` / `async-done` whose computation wraps a single instruction
is printed with the wrapped opcode's name and the suffix instead (`reduce-scatter-start`, `all-to-all-done`,
`custom-call-start`), the wrapped op's attributes inline and no `calls=` (what `HloModule::ToString()` prints by
default for a multi-GPU program). `all-reduce-start`, `all-gather-start`, `collective-permute-start`,
`copy-start` and their `-done` are opcodes of their own, not sugar.
"""

from __future__ import annotations

import functools

__all__ = ["ARITY", "OPCODES", "ASYNC_PHASES", "async_parts", "is_known_opcode", "arity"]

_V = None  # variadic

ARITY: dict[str, int | None] = {
    "abs": 1, "acos": 1, "acosh": 1, "add": 2, "add-dependency": 2, "after-all": _V, "all-gather": _V,
    "all-gather-done": 1, "all-gather-start": _V, "all-reduce": _V, "all-reduce-done": 1, "all-reduce-start": _V,
    "all-to-all": _V, "and": 2, "asin": 1, "asinh": 1, "async-done": 1, "async-start": _V, "async-update": _V,
    "atan": 1, "atan2": 2, "atanh": 1, "batch-norm-grad": 5, "batch-norm-inference": 5, "batch-norm-training": 3,
    "bitcast": 1, "bitcast-convert": 1, "broadcast": 1, "call": _V, "cbrt": 1, "ceil": 1, "cholesky": 1,
    "clamp": 3, "count-leading-zeros": 1, "collective-broadcast": _V, "collective-permute": _V,
    "collective-permute-done": 1, "collective-permute-start": _V, "collective-reduce": _V, "compare": 2,
    "complex": 2, "concatenate": _V, "conditional": _V, "constant": 0, "convert": 1, "convolution": _V, "copy": 1,
    "copy-done": 1, "copy-start": 1, "cosine": 1, "cosh": 1, "custom-call": _V, "divide": 2, "domain": 1, "dot": 2,
    "dynamic-reshape": _V, "dynamic-slice": _V, "dynamic-update-slice": _V, "erf": 1, "exponential": 1,
    "exponential-minus-one": 1, "fft": 1, "floor": 1, "fusion": _V, "gather": 2, "get-dimension-size": 1,
    "get-tuple-element": 1, "imag": 1, "infeed": 1, "iota": 0, "is-finite": 1, "log": 1, "log-plus-one": 1,
    "logistic": 1, "map": _V, "maximum": 2, "minimum": 2, "mulhi": 2, "multiply": 2, "negate": 1, "not": 1,
    "opt-barrier": 1, "or": 2, "outfeed": 2, "pad": 2, "parameter": 0, "partition-id": 0, "popcnt": 1, "power": 2,
    "ragged-all-to-all": 6, "ragged-dot": 3, "real": 1, "recv": 1, "recv-done": 1, "reduce": _V,
    "reduce-precision": 1, "reduce-scatter": _V, "reduce-window": _V, "remainder": 2, "replica-id": 0,
    "reshape": 1, "reverse": 1, "rng": _V, "rng-bit-generator": 1, "rng-get-and-update-state": 0,
    "round-nearest-afz": 1, "round-nearest-even": 1, "rsqrt": 1, "scaled-dot": 4, "scan": _V, "scatter": _V,
    "select": 3, "select-and-scatter": 3, "send": 2, "send-done": 1, "set-dimension-size": 2, "shift-left": 2,
    "shift-right-arithmetic": 2, "shift-right-logical": 2, "shuffle": 1, "sign": 1, "sine": 1, "sinh": 1,
    "slice": 1, "sort": _V, "sqrt": 1, "stochastic-convert": 2, "subtract": 2, "tan": 1, "tanh": 1, "topk": 1,
    "transpose": 1, "triangular-solve": 2, "tuple": _V, "while": 1, "xor": 2,
}
OPCODES = frozenset(ARITY)

ASYNC_PHASES = ("start", "update", "done")
_ASYNC_OPCODES = {"async-start": "start", "async-update": "update", "async-done": "done",
                  "all-reduce-start": "start", "all-reduce-done": "done", "all-gather-start": "start",
                  "all-gather-done": "done", "collective-permute-start": "start", "collective-permute-done": "done",
                  "copy-start": "start", "copy-done": "done"}


@functools.lru_cache(maxsize=1024)
def async_parts(opcode: str) -> tuple[str, str]:
    """(wrapped opcode, phase) of an asynchronous opcode, ('', '') for a synchronous one.

    `reduce-scatter-start` -> ('reduce-scatter', 'start') (sugar), `all-reduce-done` -> ('all-reduce', 'done'),
    `async-start` -> ('', 'start') (the wrapped op is in its `calls=` computation), `add` -> ('', '').
    """
    phase = _ASYNC_OPCODES.get(opcode)
    if phase is not None:
        return ("" if opcode.startswith("async-") else opcode.rsplit("-", 1)[0]), phase
    base, _, suffix = opcode.rpartition("-")
    if suffix in ASYNC_PHASES and base in OPCODES and base not in _ASYNC_OPCODES:
        return base, suffix
    return "", ""


def is_known_opcode(opcode: str) -> bool:
    """An opcode of hlo_opcode.h or the async sugar of one."""
    return opcode in OPCODES or bool(async_parts(opcode)[1])


def arity(opcode: str) -> int | None:
    """The fixed operand count of an opcode (sugar included: `-done` and `-update` take 1), None if variadic."""
    if opcode in ARITY:
        return ARITY[opcode]
    phase = async_parts(opcode)[1]
    return None if phase == "start" else 1
