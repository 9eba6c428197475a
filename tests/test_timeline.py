"""jaxfuse.timeline: the interval arithmetic on hand-made kernels, and reading a profiler trace (a text XSpace)."""

import pytest

from jaxfuse import timeline

GPU0 = "/device:GPU:0"


def test_overlap_exposed_and_idle():
    # compute [0, 5) and [6, 7) µs on two streams, a collective [4, 8): 1 µs beside compute at 4-5 and at 6-7
    kernels = [("gemm_fusion", 0, 5000), ("loop_add_fusion", 6000, 7000),
               ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 4000, 8000), ("input_reduce_fusion", 10000, 11000)]
    t = timeline.summarize(GPU0, kernels)
    assert t.span_us == pytest.approx(11.0)
    assert t.compute_us == pytest.approx(7.0)
    assert t.collective_us == pytest.approx(4.0)
    assert t.overlapped_us == pytest.approx(2.0)
    assert t.exposed_collective_us == pytest.approx(2.0)
    assert t.idle_us == pytest.approx(2.0)  # 8-10 µs
    assert (t.kernels, t.collectives) == (3, 1)


def test_concurrent_compute_streams_count_once():
    t = timeline.summarize(GPU0, [("a_fusion", 0, 4000), ("b_fusion", 1000, 3000), ("c_fusion", 2000, 6000)])
    assert t.compute_us == pytest.approx(6.0)
    assert t.collective_us == t.overlapped_us == t.idle_us == 0.0


def test_collective_names():
    for name in ("ncclDevKernel_AllGather_RING_LL", "all-reduce-start.3", "reduce-scatter.1", "collective-permute"):
        assert timeline.is_collective(name), name
    for name in ("gemm_fusion_dot.12", "input_reduce_fusion", "nvjet_sm90_tst_128x256", "cudnn_fmha"):
        assert not timeline.is_collective(name), name


def test_bad_kernels_name_the_argument():
    with pytest.raises(ValueError, match="kernels: /device:GPU:0 ran no kernel"):
        timeline.summarize(GPU0, [])
    with pytest.raises(ValueError, match="kernels: 'x' on /device:GPU:0 ends"):
        timeline.summarize(GPU0, [("x", 10, 5)])


_TRACE = '''
planes { id: 1 name: "/host:CPU" lines { id: 1 name: "python" timestamp_ns: 0
  events { metadata_id: 1 offset_ps: 0 duration_ps: 9000000 } } event_metadata { key: 1 value { id: 1 name: "step" } } }
planes { id: 2 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(compute)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 }
    events { metadata_id: 2 offset_ps: 6000000 duration_ps: 1000000 } }
  lines { id: 2 name: "Stream #20(nccl)" timestamp_ns: 1000
    events { metadata_id: 3 offset_ps: 4000000 duration_ps: 4000000 } }
  lines { id: 3 name: "XLA Ops" timestamp_ns: 1000 events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 } }
  event_metadata { key: 1 value { id: 1 name: "gemm_fusion" } }
  event_metadata { key: 2 value { id: 2 name: "loop_add_fusion" } }
  event_metadata { key: 3 value { id: 3 name: "ncclDevKernel_AllReduce_Sum_bf16_RING_LL" } }
}
'''


def test_trace_kernels_reads_device_streams_only():
    from jax import profiler

    kernels = timeline.trace_kernels(profiler.ProfileData.from_text_proto(_TRACE))
    assert list(kernels) == [GPU0]  # the host plane and the "XLA Ops" summary line are left out
    assert sorted(kernels[GPU0]) == [("gemm_fusion", 1000, 6000), ("loop_add_fusion", 7000, 8000),
                                     ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 5000, 9000)]
    t = timeline.summarize(GPU0, kernels[GPU0])
    assert (t.overlapped_us, t.exposed_collective_us) == (pytest.approx(2.0), pytest.approx(2.0))
    assert "| /device:GPU:0 | 8.0 | 6.0 | 4.0 | 2.0 | 2.0 | 0.0 | 2 | 1 |" in timeline.timeline_table([t])


def test_device_timeline_needs_a_gpu_on_cpu():
    import jax
    import jax.numpy as jnp

    if jax.default_backend() == "gpu":
        per_device = timeline.device_timeline(jnp.sin, (jnp.ones((1 << 20,)),), calls=2)
        assert per_device and all(t.compute_us > 0 and t.collective_us == 0 for t in per_device)
    else:
        with pytest.raises(RuntimeError, match="needs a GPU"):
            timeline.device_timeline(jnp.sin, (jnp.ones((8,)),), calls=1, warmup=1)
    with pytest.raises(ValueError, match="calls: expected a positive int, got 0"):
        timeline.device_timeline(jnp.sin, (jnp.ones((8,)),), calls=0)
