"""The Triton IR inside Pallas-Triton kernels, on any machine: lower for CUDA, decode each kernel's IR.

    from hlo_inspect import triton_ir
    for k in triton_ir.lower_kernels(fn, *args):       # args: arrays or jax.ShapeDtypeStruct
        print(k.name, k.grid, k.num_warps, k.num_stages)
        print(k.summary())                              # loops, dots with their shapes, loads, stores, math calls
        print(k.text)                                   # the whole kernel in the Triton (tt) dialect

jax lowers a Pallas call on the Triton backend to a custom call whose backend_config carries the kernel's Triton IR
as MLIR bytecode. Lowering for CUDA needs no GPU (``lowering_platforms=("cuda",)``), so this reads a kernel's IR on a
CPU: how its loops, dots, masked loads and transcendental calls came out, before Triton's own passes (pipelining,
layouts) run on a GPU. A Pallas call in interpret mode lowers to ordinary XLA ops instead and has no Triton IR: pass
``interpret=False`` to the kernels you want to read. Needs jax and its Triton dialect; the rest of hlo_inspect
reads saved text without jax.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable

__all__ = ["TritonKernel", "lower_kernels", "lower_program"]

_TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"
_OP = re.compile(r"(?:=|^)\s*\"?((?:tt|scf|arith|math)\.[a-z_.]+)")
_EXTERN_SYMBOL = re.compile(r'symbol = "([^"]+)"')
_INLINE_ASM = re.compile(r'tt\.elementwise_inline_asm "([^"]*)"')
_DOT_TYPES = re.compile(r"tt\.dot .*: (tensor<[^>]+>) \* (tensor<[^>]+>) -> (tensor<[^>]+>)")


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Pallas-Triton kernel: its launch parameters and its Triton IR as text (locations stripped)."""

    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    text: str

    def op_counts(self) -> dict[str, int]:
        """How many of each tt / scf / arith / math op the IR holds, e.g. {"tt.dot": 2, "scf.for": 1, ...}."""
        counts = collections.Counter()
        for line in self.text.splitlines():
            match = _OP.search(line.strip())
            if match:
                counts[match.group(1)] += 1
        return dict(counts)

    def dots(self) -> list[str]:
        """Each tt.dot as 'A x B -> C' tensor types, in program order."""
        return [f"{a} x {b} -> {c}" for a, b, c in _DOT_TYPES.findall(self.text)]

    def extern_calls(self) -> dict[str, int]:
        """Library functions the kernel calls (libdevice on NVIDIA: __nv_exp2f, __nv_logf, ...) and how often."""
        return dict(collections.Counter(_EXTERN_SYMBOL.findall(self.text)))

    def inline_asm(self) -> dict[str, int]:
        """Inline assembly the kernel holds (tt.elementwise_inline_asm: e.g. 'ex2.approx.ftz.f32 $0, $1;') and how
        often."""
        return dict(collections.Counter(_INLINE_ASM.findall(self.text)))

    def summary(self) -> str:
        """One paragraph: launch, loops, dots, loads (masked of all), stores, library calls, inline assembly."""
        ops = self.op_counts()
        masked_loads = sum(1 for line in self.text.splitlines() if _is_masked_load(line))
        calls = ", ".join(f"{name}×{n}" for name, n in sorted(self.extern_calls().items())) or "none"
        dots = collections.Counter(self.dots())  # insertion order: first appearance
        dot_text = "; ".join(f"{n}× {dot}" if n > 1 else dot for dot, n in dots.items()) or "none"
        asm = "".join(f"; inline asm {text!r}×{n}" for text, n in self.inline_asm().items())
        return (f"{self.name}: grid {self.grid}, {self.num_warps} warps, {self.num_stages} stages; "
                f"{ops.get('scf.for', 0)} loops, {ops.get('scf.if', 0)} branches; "
                f"{len(self.dots())} dots ({dot_text}); "
                f"{ops.get('tt.load', 0)} loads ({masked_loads} masked), {ops.get('tt.store', 0)} stores; "
                f"library calls: {calls}" + asm)


def _is_masked_load(line: str) -> bool:
    """`%x = tt.load %ptr, %mask[, %other] : ...` (masked) against `%x = tt.load %ptr : ...`."""
    if "tt.load " not in line:
        return False
    operands = line.split("tt.load ", 1)[1].split(" : ", 1)[0]
    return operands.count("%") > 1


def _custom_calls(op, found: list) -> list:
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == "stablehlo.custom_call":
                    found.append(inner.operation)
                _custom_calls(inner.operation, found)
    return found


def _strip_locations(text: str) -> str:
    lines = [re.sub(r"\s*loc\(.*$", "", line) for line in text.splitlines() if not line.startswith("#loc")]
    return "\n".join(lines)


def lower_kernels(fn: Callable, *args, **kwargs) -> list[TritonKernel]:
    """The Pallas-Triton kernels of ``jax.jit(fn)(*args, **kwargs)``, lowered for CUDA (no GPU needed), in program
    order. Raises ValueError when the lowering holds none (plain jnp, or Pallas calls in interpret mode)."""
    kernels, _ = lower_program(fn, *args, **kwargs)
    if not kernels:
        raise ValueError("fn: its CUDA lowering holds no Pallas-Triton kernel (plain jnp, or Pallas calls in "
                         "interpret mode, which lower to ordinary ops: pass interpret=False)")
    return kernels


def lower_program(fn: Callable, *args, **kwargs) -> tuple[list[TritonKernel], dict[str, int]]:
    """``lower_kernels`` without the error when there is none: (its Pallas-Triton kernels, possibly [], and how
    many of the CUDA lowering's other custom calls each target has, e.g. {"mosaic_gpu_v2": 2})."""
    import jax
    from jax._src.lib.mlir import ir

    try:
        from jax._src.lib.triton import dialect as tt_dialect
    except ImportError as e:  # pragma: no cover - every jaxlib we support ships it
        raise ImportError("hlo_inspect.triton_ir needs jaxlib's Triton dialect bindings") from e

    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    lowered = jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    calls, others = [], {}
    for op in _custom_calls(lowered.compiler_ir("stablehlo").operation, []):
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        if target == _TRITON_CALL_TARGET:
            calls.append(op)
        else:
            others[target] = others.get(target, 0) + 1
    context = ir.Context()
    tt_dialect.register_dialect(context)
    kernels = []
    for op in calls:
        config = ir.DictAttr(op.attributes["mhlo.backend_config"])  # name, ir, grid_x/y/z, num_warps, num_stages
        with context:
            text = str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))
        kernels.append(TritonKernel(
            name=ir.StringAttr(config["name"]).value,
            grid=tuple(ir.IntegerAttr(config[f"grid_{axis}"]).value for axis in "xyz"),
            num_warps=ir.IntegerAttr(config["num_warps"]).value,
            num_stages=ir.IntegerAttr(config["num_stages"]).value,
            text=_strip_locations(text)))
    return kernels, others
