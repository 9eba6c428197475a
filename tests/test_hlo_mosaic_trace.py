"""hlo_inspect.mosaic_trace: Mosaic GPU's on-device profiler traces read back, and the GEMM core's regions under
``mosaic_utils.profiling`` (lowered for CUDA on the CPU). The traces here are written by jax's own profiler dump
(``ProfilerSpec.dump``) from buffers laid out as the kernel's finalize step leaves them."""

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import profiler

from hlo_inspect import mosaic_ir, mosaic_trace
from pallas_kernels import backends
from pallas_kernels import mosaic_utils as mu
from pallas_kernels.gemm import MosaicGemmConfig, matmul

_ENTRIES = 64  # per warpgroup


def _document(blocks: list[list[list[tuple[str, str, int]]]], starts=None, sms=None) -> dict:
    """A trace document as jax's profiler writes it: blocks[b][wg] = [(name, "B" or "E", cycle), ...] (three
    warpgroups per block, 384 threads); each warpgroup starts at starts[b] ns (default 1000 · b) on SM sms[b]."""
    spec = profiler.ProfilerSpec(_ENTRIES)
    buffer = np.zeros((len(blocks), 3, _ENTRIES), np.int64)  # (the GPU's is uint32; int64 keeps the dump's
    # overhead estimate, min(step) - 1 = 0 here, from wrapping around)
    for b, warpgroups in enumerate(blocks):
        for wg, events in enumerate(warpgroups):
            buffer[b, wg, 0] = 1000 * b if starts is None else starts[b]
            buffer[b, wg, 1] = b if sms is None else sms[b]
            buffer[b, wg, 2] = 2 * len(events)
            for i, (name, ph, cycle) in enumerate(events):
                tag = spec.intern_name(name) | (0 if ph == "B" else profiler.ProfilerSpec.EXIT)
                buffer[b, wg, 3 + 2 * i:5 + 2 * i] = (tag, cycle)
    out = io.StringIO()
    spec.dump(buffer.reshape(-1), out, grid=(len(blocks),), block=(384,))
    return json.loads(out.getvalue())


def _gemm_block(tiles: int, k_loop: int, epilogue: int, gap: int = 5) -> list[list[tuple[str, str, int]]]:
    """Two MMA warpgroups running `tiles` tiles (`gap` cycles, the K loop, 1 cycle, the epilogue), a memory
    warpgroup with only the profiler's Init region. Init ends 1 cycle after it begins, so the dump's overhead
    estimate is 0 (and its events are strictly increasing, as the dump makes them)."""
    mma, t = [("Init", "B", 0), ("Init", "E", 1)], 1
    for _ in range(tiles):
        mma += [("k_loop", "B", t + gap), ("k_loop", "E", t + gap + k_loop),
                ("epilogue", "B", t + gap + k_loop + 1), ("epilogue", "E", t + gap + k_loop + 1 + epilogue)]
        t += gap + k_loop + 1 + epilogue
    return [mma, list(mma), [("Init", "B", 0), ("Init", "E", 1)]]


def test_regions_read_back_in_cycles_with_each_warpgroups_start_and_sm():
    traces = mosaic_trace.parse(_document([_gemm_block(2, 1000, 100)], starts=[5000], sms=[7]))
    assert len(traces) == 3 and all(t.sm == 7 and t.start_ns == 5000 for t in traces)
    mma = traces[0]
    assert [(r.name, r.begin, r.end) for r in mma.regions] == [
        ("Init", 0, 1), ("k_loop", 6, 1006), ("epilogue", 1007, 1107), ("k_loop", 1112, 2112),
        ("epilogue", 2113, 2213)]
    assert mma.span == 2213 and traces[2].span == 1


def test_summary_takes_spans_tail_and_gaps_over_the_warpgroups_that_ran_regions():
    # block 0 runs 3 tiles, block 1 runs 2: the second's warpgroups end a third of the way early
    summary = mosaic_trace.summarize(mosaic_trace.parse(_document([_gemm_block(3, 1000, 100),
                                                                   _gemm_block(2, 1000, 100)], starts=[0, 40])))
    assert (summary["traces"], summary["sms"], summary["without_regions"]) == (4, 2, 2)
    assert summary["spans"] == dict(min=2213, median=(2213 + 3319) / 2, max=3319)
    assert summary["tail"] == pytest.approx(1 - (2213 + 3319) / 2 / 3319)
    assert summary["start_skew_ns"] == 40
    assert summary["gaps"] == dict(median=(12 + 18) / 2, max=18)  # 5 cycles before each tile, 1 inside it
    k_loop = summary["regions"]["k_loop"]
    assert k_loop["occurrences_per_trace"] == 2.5 and k_loop["median"] == 1000 and k_loop["later_median"] == 1000
    assert k_loop["share_of_spans"] == pytest.approx(10 * 1000 / (2 * 2213 + 2 * 3319))
    only = mosaic_trace.summarize(mosaic_trace.parse(_document([_gemm_block(2, 1000, 100)])), names=("epilogue",))
    assert list(only["regions"]) == ["epilogue"] and only["spans"]["max"] == 2213 - 1007


def test_the_start_skew_survives_the_timers_32_bit_wrap():
    starts = [(1 << 32) - 100, 60]  # the profiler keeps the global timer's lower 32 bits
    summary = mosaic_trace.summarize(mosaic_trace.parse(_document([_gemm_block(1, 1000, 100)] * 2, starts=starts)))
    assert summary["start_skew_ns"] == 160


def test_a_slow_first_tile_shows_in_first_against_later():
    block = _gemm_block(3, 1000, 100)
    for wg in (0, 1):  # the first tile's K loop 500 cycles longer (the pipeline's fill), the rest shifted
        block[wg] = [(n, ph, c + 500 if (n, ph) != ("Init", "B") and c > 1 + 5 else c) for n, ph, c in block[wg]]
    regions = mosaic_trace.summarize(mosaic_trace.parse(_document([block])))["regions"]
    assert (regions["k_loop"]["first_median"], regions["k_loop"]["later_median"]) == (1500, 1000)


def test_report_prints_cycles_and_microseconds_at_a_given_clock():
    text = mosaic_trace.report(mosaic_trace.parse(_document([_gemm_block(2, 1580, 158)])), clock_ghz=1.58)
    assert "k_loop: 2.00, 1,580 (1.00 µs)" in text and "without regions" in text


@pytest.mark.parametrize("document, message", [
    ([], "expected a JSON object with a 'traceEvents' list"),
    ({"traceEvents": [{"name": "a", "ph": "B", "ts": 1.0, "pid": 1}]}, "event 0 lacks tid"),
    ({"traceEvents": [{"name": "a", "ph": "X", "ts": 1.0, "pid": 1, "tid": 1}]}, "ph='X'"),
    ({"traceEvents": [{"name": "a", "ph": "E", "ts": 1.0, "pid": 1, "tid": 1}]}, "ends region 'a'"),
    ({"traceEvents": [{"name": "a", "ph": "B", "ts": 1.0, "pid": 1, "tid": 1}]}, "never ends ['a']"),
])
def test_what_is_not_a_profiler_trace_is_named(document, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        mosaic_trace.parse(document)


def test_a_trace_of_only_init_regions_has_nothing_to_summarize():
    memory_only = [[[("Init", "B", 0), ("Init", "E", 1)]] * 3]
    with pytest.raises(ValueError, match="no warpgroup ran a region besides the profiler's 'Init'"):
        mosaic_trace.summarize(mosaic_trace.parse(_document(memory_only)))


def test_cli_prints_the_summary_and_writes_json(tmp_path, capsys):
    path = tmp_path / "k-1-trace.json"
    path.write_text(json.dumps(_document([_gemm_block(2, 1000, 100)])))
    out = tmp_path / "summary.json"
    assert mosaic_trace.main([str(path), "--regions", "k_loop,epilogue", "--json", str(out)]) == 0
    assert "k_loop: 2.00, 1,000" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["regions"] == ["k_loop", "epilogue"] and saved["summaries"][str(path)]["traces"] == 2


def test_a_compressed_trace_reads_back_alike(tmp_path):
    import gzip

    document = _document([_gemm_block(2, 1000, 100)])
    path = tmp_path / "k-1-trace.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(document, f)
    assert mosaic_trace.load(str(path)) == mosaic_trace.parse(document)


def test_cli_names_a_bad_file_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert mosaic_trace.main([str(bad)]) == 2
    assert "is not JSON" in capsys.readouterr().err
    assert mosaic_trace.main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mosaic_trace.main([str(bad), "--clock-ghz", "0"])
    assert "--clock-ghz: must be positive" in capsys.readouterr().err


def test_profiling_sets_the_compiler_params_only_inside_its_block():
    assert mu.compiler_params().profile_space == 0
    with mu.profiling("/tmp/traces", ranges=24):
        params = mu.compiler_params()
        assert (params.profile_space, params.profile_dir) == (24, "/tmp/traces")
        with mu.interpret_on_cpu():  # the interpreter has no profiler
            assert mu.compiler_params().profile_space == 0
    assert mu.compiler_params().profile_dir == ""
    with mu.profiling("/tmp/traces", ranges=24, kernels=("rmsnorm_matmul_dx",)):  # that kernel only
        assert mu.compiler_params(kernel_name="rmsnorm_matmul_dx").profile_space == 24
        assert mu.compiler_params(kernel_name="rmsnorm_matmul_fwd").profile_space == 0
    assert isinstance(mu.region("k_loop"), contextlib.AbstractContextManager)
    for bad, message in ((dict(ranges=0), "ranges: must be a positive int"), (dict(directory=""), "directory"),
                         (dict(regions="k_loop"), "regions: must be None or a tuple of region names"),
                         (dict(kernels="rmsnorm_matmul_dx"), "kernels: must be None or a tuple of kernel names")):
        with pytest.raises(ValueError, match=message):
            with mu.profiling(**{"directory": "/tmp/traces", **bad}):
                pass


def _profiler_records(monkeypatch, config, shape=(4352, 1024, 4096), profile=True, regions=None) -> int:
    """Static count of the profiler's shared-memory records (two per region: begin and end) in the GEMM core's
    kernel lowered for CUDA. jax lowers the trace's dump as a host callback, which a CPU backend cannot lower for
    CUDA: replaced by a no-op here (the kernel's module is what is checked)."""
    monkeypatch.setattr(jax.debug, "callback", lambda *args, **kwargs: None)
    M, K, N = shape
    a, b = jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((K, N), jnp.bfloat16)
    jax.clear_caches()
    with backends.lowering_for_gpu():
        if profile:
            with mu.profiling("/tmp/traces", ranges=16, regions=regions):
                (kernel,) = mosaic_ir.lower_kernels(lambda a, b: matmul(a, b, config=config), a, b)
        else:
            (kernel,) = mosaic_ir.lower_kernels(lambda a, b: matmul(a, b, config=config), a, b)
    return kernel.text.count("st.shared.v2.u32")


def test_the_cores_regions_are_recorded_once_each_outside_the_k_loop(monkeypatch):
    stacked = MosaicGemmConfig(tile_m=64, tile_n=256, tile_k=64, num_stages=4, wg_split="m", grid_minor="m")
    # Init, k_loop, epilogue: one begin and one end each in the program text (a region inside the K loop's body
    # would open and close once per step, overflowing the buffer)
    assert _profiler_records(monkeypatch, stacked) == 6
    # stream-K (4352 rows: a last round of 4 tiles) adds its segments' loop and epilogue
    assert _profiler_records(monkeypatch, MosaicGemmConfig(**{**stacked.to_dict(), "stream_k": 4})) == 10
    assert _profiler_records(monkeypatch, stacked, profile=False) == 0
    # only the K loops' regions (the room a kernel with 32 tiles a block leaves: 16 bytes per region)
    assert _profiler_records(monkeypatch, MosaicGemmConfig(**{**stacked.to_dict(), "stream_k": 4}),
                             regions=("k_loop", "stream_k_loop")) == 6


ON_SM90 = mu.is_hopper()


@pytest.mark.skipif(not ON_SM90, reason="Mosaic-GPU kernels run on an sm90 GPU")
def test_on_the_gpu_every_tile_and_segment_leaves_its_regions_and_the_product_is_unchanged(tmp_path):
    from pallas_kernels.gemm import stream_k

    M, K, N = 4352, 1024, 4096  # 34 x 16 tiles of 128x256 on 132 blocks: 4 rounds and 16 tiles of stream-K
    config = MosaicGemmConfig(tile_m=64, tile_n=256, tile_k=64, num_stages=4, wg_split="m", grid_minor="m",
                              stream_k=4)
    ka, kb = jax.random.split(jax.random.key(11))
    a = jax.random.normal(ka, (M, K), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (K, N), jnp.float32).astype(jnp.bfloat16)
    jax.clear_caches()
    with mu.profiling(str(tmp_path), ranges=24):
        got = jax.block_until_ready(jax.jit(lambda a, b: matmul(a, b, config=config))(a, b))
    jax.effects_barrier()
    want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want))) < 1e-2
    (path,) = tmp_path.glob("*-trace.json")
    traces = mosaic_trace.load(str(path))
    blocks = mu.num_sms()
    plan = stream_k.plan_for((M // 128) * (N // 256), blocks, K // 64, split=4)
    assert len(traces) == 3 * blocks
    for wg in (0, 1):  # each compute warpgroup: one k_loop per whole tile, one stream_k_loop per segment
        mine = [t for t in traces if (t.tid - 1) % 3 == wg]
        assert sum(r.name == "k_loop" for t in mine for r in t.regions) == plan.dp_tiles
        assert sum(r.name == "stream_k_loop" for t in mine for r in t.regions) == sum(
            plan.num_segments(u) for u in range(plan.units))
    summary = mosaic_trace.summarize(traces)
    assert summary["without_regions"] == blocks and 0 <= summary["tail"] < 0.5
