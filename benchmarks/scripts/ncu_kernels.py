"""Kernels to read with Nsight Compute (ncu) on the H100 or H200: the loss's dw update (Mosaic accumulate_into /
cuBLAS beta = 1), its logits GEMM (Mosaic with the softmax statistics, ping-pong and stacked tiles / cuBLAS), the GEMM
core against cuBLAS (32768x4096x4096, 4096x4096x14336, 8192x4096x6144), rmsnorm_matmul's fused forward (and forward
+ backward) against XLA's norm + matmul, and a 2 GiB copy (x + 1) as the HBM reference. Each case runs 3 warm calls,
then one more; ncu's kernel filter picks what it profiles (records: benchmarks/results/ncu_*.json, ncu_*.txt):

    XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false" ncu --clock-control none \
        -k regex:"mosaic|nvjet|gemm|add_fusion" -c 80 --section SpeedOfLight --section WarpStateStats \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
        python benchmarks/scripts/ncu_kernels.py core32k,log256k,logstacked,upd256k,upd32k,copy

(autotuning off keeps ncu from profiling the autotuner's candidates; cuBLAS then runs its heuristic's kernel). The
H200 records of the core and the fused forward (``ncu_core_14336_6144-h200-9e45f8b.txt``,
``ncu_fused_14336_6144-h200-365a14f.txt``) came from ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.3``, ``-k
regex:"mosaic|nvjet"`` (``"rmsnorm|nvjet"`` for the fused cases: a wider filter profiles the inputs' random-number
kernels), ``-c 16 --section SpeedOfLight --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,
sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active`` and the
cases ``core14336,core6144`` and ``fused14336,fused6144``; ``python -m hlo_inspect.ncu REPORT.txt --json
REPORT.json --meta device=... --meta commit=...`` reads such a report back (medians per kernel and shape, and where
each launch's cycles go).
Per SASS opcode (where the instructions go): add ``--metrics sass__inst_executed_per_opcode
--print-metric-instances details`` (with "values" ncu prints the counts without their opcodes); ``python -m
hlo_inspect.ncu REPORT.txt`` then lists each kernel's most executed opcodes (``ncu_fused_opcodes-h200-87a5a1a.txt``:
cases ``fusedbwd32k``, ``-k regex:"rmsnorm_matmul_(fwd|dx|dw)" -c 3``).
With NCU_RANGE=1 the last call of each case is bracketed by cudaProfilerStart/Stop (for ncu --profile-from-start
off; that crashed python under ncu on the H100, so the records use the kernel filter)."""
import ctypes
import dataclasses
import glob
import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import gemm
from pallas_kernels.cross_entropy import mosaic_logits

KEYS = jax.random.split(jax.random.key(0), 8)


def cudart():
    """The CUDA runtime library (for cudaProfilerStart / Stop), or None."""
    paths = glob.glob("/usr/local/cuda*/lib64/libcudart.so*")
    for module in ("nvidia.cuda_runtime", "nvidia.cu13", "nvidia.cu12"):
        try:
            package = __import__(module, fromlist=["_"])
            paths += glob.glob(os.path.join(list(package.__path__)[0], "lib*", "libcudart.so*"))
        except ImportError:
            pass
    for path in paths + ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def normal(key, shape, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)


def dw_update_cases(H, V, Bc):
    """dw (H, V) += h_cᵀ (H, Bc) @ dl (Bc, V): the Mosaic update in place, and XLA's (cuBLAS, beta = 1)."""
    h, dl = normal(KEYS[0], (Bc, H)), normal(KEYS[1], (Bc, V), 1e-3)
    fresh_dw = lambda: (h, dl, normal(KEYS[3], (H, V)))  # noqa: E731 - each call donates its dw
    mosaic = jax.jit(lambda h, dl, dw: gemm.matmul(h, dl, transpose_a=True, accumulate_into=dw), donate_argnums=2)
    cublas = jax.jit(lambda h, dl, dw: dw + jax.lax.dot_general(h, dl, (((0,), (0,)), ((), ())),
                                                                preferred_element_type=jnp.bfloat16), donate_argnums=2)
    tag = f"{H}x{V}x{Bc}"
    return {f"update_mosaic_{tag}": (mosaic, fresh_dw), f"update_cublas_{tag}": (cublas, fresh_dw)}


def logits_cases(Bc, H, V, stacked=False):
    """A chunk's logits (Bc, H) @ (H, V): the Mosaic GEMM with the softmax statistics (its ping-pong tiles, or the
    core's stacked 64x256 tiles without stream-K, then also without the statistics), or cuBLAS."""
    h, w = normal(KEYS[4], (Bc, H)), normal(KEYS[5], (H, V), 0.02)
    tag = f"{Bc}x{H}x{V}"
    if not stacked:
        return {f"logits_mosaic_{tag}": (jax.jit(mosaic_logits.logits_and_lse), lambda: (h, w)),
                f"logits_cublas_{tag}": (jax.jit(lambda h, w: h @ w), lambda: (h, w))}
    config = dataclasses.replace(gemm.CANDIDATES[0], stream_k=0)
    stats = mosaic_logits._stats_fusion(Bc, V, config.tile_n, jnp.bfloat16)
    with_stats = jax.jit(lambda h, w: gemm.gemm(h, w, config=config, out_dtype=h.dtype, fusion=stats,
                                                name="logits_stacked"))
    plain = jax.jit(lambda h, w: gemm.matmul(h, w, config=config))
    return {f"logits_mosaic_stacked_{tag}": (with_stats, lambda: (h, w)),
            f"plain_mosaic_stacked_{tag}": (plain, lambda: (h, w))}


def core_cases(M, K, N):
    """The GEMM core's default tiles and cuBLAS on one product."""
    a, b = normal(KEYS[6], (M, K)), normal(KEYS[7], (K, N), 0.02)
    tag = f"{M}x{K}x{N}"
    return {f"core_mosaic_{tag}": (jax.jit(lambda a, b: gemm.matmul(a, b)), lambda: (a, b)),
            f"core_cublas_{tag}": (jax.jit(lambda a, b: a @ b), lambda: (a, b))}


def decode_gemv_cases(M, K, N):
    """``matmul``'s GEMV at M rows, forward (b read transposed) and dA's form (g @ wᵀ, w read as stored), dB (aᵀ g,
    a 16-deep contraction writing (K, N)) on our kernel, and XLA on all three: at 16x4096x4096 dA took 14-16 µs
    against XLA's 10 where the forward took 12-15 (NOTES.md, seventy-fifth session); dB 10.6 against XLA's 8.8
    (seventy-seventh)."""
    a, w, g = normal(KEYS[6], (M, K)), normal(KEYS[7], (K, N), 0.02), normal(KEYS[5], (M, N))
    tag = f"{M}x{K}x{N}"
    return {f"gemv_fwd_{tag}": (jax.jit(lambda a, w: gemm.gemv(a, w)), lambda: (a, w)),
            f"gemv_da_{tag}": (jax.jit(lambda g, w: gemm.gemv(g, w, transpose_b=True)), lambda: (g, w)),
            f"mosaic_db_{tag}": (jax.jit(lambda a, g: gemm.matmul(a, g, transpose_a=True)), lambda: (a, g)),
            f"cublas_fwd_{tag}": (jax.jit(lambda a, w: a @ w), lambda: (a, w)),
            f"cublas_da_{tag}": (jax.jit(lambda g, w: g @ w.T), lambda: (g, w)),
            f"xla_db_{tag}": (jax.jit(lambda a, g: a.T @ g), lambda: (a, g))}


def core_variant_cases(M, K, N, variants):
    """The GEMM core at one product under named configs of ``mosaic_gemm_tiles.CONFIGS``, one case each."""
    from mosaic_gemm_tiles import CONFIGS

    a, b = normal(KEYS[6], (M, K)), normal(KEYS[7], (K, N), 0.02)
    return {f"core_{name}_{M}x{K}x{N}": (jax.jit(lambda a, b, c=CONFIGS[name]: gemm.matmul(a, b, config=c)),
                                         lambda: (a, b)) for name in variants}


def fused_forward_cases(M, K, N):
    """rmsnorm_matmul's forward: the Mosaic kernel in its tuned entry, and XLA's norm + matmul (the suite's)."""
    import pallas_kernels
    from jaxfuse.suites import rmsnorm_matmul as suite

    x, g, w, _ = suite.make_inputs(M, K, N)
    tag = f"{M}x{K}x{N}"
    mosaic = jax.jit(lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w, backend="mosaic"))
    return {f"fused_mosaic_{tag}": (mosaic, lambda: (x, g, w)),
            f"fused_xla_{tag}": (jax.jit(suite.SPEC.implementations()["xla"]), lambda: (x, g, w))}


def fused_backward_cases(M, K, N):
    """rmsnorm_matmul forward + backward (the suite's program, a random cotangent): the Mosaic kernels in their
    tuned entry, and XLA's."""
    import pallas_kernels
    from jaxfuse.suites import rmsnorm_matmul as suite

    inputs = suite.make_inputs(M, K, N)
    shape = dict(M=M, K=K, N=N)
    mosaic = lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w, backend="mosaic")  # noqa: E731
    tag = f"{M}x{K}x{N}"
    return {f"fused_bwd_mosaic_{tag}": (jax.jit(suite.SPEC.program(mosaic, "fwd+bwd", shape, {})), lambda: inputs),
            f"fused_bwd_xla_{tag}": (jax.jit(suite.SPEC.program(suite.SPEC.implementations()["xla"], "fwd+bwd",
                                                                shape, {})), lambda: inputs)}


def torch_cases(M, K, N):
    """cuBLAS's product through PyTorch (its own heuristic, no XLA autotuner for ncu to trip over: the autotuned
    XLA kernel ended ncu in a segmentation fault, NOTES.md forty-first session), where torch is installed."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02

    def product(a, b):
        out = torch.matmul(a, b)
        torch.cuda.synchronize()
        return out
    return {f"core_torch_{M}x{K}x{N}": (product, lambda: (a, b))}


def copy_cases():
    x = normal(KEYS[6], (2**30,))
    return {"copy_2GiB": (jax.jit(lambda x: x + 1), lambda: (x,))}


BUILDERS = {"upd256k": lambda: dw_update_cases(2048, 256000, 512), "upd32k": lambda: dw_update_cases(4096, 32000, 1024),
            "log256k": lambda: logits_cases(512, 2048, 256000),
            "logstacked": lambda: logits_cases(512, 2048, 256000, stacked=True),
            "core32k": lambda: core_cases(32768, 4096, 4096), "core14336": lambda: core_cases(4096, 4096, 14336),
            "core6144": lambda: core_cases(8192, 4096, 6144), "core5504": lambda: core_cases(16384, 1024, 5504),
            "fused14336": lambda: fused_forward_cases(4096, 4096, 14336),
            "fused6144": lambda: fused_forward_cases(8192, 4096, 6144),
            "fused5504": lambda: fused_forward_cases(16384, 1024, 5504),
            # short K, no tuned entry: the untuned rule's forward (r from XLA, ping-pong 128x128 tiles since 9cb3fb4;
            # whole 128x256 ones before) against cuBLAS's 128x160 tiles in clusters of 2x1 (27.4 µs where ours took
            # 33.2 with whole tiles, 29.5 ping-pong: NOTES.md, sixty-eighth and sixty-ninth sessions)
            "fused960": lambda: fused_forward_cases(4096, 960, 2560), "core960": lambda: core_cases(4096, 960, 2560),
            # ping-pong 128x128 in a cluster of two sharing B (cuBLAS's autotuned form there), 128-wide K steps
            "core5504var": lambda: core_variant_cases(16384, 1024, 5504, (
                "pingpong_128x128_s6_delay1_minor_m_cluster_m", "pingpong_128x128_k128_s3_delay1_minor_m")),
            # the default ping-pong tiles there with the loads from one warp of the memory warpgroup, and without
            "core5504mw": lambda: core_variant_cases(16384, 1024, 5504, (
                "pingpong_128x128_s6_delay1_minor_m", "pingpong_128x128_s6_delay1_minor_m_mw1")),
            "gemv14336": lambda: fused_forward_cases(1, 4096, 14336),
            "gemv16": lambda: decode_gemv_cases(16, 4096, 4096),
            "fusedbwd14336": lambda: fused_backward_cases(4096, 4096, 14336), "copy": copy_cases,
            "torch5504": lambda: torch_cases(16384, 1024, 5504), "torch32k": lambda: torch_cases(32768, 4096, 4096),
            "fusedbwd32k": lambda: {k: v for k, v in fused_backward_cases(32768, 4096, 4096).items() if "mosaic" in k}}


def main() -> int:
    cases = {}
    for name in sys.argv[1].split(","):
        cases.update(BUILDERS[name]())
    for name, (fn, args) in cases.items():
        print("warm", name, flush=True)
        for _ in range(3):
            jax.block_until_ready(fn(*args()))
    runtime = cudart() if os.environ.get("NCU_RANGE") else None
    for name, (fn, args) in cases.items():
        call_args = args()
        jax.block_until_ready(call_args)
        print("case", name, flush=True)
        if runtime:
            runtime.cudaProfilerStart()
        jax.block_until_ready(fn(*call_args))
        if runtime:
            runtime.cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
