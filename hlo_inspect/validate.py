"""What `parse()` checks once names are linked, so that every later stage ends on every module it accepts.

XLA's own verifier checks far more; these are the facts hlo_inspect's stages walk or index by, each one a
`HloParseError` naming the instruction's line when it does not hold:
- no instruction is its own operand, directly or through others (walks along operands would loop forever);
- no computation calls itself, directly or through others, and nothing calls the ENTRY computation;
- calls nest at most `MAX_CALL_DEPTH` deep, and the walk from the entry through every call (a computation called
  from n places is walked n times) visits at most `MAX_EXPANDED_INSTRUCTIONS` instructions;
- each opcode with a fixed operand count (`hlo_inspect.opcodes.ARITY`) has that many operands;
- `parameter(N)` takes a non-negative integer, once per computation; `get-tuple-element` an integer `index=`
  inside its operand's tuple;
- dots and convolutions have array operands and results, and the dimension numbers they name exist;
- elementwise unary and binary ops (`ELEMENTWISE_OPCODES`) have operands with their result's dimensions (XLA's
  verifier: "implicit broadcast is not allowed in HLO") and, except the ops that change the type
  (`TYPE_CHANGING_OPCODES`), its element type, or another floating-point type (XLA's mixed precision);
- a fusion's `kind=` is one of XLA's `FUSION_KINDS`; a `slice`'s ranges fit its operand and make its result;
- collectives' `replica_groups` and `source_target_pairs` read as groups and pairs (`hlo_inspect.collectives`).
All of it is linear in the size of the module.
"""

from __future__ import annotations

import re

from hlo_inspect import collectives
from hlo_inspect.opcodes import arity
from hlo_inspect.parser import Computation, Instruction, Module, Shape
from hlo_inspect.scanning import HloParseError

__all__ = ["validate", "MAX_CALL_DEPTH", "MAX_EXPANDED_INSTRUCTIONS", "ELEMENTWISE_OPCODES", "TYPE_CHANGING_OPCODES",
           "FUSION_KINDS"]

MAX_CALL_DEPTH = 100
MAX_EXPANDED_INSTRUCTIONS = 1_000_000

# Unary and binary ops whose result has each operand's dimensions (HloInstruction::IsElementwise). Left out:
# bitcast-convert (changes the dimensions when the bit widths differ), select and clamp (three operands).
ELEMENTWISE_OPCODES = frozenset({
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cbrt", "ceil", "convert", "copy", "cosh", "cosine",
    "count-leading-zeros", "erf", "exponential", "exponential-minus-one", "floor", "imag", "is-finite", "log",
    "log-plus-one", "logistic", "negate", "not", "popcnt", "real", "reduce-precision", "round-nearest-afz",
    "round-nearest-even", "rsqrt", "sign", "sine", "sinh", "sqrt", "tan", "tanh",
    "add", "and", "atan2", "compare", "complex", "divide", "maximum", "minimum", "multiply", "or", "power",
    "remainder", "shift-left", "shift-right-arithmetic", "shift-right-logical", "stochastic-convert", "subtract",
    "xor",
})
# Elementwise ops whose result type may differ from their operands' (pred from compare, f32 from c64 abs, ...).
TYPE_CHANGING_OPCODES = frozenset({"convert", "stochastic-convert", "compare", "is-finite", "abs", "real", "imag",
                                   "complex"})
FUSION_KINDS = ("kLoop", "kInput", "kOutput", "kCustom")  # HloInstruction::FusionKind


def _error(inst: Instruction, message: str) -> HloParseError:
    return HloParseError(f"%{inst.name}: {message}", inst.line_no, inst.text or None)


def validate(module: Module) -> None:
    """Raise HloParseError at the first fact above that does not hold."""
    for comp in module.computations.values():
        parameters: dict[int, Instruction] = {}
        for inst in comp.instructions:
            _check_instruction(inst)
            if inst.opcode == "parameter":
                number = inst.parameter_number
                if number in parameters:
                    raise _error(inst, f"parameter number {number} is taken twice in computation {comp.name} "
                                       f"(also %{parameters[number].name}, line {parameters[number].line_no})")
                parameters[number] = inst
        _check_no_cycle(comp)
    _check_call_graph(module)


# ---- one instruction ---------------------------------------------------------------------------------------

_DIMS_ATTR_RE = re.compile(r"\{\s*(?:\d+(?:\s*,\s*\d+)*)?\s*\}")
_DIM_LABELS_RE = re.compile(r"([a-z0-9]+)_([a-z0-9]+)->([a-z0-9]+)")
_DOT_DIMS = (("lhs_contracting_dims", 0), ("lhs_batch_dims", 0), ("rhs_contracting_dims", 1),
             ("rhs_batch_dims", 1))


def _check_instruction(inst: Instruction) -> None:
    op = inst.opcode
    expected = arity(op)
    if expected is not None and len(inst.operands) != expected:
        raise _error(inst, f"{op} takes {expected} operand{'s' if expected != 1 else ''}, got {len(inst.operands)}")
    if op == "parameter" and inst.parameter_number is None:
        raise _error(inst, f"parameter({inst.literal}) : expected a non-negative integer parameter number")
    elif op == "get-tuple-element":
        _check_tuple_index(inst)
    elif op in ("dot", "ragged-dot", "scaled-dot"):
        _check_dot(inst)
    elif op == "convolution":
        _check_convolution(inst)
    elif op in ELEMENTWISE_OPCODES:
        _check_elementwise(inst)
    elif op == "slice":
        _check_slice(inst)
    elif op == "fusion" and inst.attrs.get("kind", FUSION_KINDS[0]).strip() not in FUSION_KINDS:
        raise _error(inst, f"kind={inst.attrs['kind']} is not a fusion kind: expected one of {', '.join(FUSION_KINDS)}")
    elif "replica_groups" in inst.attrs or "source_target_pairs" in inst.attrs:
        try:
            collectives.check(inst)
        except ValueError as e:
            raise _error(inst, str(e)) from None


def _check_tuple_index(inst: Instruction) -> None:
    text = inst.attrs.get("index")
    if text is None or not text.strip().isdigit():
        raise _error(inst, f"get-tuple-element needs an integer index=, got {text!r}")
    index, shape = int(text), inst.operands[0].shape
    if not shape.is_tuple or index >= len(shape.tuple_shapes):
        size = f"a tuple of {len(shape.tuple_shapes)}" if shape.is_tuple else "not a tuple"
        raise _error(inst, f"index={index} but its operand %{inst.operands[0].name} is {size}")


def _check_arrays(inst: Instruction, operands: int) -> None:
    if len(inst.operands) < operands:
        raise _error(inst, f"{inst.opcode} takes at least {operands} operands, got {len(inst.operands)}")
    for operand in [inst] + inst.operands[:operands]:
        if operand.shape.is_tuple:
            which = "its result" if operand is inst else f"its operand %{operand.name}"
            raise _error(inst, f"{inst.opcode} needs arrays, but {which} is a tuple {operand.shape}")


def _is_float(dtype: str | None) -> bool:
    return dtype is not None and (dtype.startswith("f") or dtype == "bf16")


def _check_elementwise(inst: Instruction) -> None:
    """Each operand has the result's dimensions (an unbounded `?` matches any size, a bounded `<=N` counts as N)
    and, unless the op changes the type, its element type or another floating-point one."""
    result = inst.shape
    for operand in inst.operands:
        shape = operand.shape
        if shape.dims == result.dims and shape.dtype == result.dtype:
            continue  # the usual case
        if shape.is_tuple or result.is_tuple:
            return
        if shape.dims != result.dims and not _same_bounded_dims(shape, result):
            raise _error(inst, f"{inst.opcode} is elementwise, so its result has its operands' dimensions, but the "
                               f"result is {result} and operand %{operand.name} is {shape}")
        if (shape.dtype != result.dtype and inst.opcode not in TYPE_CHANGING_OPCODES
                and not (_is_float(shape.dtype) and _is_float(result.dtype))):
            changing = ", ".join(sorted(TYPE_CHANGING_OPCODES))
            raise _error(inst, f"{inst.opcode} keeps its operands' element type, but the result is {result.dtype} "
                               f"and operand %{operand.name} is {shape.dtype}: only {changing} change it (and "
                               "floating-point types may mix)")


def _check_slice(inst: Instruction) -> None:
    """`slice={[start:limit:stride], ...}`: one range per operand dimension, 0 <= start <= limit <= the dimension's
    size (its bound for `<=N`), stride >= 1, and the result's dimension ceil((limit - start) / stride)."""
    _check_arrays(inst, 1)
    operand, bounds = inst.operands[0].shape, inst.slice_bounds
    if not bounds or operand.unbounded_dims or inst.shape.unbounded_dims:
        return
    if len(bounds) != len(operand.dims):
        raise _error(inst, f"slice={inst.attrs['slice']} gives {len(bounds)} ranges for operand "
                           f"%{inst.operands[0].name} of rank {len(operand.dims)}: expected one per dimension")
    for d, ((start, limit, stride), size) in enumerate(zip(bounds, operand.dims)):
        if not (0 <= start <= limit <= size and stride >= 1):
            raise _error(inst, f"slice range [{start}:{limit}:{stride}] of dimension {d} does not fit %"
                               f"{inst.operands[0].name} {operand}: expected 0 <= start <= limit <= {size}, "
                               "stride >= 1")
    want = [-(-(limit - start) // stride) for start, limit, stride in bounds]
    if list(inst.shape.dims) != want:
        raise _error(inst, f"the result is {inst.shape}, but slice={inst.attrs['slice']} of {operand} makes "
                           f"dimensions {want}")


def _same_bounded_dims(a: Shape, b: Shape) -> bool:
    """Same rank, and equal sizes (bounds) where neither dimension is unbounded (`?`), as XLA's
    `ShapeUtil::CompatibleIgnoringElementType` compares them."""
    unbounded = {*a.unbounded_dims, *b.unbounded_dims}
    return len(a.dims) == len(b.dims) and all(x == y for d, (x, y) in enumerate(zip(a.dims, b.dims))
                                              if d not in unbounded)


def _check_dot(inst: Instruction) -> None:
    _check_arrays(inst, 2)
    for attr, side in _DOT_DIMS:
        text = inst.attrs.get(attr)
        if text is None:
            continue
        if not _DIMS_ATTR_RE.fullmatch(text.strip()):
            raise _error(inst, f"{attr}={text}: expected a list of dimension numbers such as {{1}}")
        rank = len(inst.operands[side].shape.dims)
        for d in (int(x) for x in re.findall(r"\d+", text)):
            if d >= rank:
                raise _error(inst, f"{attr} names dimension {d}, but %{inst.operands[side].name} has rank {rank}")


def _check_convolution(inst: Instruction) -> None:
    _check_arrays(inst, 2)
    for attr in ("feature_group_count", "batch_group_count"):
        text = inst.attrs.get(attr, "1").strip()
        if not text.isdigit() or int(text) < 1:
            raise _error(inst, f"{attr}={text}: expected a positive integer")
    labels = inst.attrs.get("dim_labels")
    if labels is None:
        return
    m = _DIM_LABELS_RE.fullmatch(labels.strip())
    if m is None:
        raise _error(inst, f"dim_labels={labels}: expected <input>_<kernel>-><output> such as b01f_01io->b01f")
    shapes = (inst.operands[0].shape, inst.operands[1].shape, inst.shape)
    for part, shape, needed, what in zip(m.groups(), shapes, ("bf", "io", "bf"), ("input", "kernel", "output")):
        if len(part) != len(shape.dims) or not set(needed) <= set(part):
            raise _error(inst, f"dim_labels={labels}: the {what} labels {part!r} do not fit its shape {shape} "
                               f"(one label per dimension, {' and '.join(needed)} among them)")


# ---- cycles ------------------------------------------------------------------------------------------------

def _defined_in_order(comp: Computation) -> bool:
    """True when every operand is listed before its user (as XLA prints): then there can be no cycle."""
    position = {id(inst): i for i, inst in enumerate(comp.instructions)}
    for i, inst in enumerate(comp.instructions):
        for operand in inst.operands:
            p = position.get(id(operand))
            while p is None:  # `%x#1`: an element made by the parser, listed where its tuple is
                operand = operand.operands[0]
                p = position.get(id(operand))
            if p >= i:
                return False
    return True


def _check_no_cycle(comp: Computation) -> None:
    """No instruction reaches itself along operands (iterative depth-first search, linear)."""
    if _defined_in_order(comp):
        return
    state: dict[int, int] = {}  # id -> 1 on the current path, 2 finished
    for start in comp.instructions:
        if id(start) in state:
            continue
        state[id(start)] = 1
        path, stack = [start], [iter(start.operands)]
        while stack:
            operand = next(stack[-1], None)
            if operand is None:
                stack.pop()
                state[id(path.pop())] = 2
                continue
            seen = state.get(id(operand))
            if seen == 2:
                continue
            if seen == 1:
                cycle = path[path.index(operand):] + [operand]
                names = " -> ".join(f"%{i.name}" for i in cycle)
                raise _error(cycle[-2], f"instructions use each other's results in a cycle ({names}): an "
                                        "instruction cannot use its own result")
            state[id(operand)] = 1
            path.append(operand)
            stack.append(iter(operand.operands))


def _calls(comp: Computation) -> list[tuple[Instruction, Computation]]:
    return [(inst, callee) for inst in comp.instructions for callee in inst.called_computations]


def _check_call_graph(module: Module) -> None:
    """No computation calls itself (directly or not), none calls the entry; depth and expansion bounded."""
    state: dict[int, int] = {}
    depth: dict[int, int] = {}
    size: dict[int, int] = {}
    for start in module.computations.values():
        if id(start) in state:
            continue
        state[id(start)] = 1
        path, stack = [start], [iter(_calls(start))]
        while stack:
            step = next(stack[-1], None)
            if step is None:
                stack.pop()
                comp = path.pop()
                state[id(comp)] = 2
                calls = _calls(comp)
                depth[id(comp)] = 1 + max((depth[id(c)] for _, c in calls), default=0)
                size[id(comp)] = min(len(comp.instructions) + sum(size[id(c)] for _, c in calls),
                                     MAX_EXPANDED_INSTRUCTIONS + 1)
                continue
            inst, callee = step
            if callee.is_entry:
                raise _error(inst, f"calls the ENTRY computation {callee.name}: nothing may call the entry")
            seen = state.get(id(callee))
            if seen == 2:
                continue
            if seen == 1:
                cycle = path[path.index(callee):] + [callee]
                if len(cycle) == 2:
                    raise _error(inst, f"computation {callee.name} calls itself")
                names = " -> ".join(c.name for c in cycle)
                raise _error(inst, f"computations call each other in a cycle ({names})")
            state[id(callee)] = 1
            path.append(callee)
            stack.append(iter(_calls(callee)))
    entry = module.entry
    if depth[id(entry)] > MAX_CALL_DEPTH:
        raise HloParseError(f"calls nest {depth[id(entry)]} computations deep from the entry; hlo_inspect reads at "
                            f"most {MAX_CALL_DEPTH}", entry.line_no)
    if size[id(entry)] > MAX_EXPANDED_INSTRUCTIONS:
        raise HloParseError(f"walking every call from the entry visits more than {MAX_EXPANDED_INSTRUCTIONS:,} "
                            "instructions (computations called from many places, nested); hlo_inspect reads at "
                            "most that many", entry.line_no)
