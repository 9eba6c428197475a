"""How the model is laid out on a device mesh: the mesh, and the partition specs of the parameters, the optimizer
state and the batch for data parallelism, fully-sharded data parallelism and tensor parallelism.

    layout = Layout.parse("data=2,model=2", fsdp=True)        # 4 devices: jax.devices() must hold exactly 4
    params = jax.device_put(params, layout.shardings(params))  # the same for the optimizer state
    tokens = jax.device_put(tokens, layout.batch_sharding())
    with layout.tracing():                                     # inside the jitted step: the Pallas sites see the mesh
        ...

A ``Layout`` is a ``jax.sharding.Mesh`` with two axes, ``data`` and ``model`` (axis type Auto: XLA's SPMD
partitioner propagates the argument shardings through the program and inserts the collectives), and one choice:

  data    the batch's first dimension is split over it (data parallel: parameters replicated, gradients
          all-reduced). With ``fsdp``, every parameter and the optimizer state beside it are also split over it, along
          their largest dimension that the axis size divides (and that ``model`` does not split): XLA all-gathers a
          parameter where it is used and reduce-scatters its gradient, so a device holds 1/data of each. A parameter
          that ``model`` leaves whole (embedding, norm scales) is split over both axes where data x model divides a
          dimension, so that every device holds 1/devices of the whole.
  model   tensor parallelism (Megatron style) whenever its size is > 1: attention heads and the MLP's hidden units.
          ``qkv_proj`` and ``gate_up_proj`` are column-parallel (their fused columns are ordered so that equal
          blocks hold whole head groups and matching gate/up pairs: ``jaxfuse.models.transformer``), ``out_proj``
          and ``down_proj`` row-parallel (XLA all-reduces their outputs), the LM head's vocabulary columns split
          (the loss combines the log-sum-exp across the axis). The embedding table and norm scales stay replicated
          over it.

``strategy`` names the combination: "dp", "fsdp", "dp+tp", "fsdp+tp". The Pallas kernel sites are custom calls
XLA cannot partition: ``jaxfuse.sharded_kernels`` runs them under ``jax.shard_map`` on the mesh that
``Layout.tracing()`` makes current while the step is traced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

__all__ = ["AXES", "DATA", "MODEL", "Layout", "bytes_per_device", "constrain_activation", "current_mesh", "mesh_axis",
           "parse_mesh"]

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# Tensor parallelism: (module attribute name, parameter name) -> the spec of that 2-D parameter over `model`.
_TENSOR_PARALLEL = {
    ("qkv_proj", "kernel"): (None, MODEL),  # column-parallel: whole kv-head groups per block of columns
    ("gate_up_proj", "kernel"): (None, MODEL),  # column-parallel: gate/up pairs interleaved
    ("out_proj", "kernel"): (MODEL, None),  # row-parallel: its input (heads) is split; the output all-reduced
    ("down_proj", "kernel"): (MODEL, None),  # row-parallel over the MLP hidden units
    ("lm_head", "kernel"): (None, MODEL),  # vocabulary-parallel: the loss combines across `model`
}


def parse_mesh(spec: str, n_devices: int | None = None) -> dict[str, int]:
    """``"data=2,model=2"`` -> {"data": 2, "model": 2}; an axis left out has size 1.

    ValueError naming ``mesh`` for an unknown axis, an axis given twice, a size that is not a positive int, or (with
    ``n_devices``) sizes whose product is not the number of devices."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh: expected axis sizes like 'data=2,model=2' (axes {list(AXES)}), got {spec!r}")
    sizes: dict[str, int] = {}
    for item in (part.strip() for part in spec.split(",")):
        name, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not name:
            raise ValueError(f"mesh: expected items like 'data=2', got {item!r} in {spec!r}")
        if name not in AXES:
            raise ValueError(f"mesh: unknown axis {name!r} in {spec!r}; allowed axes: {list(AXES)}")
        if name in sizes:
            raise ValueError(f"mesh: axis {name!r} given twice in {spec!r}")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if str(size) != value.lstrip("+") or size < 1:
            raise ValueError(f"mesh: size of {name!r} must be a positive int, got {value!r} in {spec!r}")
        sizes[name] = size
    sizes = {axis: sizes.get(axis, 1) for axis in AXES}
    if n_devices is not None and math.prod(sizes.values()) != n_devices:
        raise ValueError(f"mesh: {spec!r} has {math.prod(sizes.values())} devices "
                         f"({' x '.join(f'{a}={s}' for a, s in sizes.items())}) but this machine has {n_devices}; "
                         f"the product of the axis sizes must equal the number of devices (select devices with "
                         f"CUDA_VISIBLE_DEVICES)")
    return sizes


def current_mesh():
    """The mesh a step is being traced on (``Layout.tracing()``: an AbstractMesh with axes data and model, more than
    one device), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or not set(mesh.axis_names) >= set(AXES):
        return None
    return mesh


def mesh_axis(mesh, name: str, length: int) -> str | None:
    """``name`` when that mesh axis is larger than 1 and divides ``length`` (a dimension can be split over it), else
    None (the dimension stays whole, replicated over the axis)."""
    size = mesh.shape[name]
    return name if size > 1 and length % size == 0 else None


def constrain_activation(x: jax.Array, *axes: str | None) -> jax.Array:
    """``x`` with dimension i split over mesh axis ``axes[i]`` (None: whole) when a mesh is current and the axis
    divides it; ``x`` unchanged otherwise. The model marks its head-split activations with it: propagation alone
    loses the head split through the fused projections' reshapes and slices."""
    mesh = current_mesh()
    if mesh is None:
        return x
    spec = PartitionSpec(*(mesh_axis(mesh, a, n) if a else None for a, n in zip(axes, x.shape)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def bytes_per_device(tree) -> int:
    """The most bytes any one device holds of the arrays in ``tree`` (summing each device's addressable shards)."""
    held: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values(), default=0)


def _names(path) -> tuple[str, ...]:
    """A pytree key path as strings: ('blocks', '0', 'attn', 'qkv_proj', 'kernel'); nnx's trailing 'value' dropped."""
    names = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


@dataclasses.dataclass(frozen=True)
class Layout:
    """A (data, model) mesh and whether parameters are fully sharded over ``data``; see the module docstring."""

    mesh: Mesh
    fsdp: bool = False

    @classmethod
    def parse(cls, spec: str, *, fsdp: bool = False, devices: Sequence | None = None) -> Layout:
        """The layout of ``--mesh spec`` over ``devices`` (default: all of ``jax.devices()``, which must number
        exactly the product of the sizes)."""
        devices = list(jax.devices() if devices is None else devices)
        sizes = parse_mesh(spec, len(devices))
        mesh = jax.make_mesh(tuple(sizes.values()), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
        return cls(mesh=mesh, fsdp=bool(fsdp))

    @property
    def data(self) -> int:
        return self.mesh.shape[DATA]

    @property
    def model(self) -> int:
        return self.mesh.shape[MODEL]

    @property
    def devices(self) -> int:
        return self.mesh.size

    @property
    def strategy(self) -> str:
        """"dp" or "fsdp", with "+tp" when the model axis is larger than 1."""
        return ("fsdp" if self.fsdp else "dp") + ("+tp" if self.model > 1 else "")

    def __str__(self) -> str:
        return f"data={self.data},model={self.model}"

    def check_model(self, cfg, batch: int) -> None:
        """ValueError naming what does not divide: the batch by ``data``; with tensor parallelism, the key/value
        heads, the MLP hidden width and the vocabulary by ``model``."""
        if batch % self.data:
            raise ValueError(f"mesh: batch {batch} is not divisible by data={self.data}")
        if self.model > 1:
            for what, n in (("key/value heads", cfg.n_kv_heads), ("MLP hidden width", cfg.mlp_hidden),
                            ("vocabulary", cfg.vocab)):
                if n % self.model:
                    raise ValueError(f"mesh: model={self.model} splits the {what} ({n}), which it does not divide")

    def spec(self, path: Sequence[str], shape: Sequence[int]) -> PartitionSpec:
        """The PartitionSpec of the parameter (or optimizer-state leaf beside it) at key path ``path`` (names)."""
        axes: list = [None] * len(shape)
        if self.model > 1 and len(path) >= 2 and len(shape) == 2:
            axes = list(_TENSOR_PARALLEL.get((path[-2], path[-1]), axes))
        if self.fsdp and self.data > 1:
            # a parameter tensor parallelism leaves whole is split over both axes where it can be: 1/n per device
            groups = [((DATA, MODEL), self.devices)] if self.model > 1 and MODEL not in axes else []
            for group, size in groups + [(DATA, self.data)]:
                free = [d for d in range(len(shape)) if axes[d] is None and shape[d] % size == 0]
                if free:
                    axes[max(free, key=lambda d: (shape[d], -d))] = group
                    break
        return PartitionSpec(*axes)

    def shardings(self, tree):
        """A NamedSharding per array leaf of ``tree`` (parameters as ``nnx.split`` gives them, or an optax state
        holding trees like them: a leaf's rule comes from the end of its key path)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: NamedSharding(self.mesh, self.spec(_names(path), getattr(x, "shape", ()))), tree)

    def batch_sharding(self) -> NamedSharding:
        """Tokens and labels (B, T): the batch over ``data``."""
        return NamedSharding(self.mesh, PartitionSpec(DATA))

    def tracing(self):
        """Context manager for tracing the step: makes the mesh current (``jax.sharding.use_abstract_mesh``), so
        that ``jaxfuse.sharded_kernels`` runs the Pallas sites under ``shard_map`` on it. Usable inside jit."""
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)

    def constrain(self, tree):
        """``tree`` with its sharding pinned to ``shardings(tree)`` (``jax.lax.with_sharding_constraint``): the
        step's updated parameters and optimizer state keep their layout."""
        return jax.lax.with_sharding_constraint(tree, self.shardings(tree))
