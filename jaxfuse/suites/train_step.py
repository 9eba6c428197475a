"""Train-step spec: one optimizer step of the language model (forward, backward, AdamW update) per kernel set.

    jaxfuse bench --op train_step                        # GPU: the "small" and "1b" presets
    jaxfuse bench --op train_step --shapes tiny          # CPU: a tiny preset (GPU-sized presets are refused)

Kernel sets (the implementations, named as ``str(KernelSet)``): every site xla; cuDNN attention; each site's Pallas
kernel alone, per Pallas backend the op implements; every site on that backend. Each record carries the step's
time (CUPTI device time on GPU, wall time on CPU), ``temp_bytes`` and ``peak_bytes`` (arguments + outputs +
temporaries − aliased, from ``compiled.memory_analysis()``) and the step's loss. All sets start from the same
parameters and batch, so their losses agree to rounding. The loss site's shapes (tokens × width × vocabulary) are
``cross_entropy``'s "lm_head_small" and "lm_head_1b"; FLOPs are 6 per parameter of the matmuls (the embedding
gather excluded) per token plus 3.5× the causal attention forward, the floor those FLOPs at the device's bf16 rate.
Records also carry ``tokens_per_s`` and ``param_bytes_per_device`` / ``opt_bytes_per_device`` (the most bytes of
parameters / optimizer state one device holds after the step, from the arrays' addressable shards).

On a device mesh (``jaxfuse.sharding``):

    jaxfuse bench --op train_step --shapes 1b --mesh data=2             # data parallel over 2 GPUs
    jaxfuse bench --op train_step --shapes 1b --mesh data=4 --fsdp      # fully sharded over 4
    jaxfuse bench --op train_step --shapes 1b --mesh data=2,model=2     # data x tensor parallel

``on_mesh(layout)`` is the spec run there: a preset's batch is per data shard (the global batch is batch x data, so
tokens/s against ``--mesh data=1`` measures weak scaling), parameters, optimizer state and batch are placed with the
layout's shardings, the step keeps them, every record carries ``mesh``, ``strategy`` and ``devices``, and steps are
timed with the host wall clock (CUPTI would add up every device's kernels); time ``--mesh data=1`` for the one-GPU
figure to compare with.
"""

from __future__ import annotations

from jaxfuse.kernels import KernelSet
from jaxfuse.suites.spec import OpSpec

__all__ = ["PRESETS", "SPEC", "check_mesh", "kernel_sets", "model_config", "on_mesh"]

# name -> model and batch: Config.from_width(dim, heads, kv_heads, n_layers=layers, vocab=vocab) with batch x seq
# tokens per step. "small" is Config.small's model with a 32k vocabulary; "1b" Llama-3.2-1B's proportions (width
# 2048, 16 layers, 32 / 8 heads of 64, a 128k vocabulary) with an untied LM head: 1.24B parameters.
PRESETS = {
    "tiny": dict(dim=64, heads=2, kv_heads=2, layers=1, vocab=256, batch=2, seq=32, dtype="float32",
                 note="CPU smoke preset (interpret mode); 2 kv heads: splits over a model axis of 2"),
    "small": dict(dim=512, heads=8, kv_heads=2, layers=8, vocab=32768, batch=8, seq=1024, dtype="bfloat16",
                  note="Config.small with a 32k vocabulary"),
    "1b": dict(dim=2048, heads=32, kv_heads=8, layers=16, vocab=128256, batch=2, seq=2048, dtype="bfloat16",
               note="Llama-3.2-1B proportions, untied LM head"),
}


def model_config(preset):
    """The model Config of a preset (a PRESETS entry)."""
    from jaxfuse.models import Config

    return Config.from_width(preset["dim"], preset["heads"], preset["kv_heads"], n_layers=preset["layers"],
                             vocab=preset["vocab"], max_seq=preset["seq"], dtype=preset["dtype"])


def kernel_sets() -> dict:
    """str(KernelSet) -> KernelSet: all xla; cuDNN attention; per Pallas backend, each site alone and all sites."""
    import pallas_kernels
    from jaxfuse.kernels import SITE_OPS, SITES

    sets = [KernelSet(), KernelSet(attention="cudnn")]
    for backend in pallas_kernels.backends.NAMES:
        sites = [s for s in SITES if backend in pallas_kernels.BACKENDS[SITE_OPS[s]].names]
        sets += [KernelSet(**{site: f"pallas_{backend}"}) for site in sites]
        if len(sites) > 1:
            sets.append(KernelSet(**{site: f"pallas_{backend}" for site in sites}))
    return {str(ks): ks for ks in sets}


def _params(cfg) -> tuple[int, int]:
    """(all parameters, parameters of the matmuls) of the model."""
    per_layer = (cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + cfg.n_heads * cfg.head_dim * cfg.dim
                 + 3 * cfg.dim * cfg.mlp_hidden)
    matmuls = cfg.n_layers * per_layer + cfg.dim * cfg.vocab
    return matmuls + cfg.vocab * cfg.dim + (2 * cfg.n_layers + 1) * cfg.dim, matmuls


def _cost(preset, variant, mode) -> tuple[float, float]:
    """FLOPs: 6 per matmul parameter and token, plus 3.5x the causal attention forward. Bytes: the optimizer's
    float32 traffic (parameters, gradients and both moments read, parameters and moments written); activations are
    not counted."""
    cfg = model_config(preset)
    total, matmuls = _params(cfg)
    B, T = preset["batch"], preset["seq"]
    attention = 4.0 * B * cfg.n_heads * T * T * cfg.head_dim * 0.5 * cfg.n_layers
    return 6.0 * matmuls * B * T + 3.5 * attention, 4.0 * total * 7


def _make_inputs(preset, seed: int, layout=None):
    """(params, opt_state, tokens (B, T), labels (B, T)): random parameters and tokens, next-token labels; placed
    with ``layout``'s shardings when given."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxfuse import train
    from jaxfuse.models import Transformer

    cfg = model_config(preset)
    _, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))
    opt, _ = train.optimizer(train.TrainConfig())
    tokens = jax.random.randint(jax.random.key(seed + 1), (preset["batch"], preset["seq"] + 1), 0, cfg.vocab,
                                dtype=jnp.int32)
    if layout is None:
        return params, opt.init(params), tokens[:, :-1], tokens[:, 1:]
    check_mesh(preset, layout)
    batch = layout.batch_sharding()
    return (*train.place(layout, params, opt.init(params)), jax.device_put(tokens[:, :-1], batch),
            jax.device_put(tokens[:, 1:], batch))


def _program(kernels, mode, preset, variant, layout=None):
    """The jit-able optimizer step of the model with ``kernels`` at its sites (graph only: no parameters made), on
    ``layout``'s mesh when given."""
    from flax import nnx

    from jaxfuse import train
    from jaxfuse.models import Transformer

    cfg = model_config(preset)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, kernels=kernels, rngs=nnx.Rngs(0))))
    opt, optax = train.optimizer(train.TrainConfig())
    step, _ = train.step_functions(graphdef, opt, optax, layout)
    return step


def _summarize(outputs) -> dict:
    from jaxfuse.sharding import bytes_per_device

    params, opt_state, loss = outputs
    return {"loss": float(loss), "param_bytes_per_device": bytes_per_device(params),
            "opt_bytes_per_device": bytes_per_device(opt_state)}


def _skip_reason(name: str, preset) -> str | None:
    from jaxfuse import kernels

    try:
        import optax  # noqa: F401
    except ImportError:
        return "train_step needs optax: pip install 'jaxfuse[train]'"
    ks = KernelSet.parse(name)
    reasons = [kernels.unavailable_reason(site, getattr(ks, site)) for site in kernels.SITES]
    return "; ".join(r for r in reasons if r) or None


def _label(preset, variant) -> str:
    total, _ = _params(model_config(preset))
    size = f"{total / 1e9:.2f}B" if total >= 1e9 else f"{total / 1e6:.2f}M"
    return (f"{preset['layers']}x{preset['dim']} V{preset['vocab']} ({size} params), "
            f"{preset['batch']}x{preset['seq']} tokens")


SPEC = OpSpec(
    name="train_step", site=None, op=None, shapes=PRESETS, default_shapes=("small", "1b"), cpu_shapes=("tiny",),
    make_inputs=_make_inputs, num_args=4, grad_argnums=(), output_names={"step": ("params", "opt_state", "loss")},
    cost=_cost, reduction_length=lambda preset: preset["batch"] * preset["seq"], label=_label,
    baselines=(str(KernelSet()),), opt_in=(),
    skip_reason=_skip_reason, input_sets=1, modes=("step",), program_fn=_program, implementations_fn=kernel_sets,
    reference_impl=None, summarize=_summarize, tokens=lambda preset: preset["batch"] * preset["seq"])


def check_mesh(preset, layout) -> None:
    """ValueError naming what ``layout`` cannot split in ``preset`` (``Layout.check_model``)."""
    layout.check_model(model_config(preset), preset["batch"])


def on_mesh(layout) -> OpSpec:
    """The spec on ``layout`` (a ``jaxfuse.sharding.Layout``): presets' batches are per data shard, inputs placed
    with the layout's shardings, the step traced on its mesh, wall-clock timing; records name the mesh, strategy and
    device count (their ``variant``)."""
    import dataclasses
    import functools

    shapes = {name: dict(preset, batch=preset["batch"] * layout.data) for name, preset in PRESETS.items()}
    return dataclasses.replace(
        SPEC, shapes=shapes, make_inputs=functools.partial(_make_inputs, layout=layout),
        program_fn=functools.partial(_program, layout=layout), wall_time=True,
        variants=({"mesh": str(layout), "strategy": layout.strategy, "devices": layout.devices},),
        label=lambda preset, variant: f"{_label(preset, variant)}, mesh {variant['mesh']} ({variant['strategy']})")
