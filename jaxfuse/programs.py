"""The programs that ``jaxfuse inspect`` and ``hlo_inspect`` compile: a model, its inputs, forward or train step.

    >>> from jaxfuse.programs import build_program
    >>> p = build_program("block", train_step=True)
    >>> loss, grads = jax.jit(p.fn)(*p.args)          # or hlo_inspect.inspect(p.fn, *p.args)

``Program.fn`` is pure: parameters are its first argument (an ``nnx.State`` split off the model with
``nnx.split``), so they are explicit jit arguments, not constants folded into the HLO. With ``mesh=`` (and
``fsdp=``) the arguments are placed on a device mesh (``jaxfuse.sharding``) and ``fn`` traces on it: compiling it
gives one device's SPMD-partitioned program, its collectives included (``jaxfuse inspect --mesh data=2,model=2``).

  model="block", forward:     fn(params, x (B, T, D)) -> y (B, T, D)
  model="block", train_step:  fn(params, x) -> (loss, grads); loss = mean(y²) in float32, grads like params
  model="lm", forward:        fn(params, tokens (B, T)) -> logits (B, T, V), final norm fused into the LM head
                              through the norm_matmul site
  model="lm", train_step:     fn(params, tokens, labels (B, T)) -> (loss, grads); mean next-token cross-entropy
                              through the loss site

Defaults (a Llama-shaped block that compiles in seconds on CPU): batch 2, seq 128, and the model shape of
``Config.block_default()`` (dim 256, 4 query heads and 2 key/value heads (head dim 64, GQA), MLP hidden 704,
bfloat16 compute with float32 parameters; the LM adds 2 layers and a 4096-token vocabulary).

What `jaxfuse inspect | diff` do with a program, as functions of plain arguments that return data:

    report = inspect_program(build_program("block"), xla_flags="--xla_gpu_enable_triton_gemm=false")
    d = diff_programs("attention=xla", "attention=cudnn", model=dict(train_step=True))
    kernels = triton_kernels(build_program(kernels=KernelSet.parse("all=pallas_triton")))  # any machine: for CUDA
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import hlo_inspect
from hlo_inspect.formatting import parse_xla_flags
from jaxfuse.kernels import SITES, KernelSet
from jaxfuse.models import Block, Config, Transformer
from jaxfuse.sharding import Layout

__all__ = ["DEFAULT_MODEL", "MODELS", "Program", "build_program", "check_kernels", "diff_programs",
           "foreign_flags_warning", "inspect_program", "interpret_mode_caveat", "triton_kernels", "xla_option_error"]

MODELS = ("block", "lm")
IGNORE_LABEL = -100  # label of the last position, which has no next token
DEFAULT_MODEL = Config.block_default()  # the one definition of the default model's shape (CLI, train, programs)


@dataclasses.dataclass(frozen=True)
class Program:
    """A pure function and concrete arguments to call (or jit, lower, compile) it with."""

    fn: Callable[..., Any]  # fn(params, *inputs); jit-able
    args: tuple[Any, ...]  # (params nnx.State, *inputs), random values
    description: str  # one line: model, shapes, dtype, mode, kernels
    config: Config
    kernels: KernelSet
    layout: Layout | None = None  # the device mesh the program is partitioned over (jaxfuse.sharding), or None
    sites: tuple[str, ...] = SITES  # the kernel sites fn calls (the loss site only in the LM's train step)


def build_program(
    model: str = "block",
    *,
    batch: int = 2,
    seq: int = 128,
    dim: int = DEFAULT_MODEL.dim,
    heads: int = DEFAULT_MODEL.n_heads,
    kv_heads: int = DEFAULT_MODEL.n_kv_heads,
    dtype: Any = DEFAULT_MODEL.dtype.name,
    train_step: bool = False,
    kernels: KernelSet = KernelSet(),
    seed: int = 0,
    layers: int = DEFAULT_MODEL.n_layers,
    vocab: int = DEFAULT_MODEL.vocab,
    mesh: str | None = None,
    fsdp: bool = False,
) -> Program:
    """Builds the model ("block": one decoder block; "lm": ``layers`` blocks with embedding and LM head).

    Head dim is dim / heads and the MLP hidden width 8/3·dim rounded up to 64 (``Config.from_width``).
    ``layers`` and ``vocab`` apply to "lm" only. Parameters come from ``nnx.Rngs(seed)``, inputs from
    ``jax.random.key(seed + 1)``. ``mesh`` ("data=2,model=2", with ``fsdp``: ``jaxfuse.sharding.Layout``): the
    parameters and inputs are placed with the layout's shardings and ``fn`` traces on its mesh, so compiling it
    gives the SPMD-partitioned program of one device, collectives included. Raises ``ValueError`` naming the
    argument for bad values.
    """
    if model not in MODELS:
        raise ValueError(f"model: expected one of {list(MODELS)}, got {model!r}")
    for name, value in (("batch", batch), ("seq", seq), ("heads", heads), ("kv_heads", kv_heads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if not isinstance(kernels, KernelSet):
        raise TypeError(f"kernels: expected a KernelSet, got {type(kernels).__name__}")
    cfg = Config.from_width(dim, heads, kv_heads, n_layers=layers if model == "lm" else 1,
                            vocab=vocab, max_seq=seq, dtype=dtype)
    x_key = jax.random.key(seed + 1)
    mode = "train_step" if train_step else "forward"
    if fsdp and mesh is None:
        raise ValueError("fsdp: shards over a mesh's data axis; give a mesh too (mesh='data=N')")
    layout = Layout.parse(mesh, fsdp=fsdp) if mesh is not None else None
    if layout is not None:
        layout.check_model(cfg, batch)

    if model == "block":
        graphdef, params = nnx.split(Block(cfg, kernels=kernels, rngs=nnx.Rngs(seed)))
        x = jax.random.normal(x_key, (batch, seq, dim), cfg.dtype)  # (B, T, D)

        def block_forward(params: nnx.State, x: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, params)(x)  # (B, T, D)

        def block_train_step(params: nnx.State, x: jax.Array) -> tuple[jax.Array, nnx.State]:
            def loss_of(params):
                y = nnx.merge(graphdef, params)(x)  # (B, T, D)
                return jnp.mean(jnp.square(y.astype(jnp.float32)))

            return jax.value_and_grad(loss_of)(params)

        fn, args = (block_train_step if train_step else block_forward), (params, x)
        shapes = f"x ({batch}, {seq}, {dim})"
    else:
        graphdef, params = nnx.split(Transformer(cfg, kernels=kernels, rngs=nnx.Rngs(seed)))
        tokens = jax.random.randint(x_key, (batch, seq), 0, vocab, dtype=jnp.int32)  # (B, T)
        labels = jnp.concatenate([tokens[:, 1:], jnp.full((batch, 1), IGNORE_LABEL, jnp.int32)], axis=1)  # (B, T)

        def lm_forward(params: nnx.State, tokens: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, params)(tokens)  # (B, T, V)

        def lm_train_step(params: nnx.State, tokens: jax.Array, labels: jax.Array) -> tuple[jax.Array, nnx.State]:
            def loss_of(params):
                return nnx.merge(graphdef, params).loss(tokens, labels)

            return jax.value_and_grad(loss_of)(params)

        fn, args = (lm_train_step, (params, tokens, labels)) if train_step else (lm_forward, (params, tokens))
        shapes = f"tokens ({batch}, {seq}), {layers} layers, vocab {vocab}"

    description = (
        f"{model} {mode}: {shapes}, dim {dim}, heads {heads}/{kv_heads} (head dim {cfg.head_dim}), "
        f"mlp {cfg.mlp_hidden}, {cfg.dtype.name} compute, {cfg.param_dtype.name} params, kernels {kernels}"
    )
    if layout is not None:
        fn, args = _on_mesh(fn, args, layout)
        description += f", mesh {layout} ({layout.strategy}, {layout.devices} devices)"
    sites = SITES if (model == "lm" and train_step) else tuple(site for site in SITES if site != "loss")
    return Program(fn=fn, args=args, description=description, config=cfg, kernels=kernels, layout=layout,
                   sites=sites)


def _on_mesh(fn: Callable, args: tuple, layout: Layout) -> tuple[Callable, tuple]:
    """(fn traced on the layout's mesh, args placed: parameters by its rules, inputs split over data)."""
    params, *inputs = args

    @functools.wraps(fn)
    def on_mesh(*args):
        with layout.tracing():
            return fn(*args)

    placed = [jax.device_put(params, layout.shardings(params))]
    placed += [jax.device_put(x, layout.batch_sharding()) for x in inputs]
    return on_mesh, tuple(placed)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _pallas_sites(kernels: KernelSet, sites: tuple[str, ...] = SITES) -> list[str]:
    """The ``sites`` (all by default; a program's own) at which ``kernels`` runs a Pallas kernel."""
    return [site for site in sites if getattr(kernels, site).startswith("pallas")]


def check_kernels(kernels: KernelSet, *, lowering_only: bool = False) -> None:
    """ValueError naming every site whose implementation cannot run on this machine (cuDNN without an NVIDIA
    GPU, a Pallas backend the op does not implement, Mosaic kernels off an sm90 GPU), before anything compiles.
    ``lowering_only``: the program is only lowered for CUDA (``triton_kernels``), which Mosaic kernels allow
    anywhere."""
    from jaxfuse import kernels as registry
    from pallas_kernels import backends

    reasons = []
    for site in SITES:
        name = getattr(kernels, site)
        with backends.lowering_for_gpu() if lowering_only else contextlib.nullcontext():
            reason = registry.unavailable_reason(site, name)
        if reason:
            reasons.append(f"{site}={name}: {reason.removeprefix(name + ': ')}")
    if reasons:
        raise ValueError("kernels: " + "; ".join(reasons))


def interpret_mode_caveat(kernels: KernelSet, sites: tuple[str, ...] = SITES) -> str | None:
    """The warning a report of a program calling ``sites`` with ``kernels`` carries when its Pallas kernels run in
    interpret mode here (on a CPU), or None."""
    sites = _pallas_sites(kernels, sites)
    if not sites or jax.default_backend() != "cpu":
        return None
    return (f"interpret mode: the Pallas kernels ({', '.join(sites)}) ran in interpret mode on the CPU: their "
            "kernels here are the interpreter's loops of small XLA ops (a CPU emulation), not the one kernel each "
            "that a GPU launches; their counts, bytes and the fusion saving say nothing about a GPU")


def xla_option_error(error: Exception, options: dict[str, Any]) -> ValueError | None:
    """A one-line ValueError naming the XLA flag(s) behind a compile ``error`` (an option XLA does not know, or a
    value it cannot read) and what XLA said; None when ``error`` does not come from ``options``."""
    said = " ".join(str(error).split())
    named = [name for name in options if name in said]
    if not options or not (named or "option" in said):
        return None
    given = " ".join(f"--{name}={str(options[name]).lower() if isinstance(options[name], bool) else options[name]}"
                     for name in (named or options))
    return ValueError(f"xla_flags {given}: XLA says: {said}")


def foreign_flags_warning(options: dict[str, Any], platform: str | None = None) -> str | None:
    """A one-line warning when XLA flags of another platform (``--xla_gpu_*`` on a CPU, ``--xla_cpu_*`` on a
    GPU) are given: XLA accepts them and they change nothing. None when every flag applies here."""
    platform = platform or jax.default_backend()
    other = {"cpu": "xla_gpu_", "gpu": "xla_cpu_"}.get(platform)
    foreign = [name for name in options if other and name.startswith(other)]
    if not foreign:
        return None
    one = len(foreign) == 1
    return (f"warning: {', '.join('--' + name for name in foreign)} only affect{'s' if one else ''} "
            f"{'GPU' if other == 'xla_gpu_' else 'CPU'} compiles; on this {platform} machine "
            f"{'it has' if one else 'they have'} no effect")


def inspect_program(program: Program, *, xla_flags: str = "",
                    progress: Callable[[str], None] = _progress) -> hlo_inspect.Report:
    """Compiles ``program`` (with XLA options given as flags, ``"--xla_name=value ..."``) and returns its report,
    titled with the program, device and jax version; ``report.program`` is the program (for ``--measure``).

    ValueError (one line) for kernels this machine cannot run and for XLA flags XLA rejects; a Pallas kernel in
    interpret mode puts ``interpret_mode_caveat`` among the report's warnings."""
    options = parse_xla_flags(xla_flags)
    check_kernels(program.kernels)
    foreign = foreign_flags_warning(options)
    if foreign:
        progress(foreign)
    caveat = interpret_mode_caveat(program.kernels, program.sites)
    if caveat:
        sites = ", ".join(_pallas_sites(program.kernels, program.sites))
        progress(f"note: on the CPU the Pallas kernels ({sites}) run in interpret mode: the report lists the "
                 "interpreter's loops of small XLA ops, not one fused kernel; inspect on a GPU to see the kernel "
                 "itself")
    progress(f"compiling {program.description} on {jax.devices()[0].device_kind} ...")
    start = time.perf_counter()
    try:
        report = hlo_inspect.inspect(program.fn, *program.args, compiler_options=options or None)
    except jax.errors.JaxRuntimeError as e:
        error = xla_option_error(e, options)
        if error is None:
            raise
        raise error from e
    report.title = (f"{program.description} on {jax.devices()[0].device_kind} (jax {jax.__version__})"
                    + (f", XLA options {options}" if options else ""))
    if caveat:
        report.caveats.append(caveat)
    progress(f"compiled in {time.perf_counter() - start:.1f} s")
    report.program = program
    return report


@contextlib.contextmanager
def _naming_side(name: str, spec: str | None):
    """ValueErrors (HloParseError is one) inside start with the side: "A (old.hlo.txt): line 3: ..."."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{name} ({spec if spec else 'default kernels'}): {e}") from e


def _side_source(spec: str | None, xla_flags: str) -> str | KernelSet:
    """One side of a diff, checked before anything compiles: a saved HLO file's text (a folder of XLA dumps: its
    one optimized module), or the kernel set of the model ('' or None for the defaults) that this machine can
    run."""
    if spec and os.path.isdir(spec):
        from hlo_inspect.passes import optimized_dumps

        try:
            dumps = optimized_dumps(spec)
        except OSError as e:
            raise ValueError(f"cannot read the folder: {e.strerror}") from None
        if len(dumps) != 1:
            found = (f"holds {len(dumps)} optimized modules; pass one of them: "
                     + ", ".join(os.path.basename(d) for d in dumps[:10]) + (", ..." if len(dumps) > 10 else "")
                     if dumps else "is a folder without an optimized module (module_*.*after_optimizations.txt, as "
                     "--xla_dump_to writes them)")
            raise ValueError(f"{found}; expected an HLO text file or a kernel spec like 'attention=cudnn'")
        spec = dumps[0]
    if spec and os.path.isfile(spec):
        if xla_flags:
            raise ValueError(f"xla_flags: XLA flags apply to programs we compile, not to the saved file {spec}")
        with open(spec, "rb") as f:
            data = f.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): expected the "
                             "HLO text of a compiled program, `jax.jit(f).lower(*args).compile().as_text()`") from None
    if spec and "=" not in spec:
        if "/" in spec or spec.endswith((".txt", ".hlo")):
            raise ValueError("no such file")
        raise ValueError(f"{spec!r} is neither an HLO text file nor a kernel spec like 'attention=cudnn'")
    parse_xla_flags(xla_flags)
    kernels = KernelSet.parse(spec or "")
    check_kernels(kernels)
    return kernels


def diff_programs(a: str | None, b: str | None, *, a_xla_flags: str = "", b_xla_flags: str = "",
                  model: dict | None = None, progress: Callable[[str], None] = _progress) -> hlo_inspect.Diff:
    """The ``hlo_inspect.Diff`` of two programs, each a saved HLO text file or a kernel spec for the model that
    ``build_program(**model)`` builds ('' or None: the default kernels), compiled with its XLA flags. Both sides
    are checked before either compiles; a bad side is a ValueError that starts with its name ("A (old.hlo.txt):
    line 3: ...", "B (attention=cudnn): ...")."""
    if a is None and b is None and not (a_xla_flags or b_xla_flags):
        raise ValueError("give a and b (HLO files or kernel specs), or XLA flags for either side")
    model = dict(model or {})
    sides = (("A", a, a_xla_flags), ("B", b, b_xla_flags))
    sources = []
    for name, spec, xla_flags in sides:
        with _naming_side(name, spec):
            sources.append(_side_source(spec, xla_flags))
    reports, labels = [], []
    for (name, spec, xla_flags), source in zip(sides, sources):
        with _naming_side(name, spec):
            if isinstance(source, str):
                reports.append(hlo_inspect.from_text(source, title=spec))
                labels.append(spec)
                continue
            program = build_program(**model, kernels=source)
            reports.append(inspect_program(program, xla_flags=xla_flags, progress=progress))
            labels.append((spec or "default kernels") + (f" {xla_flags}" if xla_flags else ""))
    return hlo_inspect.diff(reports[0], reports[1], label_a=labels[0], label_b=labels[1])


def _mosaic_note(kernels: KernelSet, backends_run: dict[str, set[str]], mosaic_calls: int) -> str | None:
    """What ``triton_kernels`` leaves out: the sites that lowered as Mosaic GPU kernels (``backends_run``:
    ``kernels.recording_backends``'s record) and why, or the program's ``mosaic_calls`` Mosaic kernel calls that
    Triton-backend ops make themselves; and where to see them. None when the lowering holds no Mosaic kernel."""
    sites = [site for site in SITES if "mosaic" in backends_run.get(site, ())]
    see = "see them with --mosaic-ir"
    if not sites and not mosaic_calls:
        return None
    if not sites:
        return (f"{mosaic_calls} Mosaic GPU kernel call{'s' if mosaic_calls != 1 else ''} that Triton-backend ops "
                f"make themselves (the loss runs its GEMMs on the Mosaic core on Hopper): {see}")
    why = (" ('pallas' takes Mosaic where it runs these shapes, as on an H100)"
           if any(getattr(kernels, site) == "pallas" for site in sites) else "")
    named = ", ".join(f"{site}={getattr(kernels, site)}" for site in sites)
    return (f"{named} lower{'s' if len(sites) == 1 else ''} for CUDA as Mosaic GPU kernels{why}, not Triton: "
            f"name pallas_triton to see them as Triton kernels, or {see}")


def _to_lower(program: Program, view: str, example: str, example_all: str, progress: Callable[[str], None]):
    """What ``mosaic_kernels`` and ``triton_kernels`` (``view``) check before lowering ``program`` for CUDA (a site
    that runs a Pallas kernel, else ValueError suggesting ``--kernels example`` or ``example_all``; kernels that
    lower here), then a new function calling the program's, so jax traces it anew (no cached trace) and every site
    call is recorded."""
    if not _pallas_sites(program.kernels, program.sites):
        raise ValueError(f"{view}: no site runs a Pallas kernel ({program.kernels}; this program calls "
                         f"{', '.join(program.sites)}); choose one, e.g. --kernels {example} or --kernels "
                         f"{example_all}")
    check_kernels(program.kernels, lowering_only=True)
    progress(f"lowering {program.description} for CUDA ...")

    def fn(*args):
        return program.fn(*args)

    return fn


def mosaic_kernels(program: Program, *, progress: Callable[[str], None] = _progress) -> list:
    """The Mosaic GPU kernels of ``program`` lowered for CUDA (on any machine), in program order:
    [hlo_inspect.mosaic_ir.MosaicKernel] (their tiles from this machine's tuning cache or the built-in tables).
    The sites that lower as Triton kernels are left out, said through ``progress``; ValueError naming them when no
    Mosaic kernel is left, or when no site runs a Pallas kernel."""
    from hlo_inspect import mosaic_ir
    from jaxfuse import kernels as registry
    from pallas_kernels import backends

    fn = _to_lower(program, "mosaic_ir", "norm_matmul=pallas_mosaic", "all=pallas", progress)  # (all=pallas_mosaic
    # is refused: the loss has no Mosaic backend)
    with registry.recording_backends() as backends_run, backends.lowering_for_gpu():
        try:
            kernels = mosaic_ir.lower_kernels(fn, *program.args)
        except ValueError as error:
            if "holds no Mosaic-GPU kernel" not in str(error):
                raise
            kernels = []
    triton = [f"{site}={getattr(program.kernels, site)}" for site in SITES if "triton" in backends_run.get(site, ())]
    left_out = (f"{', '.join(triton)} lower{'s' if len(triton) == 1 else ''} for CUDA as Triton kernels: see them "
                f"with --triton-ir" if triton else None)
    if not kernels:
        raise ValueError(f"mosaic_ir: no Mosaic GPU kernel to show: {left_out or 'the CUDA lowering holds none'}"
                         + ("; name pallas_mosaic where the op has a Mosaic backend" if triton else ""))
    if left_out:
        progress(f"note: left out: {left_out}")
    return kernels


def triton_kernels(program: Program, *, progress: Callable[[str], None] = _progress) -> list:
    """The Pallas kernels of ``program`` lowered for CUDA (on any machine): [hlo_inspect.triton_ir.TritonKernel].

    The Mosaic GPU kernels of the lowering (sites that lower as Mosaic, GEMMs a Triton op runs on the Mosaic core)
    are left out, said through ``progress``; ValueError naming them when no Triton kernel is left."""
    from hlo_inspect import mosaic_ir, triton_ir
    from jaxfuse import kernels as registry
    from pallas_kernels import backends, triton_utils

    fn = _to_lower(program, "triton_ir", "attention=pallas_triton", "all=pallas_triton", progress)
    with (registry.recording_backends() as backends_run, backends.lowering_for_gpu(),
          triton_utils.quiet_triton_deprecation()):
        kernels, other_calls = triton_ir.lower_program(fn, *program.args)
    mosaic = _mosaic_note(program.kernels, backends_run, other_calls.get(mosaic_ir.MOSAIC_CALL_TARGET, 0))
    if not kernels:
        raise ValueError(f"triton_ir: no Triton kernel to show: {mosaic or 'the CUDA lowering holds none'}")
    if mosaic:
        progress(f"note: left out: {mosaic}")
    return kernels
