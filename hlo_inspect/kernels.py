"""The entry computation as the list of kernels it launches, each classified, with HBM bytes and FLOPs.

Byte rule (the same as XLA's cost analysis where XLA's is sound): a kernel reads each distinct operand buffer
once and writes each output once, at the kernel boundary. Operands reached through `bitcast` are the same buffer.
A fusion parameter used only by `slice`/`dynamic-slice` inside the fusion is read only for what those take; a
fusion whose root is a `dynamic-update-slice` into a parameter writes (and does not read) only the update.
The workspace a cuBLAS/cuDNN custom call returns (its trailing `u8[...]` output) is not traffic. Parameters,
constants, bitcasts, tuples and get-tuple-element launch nothing. Only buffers in HBM count (`shapes.hbm_resident`):
on a TPU a value in VMEM (`S(1)`) moves no HBM bytes, and the `copy-start` that prefetches a weight there reads
it from HBM and writes nothing to HBM; a buffer in host memory (`S(5)`, offloaded) is not HBM either, and a
`copy-start` to or from it is a host transfer (any other `copy-start` is an asynchronous device copy). Tiled
layouts count their padding (`Shape.size_bytes`).

FLOPs: `dot` and `convolution` exactly (2 per multiply-add); each elementwise arithmetic op 1 per output element;
`reduce` 1 per input element; data movement 0; an all-reduce 1 per output element (XLA's rule, as if over 2
devices), other collectives 0. Library calls (cuBLAS GEMM, cuDNN attention) are counted from their
dot dimension numbers; an opaque custom call (a Pallas kernel) has `flops=None`.

Collectives (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, ...; synchronous, as
`all-reduce-start`/`-done` or the sugar `all-to-all-start`/`-done`, or a generic `async-start` whose `calls=`
computation wraps one) are kernels of category "collective": a start and its done are one kernel, named by the
start, with the done in `Kernel.done`. Besides their HBM bytes they carry the bytes each device sends and
receives over the interconnect (`Kernel.collective`, see `hlo_inspect.collectives`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Iterator

from hlo_inspect.collectives import COLLECTIVE_OPCODES, Collective, collective, collective_instruction
from hlo_inspect.parser import Computation, Instruction, Module, Shape, gc_paused
from hlo_inspect.shapes import HOST_MEMORY_SPACE, hbm_resident
from hlo_inspect.source import scope_of

__all__ = ["Kernel", "kernels", "CATEGORIES", "classify", "fused_instructions", "tiled_layouts", "trip_count",
           "written_shape"]

# category -> human-readable label.
CATEGORIES = {
    "loop": "loop fusion",
    "reduction": "reduction fusion",
    "output": "output fusion",
    "transpose": "transpose fusion",
    "scatter": "scatter fusion",
    "concatenate": "concatenate fusion",
    "triton_gemm": "Triton GEMM fusion",
    "triton_reduction": "Triton normalization/softmax fusion",
    "triton_fusion": "Triton block-level fusion",
    "cublas": "cuBLAS GEMM",
    "cudnn": "cuDNN",
    "pallas": "Pallas/Triton kernel",
    "mosaic": "Pallas Mosaic kernel",
    "cpu_fusion": "CPU library fusion",
    "custom_fusion": "custom fusion",
    "custom_call": "other custom call",
    "dot": "unfused dot",
    "convolution": "unfused convolution",
    "copy": "copy",
    "collective": "collective",
    "host": "host transfer",
    "unfused": "unfused op",
}

# Instructions that launch no device work.
_NO_WORK = frozenset({
    "parameter", "constant", "bitcast", "tuple", "get-tuple-element", "after-all", "add-dependency",
    "opt-barrier", "domain", "partition-id", "replica-id", "send-done", "recv-done",
})  # and the `-done` / `-update` half of every asynchronous op (`Instruction.async_phase`)
_CONTROL_FLOW = frozenset({"while", "conditional", "call"})
_HOST = frozenset({"send", "recv", "infeed", "outfeed"})  # and a copy-start to or from host memory
_DATA_MOVEMENT = frozenset({
    "parameter", "constant", "bitcast", "broadcast", "reshape", "transpose", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "copy", "gather", "scatter", "iota", "tuple",
    "get-tuple-element", "reverse", "bitcast-convert", "dynamic-reshape", "sort", "after-all",
    "opt-barrier", "domain", "partition-id", "replica-id", "fusion", "call", "while",
    "conditional", "custom-call", "get-dimension-size", "set-dimension-size", "shuffle", "scan",
})
_TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "tanh", "rsqrt", "sqrt", "cbrt",
    "power", "sine", "cosine", "tan", "atan2", "erf",
})


@dataclasses.dataclass(eq=False)
class Kernel:
    """One launched kernel (or library call) of a compiled program.

    bytes_read / bytes_written: HBM bytes at the kernel boundary for one launch; `launches` is how many times
    it runs per program execution (a known while-loop trip count, else 1). flops is None when unknown.
    """

    name: str
    category: str
    instruction: Instruction
    ops: collections.Counter
    bytes_read: int
    bytes_written: int
    flops: int | None
    transcendentals: int
    scopes: list[str]
    source_lines: list[str]
    loop: str = ""  # name of the enclosing while body ('' at top level)
    launches: int = 1
    reads: list[tuple[Instruction, int]] = dataclasses.field(default_factory=list, repr=False)
    collective: Collective | None = None  # the group and interconnect bytes of a collective; None otherwise
    done: Instruction | None = dataclasses.field(default=None, repr=False)  # an async kernel's `-done`

    @property
    def result(self) -> Instruction:
        """The instruction whose value is this kernel's result: the `-done` of an asynchronous kernel."""
        return self.done or self.instruction

    @property
    def bytes_sent(self) -> int:
        """Interconnect bytes one device sends per launch (collectives; 0 for every other kernel)."""
        return self.collective.bytes_sent if self.collective else 0

    @property
    def bytes_received(self) -> int:
        """Interconnect bytes one device receives per launch (collectives; 0 for every other kernel)."""
        return self.collective.bytes_received if self.collective else 0

    @property
    def label(self) -> str:
        return CATEGORIES.get(self.category, self.category)

    @property
    def bytes_total(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def xla_estimate_us(self) -> float | None:
        """XLA's own cost-model estimate of this kernel (µs), from `reification_cost` in its backend_config.

        XLA fills it when compiled with `--xla_gpu_collect_cost_model_stats=true`; None otherwise.
        """
        cfg = self.instruction.backend_config
        costs = cfg.get("reification_cost") if isinstance(cfg, dict) else None
        for cost in costs if isinstance(costs, list) else []:
            value = cost.get("exec_time_us") if isinstance(cost, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                return float(value)
        return None

    @property
    def target(self) -> str:
        """The custom-call target or fusion backend kind, '' for plain fusions/ops."""
        return self.instruction.custom_call_target or self.instruction.backend_kind

    def __repr__(self) -> str:
        return (f"Kernel({self.name}, {self.category}, read={self.bytes_read}, written={self.bytes_written}, "
                f"flops={self.flops})")


# ---------------------------------------------------------------------------------------------------------
# Classification.

def classify(inst: Instruction) -> str:
    """The category key (see CATEGORIES) of an instruction that launches work.

    The start of an asynchronous op is classified as the op it runs (`reduce-scatter-start` and an `async-start`
    wrapping an all-gather are collectives, `custom-call-start` by its target)."""
    op = inst.opcode
    if op in _HOST or (op == "copy-start" and any(
            leaf.memory_space == HOST_MEMORY_SPACE for leaf in inst.shape.leaves())):
        return "host"
    if collective_instruction(inst) is not None:
        return "collective"
    if inst.async_phase == "start" and inst.async_wrapped_opcode:
        op = inst.async_wrapped_opcode
    if op == "fusion":
        kind = inst.fusion_kind
        backend = inst.backend_kind
        if kind == "kCustom" or backend:
            if backend in ("__triton_gemm", "__triton_nested_gemm_fusion", "__triton_scaled_dot_fusion"):
                return "triton_gemm"
            if backend.startswith("__triton"):
                fused = {i.opcode for c in inst.called_computations[:1] for i in c.instructions}
                return "triton_reduction" if "reduce" in fused else "triton_fusion"
            if backend.startswith("__cudnn"):
                return "cudnn"
            if backend.startswith(("__ynn", "__onednn", "__xnn")):
                return "cpu_fusion"
            if backend.startswith("__cub"):
                return "custom_fusion"
            return "custom_fusion" if kind == "kCustom" else _plain_fusion_category(inst)
        return _plain_fusion_category(inst)
    if op == "custom-call":
        target = inst.custom_call_target
        if target.startswith("__cublas$") or target.startswith("__cublasLt"):
            return "cublas"
        if target.startswith("__cudnn$"):
            return "cudnn"
        if target in ("__gpu$xla.gpu.triton", "triton_kernel_call"):
            return "pallas"
        if target.startswith("mosaic_gpu") or target == "tpu_custom_call":
            return "mosaic"
        return "custom_call"
    if op in ("copy", "copy-start"):
        return "copy"
    if op in ("dot", "ragged-dot", "scaled-dot"):
        return "dot"
    if op == "convolution":
        return "convolution"
    return "unfused"


def _heroes(comp: Computation) -> list[Instruction]:
    """The ops a fusion's emitter is chosen by: the root (each output of a tuple root), looking through
    bitcasts and elementwise conversions. Each instruction is looked at once (tuples may share operands)."""
    heroes, stack, seen = [], [comp.root], set()
    while stack:
        inst = stack.pop()
        if id(inst) in seen:
            continue
        seen.add(id(inst))
        if inst.opcode == "tuple":
            stack.extend(inst.operands)
        elif inst.opcode in ("bitcast", "convert", "reshape", "negate", "multiply", "add") and inst.operands:
            stack.append(inst.operands[0])
        else:
            heroes.append(inst)
    return heroes


def _plain_fusion_category(inst: Instruction) -> str:
    kind = inst.fusion_kind
    if kind == "kOutput":
        return "output"
    if kind != "kInput" or not inst.called_computations:
        return "loop"
    hero_ops = {h.opcode for h in _heroes(inst.called_computations[0])}
    for opcodes, category in (({"reduce", "reduce-window"}, "reduction"), ({"transpose", "copy"}, "transpose"),
                              ({"scatter"}, "scatter"), ({"concatenate"}, "concatenate")):
        if hero_ops & opcodes:
            return category
    fused = {i.opcode for i in inst.called_computations[0].instructions}
    return "reduction" if "reduce" in fused else "loop"


# ---------------------------------------------------------------------------------------------------------
# Bytes.

def _buffer_source(inst: Instruction) -> Instruction:
    """Follow bitcasts (same buffer, new shape) to the instruction that owns the buffer. Each bitcast's answer
    is kept (per computation), so a long chain read by many kernels is walked once."""
    if inst.opcode != "bitcast" or not inst.operands:
        return inst
    known = inst.computation.cache.setdefault("buffer_source", {}) if inst.computation else {}
    chain = []
    while inst.opcode == "bitcast" and inst.operands and id(inst) not in known:
        chain.append(inst)
        inst = inst.operands[0]
    source = known.get(id(inst), inst)
    for bitcast in chain:
        known[id(bitcast)] = source
    return source


def written_shape(inst: Instruction) -> Shape:
    """What an instruction writes: its shape, except for the start of an asynchronous op, whose tuple also
    holds its operands and context: `((operands), output, context)` for async-start (sugar included),
    all-gather-start and collective-permute-start; `(destination, source, context)` for copy-start.
    all-reduce-start's shape is its output."""
    shape = inst.shape
    if inst.async_phase == "start" and shape.is_tuple and inst.opcode != "all-reduce-start":
        index = 0 if inst.opcode == "copy-start" else 1
        if len(shape.tuple_shapes) > index:
            return shape.tuple_shapes[index]
    return shape


def _output_bytes(inst: Instruction, tiled: bool) -> int:
    """HBM bytes an instruction writes (a library call's workspace left out)."""
    leaves = list(written_shape(inst).leaves())
    if inst.opcode == "custom-call" and inst.shape.is_tuple and len(leaves) > 1:
        last = leaves[-1]
        if last.dtype in ("u8", "s8") and len(last.dims) == 1:
            leaves = leaves[:-1]  # library workspace
    return sum(s.size_bytes for s in leaves if hbm_resident(s, tiled))


def _fusion_parameter_reads(inst: Instruction) -> dict[int, int]:
    """Operand index -> bytes read, for fusion parameters used only through slices (or not read at all)."""
    reads: dict[int, int] = {}
    if inst.opcode != "fusion" or not inst.called_computations:
        return reads
    comp = inst.called_computations[0]
    users: dict[str, list[Instruction]] = collections.defaultdict(list)
    for i in comp.instructions:
        for o in i.operands:
            users[o.name].append(i)
    for param in comp.parameters:
        index = param.parameter_number
        if index is None:
            continue
        param_users = _users_through_bitcasts(param, users)
        if param_users and all(u.opcode in ("slice", "dynamic-slice") and u.operands and
                               _buffer_source(u.operands[0]) is param for u in param_users):
            reads[index] = sum(u.shape.size_bytes for u in param_users)
        elif param_users and all(u.opcode == "dynamic-update-slice" and u.operands and
                                 _buffer_source(u.operands[0]) is param and u.is_root for u in param_users):
            reads[index] = 0  # updated in place: only the update is read and written
    return reads


def _users_through_bitcasts(inst: Instruction, users: dict[str, list[Instruction]]) -> list[Instruction]:
    """The users of `inst`, looking through bitcasts of it (iteratively: chains may be long)."""
    out, stack = [], [inst]
    while stack:
        for u in users.get(stack.pop().name, []):
            if u.opcode == "bitcast":
                stack.append(u)
            else:
                out.append(u)
    return out


def _in_place_update_bytes(inst: Instruction) -> int | None:
    """For a dynamic-update-slice (fused or not) into its operand: bytes of the update written."""
    root = inst
    if inst.opcode == "fusion" and inst.called_computations:
        root = inst.called_computations[0].root
    if root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
        target = _buffer_source(root.operands[0])
        if target.opcode == "parameter" or inst.opcode == "dynamic-update-slice":
            return root.operands[1].shape.size_bytes
    return None


def _bytes(inst: Instruction, tiled: bool = False) -> tuple[int, int, list[tuple[Instruction, int]]]:
    """(bytes_read, bytes_written, [(operand buffer, bytes read)]) of a launched instruction: HBM bytes only
    (``tiled``: the program's layouts carry tiles, a TPU's, see ``shapes.hbm_resident``)."""
    partial = _fusion_parameter_reads(inst)
    seen: dict[int, tuple[Instruction, int]] = {}
    for index, operand in enumerate(inst.operands):
        source = _buffer_source(operand)
        nbytes = partial.get(index, operand.shape.size_bytes)
        if operand.shape.is_tuple or not hbm_resident(operand.shape, tiled):
            nbytes = 0  # a tuple operand (while/call state) is plumbing, its leaves counted by users; or not in HBM
        key = id(source)
        if key in seen:
            seen[key] = (source, max(seen[key][1], nbytes))
        else:
            seen[key] = (source, nbytes)
    if inst.opcode in ("slice", "dynamic-slice") and inst.operands:
        src = _buffer_source(inst.operands[0])
        seen[id(src)] = (src, inst.shape.size_bytes if hbm_resident(inst.operands[0].shape, tiled) else 0)
    update = _in_place_update_bytes(inst)
    if update is not None and not all(hbm_resident(leaf, tiled) for leaf in inst.shape.leaves()):
        update = 0
    if inst.opcode == "dynamic-update-slice" and inst.operands:
        src = _buffer_source(inst.operands[0])
        seen[id(src)] = (src, 0)
    reads = list(seen.values())
    written = update if update is not None else _output_bytes(inst, tiled)
    return sum(n for _, n in reads), written, reads


# ---------------------------------------------------------------------------------------------------------
# FLOPs.

def _dot_flops(result: Shape, lhs: Shape, contracting_dims: tuple[int, ...] | list[int]) -> int | None:
    """2 per multiply-add; None when the dimension numbers do not fit the shapes (a library call's config)."""
    if result.is_tuple:
        result = next(result.leaves(), None)
    if result is None or lhs.is_tuple or any(not 0 <= d < len(lhs.dims) for d in contracting_dims):
        return None
    return 2 * result.num_elements * math.prod(lhs.dims[d] for d in contracting_dims)


def _first_leaf_elements(shape: Shape) -> int:
    return next((leaf.num_elements for leaf in shape.leaves()), 0)


# Counts past these are clamped: no program launches 2**63 kernels or does 2**127 FLOPs, and hostile text
# (nested windows and loops of int64 sizes) would otherwise make numbers too long to print as JSON.
MAX_LAUNCHES = 2 ** 63 - 1
MAX_FLOPS = 2 ** 127 - 1


def _instruction_flops(inst: Instruction) -> tuple[int, int]:
    """(flops, transcendentals) of one non-fusion instruction, recursing into called computations."""
    flops, transcendentals = _unclamped_flops(inst)
    return min(flops, MAX_FLOPS), min(transcendentals, MAX_FLOPS)


def _unclamped_flops(inst: Instruction) -> tuple[int, int]:
    op = inst.opcode
    if inst.async_phase:  # the start of an asynchronous op does the work of the op it wraps; the rest none
        if inst.async_phase != "start" or not inst.async_wrapped_opcode:
            return 0, 0
        op = inst.async_wrapped_opcode
    if op == "all-reduce":  # HloCostAnalysis::HandleAllReduce: one reduction per output element
        return sum(leaf.num_elements for leaf in inst.shape.leaves()), 0
    if op in ("dot", "ragged-dot", "scaled-dot"):
        # parse() checked the dimension numbers (hlo_inspect.validate).
        contracting = tuple(int(x) for x in inst.attrs.get("lhs_contracting_dims", "{}").strip("{} ").split(",")
                            if x.strip())
        return _dot_flops(inst.shape, inst.operands[0].shape, contracting) or 0, 0
    if op == "convolution":
        return _convolution_flops(inst), 0
    if op == "reduce":
        # Combining n elements into one takes n - 1 applications of the reducer (as XLA counts).
        inputs = inst.operands[: len(inst.operands) // 2] or inst.operands
        outputs = sum(s.num_elements for s in inst.shape.leaves())
        per_element = max(sum(_computation_flops(c)[0] for c in inst.called_computations), 1)
        return max(sum(o.shape.num_elements for o in inputs) - outputs, 0) * per_element, 0
    if op == "reduce-window":
        per_element = max(sum(_computation_flops(c)[0] for c in inst.called_computations), 1)
        window = math.prod(_int_list_attr(inst.attrs.get("window", ""), "size") or (1,))
        return _first_leaf_elements(inst.shape) * max(window - 1, 0) * per_element, 0
    if op in ("fusion", "call"):
        total = [0, 0]
        for comp in inst.called_computations:
            f, t = _computation_flops(comp)
            total[0] += f
            total[1] += t
        return total[0], total[1]
    if op in ("map",):
        return inst.shape.num_elements * sum(_computation_flops(c)[0] for c in inst.called_computations), 0
    if op in _DATA_MOVEMENT or op in _NO_WORK or op in COLLECTIVE_OPCODES or op in _HOST:
        return 0, 0
    if inst.shape.is_tuple:
        return 0, 0
    n = inst.shape.num_elements
    return (0, n) if op in _TRANSCENDENTAL else (n, 0)  # XLA counts transcendentals apart from flops


def _int_list_attr(text: str, key: str) -> tuple[int, ...]:
    """`{size=3x3 stride=2x2}` with key 'size' -> (3, 3)."""
    for item in text.strip("{}").split():
        name, _, value = item.partition("=")
        if name == key:
            return tuple(int(v) for v in value.split("x") if v.lstrip("-").isdigit())
    return ()


def _computation_flops(comp: Computation) -> tuple[int, int]:
    """(flops, transcendentals) of one run of a computation; computed once per computation (reducers and
    fused computations are shared by many callers)."""
    cached = comp.cache.get("flops")
    if cached is None:
        flops = trans = 0
        for inst in comp.instructions:
            f, t = _instruction_flops(inst)
            flops += f
            trans += t
        cached = comp.cache["flops"] = (min(flops, MAX_FLOPS), min(trans, MAX_FLOPS))
    return cached


def _convolution_flops(inst: Instruction) -> int:
    """2 per multiply-add: each output element takes (kernel spatial size x input features / groups) of them.
    parse() checked that dim_labels (e.g. `b01f_01io->b01f`) fit the shapes and the group count is positive."""
    lhs, rhs = inst.operands[0].shape, inst.operands[1].shape
    labels = inst.attrs.get("dim_labels", "").strip()
    groups = int(inst.attrs.get("feature_group_count", "1"))
    outputs = _first_leaf_elements(inst.shape)
    if not labels:  # no labels printed: XLA's default layout, features last
        return 2 * outputs * math.prod(rhs.dims[:-1] or (1,))
    lhs_labels, rest = labels.split("_", 1)
    kernel_labels = rest.split("->")[0]
    kernel_spatial = math.prod(rhs.dims[i] for i, c in enumerate(kernel_labels) if c not in "io")
    input_features = lhs.dims[lhs_labels.index("f")] // groups
    return 2 * outputs * kernel_spatial * input_features


def _dimension_list(value) -> list[int] | None:
    """A backend_config list of dimension numbers (ints or digit strings), None if it is anything else."""
    if not isinstance(value, list):
        return None
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, str)) or not str(item).isdigit():
            return None
        out.append(int(item))
    return out


def _library_flops(inst: Instruction) -> int | None:
    """FLOPs of a cuBLAS GEMM or cuDNN attention call from its backend_config; None when unknown (absent, or
    dimension numbers that do not fit the operands)."""
    cfg = inst.backend_config if isinstance(inst.backend_config, dict) else {}
    gemm = cfg.get("gemm_backend_config")
    if isinstance(gemm, dict) and inst.operands:
        dims = gemm.get("dot_dimension_numbers", {})
        contracting = _dimension_list(dims.get("lhs_contracting_dimensions", []) if isinstance(dims, dict) else None)
        return None if contracting is None else _dot_flops(inst.shape, inst.operands[0].shape, contracting)
    fmha = cfg.get("cudnn_fmha_backend_config")
    if isinstance(fmha, dict):
        dims = fmha.get("bmm1_dot_dimension_numbers")
        if not isinstance(dims, dict) or len(inst.operands) < 2:
            return None
        q, k = inst.operands[0].shape, inst.operands[1].shape  # Q·Kᵀ is bmm1: batch (B, N), rows T, depth H
        lists = [_dimension_list(dims.get(key, [])) for key in (
            "lhs_batch_dimensions", "lhs_contracting_dimensions", "rhs_batch_dimensions",
            "rhs_contracting_dimensions")]
        if q.is_tuple or k.is_tuple or any(d is None for d in lists):
            return None
        lhs_batch, lhs_contract, rhs_batch, rhs_contract = lists
        if any(d >= len(q.dims) for d in lhs_batch + lhs_contract) or any(
                d >= len(k.dims) for d in rhs_batch + rhs_contract):
            return None
        rhs_free = [i for i in range(len(k.dims)) if i not in rhs_batch + rhs_contract]
        batch = math.prod(q.dims[i] for i in lhs_batch)
        depth = math.prod(q.dims[i] for i in lhs_contract)
        rows = math.prod(q.dims[i] for i in range(len(q.dims)) if i not in lhs_batch + lhs_contract)
        cols = math.prod(k.dims[i] for i in rhs_free)
        total = 4 * batch * rows * cols * depth  # Q·Kᵀ and P·V, 2 FLOPs per multiply-add each
        if "Backward" in inst.custom_call_target:
            total = total * 5 // 2  # five matmuls instead of two
        if "CAUSAL" in str(fmha.get("mask_type", "")).upper():
            total //= 2
        return total
    return None


# ---------------------------------------------------------------------------------------------------------
# Scopes and source lines.

_PLUMBING = frozenset({"parameter", "tuple", "get-tuple-element"})


def fused_instructions(inst: Instruction) -> Iterator[Instruction]:
    """The instruction and, for fusions and async-starts, everything inside (nested fusions too; not reducer
    bodies)."""
    yield inst
    if inst.opcode in ("fusion", "async-start"):
        for comp in inst.called_computations:
            for i in comp.instructions:
                yield from fused_instructions(i)


def _user_line(module: Module, inst: Instruction) -> str:
    md = inst.metadata
    if md.stack_frame_id and module.source:
        location = module.source.user_location(md.stack_frame_id)
        if location:
            return location
    if md.source_file:
        return f"{md.source_file}:{md.source_line}"
    return ""


def _provenance(module: Module, inst: Instruction) -> tuple[collections.Counter, list[str], list[str]]:
    ops: collections.Counter = collections.Counter()
    scope_counts: collections.Counter = collections.Counter()
    line_counts: collections.Counter = collections.Counter()
    for i in fused_instructions(inst):
        if i.opcode not in _PLUMBING and not (i is inst and i.opcode in ("fusion", "async-start")):
            ops[i.async_wrapped_opcode or i.opcode] += 1  # `all-reduce-start` runs an all-reduce
        if i.metadata.op_name:
            for name in i.metadata.op_name.split(";"):
                scope = scope_of(name)
                if scope:
                    scope_counts[scope] += 1
        line = _user_line(module, i)
        if line:
            line_counts[line] += 1
    return ops, [s for s, _ in scope_counts.most_common()], [l for l, _ in line_counts.most_common()]


# ---------------------------------------------------------------------------------------------------------
# Walking the program.

def trip_count(inst: Instruction) -> int | None:
    """`backend_config={"known_trip_count":{"n":"8"}}` -> 8; None when absent or not a count."""
    cfg = inst.backend_config
    known = cfg.get("known_trip_count") if isinstance(cfg, dict) else None
    n = known.get("n") if isinstance(known, dict) else None
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    return int(n) if isinstance(n, str) and n.isdigit() else None


def _dones(comp: Computation) -> dict[int, Instruction]:
    """id(start) -> its `-done`, for the asynchronous ops of a computation (through any `-update`s)."""
    out = {}
    for inst in comp.instructions:
        if inst.async_phase != "done":
            continue
        start = inst.operands[0] if inst.operands else None
        while start is not None and start.async_phase == "update" and start.operands:
            start = start.operands[0]
        if start is not None and start.async_phase == "start":
            out[id(start)] = inst
    return out


def tiled_layouts(module: Module) -> bool:
    """Whether the program's layouts carry tiles (`{1,0:T(8,128)}`), as a TPU's do: its memory spaces then mean
    on-chip memories (``shapes.hbm_resident``). Kept in the entry computation's cache."""
    cache = module.entry.cache
    if "tiled_layouts" not in cache:
        cache["tiled_layouts"] = any(leaf.tiles for inst in module.instructions() for leaf in inst.shape.leaves())
    return cache["tiled_layouts"]


def _walk(module: Module, comp: Computation, loop: str, launches: int, out: list[Kernel]) -> None:
    dones = None
    for inst in comp.instructions:
        op = inst.opcode
        if op in _NO_WORK or inst.async_phase in ("update", "done"):
            continue
        if op in _CONTROL_FLOW:
            if op == "while":
                body = next(iter(inst.called("body")), None)
                cond = next(iter(inst.called("condition")), None)
                trips = trip_count(inst)
                n = min(launches * (trips if trips is not None else 1), MAX_LAUNCHES)
                if cond is not None:
                    _walk(module, cond, cond.name, min(n + (launches if trips is not None else 0), MAX_LAUNCHES),
                          out)
                if body is not None:
                    _walk(module, body, body.name, n, out)
            else:
                for called in inst.called_computations:
                    _walk(module, called, loop, launches, out)
            continue
        if op == "async-start" and collective_instruction(inst) is None:
            for called in inst.called_computations:
                _walk(module, called, loop, launches, out)
            continue
        category = classify(inst)
        bytes_read, bytes_written, reads = _bytes(inst, tiled_layouts(module))
        if category in ("cublas", "cudnn") and op == "custom-call":
            flops, trans = _library_flops(inst), 0
            flops = None if flops is None else min(flops, MAX_FLOPS)
        elif category in ("pallas", "mosaic", "custom_call"):
            flops, trans = None, 0
        else:
            flops, trans = _instruction_flops(inst)
        ops, scopes, lines = _provenance(module, inst)
        done = None
        if inst.async_phase == "start":
            dones = _dones(comp) if dones is None else dones
            done = dones.get(id(inst))
        out.append(Kernel(name=inst.name, category=category, instruction=inst, ops=ops, bytes_read=bytes_read,
                          bytes_written=bytes_written, flops=flops, transcendentals=trans, scopes=scopes,
                          source_lines=lines, loop=loop, launches=launches, reads=reads,
                          collective=collective(inst, module.header_attrs) if category == "collective" else None,
                          done=done))


def kernels(module: Module) -> list[Kernel]:
    """Every kernel the entry computation launches, in program order; while/conditional/call bodies walked."""
    out: list[Kernel] = []
    with gc_paused():
        _walk(module, module.entry, "", 1, out)
    return out
