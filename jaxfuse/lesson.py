"""What the teaching notebooks (``notebooks/``) share: their first line, their sizes, the device they predict for,
exercise checks and the box that sets the seed articles beside a measurement.

    from jaxfuse import lesson
    run = lesson.start("01_pointwise_roofline")   # prints device, jax, commit, date and which sizes run
    run.on_gpu, run.dev, run.full["M"], run.sizes["M"]   # DeviceSpec to predict with; the lesson's and this run's
    lesson.check("exercise 1", answer_1, ours, rtol=0.1, unit="bytes")
    lesson.box(say="...", measured="...", why="...")

Sizes live in ``SIZES``, one entry per notebook: "full" is the lesson's size (a GPU runs it; a CPU compiles it
without running where the lesson needs it), "small" what a CPU runs in seconds. ``JAXFUSE_LESSON_SIZES=small`` or
``full`` overrides the choice (a quick smoke run of the notebooks on a GPU).
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from typing import Any

from jaxfuse import bench, costmodel

__all__ = ["SIZES", "Run", "box", "check", "rel_err", "start"]

MiB = 2**20
# notebook -> {"full": sizes of the lesson, "small": what a CPU runs}
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "00_what_xla_fuses": {
        "full": dict(M=16384, N=8192),  # bf16: 256 MiB per (M, N) tensor, five times the H100's L2
        "small": dict(M=16384, N=8192),  # predicting and compiling need shapes only: full size everywhere
    },
    "01_pointwise_roofline": {
        # chain lengths n, one tensor for the n sweep (bytes), the size sweep (bytes), the FMA ladder (FMAs per
        # element), the GEMM that measures the tensor-core ceiling (M = K = N)
        "full": dict(chain_bytes=256 * MiB, chains=tuple(range(1, 17)),
                     sweep_bytes=tuple(2**k for k in range(14, 31, 2)), sweep_chain=8,
                     fma_counts=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), gemm=8192, iterations=20),
        "small": dict(chain_bytes=16 * MiB, chains=(1, 2, 4, 8, 16),
                      sweep_bytes=tuple(2**k for k in range(14, 27, 4)), sweep_chain=8,
                      fma_counts=(1, 4, 16, 64, 256), gemm=512, iterations=5),
    },
    "02_gemm_epilogues": {
        # (M, K, N) of the epilogue GEMM; QKV: x (M, D) and three (D, D) weights; gate|up: x (M, D), (D, I) each;
        # hidden sizes for the accumulation error
        "full": dict(epilogue=(4096, 4096, 4096), decode=(16, 4096, 4096), qkv=(32768, 8192), qkv_decode=(16, 8192),
                     gate_up=(1, 8192, 28672), hidden=tuple(2**k for k in range(6, 15)), rows=256, iterations=20),
        "small": dict(epilogue=(256, 256, 256), decode=(16, 256, 256), qkv=(256, 256), qkv_decode=(16, 256),
                      gate_up=(1, 256, 512), hidden=tuple(2**k for k in range(6, 15)), rows=64, iterations=5),
    },
    "03_rmsnorm_matmul": {
        "full": dict(prefill=(32768, 4096, 4096), decode=(16, 4096, 4096)),
        "small": dict(prefill=(256, 128, 128), decode=(16, 128, 128)),
    },
    "04_attention_scores": {
        "full": dict(B=4, T=4096, S=4096, N=16, H=128, row=16, tile=4),
        "small": dict(B=1, T=64, S=64, N=2, H=32, row=16, tile=4),
    },
    "05_cross_entropy_memory": {
        "full": dict(B=8192, H=4096, V=128256),
        "small": dict(B=64, H=64, V=1000),
    },
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One execution of a notebook: where it runs, what it predicts for, and its sizes."""

    env: dict[str, str]
    on_gpu: bool
    dev: costmodel.DeviceSpec  # this GPU's spec; an H100's on a CPU or a GPU without figures (the line says)
    full: dict[str, Any]  # the lesson's sizes
    sizes: dict[str, Any]  # the sizes this run executes: full on a GPU, small on a CPU
    mode: str  # "full" | "small"


def start(notebook: str) -> Run:
    """Prints the run's first line (device, jax version, commit, date) and which sizes run; returns the Run."""
    import jax

    if notebook not in SIZES:
        raise ValueError(f"notebook: unknown {notebook!r}; one of {sorted(SIZES)}")
    on_gpu = jax.default_backend() == "gpu"
    mode = os.environ.get("JAXFUSE_LESSON_SIZES") or ("full" if on_gpu else "small")
    if mode not in ("full", "small"):
        raise ValueError(f"JAXFUSE_LESSON_SIZES: expected 'full' or 'small', got {mode!r}")
    env = bench.environment()
    print(", ".join(f"{key} {env[key]}" for key in ("device", "jax", "commit", "date")))
    detected = costmodel.detect() if on_gpu else None
    dev = detected or costmodel.device("h100")
    where = "measured on this GPU" if on_gpu else "a CPU run: wall-clock timings of the CPU, not of a GPU"
    print(f"sizes: {mode} ({where}); predictions for {dev.name}"
          + (f" (no figures for {env['device']}: {costmodel.DEVICE_ENV} gives them)" if on_gpu and not detected
             else ""))
    return Run(env, on_gpu, dev, dict(SIZES[notebook]["full"]), dict(SIZES[notebook][mode]), mode)


def rel_err(got, want) -> float:
    """max |got - want| / max |want|, in float32."""
    import jax.numpy as jnp

    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def check(name: str, answer: float | None, ours: float, *, rtol: float = 0.1, unit: str = "") -> bool | None:
    """Compares the reader's answer (None until they give one) with the solution's; True/False, None unanswered."""
    unit = f" {unit}" if unit else ""
    if answer is None:
        print(f"{name}: ours is {ours:.4g}{unit}; put yours in the cell above and run both again")
        return None
    right = abs(answer - ours) <= rtol * abs(ours)
    print(f"{name}: yours {answer:.4g}{unit}, ours {ours:.4g}{unit}: "
          f"{'right' if right else 'not yet'} (within {rtol:.0%}: {right})")
    return right


def box(*, say: str, measured: str, why: str, width: int = 112) -> None:
    """Prints the box that sets what the seed articles say beside what this run measured, and why they differ."""
    print("─" * width)
    for label, text in (("the articles say", say), ("we measured", measured), ("why", why)):
        lines = textwrap.wrap(" ".join(text.split()), width - 20) or [""]
        print(f"{label:>17} │ {lines[0]}")
        for line in lines[1:]:
            print(f"{'':>17} │ {line}")
    print("─" * width)
