"""Optimized HLO text -> `Module` / `Computation` / `Instruction`.

Reads what `jax.jit(f).lower(...).compile().as_text()` prints (any backend) and the per-pass dumps XLA writes
with `--xla_dump_hlo_as_text`. Pure Python: no JAX import.

    module = parse(open("dump.txt").read())
    for inst in module.entry.instructions: print(inst.name, inst.opcode, inst.shape)

Shapes carry dtype, dimensions and layout (`f32[64,512]{1,0}`, see `hlo_inspect.shapes`), tuples nest. Operands
are resolved to the instruction that defines them. Attributes we understand (`kind=`, `calls=`, `to_apply=`,
`custom_call_target=`, `backend_config` as JSON, `frontend_attributes`, `metadata`, `dimensions=`, `slice=`) are
parsed; every other attribute is kept as raw text in `Instruction.attrs`. Strings are C-unescaped
(`op_name="caf\\303\\251"` -> 'café').

What XLA's printers write around the instructions is read too: `/* ... */` comment lines, `} // name` and
`}, execution_thread="..."` after a computation, an instruction continued over several lines (a large
constant), the async syntax sugar (`reduce-scatter-start`, see `hlo_inspect.opcodes`). A text holding several
modules is read up to the second one, with a warning in `Module.warnings`.

Every input ends in a Module or in `HloParseError` (line number, the offending text, what was expected), in time
linear in its length: after linking, `hlo_inspect.validate` rejects what the later stages could not walk
(cycles, wrong operand counts, dimension indices out of range, call graphs that expand without bound).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
from typing import Iterator

from hlo_inspect.opcodes import OPCODES, async_parts, is_known_opcode
from hlo_inspect.scanning import (HloParseError, match_close, split_top_level, string_end, strip_comments, unescape,
                                  unquote)
from hlo_inspect.shapes import DTYPE_BITS, Shape, parse_shape, take_shape
from hlo_inspect.source import SourceTables, parse_table_line, TABLE_NAMES

__all__ = [
    "HloParseError", "Shape", "Metadata", "Instruction", "Computation", "Module", "parse", "parse_shape",
    "OPCODES", "DTYPE_BITS", "CALLED_COMPUTATION_ATTRS", "gc_paused",
]

# Attributes whose values name computations this instruction calls.
CALLED_COMPUTATION_ATTRS = (
    "calls", "to_apply", "condition", "body", "branch_computations", "true_computation", "false_computation",
    "called_computations",
)
_CALLED_ATTR_SET = frozenset(CALLED_COMPUTATION_ATTRS)
# Opcodes whose parenthesised payload is a literal, not operands.
_LITERAL_OPCODES = frozenset({"constant", "parameter", "iota", "partition-id", "replica-id",
                              "rng-get-and-update-state"})


@dataclasses.dataclass
class Metadata:
    """`metadata={...}` of an instruction: JAX's op_name path and source location (inline or via stack frame)."""

    op_name: str = ""
    op_type: str = ""
    source_file: str = ""
    source_line: int = 0
    stack_frame_id: int = 0
    raw: dict[str, str] = dataclasses.field(default_factory=dict)


_EMPTY_METADATA = Metadata()


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
    calls_by_attr: dict[str, list["Computation"]] = dataclasses.field(default_factory=dict, repr=False)
    text: str = dataclasses.field(default="", repr=False)  # the instruction as printed (lines joined)

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
        return unquote(self.attrs.get("custom_call_target", ""))

    @property
    def parameter_number(self) -> int | None:
        return int(self.literal) if self.opcode == "parameter" and self.literal.strip().isdigit() else None

    @property
    def dimensions(self) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"-?\d+", self.attrs.get("dimensions", "")))

    @property
    def tuple_index(self) -> int | None:
        index = self.attrs.get("index", "").strip()
        return int(index) if index.isdigit() else None

    @property
    def async_wrapped_opcode(self) -> str:
        """The opcode an asynchronous op runs (`reduce-scatter` for `reduce-scatter-start`), '' if none is
        printed (a plain `async-start` names its computation in `calls=`; a synchronous op)."""
        return async_parts(self.opcode)[0]

    @property
    def async_phase(self) -> str:
        """'start', 'update' or 'done' for asynchronous ops, '' for the others."""
        return async_parts(self.opcode)[1]

    def called(self, attr: str) -> list["Computation"]:
        """The computations named by one attribute (`body`, `condition`, `calls`, ...), [] if absent."""
        return self.calls_by_attr.get(attr, [])

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
    execution_thread: str = ""  # `}, execution_thread="..."` after the closing brace ('' for the main thread)

    def __post_init__(self):
        self.by_name = {inst.name: inst for inst in self.instructions}
        self.cache: dict = {}  # per-computation results of the later stages (e.g. its FLOPs), filled lazily

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
    warnings: list[str] = dataclasses.field(default_factory=list)  # what a reader of the report should know

    def instructions(self) -> Iterator[Instruction]:
        for comp in self.computations.values():
            yield from comp.instructions

    def __repr__(self) -> str:
        return f"Module({self.name}, {len(self.computations)} computations, entry {self.entry.name})"


# ---------------------------------------------------------------------------------------------------------
# Instructions.

_HEAD_RE = re.compile(r"\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*")
# `[ROOT] %name = f32[2,3]{1,0} opcode(%a, %b)`: an array shape and operands without brackets or quotes.
_COMMON_HEAD_RE = re.compile(r'\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*([a-z][a-z0-9]*\[[^\[\](){}]*\](?:\{[^{}]*\})?)'
                             r'\s*([a-z][a-z0-9\-]*)\(([^()\[\]{}"]*)\)')
_OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_ATTR_KEY_RE = re.compile(r"\s*,\s*([A-Za-z_][\w.\-]*)\s*(=)?\s*")
_PLAIN_RE = re.compile(r'[^,(){}\[\]"]+')
# One attribute value without nesting: `kLoop`, `%fused.1`, `{1,0}`, `"text"`, up to the next comma or the end.
_SIMPLE_VALUE_RE = re.compile(r'(?:\{[^{}()\[\]"]*\}|"(?:[^"\\]++|\\.)*+"|[^,(){}\[\]"]+)(?=\s*(?:,|$))')
_METADATA_BLOCK_RE = re.compile(r'\{((?:[^{}"]++|"(?:[^"\\]++|\\.)*+")*+)\}')
_METADATA_ITEM_RE = re.compile(r'(\w+)=(?:"((?:[^"\\]++|\\.)*+)"|([^\s}]+))')
_NOT_SIMPLE_OPERANDS = re.compile(r'[\[{("]')
_JSON = json.JSONDecoder()


def _parse_metadata(body: str) -> Metadata:
    """The inside of `metadata={...}`."""
    items = _METADATA_ITEM_RE.findall(body)  # (key, quoted value, bare value)
    if "\\" in body:
        raw = {k: unescape(quoted) if quoted or not bare else bare for k, quoted, bare in items}
    else:
        raw = {k: quoted or bare for k, quoted, bare in items}
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
    for item in split_top_level(body, line_no, line):
        key, _, value = item.partition("=")
        out[key.strip()] = unquote(value)
    return out


def _parse_backend_config(text: str) -> dict | str:
    """JSON (most GPU ops), or the MLIR attribute dictionary of a Triton custom call (`{grid_x = 4 : i32,
    name = "kernel", ir = "...", ...}`: values kept as text, the quotes of strings dropped, their MLIR escapes
    kept); other text is returned as is."""
    text = text.strip()
    if text.startswith('"'):  # older printers quote the JSON
        text = unquote(text)
    try:
        return json.loads(text)
    except ValueError:
        pass
    if text.startswith("{") and text.endswith("}") and " = " in text:
        try:
            items = split_top_level(text[1:-1], 0, text[:80])
        except HloParseError:
            return text
        pairs = [item.partition(" = ") for item in items]
        if all(eq and key.strip().isidentifier() for key, eq, _ in pairs):
            unquote_mlir = lambda v: v[1:-1] if len(v) >= 2 and v[0] == v[-1] == '"' else v  # noqa: E731
            return {key.strip(): unquote_mlir(value.strip()) for key, _, value in pairs}
    return text


def _value_end(text: str, pos: int, line_no: int, line: str) -> int:
    """Index of the comma (or end) that ends the attribute value starting at text[pos]."""
    n = len(text)
    while pos < n:
        ch = text[pos]
        if ch == ",":
            return pos
        if ch in "({[":
            pos = match_close(text, pos, line_no, line)
        elif ch == '"':
            pos = string_end(text, pos, line_no, line)
        elif ch in ")}]":
            raise HloParseError(f"unbalanced '{ch}' at column {pos + 1}", line_no, line)
        else:
            pos = _PLAIN_RE.match(text, pos).end()
    return pos


def _operand_name(part: str, name: str, line_no: int, line: str) -> str:
    """`%x.1`, `x.1` or (older printers) `f32[2]{0} %x.1` -> `x.1`."""
    part = part.strip()
    if "%" in part:
        part = part[part.rindex("%") + 1:].strip()
    elif " " in part:  # shape then bare name
        part = part.rsplit(" ", 1)[1]
    if not part:
        raise HloParseError(f"empty operand in the operand list of %{name}: expected '%name' between commas",
                            line_no, line)
    return part


def parse_instruction(line: str, line_no: int, shapes: dict[str, Shape] | None = None) -> Instruction:
    """One instruction, `[ROOT] %name = shape opcode(operands), attr=value, ...` (lines already joined).
    `shapes` caches parsed shapes by their text across the instructions of a module."""
    text = strip_comments(line)
    shapes = {} if shapes is None else shapes
    common = _COMMON_HEAD_RE.match(text)
    if common is not None:  # array shape, operands without brackets: most instructions, in one match
        is_root, name, shape_text, opcode, payload = common.groups()
        shape = shapes.get(shape_text)
        if shape is None:
            shape = shapes[shape_text] = parse_shape(shape_text, line_no, line)
        close = common.end()
    else:
        head = _HEAD_RE.match(text)
        if not head:
            raise HloParseError("expected an instruction '%name = shape opcode(operands), attrs'", line_no, line)
        is_root, name = head.group(1), head.group(2)
        shape, pos = take_shape(text, head.end(), shapes, line_no, line)
        op = _OPCODE_RE.match(text, pos)
        if not op:
            raise HloParseError(f"expected an opcode and '(' after the shape of %{name}, found "
                                f"{text[pos:pos + 40].strip()!r}", line_no, line)
        opcode = op.group(1)
        close = match_close(text, op.end() - 1, line_no, line)
        payload = text[op.end():close - 1]
    if opcode not in OPCODES and not is_known_opcode(opcode):
        raise HloParseError(f"unknown opcode {opcode!r} in %{name}: not an opcode of XLA's hlo_opcode.h",
                            line_no, line)

    operand_names: list[str] = []
    literal = ""
    if opcode in _LITERAL_OPCODES:
        literal = payload.strip()
    elif payload and not payload.isspace():
        names = [] if _NOT_SIMPLE_OPERANDS.search(payload) else [p.strip() for p in payload.split(",")]
        if names and all(names) and not any(" " in p for p in names):  # `%a, %b`: the usual case, fast
            operand_names = [p[1:] if p[0] == "%" else p for p in names]
        else:
            parts = names or split_top_level(payload, line_no, line, keep_empty=True)
            operand_names = [_operand_name(p, name, line_no, line) for p in parts]

    attrs: dict[str, str] = {}
    metadata = _EMPTY_METADATA
    backend_config = None
    frontend_attributes: dict[str, str] = {}
    pos, n = close, len(text)
    while pos < n:
        m = _ATTR_KEY_RE.match(text, pos)
        if m is None:
            rest = text[pos:].strip()
            if not rest:
                break
            raise HloParseError(f"expected ', name=value' after the operands of %{name}, found {rest[:40]!r}",
                                line_no, line)
        key, pos = m.group(1), m.end()
        if not m.group(2):
            attrs[key] = ""
            continue
        ch = text[pos] if pos < n else ""
        if key == "metadata" and ch == "{":
            block = _METADATA_BLOCK_RE.match(text, pos)
            if block is not None:
                metadata, pos = _parse_metadata(block.group(1)), block.end()
                continue
        if key == "backend_config" and ch == "{":
            try:
                value, end = _JSON.raw_decode(text, pos)
            except ValueError:
                pass
            else:
                if end == n or text[end] == "," or text[end:].strip() == "":
                    backend_config, pos = value, end
                    continue
        simple = _SIMPLE_VALUE_RE.match(text, pos)
        end = simple.end() if simple is not None else _value_end(text, pos, line_no, line)
        value_text = text[pos:end].strip()
        pos = end
        if key == "metadata":
            body = value_text[1:-1] if value_text.startswith("{") and value_text.endswith("}") else value_text
            metadata = _parse_metadata(body)
        elif key == "backend_config":
            backend_config = _parse_backend_config(value_text)
        elif key == "frontend_attributes":
            frontend_attributes = _parse_frontend_attributes(value_text, line_no, line)
        else:
            attrs[key] = value_text
    return Instruction(
        name=name, opcode=opcode, shape=shape, operand_names=operand_names, attrs=attrs,
        metadata=metadata if metadata is not _EMPTY_METADATA else Metadata(), line_no=line_no,
        is_root=bool(is_root),
        literal=literal, backend_config=backend_config, frontend_attributes=frontend_attributes, text=line,
    )


# ---------------------------------------------------------------------------------------------------------
# Module.

_COMPUTATION_HEAD_RE = re.compile(r"(ENTRY\s+)?%?([^\s(]+)\s*(\(.*\))?\s*(->\s*(.*?))?\s*\{\s*$")
_MODULE_HEAD_RE = re.compile(r"HloModule\s+([^\s,]+)\s*(,.*)?$")
_CLOSE_RE = re.compile(r'\}\s*(?:,\s*execution_thread\s*=\s*("(?:[^"\\]|\\.)*"))?\s*(?://.*)?$')
_INSTRUCTION_START_RE = re.compile(r'\s*(?:ROOT\s+)?%?[^\s=(){}\[\],"]+\s*=\s*(?:\(|[a-z][a-z0-9]*\[)')
_MLIR_MARKERS = ("module @", "module attributes", "func.func", "stablehlo.", "mhlo.", "#loc", "sdy.mesh")
_STABLEHLO_MESSAGE = ("this is StableHLO (MLIR) text, not HLO: pass the compiled program's HLO text, "
                      "`jax.jit(f).lower(*args).compile().as_text()` (`lowered.as_text()` prints StableHLO)")


def _path_hint(text: str) -> str:
    """'; <why>' when the whole `text` is one word (no spaces, no brackets) ending in .txt / .hlo or naming an
    existing file: a path passed where its contents were meant; else ''."""
    words = text.split() if len(text) <= 4096 else []  # a path is short (PATH_MAX); HLO text may not be
    if len(words) != 1 or any(c in words[0] for c in "{}()"):
        return ""
    path = words[0]
    if not (path.endswith((".txt", ".hlo")) or os.path.isfile(path)):
        return ""
    return (f"; {path!r} looks like a file's path, not HLO text: pass the file's text, open({path!r}).read(), "
            f"or run `hlo-inspect {path}`")


def _is_computation_header(line: str) -> bool:
    return line.endswith("{") and not _INSTRUCTION_START_RE.match(line) and bool(_COMPUTATION_HEAD_RE.match(line))


def _looks_like_mlir(line: str) -> bool:
    return line.startswith(("module", "func.func", "#loc", "%0 =", "%arg", "return ", "}) {")) or any(
        marker in line for marker in _MLIR_MARKERS)


_BRACKET_OR_QUOTE_RE = re.compile(r'[(){}\[\]"]')


def _continuation_end(lines: list[str], first: int) -> int | None:
    """The last line of an instruction that starts at lines[first] and is continued on the lines after it (a
    bracket left open, or a trailing comma), or None when it does not end before a line that starts something
    else (an instruction, a header, a computation's closing '}' at column 0) or the text ends."""
    stack: list[str] = []
    for j in range(first, len(lines)):
        line = strip_comments(lines[j])
        if j > first and (_INSTRUCTION_START_RE.match(line) or line.startswith("HloModule") or
                          _is_computation_header(line.strip()) or _CLOSE_RE.match(lines[j].rstrip())):
            return None
        pos = 0
        while True:
            m = _BRACKET_OR_QUOTE_RE.search(line, pos)
            if m is None:
                break
            ch, pos = m.group(), m.end()
            if ch == '"':
                try:
                    pos = string_end(line, m.start())
                except HloParseError:
                    return None
            elif ch in "({[":
                stack.append({"(": ")", "{": "}", "[": "]"}[ch])
            elif not stack or stack.pop() != ch:
                return None
        if not stack and not line.rstrip().endswith(","):
            return j if j > first else None
    return None


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector while building many objects that stay alive (a parsed module,
    its kernels): collections during the build would rescan them all and find no garbage (half of parse()'s
    time on a 4 MB module). Restores the collector's previous state."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse(text: str) -> Module:
    """Parse HLO module text. Raises `HloParseError` (with line number and text) on anything malformed."""
    if not isinstance(text, str):
        hint = _path_hint(os.fspath(text)) if isinstance(text, os.PathLike) else ""
        raise TypeError(f"parse() takes HLO text as str, got {type(text).__name__}{hint}")
    with gc_paused():
        return _parse(text)


def _parse(text: str) -> Module:
    lines = text.splitlines()
    module_name, header_attrs, warnings = "", {}, []
    seen_header = False
    tables = SourceTables()
    shapes: dict[str, Shape] = {}
    computations: dict[str, Computation] = {}
    entry: Computation | None = None
    current: tuple[str, bool, int, str, str] | None = None  # name, is_entry, line_no, params, result
    current_insts: list[Instruction] = []
    table: str | None = None

    i, n = 0, len(lines)
    while i < n:
        raw_line = lines[i]
        line_no = i + 1
        i += 1
        line = raw_line.strip()
        if not line:
            table = None
            continue
        if line.startswith("//"):
            continue
        if current is not None:
            if line[0] == "}":
                close = _CLOSE_RE.match(line)
                if close:
                    comp = _close_computation(current, current_insts, unquote(close.group(1) or ""))
                    if comp.name in computations:
                        raise HloParseError(f"computation {comp.name} is defined twice (first at line "
                                            f"{computations[comp.name].line_no})", comp.line_no)
                    computations[comp.name] = comp
                    if comp.is_entry:
                        if entry is not None:
                            raise HloParseError(f"a second ENTRY computation, {comp.name} (the first is "
                                                f"{entry.name}, line {entry.line_no})", comp.line_no)
                        entry = comp
                    current, current_insts = None, []
                    continue
            if line.startswith("HloModule") or _is_computation_header(line):
                raise HloParseError(f"computation {current[0]} (line {current[2]}) is never closed: expected '}}' "
                                    "before this line", line_no, raw_line)
            try:
                inst = parse_instruction(line, line_no, shapes)
            except HloParseError as e:
                end = _continuation_end(lines, i - 1) if e.unclosed or line.endswith(",") else None
                if end is None:
                    raise
                inst = parse_instruction(" ".join(l.strip() for l in lines[i - 1:end + 1]), line_no, shapes)
                i = end + 1
            current_insts.append(inst)
            continue
        if line.startswith("/*"):  # a comment before or between computations, on one line or several
            if "*/" not in line:
                end = next((j for j in range(i, n) if "*/" in lines[j]), None)
                if end is None:
                    raise HloParseError("the comment opened here is never closed with '*/'", line_no, raw_line)
                i = end + 1
            continue
        if line.startswith("HloModule"):
            if seen_header or computations:
                more = sum(1 for l in lines[i - 1:] if l.startswith("HloModule"))
                warnings.append(f"the text holds {more + 1} HLO modules: read the first "
                                f"({module_name or 'unnamed'}), ignored everything from line {line_no} on")
                break
            m = _MODULE_HEAD_RE.match(line)
            if not m:
                raise HloParseError("malformed HloModule header: expected 'HloModule name, key=value, ...'",
                                    line_no, raw_line)
            module_name, seen_header = m.group(1), True
            if m.group(2):
                for item in split_top_level(strip_comments(m.group(2)[1:]), line_no, raw_line):
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
        if _looks_like_mlir(line) and not _path_hint(text):  # `module_0008.jit_f.before_optimizations.txt`
            raise HloParseError(_STABLEHLO_MESSAGE, line_no, raw_line)
        if line.endswith("{"):
            m = _COMPUTATION_HEAD_RE.match(strip_comments(line))
            if not m:
                raise HloParseError("malformed computation header: expected '%name (params) -> shape {' or "
                                    "'ENTRY %name ... {'", line_no, raw_line)
            current = (m.group(2), bool(m.group(1)), line_no, m.group(3) or "", m.group(5) or "")
            current_insts = []
            table = None
            continue
        raise HloParseError("unexpected text outside any computation: expected 'HloModule', a computation header "
                            "('%name (params) -> shape {'), a source table or a comment" + _path_hint(text),
                            line_no, raw_line)

    if current is not None:
        raise HloParseError(f"computation {current[0]} (line {current[2]}) is never closed with '}}' "
                            "(truncated text?)", n, lines[-1] if lines else "")
    if not computations:
        raise HloParseError("no computations found: is this HLO text? (expected 'HloModule name' and "
                            "computations)", 1, lines[0] if lines else "")
    if entry is None:
        raise HloParseError("no ENTRY computation: expected one computation header starting with 'ENTRY'", 1,
                            lines[0] if lines else "")
    module = Module(name=module_name, header_attrs=header_attrs, computations=computations, entry=entry,
                    source=tables, warnings=warnings)
    _link(module)
    from hlo_inspect.validate import validate  # validate reads Module; imported here to keep the modules acyclic

    validate(module)
    return module


def _close_computation(current: tuple[str, bool, int, str, str], insts: list[Instruction],
                       execution_thread: str) -> Computation:
    name, is_entry, line_no, params, result = current
    if not insts:
        raise HloParseError(f"computation {name} has no instructions", line_no)
    comp = Computation(name=name, instructions=insts, is_entry=is_entry, line_no=line_no, parameter_text=params,
                       result_text=result, execution_thread=execution_thread)
    if len(comp.by_name) != len(insts):
        seen: dict[str, Instruction] = {}
        for inst in insts:
            if inst.name in seen:
                raise HloParseError(f"instruction %{inst.name} is defined twice in computation {name} (first at "
                                    f"line {seen[inst.name].line_no})", inst.line_no, inst.text)
            seen[inst.name] = inst
    roots = [inst for inst in insts if inst.is_root]
    if len(roots) > 1:
        raise HloParseError(f"computation {name} has two ROOT instructions (%{roots[0].name} at line "
                            f"{roots[0].line_no} and %{roots[1].name})", roots[1].line_no, roots[1].text)
    return comp


def _tuple_element(comp: Computation, name: str, user: Instruction) -> Instruction:
    """`x#1` (`x#1#0` nested): element 1 of tuple-shaped `x`, as newer XLA prints an operand without its
    get-tuple-element. Resolved to a get-tuple-element instruction made here (not added to the listing)."""
    base, *indices = name.split("#")
    inst = comp.by_name.get(base)
    if inst is None or not base:
        raise HloParseError(f"%{user.name} uses %{name}, which computation {comp.name} does not define",
                            user.line_no, user.text)
    path = base
    for index in indices:
        path += "#" + index
        if path in comp.by_name:
            inst = comp.by_name[path]
            continue
        if not index.isdigit():
            raise HloParseError(f"%{user.name} uses %{name}, which computation {comp.name} does not define",
                                user.line_no, user.text)
        i = int(index)
        if not inst.shape.is_tuple or i >= len(inst.shape.tuple_shapes):
            raise HloParseError(f"%{user.name} uses %{path}, but %{inst.name} has no tuple element {i}",
                                user.line_no, user.text)
        element = Instruction(name=path, opcode="get-tuple-element", shape=inst.shape.tuple_shapes[i],
                              operand_names=[inst.name], attrs={"index": str(i)}, metadata=Metadata(),
                              line_no=user.line_no, operands=[inst], computation=comp)
        comp.by_name[path] = element
        inst = element
    return inst


def _called_names(value: str) -> list[str]:
    return [n.strip().lstrip("%") for n in value.strip().strip("{}").split(",") if n.strip()]


def _link(module: Module) -> None:
    """Resolve operand names and called computations; check every reference exists."""
    comps = module.computations
    for comp in comps.values():
        by_name = comp.by_name
        for inst in comp.instructions:
            inst.computation = comp
            operands = []
            for name in inst.operand_names:
                op = by_name.get(name)
                operands.append(op if op is not None else _tuple_element(comp, name, inst))
            inst.operands = operands
            for key, value in inst.attrs.items():
                if key not in _CALLED_ATTR_SET or not value:
                    continue
                called = []
                for cname in _called_names(value):
                    if cname not in comps:
                        raise HloParseError(f"%{inst.name} calls computation {cname} ({key}=), which the module "
                                            "does not define (missing computation)", inst.line_no, inst.text)
                    called.append(comps[cname])
                inst.calls_by_attr[key] = called
                inst.called_computations.extend(called)
