"""Optimized HLO text -> `Module` / `Computation` / `Instruction`.

Reads what `jax.jit(f).lower(...).compile().as_text()` prints (any backend) and the per-pass dumps XLA writes
with `--xla_dump_hlo_as_text`. Pure Python: no JAX import.

    module = parse(open("dump.txt").read())
    for inst in module.entry.instructions: print(inst.name, inst.opcode, inst.shape)

Shapes carry dtype, dimensions and layout (`f32[64,512]{1,0}`), tuples nest. Operands are resolved to the
instruction that defines them. Attributes we understand (`kind=`, `calls=`, `to_apply=`, `custom_call_target=`,
`backend_config` as JSON, `frontend_attributes`, `metadata`, `dimensions=`, `slice=`) are parsed; every other
attribute is kept as raw text in `Instruction.attrs`. Malformed text raises `HloParseError` naming the line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Iterator

from hlo_inspect.source import SourceTables, parse_table_line, TABLE_NAMES

__all__ = [
    "HloParseError", "Shape", "Metadata", "Instruction", "Computation", "Module", "parse", "OPCODES",
    "DTYPE_BITS",
]


class HloParseError(ValueError):
    """Text that is not HLO as XLA prints it. `line_no` is 1-based; `line` the offending text."""

    def __init__(self, message: str, line_no: int | None = None, line: str | None = None):
        self.message, self.line_no, self.line = message, line_no, line
        where = f"line {line_no}: " if line_no is not None else ""
        shown = ""
        if line is not None:
            text = line.strip()
            shown = "\n    " + (text if len(text) <= 200 else text[:200] + " ...")
        super().__init__(f"{where}{message}{shown}")


# Bits per element of each HLO primitive type.
DTYPE_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64,
    "c128": 128, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8,
    "f8e4m3fnuz": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4, "token": 0, "opaque": 0,
}

# Every opcode XLA's HLO printer emits (hlo_opcode.h). An opcode outside this set is a parse error.
OPCODES = frozenset("""
abs add add-dependency after-all all-gather all-gather-done all-gather-start all-reduce all-reduce-done
all-reduce-start all-to-all and async-done async-start async-update atan2 batch-norm-grad batch-norm-inference
batch-norm-training bitcast bitcast-convert broadcast call cbrt ceil cholesky clamp clz collective-broadcast
collective-permute collective-permute-done collective-permute-start compare complex concatenate conditional
constant convert convolution copy copy-done copy-start cosine custom-call divide domain dot dynamic-reshape
dynamic-slice dynamic-update-slice erf exponential exponential-minus-one fft floor fusion gather
get-dimension-size get-tuple-element imag infeed iota is-finite log log-plus-one logistic map maximum minimum
multiply negate not opt-barrier optimization-barrier or outfeed pad parameter partition-id popcnt power
ragged-all-to-all ragged-dot real recv recv-done reduce reduce-precision reduce-scatter reduce-window remainder
replica-id reshape reverse rng rng-bit-generator rng-get-and-update-state round-nearest-afz round-nearest-even
rsqrt scaled-dot scatter select select-and-scatter send send-done set-dimension-size shift-left
shift-right-arithmetic shift-right-logical sign sine slice sort sqrt stochastic-convert subtract tan tanh topk
transpose triangular-solve tuple while xor
""".split())

# Attributes whose values name computations this instruction calls.
_CALLED_COMPUTATION_ATTRS = (
    "calls", "to_apply", "condition", "body", "branch_computations", "true_computation", "false_computation",
    "called_computations",
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """An array shape (`dtype`, `dims`, `layout` as minor-to-major) or a tuple of shapes (`tuple_shapes`)."""

    dtype: str | None = None
    dims: tuple[int, ...] = ()
    layout: tuple[int, ...] | None = None
    tuple_shapes: tuple["Shape", ...] | None = None
    layout_extra: str = ""  # tiling / memory space after ':' in the layout, kept raw

    @property
    def is_tuple(self) -> bool:
        return self.tuple_shapes is not None

    def leaves(self) -> Iterator["Shape"]:
        """The array shapes inside, depth first (itself for an array)."""
        if self.is_tuple:
            for s in self.tuple_shapes:
                yield from s.leaves()
        else:
            yield self

    @property
    def num_elements(self) -> int:
        """Elements of an array shape (0 for tuples)."""
        return 0 if self.is_tuple else math.prod(self.dims)

    @property
    def size_bytes(self) -> int:
        """Bytes of all array leaves, rounded up to whole bytes per array."""
        total = 0
        for leaf in self.leaves():
            total += (leaf.num_elements * DTYPE_BITS.get(leaf.dtype, 0) + 7) // 8
        return total

    def __str__(self) -> str:
        if self.is_tuple:
            return "(" + ", ".join(str(s) for s in self.tuple_shapes) + ")"
        s = f"{self.dtype}[{','.join(str(d) for d in self.dims)}]"
        if self.layout is not None:
            s += "{" + ",".join(str(d) for d in self.layout) + (":" + self.layout_extra if self.layout_extra else "") + "}"
        return s


@dataclasses.dataclass
class Metadata:
    """`metadata={...}` of an instruction: JAX's op_name path and source location (inline or via stack frame)."""

    op_name: str = ""
    op_type: str = ""
    source_file: str = ""
    source_line: int = 0
    stack_frame_id: int = 0
    raw: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class Instruction:
    """One HLO instruction. `operands` are the defining instructions, in order (same computation)."""

    name: str
    opcode: str
    shape: Shape
    operand_names: list[str]
    attrs: dict[str, str]
    metadata: Metadata
    line_no: int
    is_root: bool = False
    literal: str = ""  # constant(...) / parameter number / other parenthesised payload, raw
    backend_config: dict | str | None = None
    frontend_attributes: dict[str, str] = dataclasses.field(default_factory=dict)
    operands: list["Instruction"] = dataclasses.field(default_factory=list)
    computation: "Computation | None" = dataclasses.field(default=None, repr=False)
    called_computations: list["Computation"] = dataclasses.field(default_factory=list, repr=False)

    @property
    def fusion_kind(self) -> str:
        """`kLoop`, `kInput`, `kOutput`, `kCustom` for fusions; '' otherwise."""
        return self.attrs.get("kind", "")

    @property
    def backend_kind(self) -> str:
        """The GPU/CPU fusion backend kind (`__triton_gemm`, `__ynn_fusion`, ...) from backend_config, or ''."""
        cfg = self.backend_config
        if isinstance(cfg, dict):
            for key in ("fusion_backend_config", "fusion_config"):
                sub = cfg.get(key)
                if isinstance(sub, dict) and "kind" in sub:
                    return str(sub["kind"])
        return ""

    @property
    def custom_call_target(self) -> str:
        return _unquote(self.attrs.get("custom_call_target", ""))

    @property
    def parameter_number(self) -> int | None:
        return int(self.literal) if self.opcode == "parameter" and self.literal.strip().isdigit() else None

    @property
    def dimensions(self) -> tuple[int, ...]:
        return _int_list(self.attrs.get("dimensions", ""))

    @property
    def tuple_index(self) -> int | None:
        return int(self.attrs["index"]) if "index" in self.attrs else None

    @property
    def slice_bounds(self) -> list[tuple[int, int, int]]:
        """`slice={[0:64], [128:256:2]}` as (start, limit, stride) per dimension; [] when absent."""
        text = self.attrs.get("slice", "")
        out = []
        for m in re.finditer(r"\[(-?\d+):(-?\d+)(?::(-?\d+))?\]", text):
            out.append((int(m.group(1)), int(m.group(2)), int(m.group(3) or 1)))
        return out

    def __repr__(self) -> str:
        return f"Instruction({self.name} = {self.shape} {self.opcode}(...), line {self.line_no})"


@dataclasses.dataclass(eq=False)
class Computation:
    name: str
    instructions: list[Instruction]
    is_entry: bool
    line_no: int
    parameter_text: str = ""
    result_text: str = ""

    def __post_init__(self):
        self.by_name = {inst.name: inst for inst in self.instructions}

    @property
    def root(self) -> Instruction:
        for inst in self.instructions:
            if inst.is_root:
                return inst
        return self.instructions[-1]

    @property
    def parameters(self) -> list[Instruction]:
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: i.parameter_number if i.parameter_number is not None else 0)

    def __repr__(self) -> str:
        return f"Computation({self.name}, {len(self.instructions)} instructions)"


@dataclasses.dataclass(eq=False)
class Module:
    name: str
    header_attrs: dict[str, str]
    computations: dict[str, Computation]
    entry: Computation
    source: SourceTables

    def instructions(self) -> Iterator[Instruction]:
        for comp in self.computations.values():
            yield from comp.instructions

    def __repr__(self) -> str:
        return f"Module({self.name}, {len(self.computations)} computations, entry {self.entry.name})"


# ---------------------------------------------------------------------------------------------------------
# Low-level scanning helpers.

_COMMENT_RE = re.compile(r"/\*.*?\*/")
_BRACKETS = {"(": ")", "{": "}", "[": "]"}
_SPECIAL_RE = re.compile(r'[(){}\[\],"\\]')


def _strip_comments(line: str) -> str:
    if "/*" not in line:
        return line
    # Comments never occur inside strings in printed HLO except in backend_config JSON, which has no '/*'.
    return _COMMENT_RE.sub("", line)


def _match_close(text: str, start: int, line_no: int, line: str) -> int:
    """Index just past the bracket that closes text[start] (which is an opening bracket)."""
    stack = [_BRACKETS[text[start]]]
    in_string = False
    pos = start + 1
    for m in _SPECIAL_RE.finditer(text, pos):
        ch = m.group()
        if in_string:
            if ch == "\\":
                continue  # handled by skipping below
            if ch == '"' and not _escaped(text, m.start()):
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in _BRACKETS:
            stack.append(_BRACKETS[ch])
        elif ch in ")}]":
            if not stack or ch != stack[-1]:
                raise HloParseError(f"unbalanced '{ch}' at column {m.start() + 1}", line_no, line)
            stack.pop()
            if not stack:
                return m.end()
    raise HloParseError(f"'{text[start]}' opened at column {start + 1} is never closed (truncated text?)",
                        line_no, line)


def _escaped(text: str, pos: int) -> bool:
    backslashes = 0
    pos -= 1
    while pos >= 0 and text[pos] == "\\":
        backslashes += 1
        pos -= 1
    return backslashes % 2 == 1


def _split_top_level(text: str, line_no: int, line: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside brackets and strings."""
    parts, depth, start, in_string = [], [], 0, False
    pattern = _SPECIAL_RE if sep == "," else re.compile(r'[(){}\[\]"\\' + re.escape(sep) + "]")
    for m in pattern.finditer(text):
        ch, i = m.group(), m.start()
        if in_string:
            if ch == '"' and not _escaped(text, i):
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in _BRACKETS:
            depth.append(_BRACKETS[ch])
        elif ch in ")}]":
            if not depth or depth[-1] != ch:
                raise HloParseError(f"unbalanced '{ch}' at column {i + 1}", line_no, line)
            depth.pop()
        elif ch == sep and not depth:
            parts.append(text[start:i])
            start = i + 1
    if in_string:
        raise HloParseError("unterminated string (truncated text?)", line_no, line)
    if depth:
        raise HloParseError(f"a bracket is never closed: expected '{depth[-1]}' (truncated text?)", line_no, line)
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
        body = value[1:-1]
        if "\\" in body:
            body = re.sub(r"\\(.)", r"\1", body)
        return body
    return value


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"-?\d+", text))


# ---------------------------------------------------------------------------------------------------------
# Shapes.

_ARRAY_SHAPE_RE = re.compile(
    r"([a-z][a-z0-9]*)\[([^\]]*)\](?:\{([^}]*)\})?"
)


def parse_shape(text: str, line_no: int | None = None, line: str | None = None) -> Shape:
    """`f32[64,512]{1,0}`, `(f32[2], s32[])`, `bf16[]`, `token[]`, `f32[<=8]` -> Shape."""
    text = text.strip()
    if text.startswith("("):
        end = _match_close(text, 0, line_no, line or text)
        if text[end:].strip():
            raise HloParseError(f"unexpected text after tuple shape: {text[end:]!r}", line_no, line or text)
        inner = text[1:end - 1]
        parts = _split_top_level(inner, line_no, line or text) if inner.strip() else []
        return Shape(tuple_shapes=tuple(parse_shape(p, line_no, line) for p in parts))
    m = _ARRAY_SHAPE_RE.fullmatch(text)
    if not m:
        raise HloParseError(f"malformed shape {text!r}", line_no, line or text)
    dtype = m.group(1)
    if dtype not in DTYPE_BITS:
        raise HloParseError(f"unknown element type {dtype!r} in shape {text!r}", line_no, line or text)
    dims_text = m.group(2).strip()
    dims = tuple(int(d.strip().lstrip("<=")) for d in dims_text.split(",")) if dims_text else ()
    layout, extra = None, ""
    if m.group(3) is not None:
        layout_text = m.group(3)
        if ":" in layout_text:
            layout_text, extra = layout_text.split(":", 1)
        layout = _int_list(layout_text)
    return Shape(dtype=dtype, dims=dims, layout=layout, layout_extra=extra)


def _take_shape(text: str, line_no: int, line: str) -> tuple[Shape, str]:
    """Parse a shape at the start of text; return it and the rest."""
    text = text.lstrip()
    if text.startswith("("):
        end = _match_close(text, 0, line_no, line)
        return parse_shape(text[:end], line_no, line), text[end:]
    m = _ARRAY_SHAPE_RE.match(text)
    if not m:
        raise HloParseError(f"expected a shape, found {text[:40]!r}", line_no, line)
    return parse_shape(m.group(0), line_no, line), text[m.end():]


# ---------------------------------------------------------------------------------------------------------
# Instructions.

_INSTRUCTION_HEAD_RE = re.compile(r"\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_METADATA_ITEM_RE = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s}]+)')


def _parse_metadata(text: str) -> Metadata:
    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    raw = {k: _unquote(v) for k, v in _METADATA_ITEM_RE.findall(body)}
    md = Metadata(raw=raw, op_name=raw.get("op_name", ""), op_type=raw.get("op_type", ""),
                  source_file=raw.get("source_file", ""))
    if raw.get("source_line", "").lstrip("-").isdigit():
        md.source_line = int(raw["source_line"])
    if raw.get("stack_frame_id", "").isdigit():
        md.stack_frame_id = int(raw["stack_frame_id"])
    return md


def _parse_frontend_attributes(text: str, line_no: int, line: str) -> dict[str, str]:
    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    out = {}
    for item in _split_top_level(body, line_no, line):
        key, _, value = item.partition("=")
        out[key.strip()] = _unquote(value)
    return out


def _parse_backend_config(text: str) -> dict | str:
    """JSON (most GPU ops), or the MLIR attribute dictionary of a Triton custom call (`{grid_x = 4 : i32,
    name = "kernel", ir = "...", ...}`: values kept as text, the quotes of strings dropped, their MLIR escapes
    kept); other text is returned as is."""
    text = text.strip()
    if text.startswith('"'):  # older printers quote the JSON
        text = _unquote(text)
    try:
        return json.loads(text)
    except ValueError:
        pass
    if text.startswith("{") and text.endswith("}") and " = " in text:
        try:
            items = _split_top_level(text[1:-1], 0, text[:80])
        except HloParseError:
            return text
        pairs = [item.partition(" = ") for item in items]
        if all(eq and key.strip().isidentifier() for key, eq, _ in pairs):
            unquote = lambda v: v[1:-1] if len(v) >= 2 and v[0] == v[-1] == '"' else v  # noqa: E731
            return {key.strip(): unquote(value.strip()) for key, _, value in pairs}
    return text


def _operand_name(text: str, line_no: int, line: str) -> str:
    """`%x.1`, `x.1` or (older printers) `f32[2]{0} %x.1` -> `x.1`."""
    text = text.strip()
    if "%" in text:
        return text[text.rindex("%") + 1:].strip()
    if " " in text:  # shape then bare name
        return text.rsplit(" ", 1)[1]
    return text


def parse_instruction(line: str, line_no: int) -> Instruction:
    text = _strip_comments(line)
    head = _INSTRUCTION_HEAD_RE.match(text)
    if not head:
        raise HloParseError("expected an instruction '%name = shape opcode(operands), attrs'", line_no, line)
    is_root, name = bool(head.group(1)), head.group(2)
    shape, rest = _take_shape(text[head.end():], line_no, line)
    op = _OPCODE_RE.match(rest)
    if not op:
        raise HloParseError(f"expected an opcode after the shape of %{name}, found {rest.strip()[:40]!r}",
                            line_no, line)
    opcode = op.group(1)
    if opcode not in OPCODES:
        raise HloParseError(f"unknown opcode {opcode!r} in %{name}", line_no, line)
    open_paren = op.end() - 1
    close = _match_close(rest, open_paren, line_no, line)
    payload = rest[open_paren + 1:close - 1]
    tail = rest[close:].strip()

    operand_names: list[str] = []
    literal = ""
    if opcode in ("constant", "parameter", "iota", "partition-id", "replica-id", "after-all") or (
            payload and not any(c in payload for c in "%") and opcode in ("rng-get-and-update-state",)):
        literal = payload.strip()
        if opcode == "after-all" and "%" in payload:
            literal = ""
            operand_names = [_operand_name(p, line_no, line) for p in _split_top_level(payload, line_no, line)]
    elif payload.strip():
        operand_names = [_operand_name(p, line_no, line) for p in _split_top_level(payload, line_no, line)]

    attrs: dict[str, str] = {}
    metadata = Metadata()
    backend_config = None
    frontend_attributes: dict[str, str] = {}
    if tail:
        if not tail.startswith(","):
            raise HloParseError(f"expected ',' before the attributes of %{name}, found {tail[:40]!r}",
                                line_no, line)
        for item in _split_top_level(tail[1:], line_no, line):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq:
                attrs[key] = ""
                continue
            if key == "metadata":
                metadata = _parse_metadata(value)
            elif key == "backend_config":
                backend_config = _parse_backend_config(value)
            elif key == "frontend_attributes":
                frontend_attributes = _parse_frontend_attributes(value, line_no, line)
            else:
                attrs[key] = value.strip()
    return Instruction(
        name=name, opcode=opcode, shape=shape, operand_names=operand_names, attrs=attrs, metadata=metadata,
        line_no=line_no, is_root=is_root, literal=literal, backend_config=backend_config,
        frontend_attributes=frontend_attributes,
    )


# ---------------------------------------------------------------------------------------------------------
# Module.

_COMPUTATION_HEAD_RE = re.compile(r"(ENTRY\s+)?%?([^\s(]+)\s*(\(.*\))?\s*(->\s*(.*?))?\s*\{\s*$")
_MODULE_HEAD_RE = re.compile(r"HloModule\s+([^\s,]+)\s*(,.*)?$")


def _called_names(inst: Instruction) -> list[str]:
    names = []
    for key in _CALLED_COMPUTATION_ATTRS:
        value = inst.attrs.get(key)
        if value:
            names.extend(n.strip().lstrip("%") for n in value.strip("{}").split(",") if n.strip())
    return names


def parse(text: str) -> Module:
    """Parse HLO module text. Raises `HloParseError` (with line number and text) on anything malformed."""
    if not isinstance(text, str):
        raise TypeError(f"parse() takes HLO text as str, got {type(text).__name__}")
    lines = text.splitlines()
    module_name, header_attrs = "", {}
    tables = SourceTables()
    computations: dict[str, Computation] = {}
    entry: Computation | None = None
    current: tuple[str, bool, int, str, str] | None = None  # name, is_entry, line_no, params, result
    current_insts: list[Instruction] = []
    table: str | None = None

    for idx, raw_line in enumerate(lines):
        line_no = idx + 1
        line = raw_line.strip()
        if not line or line.startswith("//"):
            if not line:
                table = None
            continue
        if current is not None:
            if line == "}":
                comp = Computation(name=current[0], instructions=current_insts, is_entry=current[1],
                                   line_no=current[2], parameter_text=current[3], result_text=current[4])
                if not comp.instructions:
                    raise HloParseError(f"computation {comp.name} has no instructions", comp.line_no)
                if comp.name in computations:
                    raise HloParseError(f"computation {comp.name} is defined twice", comp.line_no)
                computations[comp.name] = comp
                if comp.is_entry:
                    entry = comp
                current, current_insts = None, []
                continue
            current_insts.append(parse_instruction(raw_line, line_no))
            continue
        if line.startswith("HloModule"):
            m = _MODULE_HEAD_RE.match(line)
            if not m:
                raise HloParseError("malformed HloModule header", line_no, raw_line)
            module_name = m.group(1)
            if m.group(2):
                for item in _split_top_level(_strip_comments(m.group(2)[1:]), line_no, raw_line):
                    key, _, value = item.partition("=")
                    header_attrs[key.strip()] = value.strip()
            continue
        if line in TABLE_NAMES:
            table = line
            continue
        if table is not None and line[0].isdigit():
            try:
                parse_table_line(tables, table, line)
            except ValueError as e:
                raise HloParseError(f"malformed {table} entry: {e}", line_no, raw_line) from None
            continue
        if line.endswith("{"):
            m = _COMPUTATION_HEAD_RE.match(_strip_comments(line))
            if not m:
                raise HloParseError("malformed computation header", line_no, raw_line)
            current = (m.group(2), bool(m.group(1)), line_no, m.group(3) or "", m.group(5) or "")
            current_insts = []
            table = None
            continue
        raise HloParseError("unexpected text outside any computation", line_no, raw_line)

    if current is not None:
        raise HloParseError(f"computation {current[0]} is never closed with '}}' (truncated text?)",
                            len(lines), lines[-1] if lines else "")
    if not computations:
        raise HloParseError("no computations found: is this HLO text?", 1, lines[0] if lines else "")
    if entry is None:
        raise HloParseError("no ENTRY computation", 1, lines[0] if lines else "")
    module = Module(name=module_name, header_attrs=header_attrs, computations=computations, entry=entry,
                    source=tables)
    _link(module)
    return module


def _tuple_element(comp: Computation, name: str, user: Instruction) -> Instruction:
    """`x#1` (`x#1#0` nested): element 1 of tuple-shaped `x`, as newer XLA prints an operand without its
    get-tuple-element. Resolved to a get-tuple-element instruction made here (not added to the listing)."""
    if name in comp.by_name:
        return comp.by_name[name]
    base, _, index = name.rpartition("#")
    if not index.isdigit() or not base:
        raise HloParseError(f"%{user.name} uses %{name}, which computation {comp.name} does not define",
                            user.line_no)
    tuple_inst = _tuple_element(comp, base, user) if "#" in base else comp.by_name.get(base)
    if tuple_inst is None:
        raise HloParseError(f"%{user.name} uses %{base}, which computation {comp.name} does not define",
                            user.line_no)
    i = int(index)
    if not tuple_inst.shape.is_tuple or i >= len(tuple_inst.shape.tuple_shapes):
        raise HloParseError(f"%{user.name} uses %{name}, but %{base} has no tuple element {i}", user.line_no)
    element = Instruction(name=name, opcode="get-tuple-element", shape=tuple_inst.shape.tuple_shapes[i],
                          operand_names=[base], attrs={"index": str(i)}, metadata=Metadata(),
                          line_no=user.line_no, operands=[tuple_inst], computation=comp)
    comp.by_name[name] = element
    return element


def _link(module: Module) -> None:
    """Resolve operand names and called computations; check every reference exists."""
    for comp in module.computations.values():
        for inst in comp.instructions:
            inst.computation = comp
            operands = []
            for n in inst.operand_names:
                op = comp.by_name.get(n)
                if op is None:
                    op = _tuple_element(comp, n, inst)
                operands.append(op)
            inst.operands = operands
            called = []
            for cname in _called_names(inst):
                if cname not in module.computations:
                    raise HloParseError(f"%{inst.name} calls computation {cname}, which the module does not "
                                        "define (missing computation)", inst.line_no)
                called.append(module.computations[cname])
            inst.called_computations = called
