"""The benchmark stage: stable keys, raw samples, summaries, and bad params."""

import json
import sys

import pytest
from conftest import ROOT, micro_params, run, run_in_process, write_params

from stagelm.measure.benchmark import summary, timed

KEYS = [
    ("train", "tokens_per_sec"),
    ("train", "first_call_seconds"),
    ("train", "matmul_fraction"),
    ("decode", "cached_b1", "tokens_per_sec"),
    ("decode", "cached_b8", "tokens_per_sec"),
    ("decode", "naive_b1", "tokens_per_sec"),
    ("loader", "tokens_per_sec"),
]


def test_summary_has_no_p99_below_20_samples():
    assert set(summary([3.0, 1.0, 2.0])) == {"min", "median", "max", "n"}
    assert summary([3.0, 1.0, 2.0])["median"] == 2.0
    assert "p99" in summary([float(i) for i in range(20)])


def test_timed_runs_warmup_then_repetitions():
    calls = []
    samples = timed(lambda: calls.append(1), warmup=2, reps=5)
    assert len(calls) == 7 and len(samples) == 5 and all(s >= 0 for s in samples)


def benchmark_command(micro_data, work):
    return [
        sys.executable,
        str(ROOT / "stages/benchmark.py"),
        "--params",
        str(work / "params.yaml"),
        "--packed",
        str(micro_data / "packed/train"),
        "--out",
        str(work / "out"),
    ]


@pytest.mark.slow
def test_benchmark_stage_writes_stable_keys_and_raw_samples(micro_data, tmp_path):
    params = micro_params()
    write_params(tmp_path / "params.yaml", params)
    out = run(benchmark_command(micro_data, tmp_path), tmp_path)
    assert out.stdout.startswith("benchmark: train ")
    metrics = json.loads((tmp_path / "out/metrics.json").read_text())
    assert metrics["schema_version"] == 2
    for path in KEYS:
        value = metrics
        for key in path:
            value = value[key]
        assert isinstance(value, float) and value > 0, path
    assert 0 < metrics["train"]["matmul_fraction"] < 1.5  # against a matmul measured in the same run
    assert metrics["train"]["mfu"] is None  # MFU only against a published peak: a CPU has none
    assert "no published peak" in out.stdout and "MFU" not in out.stdout
    env = metrics["environment"]
    assert env["backend"] == "cpu" and env["device_count"] >= 1 and env["jax"] and env["threads"] >= 1
    assert "commit" in metrics  # None here: the work dir is no git checkout (the pipeline test has one)
    assert "torch" not in metrics and "PyTorch" not in out.stdout  # benchmark.torch_peer false: not timed, torch or not
    reps, naive_reps = params["benchmark"]["repetitions"], params["benchmark"]["naive_repetitions"]
    samples = [json.loads(line) for line in (tmp_path / "out/samples.jsonl").read_text().splitlines()]
    by_measure = {}
    for s in samples:
        by_measure.setdefault(s["measure"], []).append(s["value"])
    naive = {f"decode.naive_b{b}.tokens_per_sec" for b in (1, 8)}
    assert naive < set(by_measure) and naive_reps < reps
    assert all(len(v) == (naive_reps if name in naive else reps) for name, v in by_measure.items())
    steps = sorted(by_measure["train.step_seconds"])
    assert metrics["summaries"]["train.step_seconds"]["median"] == pytest.approx((steps[4] + steps[5]) / 2)
    assert metrics["summaries"]["train.step_seconds"]["min"] == steps[0]
    assert "p99" not in metrics["summaries"]["train.step_seconds"]  # 10 samples: no p99
    assert metrics["decode"]["speedup_b1"] > 1  # the cache beats recomputing the prefix
    loader = metrics["loader"]
    assert loader["margin_over_train"] == pytest.approx(loader["tokens_per_sec"] / metrics["train"]["tokens_per_sec"])
    assert metrics["memory"]["host_peak_rss_bytes"] > 0


@pytest.mark.slow
def test_benchmark_bad_params_fail_in_one_line(micro_data, tmp_path, capsys):
    write_params(tmp_path / "params.yaml", micro_params(benchmark={"repetitions": 3}))
    code, stderr = run_in_process(benchmark_command(micro_data, tmp_path), capsys)
    assert code == 2
    (line,) = stderr.strip().splitlines()
    assert "benchmark.repetitions: expected an int >= 10" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_benchmark_needs_a_naive_repetition(micro_data, tmp_path, capsys):
    write_params(tmp_path / "params.yaml", micro_params(benchmark={"naive_repetitions": 0}))
    code, stderr = run_in_process(benchmark_command(micro_data, tmp_path), capsys)
    assert code == 2
    (line,) = stderr.strip().splitlines()
    assert line == "error: benchmark.naive_repetitions: expected a positive int, got 0"
    assert not (tmp_path / "out").exists()


def test_a_profile_groups_ops_by_kind_and_counts_a_loop_once():
    """The device time of a step by XLA op kind: numbered ops of one kind add up, and the `while`
    op holding the micro-batches' body (whose ops the trace lists too) is not counted twice."""
    from stagelm.measure.microbench import op_breakdown

    seconds = {
        "%while.6 = (s32[], f32[]) while(%tuple.3), condition=%cond, body=%body": 1.0,
        "%fusion.12 = f32[2,2048]{1,0} fusion(%p.1), kind=kLoop": 0.3,
        "%fusion.7 = bf16[8]{0} fusion(%p.2), kind=kOutput": 0.2,
        '%splash_mha_fwd_segmented_residuals.3 = (f32[4]) custom-call(%q), custom_call_target="tpu_custom_call"': 0.4,
        "%copy.1 = f32[4]{0} copy(%x)": 0.1,
    }
    profile = op_breakdown(seconds)
    assert profile["device_seconds"] == pytest.approx(1.0)
    assert profile["shares"] == {"fusion": 0.5, "splash_mha_fwd_segmented_residuals": 0.4, "copy": 0.1}
    assert list(profile["shares"]) == ["fusion", "splash_mha_fwd_segmented_residuals", "copy"]
    # the largest op of each kind, ranked as its kind, with its HLO text (shapes and layouts); no `while`
    assert [(text.split(" = ")[0], share) for text, share in profile["top_ops"]] == [
        ("%fusion.12", 0.3),
        ("%splash_mha_fwd_segmented_residuals.3", 0.4),
        ("%copy.1", 0.1),
    ]
    assert profile["top_ops"][0][0].startswith("%fusion.12 = f32[2,2048]{1,0}")


def test_mfu_is_against_the_published_peak_and_the_matmul_figure_is_named_apart(monkeypatch):
    """A device with a published peak: `train.mfu` is the model's FLOPs over that peak, whatever
    the in-run matmul reached; the matmul-relative figure (here above 1) is `matmul_fraction`."""
    import stagelm.measure.benchmark as benchmark
    from stagelm.model.decoder import flops_per_token
    from stagelm.pipeline.params import load_section

    cfg = load_section(micro_params(), "benchmark")
    samples = {
        "train.tokens_per_sec": [1e5],
        "train.step_seconds": [0.1],
        "matmul.flops_per_sec": [1e9],
        "loader.batches_per_sec": [1e3],
        "loader.tokens_per_sec": [1e7],
        **{f"decode.{k}_b{b}.tokens_per_sec": [100.0] for k in ("cached", "naive") for b in (1, 8)},
        **{f"decode.cached_b{b}.prefill_seconds": [0.01] for b in (1, 8)},
    }
    flops = 1e5 * flops_per_token(benchmark.decoder_config(cfg), cfg.seq_len)
    monkeypatch.setattr(benchmark, "peak_flops", lambda dtype: 1e15)
    train = benchmark.benchmark_metrics(cfg, samples, 1.0)["train"]
    assert train["mfu"] == pytest.approx(flops / 1e15) and train["mfu"] <= 1
    assert train["matmul_fraction"] == pytest.approx(flops / 1e9) and train["matmul_fraction"] > 1
    lines = benchmark.benchmark_lines(benchmark.benchmark_metrics(cfg, samples, 1.0))
    assert f"MFU {flops / 1e15:.1%} of the device's published peak" in lines[0]
