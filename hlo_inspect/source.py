"""Where an HLO instruction came from: source file:line and Flax module scope.

Two formats carry source locations in optimized HLO text:
- jax >= 0.9: tables at the top of the module (`FileNames`, `FunctionNames`, `FileLocations`, `StackFrames`),
  referenced by `metadata={... stack_frame_id=N}`;
- older text: `metadata={... source_file="f.py" source_line=12}` inline.

The `op_name` path (`jit(step)/transpose(jvp(Block))/attn/query/dot_general`) names the JAX transforms and the
name scopes (Flax modules) an op was traced in. `scope_of()` strips the transforms and the outer `jit(...)`
and the primitive, leaving the module path (`Block/attn/query`).
"""

from __future__ import annotations

import dataclasses
import functools
import re

from hlo_inspect.scanning import unescape

__all__ = ["Frame", "SourceTables", "TABLE_NAMES", "parse_table_line", "scope_of", "primitive_of",
           "split_op_name", "is_library_file"]

TABLE_NAMES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


@dataclasses.dataclass(frozen=True)
class Frame:
    """One Python frame: file, function, 1-based line and column."""

    file: str
    function: str
    line: int
    column: int = 0

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


_KV_RE = re.compile(r"(\w+)=(-?\d+)")


@dataclasses.dataclass
class SourceTables:
    """The four tables, as printed (1-based ids)."""

    file_names: dict[int, str] = dataclasses.field(default_factory=dict)
    function_names: dict[int, str] = dataclasses.field(default_factory=dict)
    file_locations: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    stack_frames: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    _stacks: dict[int, list[Frame]] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    _locations: dict[int, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __bool__(self) -> bool:
        return bool(self.stack_frames)

    def stack(self, frame_id: int) -> list[Frame]:
        """The call stack of a stack_frame_id, innermost frame first.

        The printer writes each frame's parent as `parent_frame_id` = (parent's id + 1), 1 meaning no parent:
        frame 1 `{file_location_id=1 parent_frame_id=1}` is a root, and a frame whose parent_frame_id is 5
        was called from frame 4. The list is shared between callers (computed once per id): do not modify it.
        """
        cached = self._stacks.get(frame_id)
        if cached is not None:
            return cached
        first = frame_id
        frames: list[Frame] = []
        seen = set()
        while frame_id and frame_id in self.stack_frames and frame_id not in seen:
            seen.add(frame_id)
            entry = self.stack_frames[frame_id]
            loc = self.file_locations.get(entry.get("file_location_id", 0), {})
            frames.append(Frame(
                file=self.file_names.get(loc.get("file_name_id", 0), "?"),
                function=self.function_names.get(loc.get("function_name_id", 0), "?"),
                line=loc.get("line", 0), column=loc.get("column", 0)))
            frame_id = entry.get("parent_frame_id", 0) - 1
        self._stacks[first] = frames
        return frames

    def user_location(self, frame_id: int) -> str:
        """`file:line` of the innermost frame outside installed libraries (`is_library_file`), else of the
        innermost frame; '' for an unknown id."""
        location = self._locations.get(frame_id)
        if location is None:
            frames = self.stack(frame_id)
            frame = next((f for f in frames if not is_library_file(f.file)), frames[0] if frames else None)
            location = self._locations[frame_id] = str(frame) if frame else ""
        return location


def parse_table_line(tables: SourceTables, table: str, line: str) -> None:
    """Add one printed table row (`3 "file.py"` or `3 {k=v ...}`) to `tables`; ValueError if malformed."""
    number, _, body = line.strip().partition(" ")
    if not number.isdigit() or not body:
        raise ValueError("expected '<id> <value>'")
    key = int(number)
    body = body.strip()
    if table in ("FileNames", "FunctionNames"):
        if not (body.startswith('"') and body.endswith('"') and len(body) >= 2):
            raise ValueError("expected a quoted name")
        target = tables.file_names if table == "FileNames" else tables.function_names
        target[key] = unescape(body[1:-1])
    else:
        if not (body.startswith("{") and body.endswith("}")):
            raise ValueError("expected '{key=value ...}'")
        values = {k: int(v) for k, v in _KV_RE.findall(body)}
        target = tables.file_locations if table == "FileLocations" else tables.stack_frames
        target[key] = values


_LIBRARY_MARKERS = ("site-packages/", "dist-packages/", "/jax/_src/", "/flax/", "<frozen ", "/lib/python3")


@functools.lru_cache(maxsize=1 << 12)
def is_library_file(path: str) -> bool:
    """True for frames inside installed libraries (jax, flax, the standard library), not the user's code."""
    p = path.replace("\\", "/")
    return p.startswith(("jax/", "flax/")) or any(m in p for m in _LIBRARY_MARKERS)


# JAX transform wrappers that appear in op_name paths around a scope name: `jvp(Block)`, `transpose(jvp())`.
_TRANSFORMS = ("jit", "pjit", "jvp", "transpose", "vmap", "pmap", "xmap", "remat", "checkpoint", "custom_jvp_call",
               "custom_vjp_call", "custom_vjp_call_jaxpr", "shard_map", "xla_pmap", "core_call", "named_call",
               "closed_call", "remat2", "rematted_computation", "batched", "linearize", "vjp", "grad")
_WRAPPER_RE = re.compile(r"^([A-Za-z_][\w]*)\((.*)\)$")


def _unwrap(component: str) -> str:
    """`transpose(jvp(Block))` -> `Block`; `jvp()` -> ''; a plain name stays."""
    while True:
        m = _WRAPPER_RE.match(component)
        if not m or m.group(1) not in _TRANSFORMS:
            return component
        component = m.group(2)


def split_op_name(op_name: str) -> list[str]:
    """The components of an op_name path: split on "/" outside parentheses (jit(f)/scope/dot_general -> [...])."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(op_name):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(depth - 1, 0)
        elif ch == "/" and depth == 0:
            parts.append(op_name[start:i])
            start = i + 1
    parts.append(op_name[start:])
    return parts


@functools.lru_cache(maxsize=1 << 16)
def scope_of(op_name: str) -> str:
    """Module scope of an op_name: `jit(g)/transpose(jvp(B))/up/dot_general` -> `B/up`.

    The outermost `jit(...)` (the traced function) and the last component (the primitive) are dropped;
    transform wrappers are unwrapped; empty components vanish. A fused op_name (`a;b`) gives the first's.
    """
    op_name = op_name.split(";")[0].strip()
    if not op_name:
        return ""
    parts = split_op_name(op_name)
    if len(parts) <= 1:
        return ""
    if parts[0].startswith(("jit(", "pjit(")):
        parts = parts[1:]
    scopes = [_unwrap(p) for p in parts[:-1]]
    return "/".join(s for s in scopes if s)


def primitive_of(op_name: str) -> str:
    """The JAX primitive an op_name ends with (`dot_general`), '' if none."""
    op_name = op_name.split(";")[0].strip()
    if not op_name:
        return ""
    return split_op_name(op_name)[-1]
