"""Device specs and the roofline / HBM round-trip cost model.

    dev = costmodel.device("h100")                # or costmodel.detect() for the one JAX sees
    dev.roofline_us(bytes_moved=2**30, flops=0)    # max(bytes / bandwidth, flops / peak) + launch, microseconds

Each spec carries datasheet figures and, where we have measured them on the machine, the measured ceilings
(`shared/anchors.md`: elementwise `x + 1` over 2 GiB bf16 at 2.94 TB/s, an 8192³ bf16 matmul through XLA at
805 TFLOP/s on an H100). The model uses the measured figures when present: they are what a kernel can reach.

Two compute ceilings: the tensor cores (bf16 GEMMs: `bf16_flops_per_s`) and the CUDA cores (float32 FMAs, where
elementwise and transcendental work runs: `fp32_flops_per_s`); `ridge(unit)` is either one over the bandwidth.
`launch_us` is an assumed per-kernel cost, not a measurement: `jaxfuse.measure.launch_cost()` measures it on the
machine, and `dataclasses.replace(spec, launch_us=...)` puts the measured figure into a prediction.

Seed model of fusion (one op per kernel vs one kernel for a chain of n elementwise ops over S bytes):
    T_unfused = n · (2S / BW + K_launch),   T_fused = 2S / BW + K_launch
"""

from __future__ import annotations

import dataclasses

__all__ = ["DeviceSpec", "DEVICES", "device", "detect"]


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
    # A nominal laptop/server CPU: only for predictions on the CI machine; measure before trusting.
    "cpu": DeviceSpec("cpu", 50e9, 1e12, launch_us=1.0),
}


def device(name: str) -> DeviceSpec:
    """The spec called `name` ('h100', 'h200', 'a100', 'cpu'); ValueError naming the choices otherwise."""
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"device: unknown {name!r}; one of {sorted(DEVICES)}")
    return DEVICES[key]


def detect() -> DeviceSpec:
    """The spec of the first device JAX sees (by its device_kind), the CPU spec when none matches."""
    import jax

    kind = jax.devices()[0].device_kind.lower()
    for key in ("h200", "h100", "a100"):
        if key in kind:
            return DEVICES[key]
    return DEVICES["cpu"]
