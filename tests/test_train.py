"""jaxfuse.train and `jaxfuse train` on CPU: corpus, batches, learning, equal curves across kernel sets."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CPU_ONLY
from jaxfuse import KernelSet, cli, kernels, train

_TINY = dict(batch=4, seq=32, dim=64, heads=4, kv_heads=2, layers=1, dtype="float32", timing_iterations=2)


def test_default_corpus_is_the_toolkits_own_source():
    data = train.load_corpus()
    assert data.dtype == np.uint8 and len(data) > 100_000
    assert b"def linear_cross_entropy(" in data.tobytes() and b"def train(" in data.tobytes()


def test_sample_batch_labels_are_the_next_bytes():
    data = np.random.default_rng(1).integers(0, 256, 5000).astype(np.uint8)
    tokens, labels = train.sample_batch(data, 6, 40, np.random.default_rng(0))
    assert tokens.shape == labels.shape == (6, 40) and tokens.dtype == labels.dtype == np.int32
    text = data.tobytes()
    for row_tokens, row_labels in zip(tokens, labels):
        window = bytes(row_tokens.astype(np.uint8)) + bytes(row_labels[-1:].astype(np.uint8))
        assert window in text  # a real window of the corpus, labels = the bytes that follow
        np.testing.assert_array_equal(row_labels[:-1], row_tokens[1:])
    assert len({tuple(row) for row in tokens}) == 6  # random windows, not one repeated


def test_corpus_errors_name_the_constraint(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("x" * 200)
    with pytest.raises(ValueError, match=r"200 bytes is too short for seq=64.*65 bytes"):
        train.train(train.TrainConfig(steps=1, **{**_TINY, "seq": 64}), corpus=train.load_corpus(str(short)))
    with pytest.raises(ValueError, match="no such file"):
        train.load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match=r"TrainConfig.steps: expected a positive int, got 0"):
        train.TrainConfig(steps=0)


def test_a_corpus_that_is_not_utf8_text_is_refused(tmp_path, capsys):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"hello\n\xd0\xff\x00" * 100)
    with pytest.raises(ValueError, match=r"corpus: '.*weights.bin' is not UTF-8 text \(byte 0xd0 at offset 6\)"):
        train.load_corpus(str(binary))
    assert cli.main(["train", "--steps", "2", "--corpus", str(binary)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxfuse train: corpus: {str(binary)!r} is not UTF-8 text (byte 0xd0 at offset 6); "
                          "expected a UTF-8 text file\n") and "step 0" not in err


@CPU_ONLY  # wall-clock step times and float32 matmuls as IEEE (a GPU's default to TF32)
@pytest.mark.slow
def test_training_learns_and_equivalent_kernel_sets_give_the_same_curve():
    cfg = train.TrainConfig(steps=40, eval_every=20, **{**_TINY, "batch": 8, "seq": 64})
    base, f32 = train.compare([KernelSet(), KernelSet.parse("all=xla_f32")], cfg)
    assert [step for step, _ in base.eval_loss] == [0, 20, 40]
    start, end = base.eval_loss[0][1], base.eval_loss[-1][1]
    assert end < start - 1.5 and end < 4.0  # from ~6 nats per byte (random init) to a model of the text
    assert len(base.train_loss) == 40 and all(np.isfinite(base.train_loss)) and not base.stopped
    assert max(abs(a - b) for a, b in zip(base.train_loss, f32.train_loss)) < 1e-4  # float32: same numerics
    assert base.step_time_us > 0 and base.timing == "wall" and base.tokens_per_step == 8 * 64
    table = train.comparison_table([base, f32])
    assert "attention=xla_f32,norm_matmul=xla_f32,loss=xla_f32" in table
    assert "host wall clock" in table


@CPU_ONLY  # its 1e-4 bound is IEEE float32's; test_kernel_sites compares each site on a GPU at its precision
@pytest.mark.slow
def test_pallas_sites_train_like_xla():
    cfg = train.TrainConfig(steps=3, eval_every=3, eval_batches=1, **{**_TINY, "batch": 2, "heads": 2,
                                                                       "kv_heads": 1})
    base, fused = train.compare([KernelSet(), KernelSet.parse("all=pallas")], cfg)
    assert max(abs(a - b) for a, b in zip(base.train_loss, fused.train_loss)) < 1e-4
    assert abs(base.eval_loss[-1][1] - fused.eval_loss[-1][1]) < 1e-4


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run():
    kernels.register("loss", "test_nan", lambda h, w, labels: jnp.nan * jnp.sum(h.astype(jnp.float32)))
    try:
        result = train.train(train.TrainConfig(steps=6, eval_every=3, **_TINY), KernelSet(loss="test_nan"))
    finally:
        del kernels.LOSS["test_nan"]
    assert result.stopped == "non-finite loss at or before step 3"
    assert len(result.train_loss) == 3 and [s for s, _ in result.eval_loss] == [0]
    assert "non-finite" in train.comparison_table([result])


@CPU_ONLY  # the environment it checks is the CPU's
@pytest.mark.slow
def test_cli_train_writes_and_prints_json(tmp_path, capsys):
    out = tmp_path / "runs" / "train.json"
    argv = ["train", "--steps", "4", "--batch", "2", "--seq", "16", "--dim", "32", "--heads", "2", "--kv-heads", "1",
            "--layers", "1", "--dtype", "f32", "--eval-every", "2", "--kernels", "", "--kernels", "loss=xla_f32",
            "--json", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert [r["kernels"] for r in printed["runs"]] == ["attention=xla,norm_matmul=xla,loss=xla",
                                                       "attention=xla,norm_matmul=xla,loss=xla_f32"]
    assert printed["config"]["steps"] == 4 and printed["environment"]["backend"] == "cpu"
    assert all(len(r["train_loss"]) == 4 and r["tokens_per_s"] > 0 for r in printed["runs"])


def test_cli_train_bad_flags_exit_2_with_one_line(capsys):
    assert cli.main(["train", "--dim", "100", "--heads", "3"]) == 2
    assert "dim: must be divisible by n_heads=3" in capsys.readouterr().err
    assert cli.main(["train", "--kernels", "attention=nope"]) == 2
    assert "unknown implementation 'nope'" in capsys.readouterr().err
    assert cli.main(["train", "--warmup", "500", "--steps", "10"]) == 2
    err = capsys.readouterr().err
    assert "step 0" not in err and err.startswith("jaxfuse train: TrainConfig.warmup: expected fewer warmup steps than "
                                                  "steps=10, got 500 (the learning rate would never reach its peak)\n")


def _run(kernels: str, iqr_ms: tuple[float, float], median_ms: float, losses=tuple(range(20)), window=7):
    """A TrainResult with a given step-time median and interquartile range (ms) and train losses."""
    return train.TrainResult(kernels=kernels, description="d", train_loss=tuple(float(x) for x in losses),
                             eval_loss=((0, 5.0), (len(losses), 3.0)), step_time_us=median_ms * 1e3, timing="wall",
                             tokens_per_step=100, n_params=1, wall_s=1.0,
                             step_time_iqr_us=(iqr_ms[0] * 1e3, iqr_ms[1] * 1e3), train_loss_window=window)


def test_speedups_within_the_spread_are_marked_as_noise():
    base = _run("base", (10.0, 12.0), 11.0)
    rows = train.comparison_table([base, _run("same", (10.5, 12.5), 11.4), _run("twice", (5.2, 5.8), 5.5),
                                   _run("slower", (12.1, 13.0), 12.5)]).splitlines()
    assert "'within noise' where the two IQRs overlap" in rows[1]
    table = {row.split()[0]: row for row in rows[5:]}
    assert table["base"].endswith("10.00-12.00  9,091     1.00x")
    assert table["same"].endswith("0.96x (within noise)")
    assert table["twice"].endswith("2.00x") and table["slower"].endswith("0.88x")
    assert train.within_noise(base, base) and not train.within_noise(base, _run("x", (12.01, 13.0), 12.5))


def test_the_train_loss_is_one_quantity_everywhere():
    run = _run("base", (1.0, 1.0), 1.0, losses=range(20), window=7)
    assert run.final_train_loss == sum(range(13, 20)) / 7
    table = train.comparison_table([run])
    assert "train loss: mean of the last 7 steps" in table
    assert f"  {run.final_train_loss:.4f}  " in table.splitlines()[-1]
    assert run.to_dict()["final_train_loss"] == run.final_train_loss
    assert train.TrainConfig(steps=100, eval_every=50).loss_window == 50
    assert train.TrainConfig(steps=30, eval_every=50).loss_window == 30


def test_warmup_is_shorter_than_the_run():
    assert train.TrainConfig().warmup == 20 and train.TrainConfig(steps=6).warmup == 3
    assert train.TrainConfig(steps=1).warmup == 0 and train.TrainConfig(steps=10, warmup=9).warmup == 9
    with pytest.raises(ValueError, match=r"TrainConfig.warmup: expected fewer warmup steps than steps=10, got 500"):
        train.TrainConfig(steps=10, warmup=500)
    with pytest.raises(ValueError, match=r"TrainConfig.warmup: expected fewer warmup steps than steps=10, got 10"):
        train.TrainConfig(steps=10, warmup=10)


@pytest.mark.slow
def test_two_identical_kernel_sets_report_no_speedup_outside_the_noise(capsys):
    """The same kernels twice: the step times are timed interleaved and the table never claims a speedup that
    their spread does not support; the progress lines and the table report the same train loss."""
    argv = ["train", "--steps", "6", "--eval-every", "4", "--batch", "2", "--seq", "16", "--dim", "32", "--heads",
            "2", "--kv-heads", "1", "--layers", "1", "--dtype", "f32", "--kernels", "", "--kernels", ""]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "timing the training step of 2 kernel sets, 40 steps each (fewer past 30 s), interleaved" in err
    last = [line for line in err.splitlines() if "step 6: train loss" in line]
    assert len(last) == 2 and all("(mean of the last 4 steps)" in line for line in last)
    loss = last[0].split("train loss ")[1].split()[0]
    assert "train loss: mean of the last 4 steps" in out
    rows = out.splitlines()[-2:]
    assert all(f"  {loss}  " in row for row in rows)
    assert rows[0].endswith("1.00x") and rows[1].endswith("(within noise)"), out
