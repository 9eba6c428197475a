"""How two programs' fusion decisions differ: kernels matched by the source ops they contain, not by name.

    d = hlo_inspect.diff(report_a, report_b)
    print(d.table())                      # kernels only in A / only in B, merged, split, changed category
    d.to_dict()                           # {"a": ..., "b": ..., "matches": [...], "summary": {...}}

Each kernel is reduced to the set of source ops it contains: (op_name without the outer `jit(...)`, opcode) of
every instruction fused in it. Two kernels of A and B are linked when they share a source op; the connected
groups of the A–B graph are the matches: one A kernel and one B kernel is the same kernel (or one whose category
changed); several A kernels and one B kernel were merged; one A kernel and several B kernels were split; a kernel
sharing nothing is only in its program. Source ops present in more than `max_share` kernels of one program
(a `convert` every GEMM carries, say) say nothing about identity and are ignored.

Round trips of the two ledgers are matched by (producer scope, dtype, dims): the ones only in A vanished, the ones
only in B appeared.

Collectives are kernels like the others (matched by their source ops); when either program has any, the summary
adds their count and the interconnect bytes one device sends and receives, and the table lists every match with
a collective whose bytes or existence changed (`Match.sent_a` / `sent_b`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from hlo_inspect.kernels import Kernel, fused_instructions
from hlo_inspect.formatting import format_bytes
from hlo_inspect.ledger import NO_SCOPE, RoundTrip
from hlo_inspect.report import Report
from hlo_inspect.source import split_op_name

__all__ = ["Match", "Diff", "diff", "KINDS"]

KINDS = ("same", "changed_category", "merged", "split", "regrouped", "only_a", "only_b")
_IGNORED_OPCODES = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})


@dataclasses.dataclass(eq=False)
class Match:
    kind: str
    a: list[Kernel]
    b: list[Kernel]

    @property
    def bytes_a(self) -> int:
        return sum(k.bytes_total * k.launches for k in self.a)

    @property
    def bytes_b(self) -> int:
        return sum(k.bytes_total * k.launches for k in self.b)

    @property
    def sent_a(self) -> int:
        """Interconnect bytes one device sends per run in A's kernels of this match (collectives)."""
        return sum(k.bytes_sent * k.launches for k in self.a)

    @property
    def sent_b(self) -> int:
        return sum(k.bytes_sent * k.launches for k in self.b)

    @property
    def has_collective(self) -> bool:
        return any(k.collective for k in self.a + self.b)

    @property
    def scopes(self) -> list[str]:
        seen: dict[str, None] = {}
        for k in self.a + self.b:
            for s in k.scopes[:2]:
                seen.setdefault(s, None)
        return list(seen)


def _source_ops(kernel: Kernel) -> set[tuple[str, str]]:
    ops = set()
    for inst in fused_instructions(kernel.instruction):
        if inst.opcode in _IGNORED_OPCODES or not inst.metadata.op_name:
            continue
        for name in inst.metadata.op_name.split(";"):
            parts = split_op_name(name.strip())
            if parts and parts[0].startswith(("jit(", "pjit(")):
                parts = parts[1:]
            ops.add(("/".join(parts), inst.opcode))
    return ops


def _one_to_one(ia: list[int], ib: list[int], ops_a: list[set], ops_b: list[set]) -> list[tuple[int, int]] | None:
    """Pair kernels of a group by most shared source ops (Jaccard, greedy); None unless every kernel of A
    pairs with a distinct kernel of B whose source ops are exactly its own."""
    scored = []
    for i in ia:
        for j in ib:
            union = ops_a[i] | ops_b[j]
            scored.append((len(ops_a[i] & ops_b[j]) / len(union) if union else 0.0, i, j))
    scored.sort(reverse=True)
    used_a, used_b, pairs = set(), set(), []
    for score, i, j in scored:
        if i in used_a or j in used_b:
            continue
        if score < 1.0:
            return None
        used_a.add(i)
        used_b.add(j)
        pairs.append((i, j))
    return pairs if len(pairs) == len(ia) else None


def _exact_signature(k: Kernel) -> tuple:
    return k.category, str(k.instruction.shape), tuple(sorted(k.ops.items()))


def _dtype_blind_signature(k: Kernel) -> tuple:
    """Category, result dims and fused opcodes other than convert: the same kernel computed in another dtype
    (e.g. a transpose that also fuses the casts XLA inserted, which carry no op_name)."""
    dims = tuple(leaf.dims for leaf in k.instruction.shape.leaves())
    return k.category, dims, tuple(sorted((op, n) for op, n in k.ops.items() if op != "convert"))


def _pair_leftovers(matches: list[Match]) -> list[Match]:
    """Kernels with no distinctive source op (only constants, ops every kernel has, or casts XLA inserted) pair
    up in program order when their category, result shape and fused opcodes are identical; then, among those
    left, when they are identical but for dtypes and converts."""
    for signature in (_exact_signature, _dtype_blind_signature):
        only_b: dict[tuple, list[Match]] = collections.defaultdict(list)
        for m in matches:
            if m.kind == "only_b":
                only_b[signature(m.b[0])].append(m)
        paired: set[int] = set()
        out = []
        for m in matches:
            if m.kind == "only_a" and only_b.get(signature(m.a[0])):
                partner = only_b[signature(m.a[0])].pop(0)
                paired.add(id(partner))
                out.append(Match(kind="same", a=m.a, b=partner.b))
            elif id(m) not in paired:
                out.append(m)
        matches = [m for m in out if id(m) not in paired]
    return matches


def _trip_key(t: RoundTrip) -> tuple:
    return (t.producer_scopes[0] if t.producer_scopes else "", t.shape.dtype, t.shape.dims)


@dataclasses.dataclass(eq=False)
class Diff:
    a: Report
    b: Report
    matches: list[Match]
    vanished: list[RoundTrip]  # round trips of A with no counterpart in B
    appeared: list[RoundTrip]  # round trips of B with no counterpart in A
    label_a: str = "A"
    label_b: str = "B"

    def count(self, kind: str) -> int:
        return sum(1 for m in self.matches if m.kind == kind)

    def summary(self) -> dict[str, Any]:
        ta, tb = self.a.totals, self.b.totals
        network = {"collectives": [ta.collectives, tb.collectives], "bytes_sent": [ta.bytes_sent, tb.bytes_sent],
                   "bytes_received": [ta.bytes_received, tb.bytes_received]} if ta.collectives or tb.collectives else {}
        return network | {
            "kernels": [ta.kernels, tb.kernels],
            "launches": [ta.launches, tb.launches],
            "bytes_total": [ta.bytes_total, tb.bytes_total],
            "flops": [ta.flops, tb.flops],
            "ledger_traffic_bytes": [self.a.ledger.traffic_bytes, self.b.ledger.traffic_bytes],
            "round_trips": [len(self.a.ledger.round_trips), len(self.b.ledger.round_trips)],
            "matches": {kind: self.count(kind) for kind in KINDS},
            "vanished_round_trips": len(self.vanished),
            "appeared_round_trips": len(self.appeared),
        }

    def table(self, limit: int = 40) -> str:
        s = self.summary()
        la, lb = self.label_a, self.label_b
        lines = [f"A = {la}", f"B = {lb}"]
        lines += [f"warning (A): {w}" for w in self.a.warnings] + [f"warning (B): {w}" for w in self.b.warnings]
        lines.append("")
        count = "{:,}".format
        for key, fmt in (("kernels", count), ("launches", count), ("bytes_total", format_bytes), ("flops", count),
                         ("ledger_traffic_bytes", format_bytes), ("round_trips", count), ("collectives", count),
                         ("bytes_sent", format_bytes), ("bytes_received", format_bytes)):
            if key not in s:
                continue
            va, vb = s[key]
            change = f"{(vb - va) / va:+.1%}" if va else ""
            lines.append(f"  {key:22s} {fmt(va):>14s} -> {fmt(vb):<14s} {change}")
        lines.append("  matches: " + ", ".join(f"{n} {k}" for k, n in s["matches"].items() if n))
        lines.append("")
        interesting = [m for m in self.matches if m.kind != "same"]
        if interesting:
            lines.append("what changed (kind: A kernels -> B kernels  [bytes A -> B]  scopes):")
            for m in interesting[:limit]:
                a = ", ".join(f"{k.name} ({k.label})" for k in m.a) or "-"
                b = ", ".join(f"{k.name} ({k.label})" for k in m.b) or "-"
                lines.append(f"  {m.kind:16s} {a} -> {b}  [{format_bytes(m.bytes_a)} -> {format_bytes(m.bytes_b)}]"
                             f"  {', '.join(m.scopes[:2]) or NO_SCOPE}")
            if len(interesting) > limit:
                lines.append(f"  ... {len(interesting) - limit} more")
        else:
            lines.append("every kernel of A has one counterpart of the same category in B")
        changed = [m for m in self.matches if m.has_collective and (m.kind != "same" or m.sent_a != m.sent_b)]
        if changed:
            lines.append("")
            lines.append("collectives that changed (kind: A -> B  [bytes sent per device A -> B]):")
            for m in changed[:limit]:
                a = ", ".join(_collective_name(k) for k in m.a) or "-"
                b = ", ".join(_collective_name(k) for k in m.b) or "-"
                lines.append(f"  {m.kind:16s} {a} -> {b}  [{format_bytes(m.sent_a)} -> {format_bytes(m.sent_b)}]")
            if len(changed) > limit:
                lines.append(f"  ... {len(changed) - limit} more")
        for title, trips in (("round trips that vanished (in A, not in B)", self.vanished),
                             ("round trips that appeared (in B, not in A)", self.appeared)):
            if trips:
                lines.append("")
                lines.append(f"{title}: {len(trips)}, "
                             f"{format_bytes(sum(t.traffic_bytes for t in trips))} of traffic")
                for t in sorted(trips, key=lambda t: -t.traffic_bytes)[:limit // 2]:
                    lines.append(f"  {str(t.shape).split('{')[0]:32s} {format_bytes(t.traffic_bytes):>10s}  "
                                 f"{t.producer.name} -> {', '.join(c.name for c in t.consumers)}  "
                                 f"({', '.join(t.producer_scopes[:1]) or NO_SCOPE})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        from hlo_inspect.report import _round_trip_dict

        return {
            "schema": "hlo_inspect.diff/1", "label_a": self.label_a, "label_b": self.label_b,
            "a": self.a.to_dict(), "b": self.b.to_dict(),
            "matches": [{"kind": m.kind, "a": [k.name for k in m.a], "b": [k.name for k in m.b],
                         "bytes_a": m.bytes_a, "bytes_b": m.bytes_b, "sent_a": m.sent_a, "sent_b": m.sent_b,
                         "scopes": m.scopes} for m in self.matches],
            "vanished": [_round_trip_dict(t) for t in self.vanished],
            "appeared": [_round_trip_dict(t) for t in self.appeared],
            "summary": self.summary(),
        }

    def to_html(self, path: str | None = None, *, title: str | None = None) -> str:
        """Self-contained HTML page of the diff (summary, matches, both kernel tables); also written to `path`."""
        from hlo_inspect.html import render_diff, write_html

        page = render_diff(self.to_dict(), title=title)
        if path is not None:
            write_html(path, page)
        return page


def _collective_name(k: Kernel) -> str:
    return f"{k.name} ({k.collective.opcode} ×{k.collective.group_size})" if k.collective else f"{k.name} ({k.label})"


def diff(a: Report, b: Report, *, label_a: str = "A", label_b: str = "B", max_share: int = 3) -> Diff:
    """Match the kernels of two reports by the source ops they contain; see the module docstring."""
    ops_a = [_source_ops(k) for k in a.kernels]
    ops_b = [_source_ops(k) for k in b.kernels]
    share = collections.Counter()
    for ops_list in (ops_a, ops_b):
        per_program = collections.Counter(op for ops in ops_list for op in ops)
        for op, n in per_program.items():
            share[op] = max(share[op], n)
    # Union-find over nodes ("a", i) / ("b", j), linked through shared, distinctive source ops.
    parent: dict[tuple[str, int], tuple[str, int]] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(x, y):
        parent[find(x)] = find(y)

    owner: dict[tuple[str, str], tuple[str, int]] = {}
    for side, ops_list in (("a", ops_a), ("b", ops_b)):
        for i, ops in enumerate(ops_list):
            node = (side, i)
            find(node)
            for op in ops:
                if share[op] > max_share:
                    continue
                if op in owner:
                    union(node, owner[op])
                else:
                    owner[op] = node
    groups: dict[tuple[str, int], list[tuple[str, int]]] = collections.defaultdict(list)
    for node in list(parent):
        groups[find(node)].append(node)

    matches = []
    for nodes in groups.values():
        ia = [i for side, i in sorted(nodes) if side == "a"]
        ib = [i for side, i in sorted(nodes) if side == "b"]
        pairs = _one_to_one(ia, ib, ops_a, ops_b) if len(ia) == len(ib) > 1 else None
        if pairs is not None:  # the same kernels, sharing source ops among themselves (e.g. split-K GEMM + sum)
            for i, j in pairs:
                kind = "same" if a.kernels[i].category == b.kernels[j].category else "changed_category"
                matches.append(Match(kind=kind, a=[a.kernels[i]], b=[b.kernels[j]]))
            continue
        ka, kb = [a.kernels[i] for i in ia], [b.kernels[j] for j in ib]
        if not kb:
            kind = "only_a"
        elif not ka:
            kind = "only_b"
        elif len(ka) == 1 and len(kb) == 1:
            kind = "same" if ka[0].category == kb[0].category else "changed_category"
        elif len(kb) == 1:
            kind = "merged"
        elif len(ka) == 1:
            kind = "split"
        else:
            kind = "regrouped"
        matches.append(Match(kind=kind, a=ka, b=kb))
    matches = _pair_leftovers(matches)
    order_a = {id(k): i for i, k in enumerate(a.kernels)}
    order_b = {id(k): i for i, k in enumerate(b.kernels)}
    matches.sort(key=lambda m: (order_a[id(m.a[0])] if m.a else len(order_a) + order_b[id(m.b[0])]))

    keys_b = collections.Counter(_trip_key(t) for t in b.ledger.round_trips)
    keys_a = collections.Counter(_trip_key(t) for t in a.ledger.round_trips)
    vanished, appeared = [], []
    for trips, other, out in ((a.ledger.round_trips, keys_b, vanished), (b.ledger.round_trips, keys_a, appeared)):
        remaining = collections.Counter(other)
        for t in trips:
            key = _trip_key(t)
            if remaining[key] > 0:
                remaining[key] -= 1
            else:
                out.append(t)
    return Diff(a=a, b=b, matches=matches, vanished=vanished, appeared=appeared, label_a=label_a,
                label_b=label_b)
