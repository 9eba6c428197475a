"""Device specs and the roofline / HBM round-trip cost model.

    dev = costmodel.device("h100")                # or costmodel.detect() for the one JAX sees (None: no figures)
    dev.roofline_us(bytes_moved=2**30, flops=0)    # max(bytes / bandwidth, flops / peak) + launch, microseconds

Each spec carries datasheet figures and, where we have measured them on the machine, the measured ceilings
(`shared/anchors.md`: elementwise `x + 1` over 2 GiB bf16 at 2.94 TB/s, an 8192³ bf16 matmul through XLA at
805 TFLOP/s on an H100). The model uses the measured figures when present: they are what a kernel can reach.

Two compute ceilings: the tensor cores (bf16 GEMMs: `bf16_flops_per_s`) and the CUDA cores (float32 FMAs, where
elementwise and transcendental work runs: `fp32_flops_per_s`); `ridge(unit)` is either one over the bandwidth.
`launch_us` is an assumed per-kernel cost, not a measurement: `jaxfuse.measure.launch_cost()` measures it on the
machine, and `dataclasses.replace(spec, launch_us=...)` puts the measured figure into a prediction.

Which spec a device gets (`detect`): ``JAXFUSE_DEVICE`` when set (a key of `DEVICES`, or the figures themselves,
``hbm=3.35e12,bf16=989e12[,fp32=67e12][,launch_us=2]`` in bytes/s and FLOP/s); else the spec whose device kinds
hold JAX's `device_kind` (`lookup`: "NVIDIA H100 PCIe" is not the SXM part, whose bandwidth is 1.7x its); the
CPU's on a CPU. An accelerator none of them names gets None, and what predicts says so rather than guess.

Seed model of fusion (one op per kernel vs one kernel for a chain of n elementwise ops over S bytes):
    T_unfused = n · (2S / BW + K_launch),   T_fused = 2S / BW + K_launch
"""

from __future__ import annotations

import dataclasses
import os
import re

__all__ = ["DeviceSpec", "DEVICES", "DEVICE_ENV", "device", "detect", "lookup", "from_figures",
           "no_figures_note"]

DEVICE_ENV = "JAXFUSE_DEVICE"


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Bandwidth in bytes/s, compute in FLOP/s (dense bf16 tensor core; float32 CUDA core), launch cost in
    microseconds (assumed)."""

    name: str
    hbm_bytes_per_s_datasheet: float
    bf16_flops_per_s_datasheet: float
    hbm_bytes_per_s_measured: float | None = None
    bf16_flops_per_s_measured: float | None = None
    launch_us: float = 2.0
    l2_bytes: int = 0
    fp32_flops_per_s_datasheet: float | None = None  # CUDA cores, FMA counted as 2 FLOPs
    fp32_flops_per_s_measured: float | None = None

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s_measured or self.hbm_bytes_per_s_datasheet

    @property
    def bf16_flops_per_s(self) -> float:
        return self.bf16_flops_per_s_measured or self.bf16_flops_per_s_datasheet

    @property
    def fp32_flops_per_s(self) -> float | None:
        return self.fp32_flops_per_s_measured or self.fp32_flops_per_s_datasheet

    def ridge(self, unit: str = "tensor") -> float:
        """FLOPs per HBM byte above which a kernel is compute-bound: on the tensor cores ("tensor", bf16 GEMMs) or
        on the CUDA cores ("cuda", float32 elementwise work)."""
        if unit not in ("tensor", "cuda"):
            raise ValueError(f"unit: expected 'tensor' or 'cuda', got {unit!r}")
        peak = self.bf16_flops_per_s if unit == "tensor" else self.fp32_flops_per_s
        if peak is None:
            raise ValueError(f"unit: {self.name} has no {unit}-core peak in its spec")
        return peak / self.hbm_bytes_per_s

    def memory_us(self, bytes_moved: float) -> float:
        return bytes_moved / self.hbm_bytes_per_s * 1e6

    def compute_us(self, flops: float) -> float:
        return flops / self.bf16_flops_per_s * 1e6

    def roofline_us(self, bytes_moved: float, flops: float = 0.0, launches: int = 1) -> float:
        """max(memory time, compute time) plus `launches` launch costs, microseconds."""
        return max(self.memory_us(bytes_moved), self.compute_us(flops)) + launches * self.launch_us

    def fusion_saving_us(self, tensor_bytes: float, n_ops: int) -> tuple[float, float]:
        """(T_unfused, T_fused) in microseconds for a chain of `n_ops` elementwise ops over `tensor_bytes`."""
        from hlo_inspect.unfused import seed_model_us

        return seed_model_us(tensor_bytes, n_ops, self.hbm_bytes_per_s, self.launch_us)


DEVICES = {
    # H100 SXM 80GB: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16, 67 TFLOP/s float32 on CUDA cores; bandwidth and bf16
    # measured on the lent H100 (shared/anchors.md). launch_us is assumed (measure.launch_cost measures it).
    "h100": DeviceSpec("NVIDIA H100 80GB HBM3", 3.35e12, 989e12, hbm_bytes_per_s_measured=2.94e12,
                       bf16_flops_per_s_measured=805e12, launch_us=2.0, l2_bytes=50 * 2**20,
                       fp32_flops_per_s_datasheet=67e12),
    # H200: 4.8 TB/s HBM3e, same compute as the H100; ~4.3 TB/s and ~790 TFLOP/s seen on the lent H200.
    "h200": DeviceSpec("NVIDIA H200", 4.8e12, 989e12, hbm_bytes_per_s_measured=4.3e12,
                       bf16_flops_per_s_measured=790e12, launch_us=2.0, l2_bytes=60 * 2**20,
                       fp32_flops_per_s_datasheet=67e12),
    "a100": DeviceSpec("NVIDIA A100-SXM4-80GB", 2.039e12, 312e12, launch_us=3.0, l2_bytes=40 * 2**20,
                       fp32_flops_per_s_datasheet=19.5e12),
    # The parts below: NVIDIA's and Google Cloud's datasheets (dense bf16, no sparsity), nothing measured here.
    "h100_pcie": DeviceSpec("NVIDIA H100 PCIe", 2.0e12, 756e12, launch_us=2.0, l2_bytes=50 * 2**20,
                            fp32_flops_per_s_datasheet=51e12),
    "h100_nvl": DeviceSpec("NVIDIA H100 NVL", 3.9e12, 835e12, launch_us=2.0, l2_bytes=50 * 2**20,
                           fp32_flops_per_s_datasheet=60e12),
    "h200_nvl": DeviceSpec("NVIDIA H200 NVL", 4.8e12, 835e12, launch_us=2.0, l2_bytes=60 * 2**20,
                           fp32_flops_per_s_datasheet=60e12),
    "a100_40gb": DeviceSpec("NVIDIA A100 40GB (SXM4 or PCIe)", 1.555e12, 312e12, launch_us=3.0,
                            l2_bytes=40 * 2**20, fp32_flops_per_s_datasheet=19.5e12),
    "a100_pcie": DeviceSpec("NVIDIA A100 80GB PCIe", 1.935e12, 312e12, launch_us=3.0, l2_bytes=40 * 2**20,
                            fp32_flops_per_s_datasheet=19.5e12),
    "l4": DeviceSpec("NVIDIA L4", 300e9, 121e12, launch_us=3.0, l2_bytes=48 * 2**20,
                     fp32_flops_per_s_datasheet=30.3e12),
    "l40s": DeviceSpec("NVIDIA L40S", 864e9, 362e12, launch_us=3.0, l2_bytes=96 * 2**20,
                       fp32_flops_per_s_datasheet=91.6e12),
    "a10": DeviceSpec("NVIDIA A10", 600e9, 125e12, launch_us=3.0, l2_bytes=6 * 2**20,
                      fp32_flops_per_s_datasheet=31.2e12),
    # TPUs: per chip (one JAX device); no CUDA cores, and launch_us assumed for an op of a compiled program.
    "tpu_v4": DeviceSpec("TPU v4", 1.2e12, 275e12, launch_us=1.0),
    "tpu_v5e": DeviceSpec("TPU v5e", 819e9, 197e12, launch_us=1.0),
    "tpu_v5p": DeviceSpec("TPU v5p", 2.765e12, 459e12, launch_us=1.0),
    "tpu_v6e": DeviceSpec("TPU v6e", 1.64e12, 918e12, launch_us=1.0),
    # A nominal laptop/server CPU: only for predictions on the CI machine; measure before trusting.
    "cpu": DeviceSpec("cpu", 50e9, 1e12, launch_us=1.0),
}

# JAX's device_kind (lower case, spaces and hyphens as one space) -> DEVICES key; the first pattern that matches
# wins, so each part's variants (PCIe, NVL, 40 GB) come before its plain name.
_KINDS = (
    (r"\bh100.*pcie", "h100_pcie"), (r"\bh100.*nvl", "h100_nvl"), (r"\bh100\b", "h100"),
    (r"\bh200.*nvl", "h200_nvl"), (r"\bh200\b", "h200"),  # not the GH200 (its own memory and clocks)
    (r"\ba100.*40gb", "a100_40gb"), (r"\ba100.*pcie", "a100_pcie"), (r"\ba100\b", "a100"),
    (r"\bl40s\b", "l40s"), (r"\bl4\b", "l4"), (r"\ba10\b", "a10"),
    (r"^tpu v4$", "tpu_v4"), (r"^tpu v5( lite|e)$", "tpu_v5e"), (r"^tpu v5p?$", "tpu_v5p"),
    (r"^tpu v6( lite|e)$", "tpu_v6e"), (r"^cpu$", "cpu"),
)


def device(name: str) -> DeviceSpec:
    """The spec called `name` ('h100', 'h200', 'a100', 'cpu'); ValueError naming the choices otherwise."""
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"device: unknown {name!r}; one of {sorted(DEVICES)}")
    return DEVICES[key]


def lookup(kind: str) -> DeviceSpec | None:
    """The spec of a device JAX calls ``kind`` (its ``device_kind``, e.g. "NVIDIA H100 PCIe", "TPU v5 lite"), or
    None when no spec names it."""
    normal = re.sub(r"[\s_-]+", " ", kind.strip().lower())
    return next((DEVICES[key] for pattern, key in _KINDS if re.search(pattern, normal)), None)


def from_figures(text: str) -> DeviceSpec:
    """A spec from ``hbm=BYTES_PER_S,bf16=FLOP_PER_S[,fp32=FLOP_PER_S][,launch_us=US][,l2=BYTES][,name=NAME]``;
    ValueError naming the field that is missing, unknown or not a positive number."""
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in ("hbm", "bf16", "fp32", "launch_us", "l2", "name"):
            raise ValueError(f"{DEVICE_ENV}: {item!r} is not one of hbm=, bf16=, fp32=, launch_us=, l2=, name= "
                             f"(in {text!r})")
        if key != "name":
            try:
                number = float(value)
            except ValueError:
                number = float("nan")
            if not (number > 0 and number != float("inf")) and not (key == "launch_us" and number == 0):
                raise ValueError(f"{DEVICE_ENV}: {key}={value.strip()!r} must be a positive number "
                                 f"(bytes/s for hbm, FLOP/s for bf16 and fp32, µs, bytes for l2)")
            fields[key] = number
        else:
            fields[key] = value.strip()
    missing = [key for key in ("hbm", "bf16") if key not in fields]
    if missing:
        raise ValueError(f"{DEVICE_ENV}: {text!r} needs {' and '.join(k + '=' for k in missing)} (e.g. "
                         f"'hbm=3.35e12,bf16=989e12'), or a name from {sorted(DEVICES)}")
    return DeviceSpec(fields.get("name", "custom device"), fields["hbm"], fields["bf16"],
                      launch_us=fields.get("launch_us", 2.0), l2_bytes=int(fields.get("l2", 0)),
                      fp32_flops_per_s_datasheet=fields.get("fp32"))


def detect() -> DeviceSpec | None:
    """The spec of the first device JAX sees: ``JAXFUSE_DEVICE`` when set (a `DEVICES` key or `from_figures`
    text), else the one ``lookup`` finds for its device_kind (the CPU's on any CPU), else None (an accelerator
    without figures here: no roofline is better than another device's)."""
    import jax

    override = os.environ.get(DEVICE_ENV, "").strip()
    if override:
        return DEVICES[override.lower()] if override.lower() in DEVICES else from_figures(override)
    first = jax.devices()[0]
    if first.platform == "cpu":
        return DEVICES["cpu"]
    return lookup(first.device_kind)


def no_figures_note() -> str:
    """What a report prints where ``detect`` found no spec: the device and how to give its figures."""
    import jax

    return (f"no roofline figures for {jax.devices()[0].device_kind!r}: predicted times are left out; set "
            f"{DEVICE_ENV} to one of {sorted(DEVICES)} or to its datasheet's figures, e.g. "
            f"{DEVICE_ENV}=hbm=1.0e12,bf16=165e12 (bytes/s, FLOP/s)")
