"""The unfused counterfactual: what the program would cost if every op ran as its own kernel, as in eager mode.

    unfused = counterfactual(jax.jit(f).lower(x).as_text(dialect="hlo"))   # the HLO before XLA's passes
    unfused.kernels, unfused.bytes_total, unfused.flops

Each op of the pre-optimization HLO is one kernel that reads its operands from HBM and writes its result back,
with the byte rule of `hlo_inspect.kernels`. What eager JAX would not launch is left out: parameters, constants,
tuples, bitcasts and reshapes (views), and broadcasts of a scalar (the consuming op takes the scalar). Reducer
bodies (`to_apply`) are per element, inside their reduce; `call` bodies are walked; a while body counts once.
"""

from __future__ import annotations

import dataclasses

from hlo_inspect.kernels import _instruction_flops
from hlo_inspect.parser import Computation, Instruction, Module, parse

__all__ = ["Unfused", "counterfactual", "seed_model_us"]

_VIEWS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "reshape", "after-all",
                    "opt-barrier", "optimization-barrier", "domain", "add-dependency"})


@dataclasses.dataclass(frozen=True)
class Unfused:
    """Kernel launches, HBM bytes and FLOPs with one kernel per op; `per_kernel` holds (bytes, flops) each."""

    kernels: int
    bytes_total: int
    flops: int
    transcendentals: int
    per_kernel: tuple[tuple[int, int], ...]

    def predicted_us(self, hbm_bytes_per_s: float, flops_per_s: float, launch_us: float) -> float:
        """Sum over kernels of max(bytes / BW, FLOPs / peak) + launch cost."""
        return sum(max(b / hbm_bytes_per_s, f / flops_per_s) * 1e6 + launch_us for b, f in self.per_kernel)


def _is_scalar_broadcast(inst: Instruction) -> bool:
    return inst.opcode == "broadcast" and bool(inst.operands) and not inst.operands[0].shape.dims


def _operand_bytes(inst: Instruction) -> int:
    seen, total = set(), 0
    for op in inst.operands:
        while op.opcode in ("bitcast", "reshape") and op.operands:
            op = op.operands[0]
        if _is_scalar_broadcast(op):
            op = op.operands[0]
        if id(op) in seen or op.shape.is_tuple:
            continue
        seen.add(id(op))
        total += op.shape.size_bytes
    return total


def _walk(comp: Computation, out: list[tuple[int, int, int]]) -> None:
    for inst in comp.instructions:
        if inst.opcode in ("call", "while", "conditional", "fusion", "async-start"):
            for called in inst.called_computations:
                _walk(called, out)
            continue
        if inst.opcode in _VIEWS or _is_scalar_broadcast(inst):
            continue
        flops, transcendentals = _instruction_flops(inst)
        written = sum(s.size_bytes for s in inst.shape.leaves())
        out.append((_operand_bytes(inst) + written, flops, transcendentals))


def counterfactual(text_or_module: str | Module) -> Unfused:
    """The one-kernel-per-op cost of a pre-optimization HLO module (text or parsed)."""
    module = parse(text_or_module) if isinstance(text_or_module, str) else text_or_module
    rows: list[tuple[int, int, int]] = []
    _walk(module.entry, rows)
    return Unfused(kernels=len(rows), bytes_total=sum(r[0] for r in rows), flops=sum(r[1] for r in rows),
                   transcendentals=sum(r[2] for r in rows), per_kernel=tuple((r[0], r[1]) for r in rows))


def seed_model_us(tensor_bytes: float, n_ops: int, hbm_bytes_per_s: float, launch_us: float) -> tuple[float, float]:
    """The seed articles' model for a chain of n elementwise ops over S bytes, microseconds:
    T_unfused = n·(2S/BW + K_launch), T_fused = 2S/BW + K_launch."""
    one = 2 * tensor_bytes / hbm_bytes_per_s * 1e6 + launch_us
    return n_ops * one, one
