"""Kernels to read with Nsight Compute (ncu) on the H100: the loss's dw update (Mosaic accumulate_into / cuBLAS
beta = 1), its logits GEMM (Mosaic with the softmax statistics, ping-pong and stacked tiles / cuBLAS), the GEMM core
at 32768x4096x4096 against cuBLAS, and a 2 GiB copy (x + 1) as the HBM reference. Each case runs 3 warm calls, then
one more; ncu's kernel filter picks what it profiles (records: benchmarks/results/ncu_*-h100-*.json):

    XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false" ncu --clock-control none \
        -k regex:"mosaic|nvjet|gemm|add_fusion" -c 80 --section SpeedOfLight --section WarpStateStats \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
        python benchmarks/scripts/ncu_kernels.py core32k,log256k,logstacked,upd256k,upd32k,copy

(autotuning off keeps ncu from profiling the autotuner's candidates; cuBLAS then runs its heuristic's kernel).
With NCU_RANGE=1 the last call of each case is bracketed by cudaProfilerStart/Stop (for ncu --profile-from-start
off; that crashed python under ncu on the H100, so the records use the kernel filter)."""
import ctypes, glob, os, sys
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.gemm import matmul
from pallas_kernels.cross_entropy import mosaic_logits

def cudart():
    cands = glob.glob("/usr/local/cuda*/lib64/libcudart.so*")
    for mod in ("nvidia.cuda_runtime", "nvidia.cu13", "nvidia.cu12"):
        try:
            m = __import__(mod, fromlist=["x"])
            cands += glob.glob(os.path.join(list(m.__path__)[0], "lib*", "libcudart.so*"))
        except Exception:
            pass
    for c in cands + ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]:
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    return None

k = jax.random.split(jax.random.key(0), 8)
cases = {}
which = sys.argv[1].split(",")
def upd(H, V, Bc, tag):
    h = jax.random.normal(k[0], (Bc, H), jnp.bfloat16)
    dl = (jax.random.normal(k[1], (Bc, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    dw = jax.random.normal(k[2], (H, V), jnp.bfloat16)
    mos = jax.jit(lambda h, dl, dw: matmul(h, dl, transpose_a=True, accumulate_into=dw), donate_argnums=2)
    xla = jax.jit(lambda h, dl, dw: dw + jax.lax.dot_general(h, dl, (((0,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16), donate_argnums=2)
    cases[f"update_mosaic_{tag}"] = (mos, lambda: (h, dl, jax.random.normal(k[3], (H, V), jnp.bfloat16)))
    cases[f"update_cublas_{tag}"] = (xla, lambda: (h, dl, jax.random.normal(k[3], (H, V), jnp.bfloat16)))
def logits(Bc, H, V, tag):
    h = jax.random.normal(k[4], (Bc, H), jnp.bfloat16)
    w = (jax.random.normal(k[5], (H, V), jnp.float32) * 0.02).astype(jnp.bfloat16)
    cases[f"logits_mosaic_{tag}"] = (jax.jit(mosaic_logits.logits_and_lse), lambda: (h, w))
    cases[f"logits_cublas_{tag}"] = (jax.jit(lambda h, w: h @ w), lambda: (h, w))
if "upd256k" in which: upd(2048, 256000, 512, "2048x256000x512")
if "upd32k" in which: upd(4096, 32000, 1024, "4096x32000x1024")
if "log256k" in which: logits(512, 2048, 256000, "512x2048x256000")
if "core32k" in which:
    a = jax.random.normal(k[6], (32768, 4096), jnp.bfloat16)
    b = (jax.random.normal(k[7], (4096, 4096), jnp.float32) * 0.02).astype(jnp.bfloat16)
    cases["core_mosaic_32768x4096x4096"] = (jax.jit(lambda a, b: matmul(a, b)), lambda: (a, b))
    cases["core_cublas_32768x4096x4096"] = (jax.jit(lambda a, b: a @ b), lambda: (a, b))
if "logstacked" in which:
    import dataclasses
    from pallas_kernels import gemm as G
    h = jax.random.normal(k[4], (512, 2048), jnp.bfloat16)
    w = (jax.random.normal(k[5], (2048, 256000), jnp.float32) * 0.02).astype(jnp.bfloat16)
    cfg = dataclasses.replace(G.CANDIDATES[0], stream_k=0)
    fus = mosaic_logits._stats_fusion(512, 256000, cfg.tile_n, jnp.bfloat16)
    cases["logits_mosaic_stacked_512x2048x256000"] = (jax.jit(lambda h, w: G.gemm(h, w, config=cfg, out_dtype=h.dtype, fusion=fus, name="logits_stacked")), lambda: (h, w))
    cases["plain_mosaic_stacked_512x2048x256000"] = (jax.jit(lambda h, w: matmul(h, w)), lambda: (h, w))
if "copy" in which:
    x = jax.random.normal(k[6], (2**30,), jnp.bfloat16)
    cases["copy_2GiB"] = (jax.jit(lambda x: x + 1), lambda: (x,))
for name, (fn, args) in cases.items():
    print("warm", name, flush=True)
    for _ in range(3):
        jax.block_until_ready(fn(*args()))
rt = cudart() if os.environ.get("NCU_RANGE") else None
print("cudart", rt)
for name, (fn, args) in cases.items():
    call_args = args(); jax.block_until_ready(call_args)
    print("case", name, flush=True)
    if rt: rt.cudaProfilerStart()
    jax.block_until_ready(fn(*call_args))
    if rt: rt.cudaProfilerStop()
