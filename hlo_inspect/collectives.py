"""Collectives of an SPMD-partitioned program: the devices each one spans and the bytes each device sends and
receives over the interconnect.

    c = collective(inst, module.header_attrs)   # None unless inst is a collective (or the start of one)
    c.opcode, c.group_size, c.bytes_sent, c.bytes_received

The byte model is the bandwidth-optimal (ring) algorithm, per device of a group of n devices, S the bytes of the
collective's data operands (its array operands; for an all-gather the shard each device holds, for the others
the whole buffer):

    all-reduce          sent = received = 2(n-1)/n · S   (a reduce-scatter, then an all-gather, of S)
    all-gather          sent = received = (n-1) · S      (= (n-1)/n of the gathered output)
    reduce-scatter      sent = received = (n-1)/n · S
    all-to-all          sent = received = (n-1)/n · S    (every device keeps 1/n of its input, sends the rest)
    collective-permute  S sent by each source and received by each target of `source_target_pairs` (a pair
                        whose source is its target moves nothing); the busiest device's count is reported
    collective-broadcast  S received by every device but the root and forwarded along a pipelined chain:
                        sent = received = S on the busiest device
    ragged-all-to-all   the sizes are run-time values: counted as a balanced all-to-all of the input buffer,
                        (n-1)/n · S, which `note` says is an estimate

Byte counts are rounded down to whole bytes. n = 1 moves nothing: 0 bytes. The HBM bytes a collective reads
and writes locally are not these; `hlo_inspect.kernels` counts them like any kernel's.

The group size n comes from `replica_groups` in any of XLA's three printed forms, with XLA's collective group
modes (`CollectiveOpGroupMode`):
- the list form `{{0,1},{2,3}}` (groups of unequal sizes: the largest, the busiest device);
- the iota form `[G,N]<=[d0,d1,...]` or `[G,N]<=[d0,d1,...]T(p0,p1,...)`: G groups of N, the devices iota(∏d)
  reshaped to d, transposed by p, read in order;
- the mesh-axes form `mesh['x'=2,'y'=4] {'y'}` (sub-axes `'y':(2)2`): a group spans the named axes;
- `{}` or none: every participant, which the header's `replica_count` and `num_partitions` (1 when absent) give:
  without `channel_id` the replicas; with one, all-reduce / all-gather / reduce-scatter without
  `use_global_device_ids=true` span their replica group across all partitions (n = |group| × num_partitions),
  all-to-all and collective-broadcast span partitions.
Malformed groups, pairs or counts raise ValueError naming the attribute (`hlo_inspect.validate` turns it into
an HloParseError with the line); `note` says when n was not printed but assumed.
"""

from __future__ import annotations

import dataclasses
import math
import re

from hlo_inspect.parser import Instruction

__all__ = ["COLLECTIVE_OPCODES", "Collective", "ReplicaGroups", "collective", "collective_instruction",
           "parse_replica_groups", "parse_source_target_pairs", "check", "MAX_DEVICES"]

COLLECTIVE_OPCODES = frozenset({
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
    "collective-broadcast", "collective-reduce",
})
MAX_DEVICES = 2 ** 31  # no machine has more; past it a group is a parse error, not a number to multiply by
_MATERIALIZE = 1 << 16  # iota groups are listed up to this many devices (the byte model needs only sizes)
_PARTITION_SPANNING = frozenset({"all-to-all", "ragged-all-to-all", "collective-broadcast"})  # no global-id flag

_INT_LIST = re.compile(r"\s*(\d+(?:\s*,\s*\d+)*)?\s*")
_IOTA = re.compile(r"\[\s*(\d+)\s*,\s*(\d+)\s*\]\s*<=\s*\[([\d\s,]*)\]\s*(?:T\s*\(([\d\s,]*)\))?")
_MESH = re.compile(r"mesh\s*\[([^\]]*)\]\s*(?:,\s*device_ids\s*=\s*\([^)]*\)\s*)?\{([^}]*)\}")
_MESH_AXIS = re.compile(r"\s*'?([^'=,]+?)'?\s*=\s*(\d+)\s*")
_GROUP_AXIS = re.compile(r"\s*'?([^':,]+?)'?\s*(?::\s*\(\s*(\d+)\s*\)\s*(\d+))?\s*")


@dataclasses.dataclass(frozen=True)
class ReplicaGroups:
    """`replica_groups` read: `num_groups` groups, the largest of `group_size` devices; `groups` lists them
    (list and iota forms up to 65536 devices; None for the mesh form or past that). No groups printed ({}):
    num_groups = group_size = 0."""

    num_groups: int
    group_size: int
    groups: tuple[tuple[int, ...], ...] | None


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective: n = `group_size` devices per group (`num_groups` groups; for a collective-permute, the
    devices its pairs name and the number of pairs), `payload_bytes` = S of the module docstring's model, and
    the interconnect bytes one device (the busiest) sends and receives per launch. `note` says what was
    assumed ('' when everything was printed)."""

    opcode: str
    group_size: int
    num_groups: int
    payload_bytes: int
    bytes_sent: int
    bytes_received: int
    replica_groups: str = ""  # as printed ('' when absent); source_target_pairs for collective-permute
    note: str = ""


def _ints(text: str, what: str) -> list[int]:
    if not _INT_LIST.fullmatch(text):
        raise ValueError(f"{what}: expected comma-separated non-negative integers, got {text.strip()!r}")
    return [int(x) for x in text.split(",") if x.strip()]


def _braced_lists(text: str, what: str, example: str) -> list[list[int]]:
    """`{{0,1},{2,3}}` -> [[0, 1], [2, 3]]; `{}` -> []."""
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError(f"{what}={text.strip()}: expected {example}")
    body = body[1:-1].strip()
    if not body:
        return []
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError(f"{what}={text.strip()}: expected {example}")
    return [_ints(part, what) for part in re.split(r"\}\s*,\s*\{", body[1:-1])]


def _bounded(n: int, what: str) -> int:
    if n > MAX_DEVICES:
        raise ValueError(f"{what}: {n} devices, more than the {MAX_DEVICES} any machine has")
    return n


def parse_replica_groups(text: str) -> ReplicaGroups:
    """Read `replica_groups=` in its list, iota or mesh-axes form (see the module docstring); ValueError if
    malformed."""
    value = text.strip()
    if value.startswith("{"):
        groups = _braced_lists(value, "replica_groups", "{{0,1},{2,3}}")
        if any(not g for g in groups):
            raise ValueError(f"replica_groups={value}: a group with no devices")
        _bounded(sum(len(g) for g in groups), "replica_groups")
        return ReplicaGroups(len(groups), max((len(g) for g in groups), default=0), tuple(map(tuple, groups)))
    m = _IOTA.fullmatch(value)
    if m:
        return _iota_groups(value, int(m.group(1)), int(m.group(2)), _ints(m.group(3), "replica_groups"),
                            _ints(m.group(4), "replica_groups") if m.group(4) is not None else None)
    m = _MESH.fullmatch(value)
    if m:
        return _mesh_groups(value, m.group(1), m.group(2))
    raise ValueError(f"replica_groups={value}: expected a list {{{{0,1}},{{2,3}}}}, an iota [2,2]<=[4] or "
                     "[2,2]<=[2,2]T(1,0), or mesh axes mesh['x'=2,'y'=2] {'y'}")


def _iota_groups(value: str, num_groups: int, group_size: int, dims: list[int], perm: list[int] | None
                 ) -> ReplicaGroups:
    total = math.prod(dims) if dims else 0
    if num_groups < 1 or group_size < 1 or not dims or num_groups * group_size != total:
        raise ValueError(f"replica_groups={value}: [{num_groups},{group_size}] groups need as many devices as the "
                         f"iota {dims} has ({total})")
    if perm is not None and sorted(perm) != list(range(len(dims))):
        raise ValueError(f"replica_groups={value}: T({','.join(map(str, perm))}) is not a permutation of the "
                         f"{len(dims)} iota dimensions")
    _bounded(total, "replica_groups")
    groups = None
    if total <= _MATERIALIZE:
        perm = perm or list(range(len(dims)))
        strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
        tdims, tstrides = [dims[p] for p in perm], [strides[p] for p in perm]
        devices = []
        for flat in range(total):  # the transposed iota, read in row-major order
            device, rest = 0, flat
            for size, stride in zip(reversed(tdims), reversed(tstrides)):
                device += (rest % size) * stride
                rest //= size
            devices.append(device)
        groups = tuple(tuple(devices[g * group_size:(g + 1) * group_size]) for g in range(num_groups))
    return ReplicaGroups(num_groups, group_size, groups)


def _mesh_groups(value: str, mesh_text: str, axes_text: str) -> ReplicaGroups:
    sizes: dict[str, int] = {}
    for part in mesh_text.split(","):
        m = _MESH_AXIS.fullmatch(part)
        if not m:
            raise ValueError(f"replica_groups={value}: mesh axis {part.strip()!r} is not NAME=SIZE")
        sizes[m.group(1)] = int(m.group(2))
    total = _bounded(math.prod(sizes.values()), "replica_groups")
    group_size = 1
    for part in axes_text.split(","):
        m = _GROUP_AXIS.fullmatch(part)
        if not m or m.group(1) not in sizes:
            raise ValueError(f"replica_groups={value}: group axis {part.strip()!r} is not one of the mesh's axes "
                             f"{list(sizes)}")
        axis_size = sizes[m.group(1)]
        if m.group(3) is not None:  # a sub-axis: (pre-size)size
            pre, size = int(m.group(2)), int(m.group(3))
            if pre < 1 or size < 1 or axis_size % (pre * size):
                raise ValueError(f"replica_groups={value}: sub-axis {part.strip()} does not divide axis "
                                 f"{m.group(1)} of size {axis_size}")
            axis_size = size
        group_size *= axis_size
    if group_size < 1 or total % group_size:
        raise ValueError(f"replica_groups={value}: groups of {group_size} do not divide the mesh's {total} devices")
    return ReplicaGroups(total // group_size, group_size, None)


def parse_source_target_pairs(text: str) -> list[tuple[int, int]]:
    """`{{0,1},{1,2}}` -> [(0, 1), (1, 2)]; ValueError unless every pair is two device ids."""
    pairs = _braced_lists(text, "source_target_pairs", "{{0,1},{1,2}}")
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"source_target_pairs={text.strip()}: {{{','.join(map(str, pair))}}} is not a "
                             "(source, target) pair")
    return [(s, t) for s, t in pairs]


def _replica_groups_text(inst: Instruction) -> str | None:
    """`replica_groups=` as printed. A mesh with explicit device ids prints a top-level comma
    (`mesh['x'=2,'y'=2], device_ids=(...) {'y'}`), which the attribute scanner reads as a second attribute
    `device_ids`: joined back here."""
    text = inst.attrs.get("replica_groups")
    if text is not None and text.strip().startswith("mesh") and "{" not in text and "device_ids" in inst.attrs:
        text = f"{text}, device_ids={inst.attrs['device_ids']}"
    return text


def collective_instruction(inst: Instruction) -> Instruction | None:
    """The instruction that carries a collective's attributes: the op itself (synchronous, `all-reduce-start`,
    or the sugar `all-to-all-start`), or the root of a generic `async-start`'s `calls=` computation; None when
    `inst` is no collective."""
    if inst.opcode == "async-start":
        called = inst.called("calls") or inst.called_computations
        root = called[0].root if called and called[0].instructions else None
        return root if root is not None and root.opcode in COLLECTIVE_OPCODES else None
    op = inst.opcode
    if inst.async_phase == "start":
        op = inst.async_wrapped_opcode
    elif inst.async_phase:
        return None
    return inst if op in COLLECTIVE_OPCODES else None


def _opcode(inst: Instruction) -> str:
    return inst.async_wrapped_opcode if inst.async_phase == "start" else inst.opcode


def _header_count(header: dict[str, str], key: str) -> int | None:
    text = header.get(key, "").strip()
    return int(text) if text.isdigit() and 0 < int(text) <= MAX_DEVICES else None  # else as if not printed


def _group_size(op: str, inst: Instruction, header: dict[str, str]) -> tuple[int, int, str]:
    """(n, number of groups, note) from replica_groups, the group mode and the header's device counts."""
    printed = _replica_groups_text(inst)
    groups = parse_replica_groups(printed) if printed is not None else ReplicaGroups(0, 0, ())
    replicas, partitions = _header_count(header, "replica_count"), _header_count(header, "num_partitions")
    has_channel = "channel_id" in inst.attrs
    global_ids = inst.attrs.get("use_global_device_ids", "false").strip() == "true"
    spans_partitions = has_channel and not global_ids and op not in _PARTITION_SPANNING
    if groups.group_size:
        if spans_partitions:  # kCrossReplicaAndPartition: each replica group across every partition
            return groups.group_size * (partitions or 1), groups.num_groups, ""
        return groups.group_size, groups.num_groups, ""
    # No groups printed: one group of every participant.
    if not has_channel:
        n, counted = replicas, "replica_count"
    elif op in _PARTITION_SPANNING:
        n, counted = partitions, "num_partitions"
    else:
        n = (replicas or 1) * (partitions or 1) if (replicas or partitions) else None
        counted = "replica_count x num_partitions"
    if n is None:
        return 1, 1, (f"no replica_groups and no {counted} in the module header: counted as 1 device, "
                      "0 bytes sent")
    return n, 1, f"no replica_groups: all {n} devices ({counted})"


def _array_bytes(operands: list[Instruction]) -> int:
    return sum(leaf.size_bytes for o in operands for leaf in o.shape.leaves())


def collective(inst: Instruction, header: dict[str, str]) -> Collective | None:
    """The collective `inst` runs (see collective_instruction) with its group and per-device bytes; None when
    it is no collective. ValueError on malformed replica_groups / source_target_pairs."""
    op_inst = collective_instruction(inst)
    if op_inst is None:
        return None
    op = _opcode(op_inst)
    operands = op_inst.operands
    if op == "collective-permute":
        printed = op_inst.attrs.get("source_target_pairs", "{}")
        pairs = parse_source_target_pairs(printed)
        # The in-place form (slice_sizes=) takes (input, output, input offsets, output offsets): the input moves.
        data = operands[:1] if "slice_sizes" in op_inst.attrs else operands
        size = _array_bytes(data)
        sends: dict[int, int] = {}
        receives: dict[int, int] = {}
        for source, target in pairs:
            if source != target:
                sends[source] = sends.get(source, 0) + 1
                receives[target] = receives.get(target, 0) + 1
        devices = {d for pair in pairs for d in pair}
        return Collective(op, len(devices), len(pairs), size, size * max(sends.values(), default=0),
                          size * max(receives.values(), default=0), printed.strip())
    n, num_groups, note = _group_size(op, op_inst, header)
    data = operands[:1] if op == "ragged-all-to-all" else operands
    size = _array_bytes(data)
    if op == "all-reduce":
        moved = 2 * (n - 1) * size // n
    elif op == "all-gather":
        moved = (n - 1) * size
    elif op in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
        moved = (n - 1) * size // n
    elif op == "collective-broadcast":
        moved = size if n > 1 else 0
    else:  # collective-reduce: no published algorithm to model
        moved = 0
        note = "; ".join(filter(None, [note, f"no byte model for {op}: counted as 0 bytes"]))
    if op == "ragged-all-to-all":
        note = "; ".join(filter(None, [note, "sizes are run-time values: estimated as a balanced all-to-all"]))
    return Collective(op, n, num_groups, size, moved, moved, (_replica_groups_text(op_inst) or "").strip(), note)


def check(inst: Instruction) -> None:
    """ValueError when `inst` is a collective whose replica_groups or source_target_pairs cannot be read."""
    if collective_instruction(inst) is inst:
        if "replica_groups" in inst.attrs:
            parse_replica_groups(_replica_groups_text(inst))
        if "source_target_pairs" in inst.attrs:
            parse_source_target_pairs(inst.attrs["source_target_pairs"])
