"""linear_cross_entropy: the shared tests (``base_cross_entropy``) for each backend, and the Triton backend's own: its
token-chunk layouts and config variants, the GEMMs its compiled programs launch per chunk (and skip for an input
not differentiated), its temporary memory against the plain XLA loss, the row kernel's CUDA lowering, the chunk
rule, config validation and sweep candidates."""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

import hlo_inspect
from hlo_inspect import mosaic_ir
from base_cross_entropy import SMALL, CrossEntropyTests, inputs
from conftest import ON_GPU, assert_close, cuda_program, eqns_outside_kernels, tensors_with, tolerance
from jaxfuse import kernels
from pallas_kernels import LinearCrossEntropyConfig, backends, cross_entropy, reference, triton_utils
from pallas_kernels.cross_entropy import config as ce_config


class TestTriton(CrossEntropyTests):
    backend = "triton"
    chunked_block_sizes = {"chunk_rows": 128} if ON_GPU else {"chunk_rows": 16}

    def dw_tolerance_factor(self, h, w, labels, block_sizes) -> float:
        """sqrt(chunks) for a 16-bit dw accumulated in its own dtype: one rounding per chunk where the reference
        has one (seen: 1.3e-2 at 3 chunks in bf16 on inputs whose float32-accumulated dw was off by 6.5e-3)."""
        config = cross_entropy.plan(h, w, labels, backend=self.backend, block_sizes=block_sizes).config
        B, H = h.shape
        chunks = pl.cdiv(B, ce_config.for_shape(config, B, H, w.shape[1], h.dtype).chunk_rows)
        return math.sqrt(chunks) if h.dtype.itemsize < 4 and config.dw_dtype == "param" else 1.0


_TRITON = TestTriton()


def _loss(h, w, labels, **kwargs):
    return cross_entropy.linear_cross_entropy(h, w, labels, backend="triton", **kwargs)


# ------------------------------------------------------------------------------------------------ chunks, variants
@pytest.mark.parametrize("B,chunk_rows", [pytest.param(37, 64, marks=pytest.mark.slow),
                                          pytest.param(32, 8, marks=pytest.mark.slow), (37, 36)],
                         ids=["one_chunk", "chunks_divide_B", "last_chunk_of_one_row"])
def test_every_row_counts_once_whatever_the_chunk_layout(B, chunk_rows):
    """The peeled last chunk (its B − (n − 1)·Bc rows, run first) and the loop's chunks: one chunk, chunks dividing
    B, a last chunk of one row. (A last chunk of Bc rows sharing some with the one before runs where an explicit
    Mosaic GEMM does not tile the remainder: the Mosaic tests below.)"""
    _TRITON.check_against_reference(B, 24, 131, jnp.float32, reduction="sum", z_loss=1e-2,
                                    block_sizes={"chunk_rows": chunk_rows})


@pytest.mark.parametrize("fields", [
    {"row_pass": "xla"}, {"eval_chunk_rows": 24}, pytest.param({"logits_dtype": "float32"}, marks=pytest.mark.slow),
    pytest.param({"dw_dtype": "float32", "rows_per_program": 1, "block_v": 64}, marks=pytest.mark.slow)],
    ids=["xla_row_pass", "evaluation_chunks_of_24", "float32_logits", "float32_dw-one_row_per_program"])
def test_config_variants_match_reference(fields):
    """The alternatives a config (or a sweep) may pick compute the same function."""
    B, H, V = SMALL
    _TRITON.check_against_reference(B, H, V, jnp.bfloat16, block_sizes=dict(_TRITON.chunked_block_sizes, **fields),
                                    logit_soft_cap=5.0)


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic-GPU dw GEMM runs on an sm90 GPU (its lowering is tested on CPU)")
@pytest.mark.parametrize("dtype,reduction", [(jnp.bfloat16, "mean"), (jnp.float16, "none"), (jnp.bfloat16, "sum")])
def test_mosaic_dw_accumulation_matches_reference(dtype, reduction):
    """dw added chunk by chunk by the Mosaic GEMM core in place (4 chunks of 128 rows after a last chunk of 64, whose
    dw GEMM initializes dw), against the float32 reference; the xla dw path at the same inputs is checked beside
    it."""
    for dw_gemm in ("mosaic", "xla"):
        _TRITON.check_against_reference(576, 256, 2048, dtype, reduction=reduction, z_loss=1e-3,
                                        block_sizes={"chunk_rows": 128, "dw_gemm": dw_gemm})


# ------------------------------------------------------------------------------------------------ programs
def _gemm_launches(fn, *args) -> int:
    """GEMM launches of the compiled program (cuBLAS calls, or kernels with a dot; loop bodies counted by their
    trip count)."""
    report = hlo_inspect.inspect(jax.jit(fn), *args)
    return sum(k.launches for k in report.kernels if k.category == "cublas" or k.ops.get("dot"))


def test_gemms_per_chunk_evaluation_one_gradients_three_recompute_four():
    """3 chunks (16, 16 and the last 5 rows): evaluation runs GEMM 1 per chunk; value and gradient 3 per chunk
    (logits, dh, dw); reduction="none" recomputes the logits in its backward (4 per chunk, less one: the forward's
    and the backward's last chunks are the same logits GEMM on the same 5 rows, which XLA computes once)."""
    B, H, V = 37, 24, 131
    h, w, labels = inputs(B, H, V, jnp.float32)
    n = 3
    mean = lambda h, w: _loss(h, w, labels, block_sizes={"chunk_rows": 16})
    rows = lambda h, w: _loss(h, w, labels, reduction="none", block_sizes={"chunk_rows": 16})
    assert _gemm_launches(mean, h, w) == n
    assert _gemm_launches(jax.value_and_grad(mean, argnums=(0, 1)), h, w) == 3 * n
    assert _gemm_launches(lambda h, w: jax.vjp(rows, h, w)[1](jnp.ones((B,))), h, w) == 4 * n - 1


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_an_input_not_differentiated_costs_no_gemm(reduction):
    """With w not differentiated (a frozen LM head) the dw GEMM is never traced, with h not differentiated the dh
    GEMM (symbolic zeros): counted in the jaxpr as traced (the peeled chunk and the loop body count once each),
    which is what runs outside jit; under jit, dead-code elimination would drop an unused GEMM by itself."""
    B, H, V = 37, 24, 131
    h, w, labels = inputs(B, H, V, jnp.bfloat16)
    loss = lambda h, w: jnp.sum(_loss(h, w, labels, reduction=reduction, block_sizes={"chunk_rows": 16}))
    dots = lambda argnums: sum(e.primitive.name == "dot_general" for e in eqns_outside_kernels(
        jax.make_jaxpr(jax.grad(loss, argnums=argnums))(h, w).jaxpr))
    both = 6 if reduction == "mean" else 2 + 6  # "none": the forward's GEMM 1 (peeled chunk and loop), then the
    # recompute's 3 GEMMs
    assert dots((0, 1)) == both
    assert dots(0) == dots(1) == both - 2


def test_temporary_memory_is_one_chunk_of_logits():
    """float32 at 1024×256×8192 in 128-row chunks: evaluation holds one 256-row chunk's logits, the value-and-grad
    program one 128-row chunk's logits (4 MiB)
    plus, on CPU, the dw GEMM's product before its add (8 MiB; XLA's GPU GEMM adds into dw as beta = 1) or, on a
    GPU, cuBLAS's 32 MiB workspace and one more chunk-sized buffer (H100, jax 0.11.2: 40.1 MiB in all); the plain
    XLA loss holds 64 MiB more than its workspace."""
    B, H, V, chunk = 1024, 256, 8192, 128  # evaluation takes chunks of B / 4 = 256 rows (eval_chunk_rows_for)
    h, w, labels = (jax.ShapeDtypeStruct((B, H), jnp.float32), jax.ShapeDtypeStruct((H, V), jnp.float32),
                    jax.ShapeDtypeStruct((B,), jnp.int32))
    sizes = {"chunk_rows": chunk, "rows_per_program": 8, "block_v": 1024}
    fn = lambda h, w, y: _loss(h, w, y, block_sizes=sizes)
    logits_bytes = chunk * V * 4
    other = ce_config.GEMM_WORKSPACE_BYTES if ON_GPU else H * V * 4  # see the docstring
    with triton_utils.quiet_triton_deprecation():
        temp = lambda f: jax.jit(f).lower(h, w, labels).compile().memory_analysis().temp_size_in_bytes
        assert temp(fn) <= 2 * logits_bytes + other + 2**20
        ours = temp(jax.value_and_grad(fn, argnums=(0, 1)))
    plain = temp(jax.value_and_grad(kernels.plain_cross_entropy, argnums=(0, 1)))
    assert ours <= (2 if ON_GPU else 1) * logits_bytes + other + 2**20, ours
    assert ours < 0.2 * plain + (ce_config.GEMM_WORKSPACE_BYTES if ON_GPU else 0), (ours, plain)
    assert tensors_with(cuda_program(jax.grad(fn, argnums=(0, 1)), h, w, labels), chunk, V)  # the chunk's logits


def test_mosaic_dw_gemm_lowers_in_place_for_cuda():
    """Lowered for CUDA: with dw_gemm "mosaic" (and "auto", where the shapes tile) the loop's dw update is one
    Mosaic-GPU kernel whose output aliases its dw input and the peeled chunk's GEMM stays XLA's (it writes dw
    first); "xla" has no Mosaic kernel. Where the Mosaic GEMM cannot run, "mosaic" names why and "auto" falls
    back."""
    B, H, V = 512, 256, 1024
    args = (jax.ShapeDtypeStruct((B, H), jnp.bfloat16), jax.ShapeDtypeStruct((H, V), jnp.bfloat16),
            jax.ShapeDtypeStruct((B,), jnp.int32))

    def program(dw_gemm, h, w, y):
        sizes = {"chunk_rows": 128, "dw_gemm": dw_gemm, "logits_gemm": "xla"}  # logits: cuBLAS (a test below)
        return jax.value_and_grad(lambda h, w, y: _loss(h, w, y, block_sizes=sizes), argnums=(0, 1))

    def lowered(dw_gemm, *args):
        return jax.jit(program(dw_gemm, *args)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    with backends.lowering_for_gpu(), triton_utils.quiet_triton_deprecation():
        texts = {choice: lowered(choice, *args) for choice in ("mosaic", "auto", "xla")}
        (kernel,) = mosaic_ir.lower_kernels(program("mosaic", *args), *args)
        odd_v = (args[0], jax.ShapeDtypeStruct((H, 1000), jnp.bfloat16), args[2])
        assert "mosaic_gpu" not in lowered("auto", *odd_v)
        with pytest.raises(ValueError, match=r"dw_gemm='mosaic' cannot run here: V=1000 is not a positive multiple"):
            lowered("mosaic", *odd_v)
    assert sum(kernel.wgmma().values()) > 0
    assert kernel.name == "mosaic_matmul_accumulate"  # (jax 0.10.2 names the module of a kernel updating a ref
    # in place "new_body": mosaic_ir takes the name from the custom call's location there)
    for choice in ("mosaic", "auto"):
        assert texts[choice].count("@mosaic_gpu") == 1  # one kernel: the loop body's dw update
        assert "output_operand_alias<output_tuple_indices = [], operand_index = 2" in texts[choice]  # dw in place
    assert "mosaic_gpu" not in texts["xla"]
    # "auto" (the default) takes the Mosaic update for chunks of at most 512 rows (its ping-pong K loop) only
    long_chunks = (jax.ShapeDtypeStruct((1280, H), jnp.bfloat16), args[1], jax.ShapeDtypeStruct((1280,), jnp.int32))
    with backends.lowering_for_gpu(), triton_utils.quiet_triton_deprecation():
        auto_640 = jax.jit(jax.value_and_grad(lambda h, w, y: _loss(h, w, y, block_sizes={
            "chunk_rows": 640, "logits_gemm": "xla"}),
                                              argnums=(0, 1))).trace(*long_chunks).lower(
            lowering_platforms=("cuda",)).as_text()
        default_128 = jax.jit(jax.value_and_grad(lambda h, w, y: _loss(h, w, y, block_sizes={
            "chunk_rows": 128, "logits_gemm": "xla"}),
                                                 argnums=(0, 1))).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" not in auto_640 and default_128.count("@mosaic_gpu") == 1
    h, w, labels = inputs(4, 16, 40, jnp.bfloat16, ignored_rows=())
    with pytest.raises(ValueError, match="dw_gemm='mosaic' cannot run here"):
        jax.grad(lambda w: _loss(h, w, labels, block_sizes={"dw_gemm": "mosaic"}))(w)


def test_row_kernel_lowers_for_cuda_with_dlogits_over_the_logits():
    """Lowered for CUDA on any machine: value-and-grad has one row kernel per step kind (the peeled last chunk and
    the loop), each a Triton kernel with two vocabulary loops and no dot, writing dlogits over its logits input
    (V = 5003 does not tile: the logits come from cuBLAS)."""
    from hlo_inspect import triton_ir

    B, H, V = 300, 256, 5003
    h, w, labels = (jax.ShapeDtypeStruct((B, H), jnp.bfloat16), jax.ShapeDtypeStruct((H, V), jnp.bfloat16),
                    jax.ShapeDtypeStruct((B,), jnp.int32))
    fn = jax.value_and_grad(lambda h, w, y: _loss(h, w, y, block_sizes={"chunk_rows": 128}), argnums=(0, 1))
    with backends.lowering_for_gpu(), triton_utils.quiet_triton_deprecation():
        found = triton_ir.lower_kernels(fn, h, w, labels)
        text = jax.jit(fn).trace(h, w, labels).lower(lowering_platforms=("cuda",)).as_text()
    assert [k.name for k in found] == ["linear_cross_entropy_rows"] * 2
    assert all("2 loops" in k.summary() and "0 dots" in k.summary() for k in found)
    assert text.count("output_operand_alias<output_tuple_indices = [0], operand_index = 0") == 2


# ------------------------------------------------------------------------------------------------ Mosaic logits
@pytest.mark.parametrize("dtype,reduction,z_loss", [(jnp.bfloat16, "mean", 1e-3),
                                                    pytest.param(jnp.float16, "sum", 0.0, marks=pytest.mark.slow)])
def test_mosaic_logits_with_statistics_match_reference(dtype, reduction, z_loss):
    """Logits and their log-sum-exp from the Mosaic GEMM core's epilogue (``logits_gemm="mosaic"``), the row kernel
    writing dlogits only: 3 chunks of 128 rows (the last sharing 64 with the one before), against the float32
    reference; on the CPU in GPU interpret mode (2 simulated SMs)."""
    import contextlib

    from pallas_kernels import mosaic_utils

    B, H, V = (320, 256, 2048) if ON_GPU else (320, 64, 512)
    with contextlib.nullcontext() if ON_GPU else mosaic_utils.interpret_on_cpu(num_sms=2):
        _TRITON.check_against_reference(B, H, V, dtype, reduction=reduction, z_loss=z_loss,
                                        block_sizes={"chunk_rows": 128, "logits_gemm": "mosaic"})


@pytest.mark.skipif(not ON_GPU, reason="a long chunk in GPU interpret mode takes minutes on the CPU")
def test_mosaic_logits_of_a_long_chunk_match_reference():
    """One chunk of 2304 rows (18 row tiles: the logits GEMM's tiles in runs of 4, ``mosaic_logits.config_for``)
    against the float32 reference."""
    _TRITON.check_against_reference(2304, 256, 2048, jnp.bfloat16, reduction="mean",
                                    block_sizes={"chunk_rows": 2304, "logits_gemm": "mosaic"})


def test_mosaic_dh_gemm_matches_reference():
    """dh_c on the Mosaic GEMM core (``dh_gemm="mosaic"``, dlogits times w read transposed), logits and dw too: 3
    chunks of 128 rows (the last sharing 64), against the float32 reference; on the CPU in GPU interpret mode."""
    import contextlib

    from pallas_kernels import mosaic_utils

    B, H, V = (320, 256, 2048) if ON_GPU else (320, 256, 512)
    with contextlib.nullcontext() if ON_GPU else mosaic_utils.interpret_on_cpu(num_sms=2):
        _TRITON.check_against_reference(B, H, V, jnp.bfloat16, reduction="mean",
                                        block_sizes={"chunk_rows": 128, "dh_gemm": "mosaic", "logits_gemm": "mosaic"})


def test_mosaic_dh_gemm_lowers_where_its_tiles_fill_the_gpu():
    """Lowered for CUDA: "auto" takes the Mosaic dh GEMM where its (Bc / 128)·(H / 256) tiles fill 90% of the 132
    SMs over their waves (1024 x 4096: 128 tiles; 2048 x 4096: 256 in two waves) and not where they do not (512 x
    2048: 32, cuBLAS splits K there; 1536 x 4096: 192, a second wave of 60); "mosaic" runs it anyway and names the
    tile an H that does not divide breaks."""
    def grad_fn(B, H, V, dh_gemm):
        sizes = {"chunk_rows": B, "dw_gemm": "xla", "logits_gemm": "xla", "dh_gemm": dh_gemm}
        args = (jax.ShapeDtypeStruct((B, H), jnp.bfloat16), jax.ShapeDtypeStruct((H, V), jnp.bfloat16),
                jax.ShapeDtypeStruct((B,), jnp.int32))
        fn = jax.value_and_grad(lambda h, w, y: _loss(h, w, y, block_sizes=sizes), argnums=(0, 1))
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    with backends.lowering_for_gpu(), triton_utils.quiet_triton_deprecation():
        assert grad_fn(1024, 4096, 1024, "auto").count("@mosaic_gpu") == 1  # one chunk: the peeled step only
        assert grad_fn(2048, 4096, 1024, "auto").count("@mosaic_gpu") == 1
        # 3328 x 4096: 416 tiles, a last round of 20; tile by tile, no stream-K workspace (temporary memory)
        text = grad_fn(3328, 4096, 1024, "mosaic")
        assert text.count("@mosaic_gpu") == 1 and "x2x64x256xf32>" not in text
        assert "mosaic_gpu" not in grad_fn(512, 2048, 1024, "auto")
        assert "mosaic_gpu" not in grad_fn(1536, 4096, 1024, "auto")
        assert grad_fn(512, 2048, 1024, "mosaic").count("@mosaic_gpu") == 1
        assert "mosaic_gpu" not in grad_fn(1024, 4096, 1024, "xla")
        with pytest.raises(ValueError, match="dh_gemm='mosaic' cannot run here: H=320 is not a positive multiple"):
            grad_fn(512, 320, 1024, "mosaic")


def test_mosaic_logits_lower_for_cuda_and_fall_back():
    """Lowered for CUDA: with logits_gemm "mosaic" (and "auto") value-and-grad runs one Mosaic logits kernel per step
    kind and row kernels with one vocabulary loop (dlogits only); evaluation keeps cuBLAS and the statistics pass.
    A soft cap or a V the tiles do not divide: "auto" falls back to cuBLAS, "mosaic" names why it cannot."""
    from hlo_inspect import triton_ir

    B, H, V = 384, 256, 1024
    args = (jax.ShapeDtypeStruct((B, H), jnp.bfloat16), jax.ShapeDtypeStruct((H, V), jnp.bfloat16),
            jax.ShapeDtypeStruct((B,), jnp.int32))

    def grad_fn(logits_gemm, **kwargs):  # the row kernel's softmax (the epilogue's: a test below)
        sizes = {"chunk_rows": 128, "dw_gemm": "xla", "logits_gemm": logits_gemm, "softmax": "rows"}
        return jax.value_and_grad(lambda h, w, y: _loss(h, w, y, block_sizes=sizes, **kwargs), argnums=(0, 1))

    def lowered(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    from pallas_kernels.cross_entropy import mosaic_logits

    assert mosaic_logits.config_for(128, H, V, jnp.bfloat16).schedule == "pingpong"  # its epilogue under a K loop
    # runs of 8 row tiles along the vocabulary, 4 where a chunk has more than 16 row tiles
    assert [mosaic_logits.config_for(rows, 4096, 32000, jnp.bfloat16).grid_tile_width
            for rows in (1024, 2048, 2176, 3328)] == [8, 8, 4, 4]
    with backends.lowering_for_gpu(), triton_utils.quiet_triton_deprecation():
        for choice in ("mosaic", "auto"):
            assert lowered(grad_fn(choice), *args).count("@mosaic_gpu") == 2, choice  # peeled chunk + loop body
            rows = triton_ir.lower_kernels(grad_fn(choice), *args)
            assert [k.name for k in rows] == ["linear_cross_entropy_rows"] * 2
            assert all("1 loops" in k.summary() for k in rows), [k.summary() for k in rows]
        assert "mosaic_gpu" not in lowered(grad_fn("xla"), *args)
        assert "mosaic_gpu" not in lowered(lambda h, w, y: _loss(h, w, y, block_sizes={"chunk_rows": 128}), *args)
        assert "mosaic_gpu" not in lowered(grad_fn("auto", logit_soft_cap=5.0), *args)
        odd_v = (args[0], jax.ShapeDtypeStruct((H, 1000), jnp.bfloat16), args[2])
        assert "mosaic_gpu" not in lowered(grad_fn("auto"), *odd_v)
        # B = 352: the last chunk's 96 rows do not tile; "auto" runs XLA's logits there, "mosaic" a last chunk of
        # 128 rows sharing 32 with the one before
        rows_352 = (jax.ShapeDtypeStruct((352, H), jnp.bfloat16), args[1], jax.ShapeDtypeStruct((352,), jnp.int32))
        assert lowered(grad_fn("auto"), *rows_352).count("@mosaic_gpu") == 1
        assert lowered(grad_fn("mosaic"), *rows_352).count("@mosaic_gpu") == 2
        with pytest.raises(ValueError, match=r"logits_gemm='mosaic' cannot run here: V=1000 is not a positive mult"):
            lowered(grad_fn("mosaic"), *odd_v)
        with pytest.raises(ValueError, match="logits_gemm='mosaic' cannot run here: logit_soft_cap"):
            lowered(grad_fn("mosaic", logit_soft_cap=5.0), *args)


# ------------------------------------------------------------------------------------------------ epilogue softmax
_EPILOGUE = {"chunk_rows": 128, "logits_gemm": "mosaic", "softmax": "epilogue"}


def _mosaic_here():
    """GPU interpret mode on the CPU (2 simulated SMs); nothing on the GPU."""
    import contextlib

    from pallas_kernels import mosaic_utils

    return contextlib.nullcontext() if ON_GPU else mosaic_utils.interpret_on_cpu(num_sms=2)


@pytest.mark.parametrize("reduction,z_loss", [("mean", 1e-3), pytest.param("sum", 0.0, marks=pytest.mark.slow)])
def test_epilogue_softmax_matches_reference(reduction, z_loss):
    """The softmax's exp in the logits GEMM's epilogue (``softmax="epilogue"``: exp(z − zy) stored, dlogits' row
    scale applied by GEMMs 2 and 3): 3 chunks of 128 rows (the last sharing 64), an ignored row, against the float32
    reference."""
    B, H, V = (320, 256, 2048) if ON_GPU else (320, 64, 512)
    with _mosaic_here():
        _TRITON.check_against_reference(B, H, V, jnp.bfloat16, reduction=reduction, z_loss=z_loss,
                                        block_sizes=_EPILOGUE)


@pytest.mark.slow
def test_epilogue_softmax_gradient_of_one_input():
    """Differentiating h alone (dw's GEMM never traced, no scaled h_c) or w alone (no dh GEMM) on the epilogue's
    path: each gradient against the float32 reference."""
    B, H, V = (320, 256, 2048) if ON_GPU else (320, 64, 512)
    h, w, labels = inputs(B, H, V, jnp.bfloat16)
    ours = lambda h, w: _loss(h, w, labels, block_sizes=_EPILOGUE)  # noqa: E731
    ref = lambda h, w: reference.linear_cross_entropy(h.astype(jnp.float32), w.astype(jnp.float32), labels)  # noqa
    tol = tolerance(jnp.bfloat16, max(B, H, V))
    for argnum, name in ((0, "dh"), (1, "dw")):
        with _mosaic_here():  # (plan checks the Mosaic choices where the call runs them)
            got = jax.jit(jax.grad(ours, argnums=argnum))(h, w)
            factor = _TRITON.dw_tolerance_factor(h, w, labels, _EPILOGUE) if name == "dw" else 1.0
        assert_close(got, jax.grad(ref, argnums=argnum)(h, w), tol * factor, name)


def test_epilogue_softmax_falls_back_to_the_row_kernel_on_huge_losses():
    """At logits ~ N(0, 4) the epilogue's path runs: its gradients differ from the row kernel's in the last bits.
    With h scaled by 40 (logits ~ N(0, 6400)) every chunk has rows whose loss passes 80 nats and reruns the row
    kernel's way in the same buffer: the gradients are the row kernel's, bit for bit. Both scales run through the
    same two compiled programs (the fallback is a branch at run time), so each compiles once."""
    B, H, V = (384, 256, 2048) if ON_GPU else (320, 64, 512)
    h, w, labels = inputs(B, H, V, jnp.bfloat16)

    def program(softmax):
        fn = lambda h, w: _loss(h, w, labels, z_loss=1e-4, block_sizes=dict(_EPILOGUE, softmax=softmax))  # noqa: E731
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))

    programs = {softmax: program(softmax) for softmax in ("rows", "epilogue")}
    for scale, same, name in ((1.0, False, "normal_logits"), (40.0, True, "losses_past_40_nats")):
        scaled = (h.astype(jnp.float32) * scale).astype(h.dtype)
        with _mosaic_here():
            rows, epilogue = (jax.tree.leaves(programs[softmax](scaled, w)) for softmax in ("rows", "epilogue"))
        assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in epilogue), name
        # the loss sums the same row losses in another program (XLA may order its float32 sum otherwise)
        assert float(abs(rows[0] - epilogue[0])) <= 1e-6 * float(abs(rows[0])) or not same, name
        identical = [bool(jnp.array_equal(a, b)) for a, b in zip(rows[1:], epilogue[1:])]
        assert identical == [same] * 2, (name, identical)


def test_epilogue_softmax_lowers_for_cuda():
    """Lowered for CUDA: "auto" takes the epilogue's softmax where the Mosaic logits GEMM runs in bf16: per step
    one probabilities kernel, and after the chunk loop, in a loop of at most one step, the row kernel's way again
    (its logits kernels and row kernels). float16 keeps the row kernel ("epilogue" names why), and so do cuBLAS's
    logits."""
    B, H, V = 384, 256, 1024
    args = (jax.ShapeDtypeStruct((B, H), jnp.bfloat16), jax.ShapeDtypeStruct((H, V), jnp.bfloat16),
            jax.ShapeDtypeStruct((B,), jnp.int32))

    def lowered(*args, **sizes):
        sizes = dict({"chunk_rows": 128, "dw_gemm": "xla"}, **sizes)
        fn = jax.value_and_grad(lambda h, w, y: _loss(h, w, y, block_sizes=sizes), argnums=(0, 1))
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    with backends.lowering_for_gpu(), triton_utils.quiet_triton_deprecation():
        names = [k.name for k in mosaic_ir.lower_kernels(
            jax.value_and_grad(lambda h, w, y: _loss(h, w, y, block_sizes={"chunk_rows": 128, "dw_gemm": "xla"}),
                               argnums=(0, 1)), *args)]
        assert sorted(names) == ["linear_cross_entropy_logits"] * 2 + ["linear_cross_entropy_probabilities"] * 2
        # the chunk loop, the fallback's loop of at most one step and its chunk loop; each with a peeled step
        text = lowered(*args)
        assert text.count("stablehlo.while") == 3 and text.count("@mosaic_gpu") == 4
        explicit = lowered(*args, softmax="epilogue")
        assert explicit.count("stablehlo.while") == 3 and explicit.count("@mosaic_gpu") == 4
        rows = lowered(*args, softmax="rows")
        assert rows.count("stablehlo.while") == 1 and rows.count("@mosaic_gpu") == 2
        half = (jax.ShapeDtypeStruct((B, H), jnp.float16), jax.ShapeDtypeStruct((H, V), jnp.float16), args[2])
        assert lowered(*half).count("stablehlo.while") == 1
        with pytest.raises(ValueError, match="softmax='epilogue' cannot run here: .* bfloat16 only, got float16"):
            lowered(*half, softmax="epilogue")
        assert lowered(*args, logits_gemm="xla").count("stablehlo.while") == 1
        with pytest.raises(ValueError, match="softmax='epilogue' cannot run here: it needs the Mosaic logits GEMM"):
            lowered(*args, logits_gemm="xla", softmax="epilogue")


# ------------------------------------------------------------------------------------------------ config
def test_chunk_rule_keeps_temporaries_under_the_memory_bound():
    """At the suite's shapes Bc is 2048, 1024 and 2048 (4, 4 and 8 chunks): one chunk's bf16 logits, its (Bc, H)
    slices of h and dh and a 32 MiB GEMM workspace stay within 10% of the plain loss's B·V·6 bytes; with
    temp_fraction=0.05 within 5% (1024, 512 and 1536 rows: measured on the H100, 298.5 MiB of 6012 at the first
    shape, 149.8 of 3000 at the last); B under the limit gives one chunk; else the fewest chunks of at most
    MAX_CHUNK_ROWS, B split evenly."""
    for (b, h, v), rows_10, rows_5 in (((8192, 4096, 128256), 2048, 1024), ((4096, 2048, 256000), 1024, 512),
                                       ((16384, 4096, 32000), 2048, 1536)):
        for fraction, rows in ((ce_config.TEMP_FRACTION, rows_10), (0.05, rows_5)):
            bc = ce_config.chunk_rows_for(b, h, v, jnp.bfloat16, fraction)
            assert bc == rows and bc <= ce_config.MAX_CHUNK_ROWS
            assert bc * (v + 2 * h) * 2 + ce_config.GEMM_WORKSPACE_BYTES <= fraction * b * v * 6
    assert ce_config.TEMP_FRACTION == 0.10
    # the models' heads (H100: 384 rows 0.77x XLA against 256 rows 0.59x at the 1b head within 5%; 1664 rows 1.33x
    # against 1024 rows 1.28x at the small head within 10%)
    assert ce_config.chunk_rows_for(4096, 2048, 128256, jnp.bfloat16) == 1024
    assert ce_config.chunk_rows_for(4096, 2048, 128256, jnp.bfloat16, 0.05) == 384
    assert ce_config.chunk_rows_for(8192, 512, 32768, jnp.bfloat16) == 1664
    assert ce_config.chunk_rows_for(100, 256, 50257, jnp.bfloat16) == 100
    assert ce_config.chunk_rows_for(1000, 64, 1000, jnp.float32) == 128  # at least 128 rows
    assert ce_config.chunk_rows_for(1100, 64, 1000, jnp.float32) == 128  # 9 chunks, the last of 76 rows
    assert ce_config.chunk_rows_for(3000, 64, 100000, jnp.bfloat16, 1.0) == 3000  # fits whole: one chunk, no cap
    config = ce_config.for_shape(LinearCrossEntropyConfig(), 8192, 4096, 128256, jnp.bfloat16)
    assert config.chunk_rows == 2048 and ce_config.for_shape(config, 100, 64, 1000, jnp.float32).chunk_rows == 100
    small = ce_config.for_shape(LinearCrossEntropyConfig(temp_fraction=0.05), 8192, 4096, 128256, jnp.bfloat16)
    assert small.chunk_rows == 1024
    # evaluation: a quarter of B where that is more than chunk_rows, at most B
    assert [ce_config.eval_chunk_rows_for(b, bc) for b, bc in ((8192, 2048), (4096, 512), (16384, 2048))] == [
        2048, 1024, 4096]
    assert ce_config.eval_chunk_rows_for(300, 128) == 128 and ce_config.eval_chunk_rows_for(100, 128) == 100
    assert config.eval_chunk_rows == small.eval_chunk_rows == 2048


def test_bad_block_sizes_and_mosaic():
    h, w, labels = inputs(4, 16, 40, jnp.float32, ignored_rows=())
    with pytest.raises(ValueError, match=r"block_sizes: unknown fields \['chunk_v'\]"):
        cross_entropy.linear_cross_entropy(h, w, labels, block_sizes={"chunk_v": 16})
    with pytest.raises(ValueError, match=r"backend='mosaic' is not implemented for linear_cross_entropy"):
        cross_entropy.linear_cross_entropy(h, w, labels, backend="mosaic")


@pytest.mark.parametrize("fields,name", [
    ({"chunk_rows": 0}, "chunk_rows"), ({"eval_chunk_rows": -1}, "eval_chunk_rows"),
    ({"temp_fraction": 0.0}, "temp_fraction"), ({"temp_fraction": True}, "temp_fraction"),
    ({"rows_per_program": 3}, "rows_per_program"), ({"block_v": 100}, "block_v"),
    ({"num_warps": 3}, "num_warps"), ({"dw_dtype": "bf16"}, "dw_dtype"), ({"logits_dtype": "f32"}, "logits_dtype"),
    ({"row_pass": "cuda"}, "row_pass"), ({"dw_gemm": "cublas"}, "dw_gemm"),
    ({"logits_gemm": "triton"}, "logits_gemm"), ({"softmax": "exp"}, "softmax")])
def test_config_validation_names_the_field(fields, name):
    with pytest.raises(ValueError, match=f"LinearCrossEntropyConfig.{name}"):
        LinearCrossEntropyConfig(**fields)


def test_sweep_candidates_are_valid_and_split_by_kernel():
    h, w = jnp.zeros((8192, 64), jnp.bfloat16), jnp.zeros((64, 1000), jnp.bfloat16)
    forward, backward = ce_config.sweep_candidates(h, w)
    base = forward[0]
    assert backward[0] == base and len(forward) > 3 and len(backward) > 1
    for c in forward + backward:
        assert LinearCrossEntropyConfig(**c).chunk_rows is None  # the memory rule's, never a larger chunk
    for c in forward:
        assert all(c[f] == base[f] for f in c if f not in ce_config.FORWARD_FIELDS)
    for c in backward:
        assert all(c[f] == base[f] for f in ce_config.FORWARD_FIELDS)


# ------------------------------------------------------------------------------------------------ fused chunk step
def _fused_step_inputs(Bc, H, V, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    bf16 = lambda k, shape, scale: (scale * jax.random.normal(k, shape, jnp.float32)).astype(jnp.bfloat16)  # noqa
    return (bf16(keys[0], (Bc, H), 1.0), bf16(keys[1], (Bc, V), 1e-3), bf16(keys[2], (Bc, H), 1.0),
            bf16(keys[3], (H, V), 0.05), bf16(keys[4], (H, V), 1e-2))


@pytest.mark.skipif(not ON_GPU, reason="the fused chunk step runs on an sm90 GPU (its lowering is tested on CPU)")
@pytest.mark.parametrize("V", [1024, 128 * 300])  # 8 units (most blocks idle); 300 units (2-3 per block)
@pytest.mark.parametrize("first", [True, False], ids=["first", "accumulating"])
def test_fused_step_kernel_matches_reference(V, first):
    """One fused chunk step against float32 products: the logits h_next·w (stored over dl's buffer), dw +
    h_prevᵀ·dl (or h_prevᵀ·dl for the first chunk), and the lse of the stored logits."""
    from pallas_kernels.cross_entropy import mosaic_step

    Bc, H = 256, 512
    h_prev, dl, h_next, w, dw = _fused_step_inputs(Bc, H, V)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    want_logits = f32(h_next) @ f32(w)
    want_dw = f32(h_prev).T @ f32(dl) + (0.0 if first else f32(dw))
    logits, new_dw, lse = jax.jit(mosaic_step.update_and_logits)(h_prev, dl, h_next, w, None if first else dw)
    for name, got, want in (("logits", logits, want_logits), ("dw", new_dw, want_dw)):
        got = f32(got)
        assert bool(jnp.all(jnp.isfinite(got))), name
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        assert err < 1e-2, (name, err)
    want_lse = jax.nn.logsumexp(f32(logits), axis=1)
    assert float(jnp.max(jnp.abs(lse - want_lse))) < 1e-4 * float(jnp.max(jnp.abs(want_lse)))


@pytest.mark.skipif(not ON_GPU, reason="the fused chunk step runs on an sm90 GPU (its lowering is tested on CPU)")
@pytest.mark.parametrize("reduction,B", [("mean", 1024), ("sum", 512)], ids=["4_chunks", "2_chunks"])
def test_fused_step_loss_matches_reference(reduction, B):
    """value_and_grad with the fused chunk steps (fused_step "on": the first chunk's logits, fused steps, the last
    chunk's update alone) against the float32 reference, z-loss and ignored rows included."""
    _TRITON.check_against_reference(B, 512, 2048, jnp.bfloat16, reduction=reduction, z_loss=1e-3,
                                    block_sizes={"chunk_rows": 256, "fused_step": "on"})


def test_fused_step_lowers_for_cuda_and_names_what_it_cannot_run():
    """Lowered for CUDA: with fused_step "on" value-and-grad runs the first chunk's logits GEMM, one fused kernel for
    the peeled step and one in the loop (aliasing dl's buffer to its logits and, in the loop, dw to itself), and the
    last chunk's update; the default ("off") runs the separate GEMMs. Where B is not whole chunks or H not a multiple
    of chunk_rows, "on" names why it cannot run."""
    from pallas_kernels.cross_entropy import mosaic_step

    B, H, V = 1024, 512, 2048
    args = (jax.ShapeDtypeStruct((B, H), jnp.bfloat16), jax.ShapeDtypeStruct((H, V), jnp.bfloat16),
            jax.ShapeDtypeStruct((B,), jnp.int32))

    def grad_fn(**sizes):
        return jax.value_and_grad(lambda h, w, y: _loss(h, w, y, block_sizes=dict({"chunk_rows": 256}, **sizes)),
                                  argnums=(0, 1))

    def lowered(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    with backends.lowering_for_gpu(), triton_utils.quiet_triton_deprecation():
        kernels_on = mosaic_ir.lower_kernels(grad_fn(fused_step="on"), *args)
        fused = lowered(grad_fn(fused_step="on"), *args)
        default = lowered(grad_fn(softmax="rows"), *args)  # the fused step's statistics epilogue, not the softmax's
        with pytest.raises(ValueError, match="fused_step='on' cannot run here: B=1000 is not two or more whole"):
            lowered(grad_fn(fused_step="on"), jax.ShapeDtypeStruct((1000, H), jnp.bfloat16), args[1],
                    jax.ShapeDtypeStruct((1000,), jnp.int32))
        with pytest.raises(ValueError, match="H=384 is not a multiple of chunk_rows=256"):
            lowered(grad_fn(fused_step="on"), jax.ShapeDtypeStruct((B, 384), jnp.bfloat16),
                    jax.ShapeDtypeStruct((384, V), jnp.bfloat16), args[2])
    assert len(kernels_on) == 4  # logits of chunk 0, the peeled fused step, the loop's, the last update
    assert all(k.wgmma() and k.smem_bytes <= 227 * 1024 for k in kernels_on[1:3]), [k.smem_bytes for k in kernels_on]
    assert fused.count("@mosaic_gpu") == 4 and default.count("@mosaic_gpu") == 3  # logits x2, the dw update
    assert "output_operand_alias<output_tuple_indices = [3], operand_index = 3" in fused  # peeled: logits over dl
    with pytest.raises(ValueError, match="update_and_logits: dw must be"):
        mosaic_step.update_and_logits(*(jnp.zeros(s, jnp.bfloat16) for s in ((256, 512), (256, 2048), (256, 512),
                                                                               (512, 2048), (512, 1024))))


def test_plan_takes_shape_dtype_structs():
    """plan() of abstract arguments is the plan of arrays of those shapes and dtypes (labels of any integer dtype;
    their range is checked only where they are concrete)."""
    S = jax.ShapeDtypeStruct
    args = (S((8192, 2048), jnp.bfloat16), S((2048, 32768), jnp.bfloat16), S((8192,), jnp.int64))
    arrays = [jnp.zeros(a.shape, a.dtype) for a in args]
    assert cross_entropy.plan(*args) == cross_entropy.plan(*arrays)


@pytest.mark.skipif(ON_GPU, reason="off a GPU and outside GPU interpret mode no Mosaic choice can run")
@pytest.mark.parametrize("block_sizes, match", [
    (dict(dw_gemm="mosaic"), "dw_gemm='mosaic' cannot run here: interpret mode"),
    (dict(logits_gemm="mosaic"), "logits_gemm='mosaic' cannot run here: interpret mode"),
    (dict(softmax="epilogue"), "softmax='epilogue' cannot run here: it needs the Mosaic logits GEMM"),
    (dict(fused_step="on", chunk_rows=32), "fused_step='on' cannot run here: interpret mode")])
def test_plan_refuses_what_the_differentiated_call_refuses(block_sizes, match):
    """``plan`` checks the config's Mosaic choices as the differentiated call does, with the same ValueError,
    before any kernel is traced."""
    h, w, labels = inputs(64, 32, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        cross_entropy.plan(h, w, labels, backend="triton", block_sizes=block_sizes)
    with pytest.raises(ValueError, match=match):
        jax.grad(lambda h, w: _loss(h, w, labels, block_sizes=block_sizes), argnums=(0, 1))(h, w)
    assert cross_entropy.plan(h, w, labels, backend="triton").backend == "triton"
