"""Small language-model training on an offline corpus, for end-to-end comparisons of kernel sets.

    from jaxfuse import KernelSet, train
    cfg = train.TrainConfig(steps=300)                     # byte-level LM on the toolkit's own source text
    runs = train.compare([KernelSet(), KernelSet.parse("attention=pallas,loss=pallas")], cfg)
    print(train.comparison_table(runs))                     # or: jaxfuse train --kernels '' --kernels all=pallas

Every kernel set trains the same model from the same initial parameters on the same batches in the same order,
so two loss curves differ only by the kernels' numerics (they should overlap: float32 to ~1e-5, bf16 drifts by
rounding), and the step times say what the fused kernels are worth end to end. The step time is measured after
training, on the compiled training step (forward, backward, AdamW update): device-kernel time on GPU (CUPTI,
``jaxfuse.bench.time_kernels``), wall time on CPU, and the result says which. ``compare`` times the kernel sets
interleaved (one step of each in turn, ``timing_iterations`` rounds), so a machine that slows down meanwhile slows
every set alike; each result keeps the median and the interquartile range of its step times, and the table marks a
speedup "within noise" when the two ranges overlap.

The train loss a run reports is one quantity everywhere (progress lines, table, ``final_train_loss``): the mean
over the last ``TrainConfig.loss_window`` steps (``eval_every``, or every step when the run is shorter).

The corpus is bytes (vocabulary 256) of a UTF-8 text file, or by default the Python source of the installed
jaxfuse, hlo_inspect and pallas_kernels packages (about 0.4 MB, always present, no download; it changes with the
code, so results name its size and sha256). Its last 10% is held out: the eval loss is the mean over a fixed set
of held-out batches, the same for every kernel set. With 256 tokens the LM head is small, so the loss site's fused
kernel has little to save here: it matters at vocabularies of 32k-256k (``jaxfuse bench --op cross_entropy``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfuse import bench
from jaxfuse.kernels import KernelSet
from jaxfuse.models import Config, Transformer
from jaxfuse.sharding import Layout, bytes_per_device

__all__ = ["TrainConfig", "TrainResult", "compare", "comparison_table", "load_corpus", "optimizer", "place",
           "sample_batch", "step_functions", "train", "within_noise"]

VOCAB = 256  # byte-level tokens
_MODEL = Config.block_default()
_PACKAGES = ("jaxfuse", "hlo_inspect", "pallas_kernels")
_EVAL_FRACTION = 0.1
_QUIET_S = 30.0  # longest stretch of training without a progress line


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What to train and how. Model: ``Config.from_width(dim, heads, kv_heads, n_layers=layers)`` with vocabulary
    256; optimizer: AdamW (weight decay on matrices only), linear warmup then cosine decay to lr/10, global-norm
    gradient clipping. ``corpus``: a text file, or None for the toolkit's own source."""

    steps: int = 200
    batch: int = 8  # sequences per step
    seq: int = 128  # tokens per sequence
    dim: int = _MODEL.dim  # the model shape defaults are Config.block_default()'s
    heads: int = _MODEL.n_heads
    kv_heads: int = _MODEL.n_kv_heads
    layers: int = _MODEL.n_layers
    dtype: str = _MODEL.dtype.name  # compute dtype; parameters are float32
    lr: float = 3e-3
    warmup: int | None = None  # steps of linear warmup, fewer than steps; None: min(20, steps // 2)
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    eval_every: int = 50  # steps between eval-loss measurements (and at the last step)
    eval_batches: int = 4
    seed: int = 0  # parameters, batch order and eval batches
    corpus: str | None = None
    mesh: str | None = None  # "data=2,model=2" (jaxfuse.sharding); batch is the global batch, split over data
    fsdp: bool = False  # parameters and optimizer state sharded over the mesh's data axis
    timing_iterations: int = 40  # timed calls of the compiled step after training (median and quartiles reported)
    timing_budget_s: float = 30.0  # ... fewer (at least 5) when they take longer than this: interpret mode on CPU

    def __post_init__(self):
        for name in ("steps", "batch", "seq", "dim", "heads", "kv_heads", "layers", "eval_every", "eval_batches",
                     "timing_iterations"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrainConfig.{name}: expected a positive int, got {value!r}")
        if self.warmup is None:
            object.__setattr__(self, "warmup", min(20, self.steps // 2))
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 0:
            raise ValueError(f"TrainConfig.warmup: expected an int >= 0, got {self.warmup!r}")
        if self.warmup >= self.steps:
            raise ValueError(f"TrainConfig.warmup: expected fewer warmup steps than steps={self.steps}, got "
                             f"{self.warmup} (the learning rate would never reach its peak)")
        for name in ("lr", "clip_norm", "timing_budget_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainConfig.{name}: expected > 0, got {getattr(self, name)!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"TrainConfig.weight_decay: expected >= 0, got {self.weight_decay!r}")

    @property
    def loss_window(self) -> int:
        """How many of the last steps the reported train loss averages: eval_every, at most every step."""
        return min(self.eval_every, self.steps)

    def model_config(self) -> Config:
        return Config.from_width(self.dim, self.heads, self.kv_heads, n_layers=self.layers, vocab=VOCAB,
                                 max_seq=self.seq, dtype=self.dtype)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """One training run. Losses are float32 mean next-byte cross-entropies in nats (ln 256 = 5.55 is chance)."""

    kernels: str  # str(KernelSet)
    description: str  # model, shapes, dtype, device
    train_loss: tuple[float, ...]  # one per step
    eval_loss: tuple[tuple[int, float], ...]  # (step, held-out loss); step 0 is before any update
    step_time_us: float  # median time of one compiled training step
    timing: str  # "cupti" (device kernels) or "wall"
    tokens_per_step: int
    n_params: int
    wall_s: float  # the whole run on the host, compiles included
    stopped: str = ""  # why training ended early ("non-finite loss at step N"), "" if it ran every step
    top_kernels_us: tuple[tuple[str, float], ...] = ()  # GPU: the step's 10 costliest kernels, median µs per step
    step_time_iqr_us: tuple[float, float] = (math.nan, math.nan)  # 25th and 75th percentile of the step times
    train_loss_window: int = 10  # the reported train loss is the mean of this many last steps
    mesh: str = ""  # "data=2,model=1" when run on a mesh, "" on one device
    strategy: str = ""  # "dp", "fsdp", "dp+tp", "fsdp+tp" (jaxfuse.sharding.Layout.strategy), "" on one device
    devices: int = 1
    param_bytes_per_device: int = 0  # the most bytes of parameters one device holds (its addressable shards)
    opt_bytes_per_device: int = 0  # the same for the optimizer state

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / (self.step_time_us * 1e-6)

    @property
    def final_train_loss(self) -> float:
        """The mean train loss of the last ``train_loss_window`` steps (NaN without steps)."""
        tail = self.train_loss[-self.train_loss_window:]
        return sum(tail) / len(tail) if tail else math.nan

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"tokens_per_s": self.tokens_per_s,
                                           "final_train_loss": self.final_train_loss}


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------
def _package_source() -> bytes:
    """The .py files of the installed packages, in a fixed order."""
    import importlib

    chunks = []
    for package in _PACKAGES:
        root = os.path.dirname(importlib.import_module(package).__file__)
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), "rb") as f:
                        chunks.append(f.read())
    return b"\n".join(chunks)


def load_corpus(path: str | None = None) -> np.ndarray:
    """The corpus as bytes: uint8 (n,). ``path``: a UTF-8 text file (ValueError naming the first byte that is not);
    None: the toolkit's own Python source."""
    if path is None:
        data = _package_source()
    else:
        if not os.path.isfile(path):
            raise ValueError(f"corpus: no such file {path!r}")
        with open(path, "rb") as f:
            data = f.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"corpus: {path!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                             "expected a UTF-8 text file") from None
    return np.frombuffer(data, dtype=np.uint8)


def _split(data: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) parts: the last 10% held out. Each must hold at least one window of seq + 1 bytes."""
    cut = int(len(data) * (1 - _EVAL_FRACTION))
    train_part, eval_part = data[:cut], data[cut:]
    if len(eval_part) < seq + 1:
        raise ValueError(f"corpus: {len(data)} bytes is too short for seq={seq}: the held-out last 10% "
                         f"({len(eval_part)} bytes) must hold one window of seq + 1 = {seq + 1} bytes")
    return train_part, eval_part


def sample_batch(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``batch`` random windows of data: tokens (batch, seq) int32 and labels (batch, seq) int32, the next bytes."""
    starts = rng.integers(0, len(data) - seq, size=batch)  # windows [s, s + seq] all inside data
    windows = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)  # (batch, seq + 1)
    return windows[:, :-1], windows[:, 1:]


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
def optimizer(cfg: TrainConfig):
    """(AdamW with warmup-cosine schedule and global-norm clipping, the optax module) for ``cfg``."""
    try:
        import optax
    except ImportError as e:
        raise ImportError("jaxfuse train needs optax: pip install 'jaxfuse[train]' (or pip install optax)") from e
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup, decay_steps=max(cfg.steps, cfg.warmup + 1),
        end_value=cfg.lr / 10)
    matrices_only = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on norm scales
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=matrices_only)), optax


def step_functions(graphdef, optimizer, optax, layout: Layout | None = None):
    """(train step, loss) of the model ``graphdef`` with ``optimizer``: step(params, opt_state, tokens, labels) ->
    (params, opt_state, loss float32); loss(params, tokens, labels). With ``layout`` both trace on its mesh (the
    Pallas sites run under shard_map) and the step's new parameters and optimizer state keep the layout's
    shardings; jit them with arguments placed by ``place``."""

    def loss_of(params, tokens, labels):
        with layout.tracing() if layout else contextlib.nullcontext():
            return nnx.merge(graphdef, params).loss(tokens, labels)

    def step(params, opt_state, tokens, labels):
        loss, grads = jax.value_and_grad(loss_of)(params, tokens, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if layout is not None:
            params, opt_state = layout.constrain(params), layout.constrain(opt_state)
        return params, opt_state, loss

    return step, loss_of


def place(layout: Layout | None, params, opt_state):
    """(params, opt_state) on the layout's devices with its shardings (as they are without a layout)."""
    if layout is None:
        return params, opt_state
    return jax.device_put(params, layout.shardings(params)), jax.device_put(opt_state, layout.shardings(opt_state))


def _placed(layout: Layout | None, batch: tuple) -> tuple:
    """A batch (tokens, labels) split over the layout's data axis (as it is without a layout)."""
    return batch if layout is None else tuple(jax.device_put(b, layout.batch_sharding()) for b in batch)


def train(cfg: TrainConfig = TrainConfig(), kernels: KernelSet = KernelSet(), *,
          progress: Callable[[str], None] = lambda message: None, corpus: np.ndarray | None = None) -> TrainResult:
    """Trains the byte-level LM with ``kernels`` at its sites, then times its step; see the module docstring.
    ``corpus`` (uint8 bytes) overrides ``cfg.corpus``."""
    result, step = _train(cfg, kernels, progress=progress, corpus=corpus)
    return _timed([result], [step], cfg, progress)[0]


def _train(cfg: TrainConfig, kernels: KernelSet, *, progress: Callable[[str], None],
           corpus: np.ndarray | None) -> tuple[TrainResult, tuple[Callable, tuple]]:
    """One training run, not yet timed: (result without step time, (the jitted step, arguments to time it with))."""
    if not isinstance(kernels, KernelSet):
        raise TypeError(f"kernels: expected a KernelSet, got {type(kernels).__name__}")
    start = time.perf_counter()
    data = load_corpus(cfg.corpus) if corpus is None else corpus
    train_part, eval_part = _split(data, cfg.seq)
    model_cfg = cfg.model_config()
    graphdef, params = nnx.split(Transformer(model_cfg, kernels=kernels, rngs=nnx.Rngs(cfg.seed)))
    opt, optax = optimizer(cfg)
    layout = Layout.parse(cfg.mesh, fsdp=cfg.fsdp) if cfg.mesh else None
    if layout is not None:
        layout.check_model(model_cfg, cfg.batch)
    params, opt_state = place(layout, params, opt.init(params))
    step, loss_of = step_functions(graphdef, opt, optax, layout)
    train_step = jax.jit(step, donate_argnums=(0, 1))
    eval_loss_of = jax.jit(loss_of)
    eval_rng = np.random.default_rng([cfg.seed, 1])
    eval_set = [_placed(layout, sample_batch(eval_part, cfg.batch, cfg.seq, eval_rng))
                for _ in range(cfg.eval_batches)]
    batch_rng = np.random.default_rng([cfg.seed, 0])
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    description = (f"byte-level LM: {cfg.layers} layers, dim {cfg.dim}, heads {cfg.heads}/{cfg.kv_heads}, "
                   f"mlp {model_cfg.mlp_hidden}, {n_params / 1e6:.2f}M params, batch {cfg.batch} x {cfg.seq} tokens, "
                   f"{model_cfg.dtype.name} compute, {cfg.steps} steps, corpus {len(data):,} bytes "
                   f"(sha256 {hashlib.sha256(data.tobytes()).hexdigest()[:12]}), "
                   f"on {jax.devices()[0].device_kind}"
                   + (f" x {layout.devices}, mesh {layout} ({layout.strategy})" if layout is not None else ""))

    def evaluate() -> float:
        return float(np.mean([float(eval_loss_of(params, *batch)) for batch in eval_set]))

    progress(f"[{kernels}] compiling the loss and the training step ...")
    evals = [(0, evaluate())]
    progress(f"[{kernels}] step 0: eval loss {evals[0][1]:.4f}")
    losses, stopped = [], ""
    window = cfg.loss_window
    last_said = time.perf_counter()
    for i in range(1, cfg.steps + 1):
        params, opt_state, loss = train_step(params, opt_state, *_placed(
            layout, sample_batch(train_part, cfg.batch, cfg.seq, batch_rng)))
        losses.append(loss)
        if i > 1:  # at most one step in flight, so that a progress line says where training is
            jax.block_until_ready(losses[-2])
        if time.perf_counter() - last_said > _QUIET_S and i % cfg.eval_every and i != cfg.steps:
            progress(f"[{kernels}] step {i - 1} of {cfg.steps} done")  # slow steps (interpret mode)
            last_said = time.perf_counter()
        if i % cfg.eval_every == 0 or i == cfg.steps:
            last_said = time.perf_counter()
            recent = float(jnp.mean(jnp.stack(losses[-window:])))
            if not math.isfinite(recent):
                stopped = f"non-finite loss at or before step {i}"
                progress(f"[{kernels}] {stopped}: stopping")
                break
            evals.append((i, evaluate()))
            progress(f"[{kernels}] step {i}: train loss {recent:.4f} (mean of the last {min(i, window)} steps), "
                     f"eval loss {evals[-1][1]:.4f}")
    train_loss = tuple(float(x) for x in np.asarray(jnp.stack(losses)))
    timed_step = jax.jit(step)  # no donation: the same arguments are reused for every timed call
    timed_args = (params, opt_state, *_placed(layout, sample_batch(train_part, cfg.batch, cfg.seq, batch_rng)))
    placement = {} if layout is None else dict(
        mesh=str(layout), strategy=layout.strategy, devices=layout.devices,
        param_bytes_per_device=bytes_per_device(params), opt_bytes_per_device=bytes_per_device(opt_state))
    result = TrainResult(kernels=str(kernels), description=description, train_loss=train_loss,
                         eval_loss=tuple(evals), step_time_us=math.nan, timing="", tokens_per_step=cfg.batch * cfg.seq,
                         n_params=n_params, wall_s=time.perf_counter() - start, stopped=stopped,
                         train_loss_window=window, **placement)
    return result, (timed_step, timed_args)


def _timed(results: Sequence[TrainResult], steps: Sequence[tuple[Callable, tuple]], cfg: TrainConfig,
           progress: Callable[[str], None]) -> list[TrainResult]:
    """The results with their step times: the steps timed interleaved (``bench.time_interleaved``)."""
    start = time.perf_counter()
    timings = bench.time_interleaved(steps, iterations=cfg.timing_iterations, budget_s=cfg.timing_budget_s,
                                     wall=cfg.mesh is not None)
    share = (time.perf_counter() - start) / len(results)
    out = []
    for r, timing in zip(results, timings):
        q1, _, q3 = statistics.quantiles(timing.samples_us, n=4, method="inclusive") if len(timing.samples_us) > 1 else (
            timing.median_us,) * 3
        progress(f"[{r.kernels}] step time {timing.median_us / 1e3:.2f} ms (median of {len(timing.samples_us)}, "
                 f"interquartile range {q1 / 1e3:.2f}-{q3 / 1e3:.2f} ms, {timing.method})")
        out.append(dataclasses.replace(
            r, step_time_us=timing.median_us, timing=timing.method, step_time_iqr_us=(q1, q3), wall_s=r.wall_s + share,
            top_kernels_us=tuple(sorted(timing.per_kernel_us.items(), key=lambda kv: -kv[1])[:10])))
    return out


def compare(kernel_sets: Sequence[KernelSet], cfg: TrainConfig = TrainConfig(), *,
            progress: Callable[[str], None] = lambda message: None) -> list[TrainResult]:
    """``train`` once per kernel set, same corpus, parameters and batches; the first set is the baseline. The
    step times are taken after every set has trained, one step of each set in turn."""
    if not kernel_sets:
        raise ValueError("kernel_sets: need at least one KernelSet")
    data = load_corpus(cfg.corpus)
    runs = [_train(cfg, ks, progress=progress, corpus=data) for ks in kernel_sets]
    progress(f"timing the training step of {len(runs)} kernel set{'s' if len(runs) > 1 else ''}, "
             f"{cfg.timing_iterations} steps each (fewer past {cfg.timing_budget_s:g} s), interleaved ...")
    return _timed([r for r, _ in runs], [step for _, step in runs], cfg, progress)


def within_noise(a: TrainResult, b: TrainResult) -> bool:
    """Whether two runs' step times are indistinguishable: their interquartile ranges overlap."""
    (a1, a3), (b1, b3) = a.step_time_iqr_us, b.step_time_iqr_us
    return a1 <= b3 and b1 <= a3


def comparison_table(results: Sequence[TrainResult]) -> str:
    """One row per run: final losses, the largest train-loss gap to the first run, step time with its spread, and
    the speedup over the first run ("within noise" when the two runs' interquartile ranges overlap)."""
    base = results[0]
    header = ("kernels", "train loss", "eval loss", "max |Δ train| vs first", "step ms", "IQR ms", "tokens/s",
              "speedup")
    rows = []
    for r in results:
        n = min(len(r.train_loss), len(base.train_loss))
        gap = bench.worst(abs(a - b) for a, b in zip(r.train_loss[:n], base.train_loss[:n]))  # (NaN when any is)
        speedup = f"{base.step_time_us / r.step_time_us:.2f}x"
        if r is not base and within_noise(base, r):
            speedup += " (within noise)"
        q1, q3 = r.step_time_iqr_us
        rows.append((r.kernels + (f" ({r.stopped})" if r.stopped else ""), f"{r.final_train_loss:.4f}",
                     f"{r.eval_loss[-1][1]:.4f}", f"{gap:.2e}", f"{r.step_time_us / 1e3:.2f}",
                     f"{q1 / 1e3:.2f}-{q3 / 1e3:.2f}", f"{r.tokens_per_s:,.0f}", speedup))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    timing = ", ".join(sorted({r.timing for r in results}))
    samples = f"{len(results)} kernel sets interleaved" if len(results) > 1 else "one kernel set"
    windows = sorted({r.train_loss_window for r in results})
    out = [base.description,
           f"step time: {timing} ({'device kernels' if timing == 'cupti' else 'host wall clock'}), median of the "
           f"steps timed after training ({samples}); IQR: their interquartile range; speedup: the first run's median "
           "over this one's, 'within noise' where the two IQRs overlap",
           f"train loss: mean of the last {' or '.join(map(str, windows))} steps; eval loss: held-out last 10% of the "
           "corpus", "", line(header), line(["-" * w for w in widths])]
    return "\n".join(out + [line(row) for row in rows])
