"""jaxfuse.kernels (KernelSet), jaxfuse.models (Llama-style NNX transformer) and jaxfuse.programs, on CPU.

The model is checked against a hand-written pure-jnp block / LM on the same parameters (float32, complex-number
RoPE, repeated-head GQA, explicit tril mask); gradients against jax.grad of that reference; and the compiled HLO
for module scopes in op_name metadata, forward and backward.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import key, normal, seed
from jaxfuse import KernelSet, kernels, models
from jaxfuse.programs import build_program
from pallas_kernels import reference


@pytest.fixture(autouse=True)
def _float32_as_ieee():
    """The model against its float32 reference at 1e-5-1e-6: float32 matmuls in IEEE float32, as on the CPU (on a
    GPU, XLA's default is TF32: errors of 1e-3, the reference as far off as the model)."""
    with jax.default_matmul_precision("highest"):
        yield


def _randomize(state):
    """Every parameter times (1 + 0.5·N(0, 1)), so that norm scales are not all ones."""
    return jax.tree.map(lambda p: p * (1.0 + 0.5 * normal(p.shape, p.dtype)), state)


def _model(cls, cfg, ks=KernelSet()):
    """cls(cfg) with randomized parameters: (model, params as a plain nested dict)."""
    model = cls(cfg, kernels=ks, rngs=nnx.Rngs(seed()))
    nnx.update(model, _randomize(nnx.state(model)))
    return model, nnx.to_pure_dict(nnx.state(model))


# --------------------------------------------------------------------------------------- hand-written reference
def _ref_rmsnorm(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _ref_rope(x, theta):
    """x (B, T, n, H): pairs (i, i + H/2) as complex numbers, times exp(i · t · theta^(-2i/H))."""
    T, H = x.shape[1], x.shape[-1]
    freq = theta ** (-np.arange(H // 2) * 2.0 / H)  # (H/2,)
    rotation = np.exp(1j * np.arange(T)[:, None] * freq)[None, :, None, :]  # (1, T, 1, H/2)
    z = (x[..., : H // 2] + 1j * x[..., H // 2 :]) * rotation
    return jnp.concatenate([z.real, z.imag], axis=-1).astype(jnp.float32)


def _ref_block(p, x, cfg):
    B, T, _ = x.shape
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = _ref_rmsnorm(x, p["norm1"]["scale"], cfg.eps)
    G = N // K
    qkv = (h @ p["attn"]["qkv_proj"]["kernel"]).reshape(B, T, K, G + 2, H)  # per kv head: G query heads, k, v
    q = _ref_rope(qkv[:, :, :, :G].reshape(B, T, N, H), cfg.rope_theta)
    k = _ref_rope(qkv[:, :, :, G], cfg.rope_theta)
    v = qkv[:, :, :, G + 1]
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)  # query head n reads kv head n // (N/K)
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(H)
    scores = jnp.where(np.tril(np.ones((T, T), bool)), scores, -jnp.inf)
    out = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(scores, axis=-1), v).reshape(B, T, N * H)
    x = x + out @ p["attn"]["out_proj"]["kernel"]
    h = _ref_rmsnorm(x, p["norm2"]["scale"], cfg.eps)
    gate_up = h @ p["mlp"]["gate_up_proj"]["kernel"]  # columns interleaved: gate i, up i
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    return x + (gate * jax.nn.sigmoid(gate) * up) @ p["mlp"]["down_proj"]["kernel"]


def _ref_lm_hidden(p, tokens, cfg):
    x = p["embed"]["embedding"][tokens]
    for i in range(cfg.n_layers):
        x = _ref_block(p["blocks"][i], x, cfg)
    return _ref_rmsnorm(x, p["final_norm"]["scale"], cfg.eps)


def _ref_lm_loss(p, tokens, labels, cfg):
    logits = _ref_lm_hidden(p, tokens, cfg) @ p["lm_head"]["kernel"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    valid = labels != -100
    nll = -jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.sum(valid)


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------------- KernelSet
@pytest.mark.parametrize("site", kernels.SITES)
def test_kernelset_rejects_unknown_names(site):
    with pytest.raises(ValueError, match=rf"KernelSet\.{site}.*'nope'.*'xla'"):
        KernelSet(**{site: "nope"})


@pytest.mark.parametrize("site, name", [(s, n) for s, registry in kernels.REGISTRIES.items() for n in registry])
def test_kernelset_accepts_registered_names(site, name):
    ks = KernelSet(**{site: name})
    assert ks.impl(site) is kernels.REGISTRIES[site][name]
    assert getattr(ks, f"{site}_fn") is kernels.REGISTRIES[site][name]


def test_kernelset_parse_and_str_round_trip():
    ks = KernelSet.parse(" attention=cudnn , loss=xla ")
    assert ks == KernelSet(attention="cudnn")
    assert str(ks) == "attention=cudnn,norm_matmul=xla,loss=xla"
    assert KernelSet.parse(str(ks)) == ks
    assert KernelSet.parse("") == KernelSet()
    assert KernelSet.parse("all=xla,attention=cudnn") == KernelSet(attention="cudnn")
    assert hash(ks) == hash(KernelSet(attention="cudnn"))  # usable as static jit state


@pytest.mark.parametrize(
    "spec, message",
    [
        ("attention", "expected items like"),
        ("attn=xla", "unknown site 'attn'"),
        ("loss=xla,loss=xla", "given twice"),
        ("norm_matmul=nope", r"KernelSet\.norm_matmul.*'nope'"),
        ("all=nope", r"KernelSet\.attention.*'nope'"),
    ],
)
def test_kernelset_parse_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        KernelSet.parse(spec)


def test_register_makes_a_new_implementation_selectable_and_dispatched():
    calls = []

    def recording_attention(q, k, v, *, causal, scale):
        calls.append((q.shape, k.shape, causal, scale))
        return reference.attention(q, k, v, causal=causal, scale=scale)

    kernels.register("attention", "test_recording", recording_attention)
    try:
        with pytest.raises(ValueError, match="already has"):
            kernels.register("attention", "test_recording", lambda *a, **k: None)
        cfg = models.Config.tiny()
        model, _ = _model(models.Block, cfg, KernelSet(attention="test_recording"))
        y = jax.jit(lambda x: model(x))(normal((2, 8, cfg.dim)))
        assert calls == [((2, 8, 4, 16), (2, 8, 2, 16), True, 16**-0.5)]
        assert y.shape == (2, 8, cfg.dim)
    finally:
        del kernels.ATTENTION["test_recording"]
    with pytest.raises(ValueError, match="site"):
        kernels.register("attn", "x", recording_attention)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error off GPU")
def test_cudnn_attention_off_gpu_fails_clearly_at_call_time():
    cfg = models.Config.tiny(dtype="bfloat16")
    block = models.Block(cfg, kernels=KernelSet(attention="cudnn"), rngs=nnx.Rngs(0))  # construction is fine
    with pytest.raises(RuntimeError, match=r"attention='cudnn' needs an NVIDIA GPU.*'cpu'"):
        jax.eval_shape(lambda x: block(x), jax.ShapeDtypeStruct((1, 8, cfg.dim), jnp.bfloat16))


def test_xla_norm_matmul_matches_reference_in_float32():
    x, gamma, w = normal((3, 5, 24)), normal((24,)), normal((24, 40))
    _close(kernels.NORM_MATMUL["xla"](x, gamma, w, eps=1e-5), reference.rmsnorm_matmul(x, gamma, w, eps=1e-5))


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_xla_attention_matches_reference_in_float32_and_within_bf16_rounding(causal):
    q, k, v = normal((2, 7, 4, 16)), normal((2, 9, 2, 16)), normal((2, 9, 2, 16))  # GQA, T != S
    want = reference.attention(q, k, v, causal=causal, scale=0.3)
    _close(kernels.ATTENTION["xla"](q, k, v, causal=causal, scale=0.3), want, tol=1e-5)
    got = kernels.ATTENTION["xla"](*(a.astype(jnp.bfloat16) for a in (q, k, v)), causal=causal, scale=0.3)
    assert got.dtype == jnp.bfloat16
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
    assert 0 < err < 2e-2  # bf16 operands and probabilities: rounded, not exact, and not wrong


def test_xla_attention_is_written_the_way_xla_runs_fastest():
    """plain_attention's scores come out of dot_general in its own (B, K, T, G, S) order (no transpose of a
    score-sized array) and its causal mask is built from iotas of the scores' shape (no (T, S) array that XLA makes a
    kernel of its own): on the H200 the other forms took up to 2.4x as long (NOTES.md, plain attention in XLA)."""
    B, T, N, K, H = 2, 32, 6, 2, 8  # T > H: the scores outnumber every other array
    q, k, v = normal((B, T, N, H)), normal((B, T, K, H)), normal((B, T, K, H))
    scores = B * N * T * T
    jaxpr = jax.make_jaxpr(lambda q, k, v: kernels.ATTENTION["xla"](q, k, v, causal=True))(
        *(a.astype(jnp.bfloat16) for a in (q, k, v)))
    eqns = list(jaxpr.jaxpr.eqns)
    while any("jaxpr" in e.params for e in eqns):  # look inside nested jits (einsum, where, softmax)
        eqns = [inner for e in eqns for inner in (e.params["jaxpr"].jaxpr.eqns if "jaxpr" in e.params else [e])]
    sizes = lambda e: [math.prod(o.aval.shape) for o in e.outvars]  # noqa: E731
    transposed = [e for e in eqns if e.primitive.name == "transpose" and max(sizes(e)) >= scores]
    assert not transposed, f"a score-sized transpose: {transposed}"
    iotas = [e for e in eqns if e.primitive.name == "iota"]
    assert iotas and all(sizes(e) == [scores] for e in iotas), [e.outvars[0].aval.shape for e in iotas]


def test_xla_loss_matches_reference_with_ignored_rows():
    h, w = normal((9, 24)), normal((24, 50))
    labels = jax.random.randint(key(), (9,), 0, 50).at[jnp.array([0, 4])].set(-100)
    _close(kernels.LOSS["xla"](h, w, labels), reference.linear_cross_entropy(h, w, labels), tol=1e-5)
    grads = jax.grad(kernels.LOSS["xla"], argnums=(0, 1))(h, w, labels)
    want = jax.grad(reference.linear_cross_entropy, argnums=(0, 1))(h, w, labels)
    for g, g_want in zip(grads, want):
        _close(g, g_want, tol=1e-5)
    assert not jnp.any(grads[0][jnp.array([0, 4])])  # ignored rows get no gradient
    assert float(kernels.LOSS["xla"](h, w, jnp.full((9,), -100))) == 0.0  # all ignored: 0, not NaN


# ------------------------------------------------------------------------------------------------------- Config
def test_config_presets_and_validation():
    for cfg in (models.Config.tiny(), models.Config.small(), models.Config.block_default()):
        assert cfg.n_heads % cfg.n_kv_heads == 0
    assert models.Config.small().dtype == jnp.bfloat16 and models.Config.small().param_dtype == jnp.float32
    assert models.Config.tiny(dtype="bfloat16").dtype == jnp.dtype(jnp.bfloat16)
    assert models.Config.block_default().mlp_hidden == 704
    with pytest.raises(ValueError, match=r"Config\.n_kv_heads.*n_heads=4, n_kv_heads=3"):
        models.Config.tiny(n_kv_heads=3)
    with pytest.raises(ValueError, match=r"Config\.head_dim"):
        models.Config.tiny(head_dim=15)
    with pytest.raises(ValueError, match=r"Config\.dim"):
        models.Config.tiny(dim=0)
    with pytest.raises(ValueError, match=r"Config\.dtype"):
        models.Config.tiny(dtype="int32")


# -------------------------------------------------------------------------------------------------------- model
def test_shapes_and_dtypes():
    cfg = models.Config.tiny(dtype="bfloat16")
    lm = models.Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(key(), (3, 10), 0, cfg.vocab)
    logits = jax.eval_shape(lambda t: lm(t), tokens)
    assert logits.shape == (3, 10, cfg.vocab) and logits.dtype == jnp.bfloat16
    loss = jax.jit(lambda t: lm.loss(t, t))(tokens)
    assert loss.shape == () and loss.dtype == jnp.float32 and np.isfinite(loss)
    y = jax.eval_shape(lambda x: lm.blocks[1](x), normal((3, 10, cfg.dim), jnp.bfloat16))
    assert y.shape == (3, 10, cfg.dim) and y.dtype == jnp.bfloat16
    assert lm.embed.embedding.shape == (cfg.vocab, cfg.dim)
    assert lm.blocks[0].attn.qkv_proj.kernel.shape == (cfg.dim, (4 + 2 * 2) * 16)
    assert lm.blocks[0].mlp.gate_up_proj.kernel.shape == (cfg.dim, 2 * cfg.mlp_hidden)
    with pytest.raises(ValueError, match="tokens"):
        jax.eval_shape(lambda t: lm(t), jnp.zeros((1, cfg.max_seq + 1), jnp.int32))


@pytest.mark.parametrize("n_kv_heads", [pytest.param(4, marks=pytest.mark.slow), 2, 1])  # MHA, GQA, MQA
def test_block_matches_hand_written_reference(n_kv_heads):
    # N·H = 40 != D = 48 and F = 72, so that no two widths can be confused.
    cfg = models.Config.tiny(dim=48, n_heads=4, n_kv_heads=n_kv_heads, head_dim=10, mlp_hidden=72)
    block, params = _model(models.Block, cfg)
    x = normal((2, 13, cfg.dim))
    _close(jax.jit(lambda x: block(x))(x), jax.jit(_ref_block, static_argnums=2)(params, x, cfg))


def test_gqa_equals_mha_with_repeated_kv_heads():
    """A K=2 block equals the N=4 MHA block whose k/v weight columns repeat each kv head N/K times."""
    N, K, H = 4, 2, 16
    gqa_cfg = models.Config.tiny(n_heads=N, n_kv_heads=K, head_dim=H)
    gqa, params = _model(models.Block, gqa_cfg)
    mha = models.Block(models.Config.tiny(n_heads=N, n_kv_heads=N, head_dim=H), rngs=nnx.Rngs(0))
    G = N // K
    w = params["attn"]["qkv_proj"]["kernel"]  # (D, (N + 2K)·H), per kv head j: G query heads, k_j, v_j
    D = w.shape[0]
    groups = w.reshape(D, K, G + 2, H)
    wq = groups[:, :, :G]  # (D, K, G, H): query head j·G + g
    wk, wv = (jnp.broadcast_to(groups[:, :, None, G + i], (D, K, G, H)) for i in (0, 1))  # each kv head G times
    # MHA (N kv heads, G = 1): per head n, [q_n | k_n | v_n]
    params["attn"]["qkv_proj"]["kernel"] = jnp.stack([wq, wk, wv], axis=3).reshape(D, 3 * N * H)
    state = nnx.state(mha)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(mha, state)
    x = normal((2, 9, gqa_cfg.dim))
    _close(jax.jit(lambda x: mha(x))(x), jax.jit(lambda x: gqa(x))(x))


def test_causal_position_t_ignores_later_tokens():
    cfg = models.Config.tiny()
    lm, _ = _model(models.Transformer, cfg)
    forward = jax.jit(lambda tokens: lm(tokens))
    T, t = 12, 5
    tokens = jax.random.randint(key(), (2, T), 0, cfg.vocab)
    changed = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + 1 + jnp.arange(T - t - 1)) % cfg.vocab)
    before, after = forward(tokens), forward(changed)
    _close(after[:, : t + 1], before[:, : t + 1], tol=1e-6)
    assert not np.allclose(after[:, t + 1], before[:, t + 1], atol=1e-3)  # the change does reach t + 1


def test_lm_logits_and_loss_match_hand_written_reference():
    cfg = models.Config.tiny(n_layers=2)
    lm, params = _model(models.Transformer, cfg)
    tokens = jax.random.randint(key(), (2, 11), 0, cfg.vocab)
    labels = jax.random.randint(key(), (2, 11), 0, cfg.vocab).at[:, -1].set(-100)
    ref_logits = jax.jit(lambda p, t: _ref_lm_hidden(p, t, cfg) @ p["lm_head"]["kernel"])(params, tokens)
    ref_loss = jax.jit(_ref_lm_loss, static_argnums=3)(params, tokens, labels, cfg)
    _close(jax.jit(lambda t: lm(t))(tokens), ref_logits, tol=1e-4)
    _close(jax.jit(lambda t, l: lm.loss(t, l))(tokens, labels), ref_loss, tol=1e-5)


# ------------------------------------------------------------------------------------------------ programs
_SMALL = dict(batch=2, seq=16, dim=64, heads=4, kv_heads=2, dtype="float32", vocab=96, layers=2)


@pytest.mark.parametrize("model", ["block", "lm"])
def test_build_program_forward(model):
    program = build_program(model, **_SMALL)
    params, *inputs = program.args
    assert all(not np.all(np.asarray(a) == 0) for a in jax.tree.leaves(program.args))  # random, not zeros
    out = jax.jit(program.fn)(*program.args)
    assert out.shape == ((2, 16, 64) if model == "block" else (2, 16, 96))
    assert np.all(np.isfinite(out))
    assert program.description.startswith(f"{model} forward") and "kernels attention=xla" in program.description


def test_build_program_block_train_step_matches_reference_grad():
    program = build_program("block", train_step=True, **_SMALL)
    params, x = program.args
    loss, grads = jax.jit(program.fn)(*program.args)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(
        lambda p: jnp.mean(jnp.square(_ref_block(p, x, program.config)))))(nnx.to_pure_dict(params))
    _close(loss, ref_loss)
    grads = nnx.to_pure_dict(grads)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    jax.tree.map(lambda g, r: _close(g, r, tol=1e-4), grads, ref_grads)


@pytest.mark.slow
def test_build_program_lm_train_step_matches_reference_grad():
    program = build_program("lm", train_step=True, **(_SMALL | {"layers": 1}))
    params, tokens, labels = program.args
    assert np.all(labels[:, :-1] == tokens[:, 1:]) and np.all(labels[:, -1] == -100)  # next-token targets
    loss, grads = jax.jit(program.fn)(*program.args)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_ref_lm_loss), static_argnums=3)(
        nnx.to_pure_dict(params), tokens, labels, program.config)
    _close(loss, ref_loss)
    grads = nnx.to_pure_dict(grads)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    jax.tree.map(lambda g, r: _close(g, r, tol=1e-4), grads, ref_grads)


@pytest.mark.slow
def test_build_program_default_is_bfloat16_gqa_and_validates():
    program = build_program("block", train_step=True)
    loss, grads = jax.jit(program.fn)(*program.args)
    assert program.args[1].shape == (2, 128, 256) and program.args[1].dtype == jnp.bfloat16
    assert program.config.n_kv_heads == 2 and np.isfinite(loss)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    with pytest.raises(ValueError, match="model"):
        build_program("mlp")
    with pytest.raises(ValueError, match="dim"):
        build_program("block", dim=250, heads=4)


# -------------------------------------------------------------------------------------------- HLO op_name scopes
def _op_names(fn, *args):
    """op_name metadata of every instruction in the compiled (optimized) HLO of jit(fn)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return set(re.findall(r'op_name="([^"]*)"', text))


def test_module_scopes_in_compiled_hlo_forward_and_grad():
    forward = build_program("lm", **_SMALL)
    train = build_program("lm", train_step=True, **_SMALL)
    fwd_names, train_names = _op_names(forward.fn, *forward.args), _op_names(train.fn, *train.args)

    def has(names, fragment):
        return any(fragment in name for name in names)

    for scope in ("embed/", "blocks.0/attn/qkv_proj/rmsnorm/", "blocks.0/attn/qkv_proj/matmul/dot_general",
                  "blocks.0/attn/rope/", "blocks.0/attn/sdpa/", "blocks.0/attn/out_proj/dot_general",
                  "blocks.1/mlp/gate_up_proj/matmul/dot_general", "blocks.1/mlp/swiglu/",
                  "blocks.1/mlp/down_proj/dot_general", "lm_head/matmul/dot_general"):
        assert has(fwd_names, f"jit(lm_forward)/{scope}"), scope
    for scope in ("transpose(jvp(blocks.0))/attn/qkv_proj/matmul/", "transpose(jvp(blocks.0))/attn/sdpa/",
                  "transpose(jvp(blocks.1))/mlp/down_proj/", "transpose(jvp(blocks.1))/mlp/gate_up_proj/rmsnorm/",
                  "transpose(jvp(loss))/", "transpose(jvp(embed))/", "jvp(blocks.0)/attn/qkv_proj/"):
        assert has(train_names, f"jit(lm_train_step)/{scope}"), scope
    # Every matmul, forward and backward, is attributed to a module.
    for names in (fwd_names, train_names):
        dots = [n for n in names if n.endswith("dot_general")]
        assert dots and all(re.search(r"(attn|mlp|lm_head|loss)", n) for n in dots), dots
