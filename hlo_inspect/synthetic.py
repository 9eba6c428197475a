"""Larger HLO modules made from real ones, to measure how hlo_inspect's time grows with the size of its input.

    text = replicate(open("tests/data/h100_block_grad.hlo.txt").read(), copies=23)   # about 4 MB

`replicate` keeps the module header and source tables once and repeats everything else `copies` times, the
instruction and computation names of copy k suffixed `.rk`: every non-entry computation is repeated, and the
entry computation holds each copy's instructions one after the other (the entry parameters are shared, the first
copy's ROOT stays the root, the other copies' results are dead values that still launch their kernels). The result
reads as one program `copies` times as long, with the same mix of kernels, fusions, metadata and backend_config as
the original: what a larger model's dump looks like to a parser.
"""

from __future__ import annotations

import re

__all__ = ["replicate"]

_NAME_RE = re.compile(r"%([\w.\-]+)")
_PARAMETER_RE = re.compile(r"^\s*%([\w.\-]+)\s*=.*\sparameter\(")


def replicate(text: str, copies: int) -> str:
    """`text` (one HLO module, `%`-prefixed names, an ENTRY computation last) with its program `copies` times."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    lines = text.rstrip("\n").split("\n")
    first = next((i for i, line in enumerate(lines) if line.startswith("%") and line.rstrip().endswith("{")), None)
    entry = next((i for i, line in enumerate(lines) if line.startswith("ENTRY ")), None)
    if first is None or entry is None or first > entry or lines[-1].strip() != "}":
        raise ValueError("replicate() needs one module whose computations come before its ENTRY computation, "
                         "names prefixed with '%'")
    head, callees, entry_head, entry_body = lines[:first], lines[first:entry], lines[entry], lines[entry + 1:-1]
    shared = {m.group(1) for m in map(_PARAMETER_RE.match, entry_body) if m}

    def renamed(block: list[str], k: int) -> list[str]:
        if k == 0:
            return block
        sub = lambda m: m.group(0) if m.group(1) in shared else f"%{m.group(1)}.r{k}"  # noqa: E731
        return [_NAME_RE.sub(sub, line) for line in block]

    out = list(head)
    for k in range(copies):
        out += renamed(callees, k)
    out.append(entry_head)
    for k in range(copies):
        body = renamed(entry_body, k)
        if k:
            body = [line.replace("ROOT ", "", 1) for line in body if not _PARAMETER_RE.match(line)]
        out += body
    out.append("}")
    return "\n".join(out) + "\n"
