"""The HBM round-trip ledger: tensors one kernel writes to HBM and another kernel of the program reads back.

    led = ledger(module, kernels)              # or report.ledger
    for t in led.round_trips: print(t.name, t.shape, t.bytes, t.producer.name, [c.name for c in t.consumers])

A round trip costs one write and one read per consumer (`traffic_bytes`); at a bandwidth BW it costs
`traffic_bytes / BW` seconds that a fused kernel would not spend. Program inputs (entry parameters) and the
program's outputs are listed apart: they must cross HBM whatever the fusion. A tensor that is a program output
and also read back by a later kernel is still a round trip (the read is the avoidable part; `is_output` says so).

A round trip whose producer is a fusion without parameters (a value from iotas and constants alone, a mask) is
listed by `Ledger.from_constants` with the shapes its consumers broadcast it to: its bytes are all the ledger
counts, but a consumer that reads it broadcast can run much slower than those bytes say (NOTES.md: a causal mask
made this way cost an H200 softmax fusion 2.7x its time), and written from iotas of the consumer's own shape the
value is computed inside the consumer.

Tensors are tracked through `bitcast` and `get-tuple-element` (a multi-output kernel's outputs are separate
tensors). An asynchronous kernel's result is its `-done` (`Kernel.result`): a collective started in one place
and read after its done is a round trip of the collective. Values entering or leaving a while/conditional body
are loop state, not counted. A tensor outside HBM (a TPU's VMEM, host memory: ``shapes.hbm_resident``) makes
no HBM round trip.
"""

from __future__ import annotations

import collections
import dataclasses

from hlo_inspect.kernels import Kernel, tiled_layouts
from hlo_inspect.parser import Instruction, Module, Shape
from hlo_inspect.shapes import hbm_resident

__all__ = ["Tensor", "RoundTrip", "Ledger", "ledger", "broadcast_shape", "NO_SCOPE"]

NO_SCOPE = "(no scope)"  # how tables name the scope of a kernel whose ops carry no op_name scope


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A buffer: the instruction that defines it and the tuple index (None for an array result)."""

    instruction: Instruction
    index: int | None
    shape: Shape

    @property
    def name(self) -> str:
        return self.instruction.name + ("" if self.index is None else f"#{self.index}")

    @property
    def bytes(self) -> int:
        return self.shape.size_bytes


@dataclasses.dataclass(eq=False)
class RoundTrip:
    """`tensor` written by `producer` and read back by `consumers` (bytes each reads in `read_bytes`)."""

    tensor: Tensor
    producer: Kernel
    consumers: list[Kernel]
    read_bytes: list[int]
    is_output: bool = False

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def shape(self) -> Shape:
        return self.tensor.shape

    @property
    def bytes(self) -> int:
        return self.tensor.bytes

    @property
    def traffic_bytes(self) -> int:
        """Bytes a fused program would not move: the write (unless it is an output anyway) and every read."""
        return (0 if self.is_output else self.bytes) + sum(self.read_bytes)

    def cost_us(self, hbm_bytes_per_s: float) -> float:
        return self.traffic_bytes / hbm_bytes_per_s * 1e6

    @property
    def producer_scopes(self) -> list[str]:
        return self.producer.scopes

    @property
    def consumer_scopes(self) -> list[str]:
        seen: dict[str, None] = {}
        for c in self.consumers:
            for s in c.scopes:
                seen.setdefault(s, None)
        return list(seen)


@dataclasses.dataclass(eq=False)
class Ledger:
    round_trips: list[RoundTrip]
    inputs: list[tuple[Tensor, list[Kernel]]]  # entry parameters and the kernels that read them
    outputs: list[tuple[Tensor, Kernel | None]]  # program outputs and the kernel that wrote them

    @property
    def traffic_bytes(self) -> int:
        return sum(t.traffic_bytes for t in self.round_trips)

    def from_constants(self, min_bytes: int = 1 << 20) -> list[tuple[RoundTrip, list[Shape | None]]]:
        """Round trips of at least `min_bytes` whose producer is a fusion without parameters (its value comes from
        iotas and constants alone), each with, per consumer, the shape that consumer broadcasts the value to inside
        its fusion (None where it reads it as it is)."""
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes: expected an int >= 0 (bytes), got {min_bytes!r} ({type(min_bytes).__name__})")
        return [(t, [broadcast_shape(c, t.tensor) for c in t.consumers]) for t in self.round_trips
                if t.bytes >= min_bytes and _without_parameters(t.producer.instruction)]

    def by_scope(self, hbm_bytes_per_s: float | None = None) -> list[dict]:
        """Round-trip traffic grouped by the producer's leading scope, most bytes first."""
        groups: dict[str, list[RoundTrip]] = collections.defaultdict(list)
        for t in self.round_trips:
            groups[t.producer_scopes[0] if t.producer_scopes else NO_SCOPE].append(t)
        rows = []
        for scope, trips in groups.items():
            traffic = sum(t.traffic_bytes for t in trips)
            row = {"scope": scope, "tensors": len(trips), "traffic_bytes": traffic}
            if hbm_bytes_per_s:
                row["cost_us"] = traffic / hbm_bytes_per_s * 1e6
            rows.append(row)
        return sorted(rows, key=lambda r: -r["traffic_bytes"])


def _tensor_of(inst: Instruction, known: dict[int, tuple[Instruction, int | None]]
               ) -> tuple[Instruction, int | None]:
    """Follow bitcasts and get-tuple-element to (defining instruction, tuple index). `known` keeps each answer,
    so long chains read by many kernels are walked once."""
    start = inst
    if id(start) in known:
        return known[id(start)]
    index = None
    while True:
        if inst.opcode == "bitcast" and inst.operands:
            inst = inst.operands[0]
        elif inst.opcode == "get-tuple-element" and inst.operands and index is None:
            index = inst.tuple_index
            inst = inst.operands[0]
        else:
            known[id(start)] = (inst, index)
            return inst, index


def _without_parameters(inst: Instruction) -> bool:
    """A fusion whose computation takes no parameter and draws no random numbers: iotas and constants alone."""
    return (inst.opcode == "fusion" and bool(inst.called_computations) and not inst.operands
            and not any(i.opcode in ("parameter", "rng", "rng-bit-generator")
                        for i in inst.called_computations[0].instructions))


def broadcast_shape(consumer: Kernel, tensor: Tensor) -> Shape | None:
    """The shape a fusion kernel broadcasts `tensor` to (its operand's parameter, through bitcasts and converts,
    feeding a `broadcast`), or None where it reads the tensor as it is or is not a fusion."""
    inst = consumer.instruction
    if inst.opcode != "fusion" or not inst.called_computations:
        return None
    numbers = {i for i, operand in enumerate(inst.operands)
               if _tensor_of(operand, {}) == (tensor.instruction, tensor.index)}
    fused = inst.called_computations[0]
    reached = {id(p) for p in fused.parameters if p.parameter_number in numbers}
    for user in fused.instructions:  # in order: an operand is defined before its users
        if not any(id(o) in reached for o in user.operands):
            continue
        if user.opcode == "broadcast":
            return user.shape
        if user.opcode in ("bitcast", "convert", "reshape"):
            reached.add(id(user))
    return None


def ledger(module: Module, kernels: list[Kernel]) -> Ledger:
    """Build the ledger of a program's kernels (as `hlo_inspect.kernels(module)` lists them)."""
    by_instruction = {id(k.result): k for k in kernels}
    known: dict[int, tuple[Instruction, int | None]] = {}
    consumers: dict[tuple[int, int | None], list[tuple[Kernel, int]]] = collections.defaultdict(list)
    inputs: dict[int, tuple[Tensor, list[Kernel]]] = {}
    for k in kernels:
        seen = set()
        for src, nbytes in k.reads:  # one entry per distinct buffer, already through bitcasts
            inst, index = _tensor_of(src, known)
            key = (id(inst), index)
            if key in seen:
                continue
            seen.add(key)
            if id(inst) in by_instruction:
                consumers[key].append((k, nbytes))
            elif inst.opcode == "parameter" and inst.computation is not None and inst.computation.is_entry:
                tensor = Tensor(inst, None, inst.shape)
                inputs.setdefault(id(inst), (tensor, []))[1].append(k)

    outputs: list[tuple[Tensor, Kernel | None]] = []
    output_keys = set()
    root = module.entry.root
    for leaf in (root.operands if root.opcode == "tuple" else [root]):
        inst, index = _tensor_of(leaf, known)
        outputs.append((Tensor(inst, index, leaf.shape), by_instruction.get(id(inst))))
        output_keys.add((id(inst), index))

    trips = []
    tiled = tiled_layouts(module)
    for k in kernels:
        result = k.result
        results = ([(i, s) for i, s in enumerate(result.shape.tuple_shapes)]
                   if result.shape.is_tuple else [(None, result.shape)])
        for index, shape in results:
            users = consumers.get((id(result), index))
            if not users or not hbm_resident(shape, tiled):
                continue
            trips.append(RoundTrip(tensor=Tensor(result, index, shape), producer=k,
                                   consumers=[u for u, _ in users], read_bytes=[n for _, n in users],
                                   is_output=(id(result), index) in output_keys))
    return Ledger(round_trips=trips, inputs=list(inputs.values()), outputs=outputs)
