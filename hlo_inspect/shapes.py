"""HLO shapes: `f32[64,512]{1,0}`, `(f32[2], s32[])`, `bf16[]`, `s32[<=16]`, `f32[?,8]` -> `Shape`.

Dimensions are XLA's int64: a dimension or a shape's byte size past 2**63 - 1 is a parse error, as it is in XLA.
Dynamic dimensions: `<=16` is bounded (at most 16 elements at run time); it counts as its bound, the buffer XLA
allocates. `?` is unbounded (`Shape::kUnboundedSize`): its size is known only at run time and XLA's own size
functions reject it, so it counts as 0 elements: its bytes and FLOPs are left out of every total, and the report
says how many shapes were affected (`Shape.has_unbounded`).

Layouts may carry tiles and a memory space after a colon, as TPU programs print them:
`bf16[2,1000]{1,0:T(4,128)(2,1)S(1)}`. Tiles (XLA's tiled layout, docs/tiled_layout.md there) pad the most minor
physical dimensions to whole tiles, each tile in turn tiling the result of the one before (`*` merges a dimension
into the next more minor one), so `size_bytes` counts 4 x 1024 elements above, what the buffer holds. The memory
space `S(n)` (`Shape.memory_space`, 0 when absent) says where the buffer lives: `hbm_resident` reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Iterator

from hlo_inspect.scanning import HloParseError, int_list, match_close, split_top_level

__all__ = ["DTYPE_BITS", "Shape", "parse_shape", "take_shape", "hbm_resident", "HOST_MEMORY_SPACE", "MAX_INT64",
           "MAX_TUPLE_DEPTH"]

# Bits per element of each HLO primitive type.
DTYPE_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64,
    "c128": 128, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8,
    "f8e4m3fnuz": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4, "token": 0, "opaque": 0,
}

MAX_INT64 = 2 ** 63 - 1
HOST_MEMORY_SPACE = 5  # XLA's Layout::kHostMemorySpace, on every backend: host memory (offloaded buffers)
_TILES_RE = re.compile(r"(?<![A-Za-z])T((?:\([^()]*\))+)")  # T(8,128)(2,1): the groups after T
_MEMORY_SPACE_RE = re.compile(r"(?<![A-Za-z])S\((\d+)\)")  # S(1), not SC(...)
MAX_TUPLE_DEPTH = 64  # tuples nested deeper than this are refused (XLA prints a few levels at most)


@dataclasses.dataclass(frozen=True)
class Shape:
    """An array shape (`dtype`, `dims`, `layout` as minor-to-major) or a tuple of shapes (`tuple_shapes`).

    `dynamic_dims` are the indices of `<=N` dimensions (dims holds N), `unbounded_dims` those of `?` (dims
    holds 0).
    """

    dtype: str | None = None
    dims: tuple[int, ...] = ()
    layout: tuple[int, ...] | None = None
    tuple_shapes: tuple["Shape", ...] | None = None
    layout_extra: str = ""  # tiling / memory space after ':' in the layout, kept raw
    dynamic_dims: tuple[int, ...] = ()
    unbounded_dims: tuple[int, ...] = ()

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
        """Elements of an array shape (0 for tuples; an unbounded `?` dimension counts 0)."""
        return 0 if self.is_tuple else math.prod(self.dims)

    @functools.cached_property
    def size_bytes(self) -> int:
        """Bytes of all array leaves, rounded up to whole bytes per array; a tiled layout's padding included."""
        if not self.is_tuple:
            return (self._stored_elements() * DTYPE_BITS.get(self.dtype, 0) + 7) // 8
        return sum(leaf.size_bytes for leaf in self.leaves())

    @functools.cached_property
    def tiles(self) -> tuple[tuple[int, ...], ...]:
        """The layout's tiles, outermost first: `{1,0:T(8,128)(2,1)}` -> ((8, 128), (2, 1)); `*` is -1; () without."""
        m = _TILES_RE.search(self.layout_extra) if self.layout_extra else None
        if m is None:
            return ()
        groups = re.findall(r"\(([^()]*)\)", m.group(1))
        try:
            return tuple(tuple(-1 if x.strip() == "*" else int(x) for x in g.split(",")) for g in groups)
        except ValueError:  # not XLA's tile syntax: no tiles rather than a guess
            return ()

    @functools.cached_property
    def memory_space(self) -> int:
        """The layout's memory space `S(n)`: 0 (device memory) when absent; `HOST_MEMORY_SPACE` is host memory."""
        m = _MEMORY_SPACE_RE.search(self.layout_extra) if self.layout_extra else None
        return int(m.group(1)) if m else 0

    def _stored_elements(self) -> int:
        """Elements of the buffer: the dims' product, or with tiles the padded count (XLA's tiled layout: each tile
        covers the most minor dimensions of what the tile before it made, padding them to its multiples)."""
        count = math.prod(self.dims)
        tiles = self.tiles
        if not tiles or self.layout is None or sorted(self.layout) != list(range(len(self.dims))):
            return count
        physical = [self.dims[d] for d in reversed(self.layout)]  # major to minor
        for tile in tiles:
            if any(t == 0 or t < -1 for t in tile) or tile[-1] == -1:
                return count  # not a tile XLA prints: the plain count
            physical = [1] * (len(tile) - len(physical)) + physical
            prefix, tiled = physical[:len(physical) - len(tile)], physical[len(physical) - len(tile):]
            dims, sizes, merged = [], [], 1
            for d, t in zip(tiled, tile):
                if t == -1:  # merged into the next more minor dimension
                    merged *= d
                    continue
                dims.append(d * merged)
                sizes.append(t)
                merged = 1
            physical = prefix + [-(-d // t) for d, t in zip(dims, sizes)] + sizes
        return math.prod(physical)

    @property
    def has_unbounded(self) -> bool:
        return any(leaf.unbounded_dims for leaf in self.leaves())

    def __str__(self) -> str:
        if self.is_tuple:
            return "(" + ", ".join(str(s) for s in self.tuple_shapes) + ")"
        dims = [str(d) for d in self.dims]
        for i in self.dynamic_dims:
            dims[i] = "<=" + dims[i]
        for i in self.unbounded_dims:
            dims[i] = "?"
        s = f"{self.dtype}[{','.join(dims)}]"
        if self.layout is not None:
            extra = ":" + self.layout_extra if self.layout_extra else ""
            s += "{" + ",".join(str(d) for d in self.layout) + extra + "}"
        return s


# dtype, dimensions (no brackets, braces or parentheses inside), optional layout (no braces inside).
_ARRAY_SHAPE_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\[\](){}]*)\](?:\{([^{}]*)\})?")
_DIM_RE = re.compile(r"\s*(?:(<=)?\s*(\d+)|(\?))\s*")


def hbm_resident(shape: "Shape", tiled_program: bool) -> bool:
    """Whether an array's buffer lives in the device's HBM (its bytes count as HBM traffic). Memory space 0 does
    everywhere and `HOST_MEMORY_SPACE` never does. The others differ by backend: on GPUs 1 and 2 are device memory
    set aside (collective and temporary buffers), on TPUs (a `tiled_program`: TPU layouts carry tiles) every other
    space is on chip (1 is VMEM; the semaphores' and SMEM's spaces too)."""
    space = shape.memory_space
    return space == 0 or (not tiled_program and space != HOST_MEMORY_SPACE)


def _parse_array(m: re.Match, text: str, line_no: int | None, line: str | None) -> Shape:
    dtype, dims_text, layout_text = m.group(1), m.group(2), m.group(3)
    if dtype not in DTYPE_BITS:
        raise HloParseError(f"unknown element type {dtype!r} in shape {text!r}: expected one of "
                            f"{', '.join(sorted(DTYPE_BITS))}", line_no, line or text)
    dims, dynamic, unbounded = [], [], []
    if dims_text.strip():
        for i, item in enumerate(dims_text.split(",")):
            d = _DIM_RE.fullmatch(item)
            if d is None:
                raise HloParseError(f"malformed dimension {item.strip()!r} in shape {text!r}: expected an integer, "
                                    "'<=N' or '?'", line_no, line or text)
            if d.group(3):
                unbounded.append(i)
                dims.append(0)
                continue
            if d.group(1):
                dynamic.append(i)
            size = int(d.group(2))
            if size > MAX_INT64:
                raise HloParseError(f"dimension {size} in shape {text!r} is past XLA's int64 limit",
                                    line_no, line or text)
            dims.append(size)
    layout, extra = None, ""
    if layout_text is not None:
        if ":" in layout_text:
            layout_text, extra = layout_text.split(":", 1)
        layout = int_list(layout_text)
    shape = Shape(dtype=dtype, dims=tuple(dims), layout=layout, layout_extra=extra, dynamic_dims=tuple(dynamic),
                  unbounded_dims=tuple(unbounded))
    if dims and math.prod(dims) * DTYPE_BITS[dtype] > 8 * MAX_INT64:
        raise HloParseError(f"shape {text!r} holds more than 2**63 bytes (XLA's int64 limit)", line_no, line or text)
    if extra and shape._stored_elements() * DTYPE_BITS[dtype] > 8 * MAX_INT64:
        raise HloParseError(f"shape {text!r} holds more than 2**63 bytes with its tiles' padding (XLA's int64 limit)",
                            line_no, line or text)
    return shape


def parse_shape(text: str, line_no: int | None = None, line: str | None = None, _depth: int = 0) -> Shape:
    """`f32[64,512]{1,0}`, `(f32[2], s32[])`, `bf16[]`, `token[]`, `f32[<=8]`, `f32[?]` -> Shape."""
    text = text.strip()
    if text.startswith("("):
        if _depth >= MAX_TUPLE_DEPTH:
            raise HloParseError(f"tuple shapes nested more than {MAX_TUPLE_DEPTH} deep", line_no, line or text)
        end = match_close(text, 0, line_no, line or text)
        if text[end:].strip():
            raise HloParseError(f"unexpected text after tuple shape: {text[end:]!r}", line_no, line or text)
        inner = text[1:end - 1]
        parts = split_top_level(inner, line_no, line or text) if inner.strip() else []
        return Shape(tuple_shapes=tuple(parse_shape(p, line_no, line, _depth + 1) for p in parts))
    m = _ARRAY_SHAPE_RE.fullmatch(text)
    if not m:
        raise HloParseError(f"malformed shape {text[:80]!r}: expected dtype[dims]{{layout}} or a tuple (...)",
                            line_no, line or text)
    return _parse_array(m, text, line_no, line)


def take_shape(text: str, pos: int, cache: dict[str, Shape], line_no: int | None = None,
               line: str | None = None) -> tuple[Shape, int]:
    """The shape starting at text[pos] (after spaces) and the index just past it. `cache` maps shape text to
    Shape (shapes repeat: a module has far fewer distinct shapes than instructions)."""
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if text.startswith("(", pos):
        end = match_close(text, pos, line_no, line)
    else:
        m = _ARRAY_SHAPE_RE.match(text, pos)
        if not m:
            shown = text[pos:pos + 40]
            if re.match(r"[a-z][a-z0-9]*\[", shown):
                raise HloParseError(f"malformed shape at {shown!r}: expected dtype[dims]{{layout}} with integer, "
                                    "'<=N' or '?' dimensions", line_no, line if line is not None else text)
            raise HloParseError(f"expected a shape, found {shown!r}", line_no, line if line is not None else text)
        end = m.end()
    key = text[pos:end]
    shape = cache.get(key)
    if shape is None:
        shape = cache[key] = parse_shape(key, line_no, line if line is not None else text)
    return shape, end
