"""Linear cross-entropy spec: the fused Pallas kernels against plain XLA (materialized logits), side by side.

    from jaxfuse import suites
    records = suites.run("cross_entropy", ["8k_128k"], iterations=10)     # or `jaxfuse bench --op cross_entropy`

For each shape (B×H×V, bf16, mean loss over all rows) the implementations of the model's loss site
(``jaxfuse.kernels.LOSS``): "xla" (jnp: logits = h @ w, float32 log-sum-exp, the label logit; XLA fuses what it
can), "pallas_<backend>" (``pallas_kernels.linear_cross_entropy`` on each backend it implements), and
"tokamax_chunked_xla" when tokamax is installed. "fwd" times the loss, "fwd+bwd" the loss and the gradients for h
and w. Every record carries ``temp_bytes`` (``compiled.memory_analysis()``): the fused kernels' point is memory.
The floor is GEMM FLOPs at the device's measured bf16 rate: 2·B·H·V for fwd, 3× that for fwd+bwd (what XLA with
materialized logits needs, and what the Triton backend runs with (Bc, V) token chunks: a chunk's dlogits need only
its own rows' log-sum-exp; a design that never stores even a chunk of logits needs 4×). The Pallas records name
the backend that ran ("pallas_triton") and carry its config, chunk_rows included.

The "lm_head_*" shapes are the loss site of ``jaxfuse bench --op train_step``'s presets (tokens × width ×
vocabulary, 32768 and 128256 words), taken from its PRESETS.
"""

from __future__ import annotations

from jaxfuse.suites import train_step
from jaxfuse.suites.spec import OpSpec

__all__ = ["SPEC", "SHAPES", "make_inputs"]


def _lm_head(preset: str) -> dict:
    p = train_step.PRESETS[preset]
    return dict(B=p["batch"] * p["seq"], H=p["dim"], V=p["vocab"], note=f"the loss site of train_step's {preset!r}")


SHAPES = {
    "8k_128k": dict(B=8192, H=4096, V=128256, note="Llama-3-8B's head, 8k tokens"),
    "4k_256k": dict(B=4096, H=2048, V=256000, note="a 256k vocabulary"),
    "16k_32k": dict(B=16384, H=4096, V=32000, note="Llama-2's vocabulary, 16k tokens"),
    "lm_head_small": _lm_head("small"),
    "lm_head_1b": _lm_head("1b"),
    "cpu": dict(B=64, H=64, V=1000, note="smoke shape for CPU (interpret mode)"),
}


def make_inputs(B: int, H: int, V: int, *, seed: int = 0, dtype=None):
    """h ~ N(0, 1), w ~ N(0, 1/H) (logits ~ N(0, 1), as at initialization), labels uniform in [0, V)."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.bfloat16 if dtype is None else dtype
    k_h, k_w, k_y = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k_h, (B, H), dtype)
    w = (jax.random.normal(k_w, (H, V), dtype) * (H**-0.5)).astype(dtype)
    labels = jax.random.randint(k_y, (B,), 0, V, jnp.int32)
    return h, w, labels


def _extra_implementations() -> dict:
    try:
        import tokamax
    except ImportError:
        return {}
    return {"tokamax_chunked_xla": lambda h, w, labels: tokamax.linear_softmax_cross_entropy_loss(
        h, labels, w, reduction="mean", implementation="chunked_xla")}


def _cost(s, variant, mode) -> tuple[float, float]:
    """GEMM FLOPs (fwd 1 GEMM, fwd+bwd 3); bytes: h, w and labels read (fwd+bwd also writes dh, dw)."""
    B, H, V = s["B"], s["H"], s["V"]
    io_bytes = 2.0 * (B * H + H * V) + 4.0 * B
    return (2.0 * B * H * V, io_bytes) if mode == "fwd" else (6.0 * B * H * V, 2.0 * io_bytes)


SPEC = OpSpec(
    name="cross_entropy", site="loss", op="linear_cross_entropy", shapes=SHAPES,
    default_shapes=("8k_128k", "4k_256k", "16k_32k", "lm_head_small", "lm_head_1b"), cpu_shapes=("cpu",),
    tune_shapes=("8k_128k",),
    make_inputs=lambda s, seed: make_inputs(s["B"], s["H"], s["V"], seed=seed),
    num_args=3, grad_argnums=(0, 1), output_names={"fwd": ("loss",), "fwd+bwd": ("loss", "dh", "dw")},
    cost=_cost, reduction_length=lambda s: max(s["B"], s["H"], s["V"]),
    label=lambda s, variant: f"{s['B']}x{s['H']}x{s['V']}", extra_implementations=_extra_implementations,
    input_sets=1)
