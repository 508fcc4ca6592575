"""The pretrain stage as a process: resume after SIGKILL ≡ uninterrupted, fresh on change, NaN stops."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import micro_params, run, tree_bytes, write_params
from pretrain_runs import command, history
from resume import assert_same_outputs, killed_and_whole

from stagelm.infra.files import read_json
from stagelm.model.modeldir import load_model
from stagelm.train.checkpoints import HASHES

pytestmark = pytest.mark.slow


def params_of(out: Path) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(load_model(out / "model"))]


LONG = {"steps": 120, "checkpoint_every": 10, "eval_every": 30, "log_every": 10}


def test_killed_run_resumes_bitwise(micro_data, tmp_path):
    killed, whole, resumed = killed_and_whole(tmp_path, micro_params(training=LONG), lambda w: command(micro_data, w))
    step = int(resumed.split("resuming from step ")[1].split()[0])
    assert 0 < step < LONG["steps"]
    assert history(killed / "out") == history(whole / "out")
    assert all(len(v) == len({s for s, _ in v}) for v in history(killed / "out").values())  # no step twice
    assert_same_outputs(killed, whole, "model")  # the same weights, and for DVC the same model
    ma, mb = read_json(killed / "out/metrics.json"), read_json(whole / "out/metrics.json")
    for key in ("train_loss", "val_loss", "tokens_seen", "step"):
        assert ma[key] == mb[key]
    prov = read_json(killed / "out/provenance.json")
    assert prov["resumed_from"] == step and prov["stage"] == "pretrain"


def test_changed_lr_starts_fresh_and_same_params_resume(micro_data, tmp_path):
    write_params(tmp_path / "params.yaml", micro_params())
    first = run(command(micro_data, tmp_path), tmp_path)
    assert "starting fresh at step 0: no checkpoint yet" in first.stdout
    metrics = (tmp_path / "out/metrics.json").read_bytes()
    (tmp_path / "out/metrics.json").unlink()  # what `dvc repro -f` does before it reruns the stage
    again = run(command(micro_data, tmp_path), tmp_path)
    assert "resuming from step 12" in again.stdout  # the final checkpoint: nothing left to train
    # ... and its metrics come back as the run wrote them, timings too (saved with the checkpoint)
    assert (tmp_path / "out/metrics.json").read_bytes() == metrics
    assert read_json(tmp_path / "out/metrics.json")["tokens_per_sec"] > 0
    write_params(tmp_path / "params.yaml", micro_params(training={"lr": 1e-3}))
    changed = run(command(micro_data, tmp_path), tmp_path)
    assert "starting fresh at step 0: checkpoints exist only for other fingerprints" in changed.stdout
    write_params(tmp_path / "params.yaml", micro_params(training={"log_every": 3, "checkpoint_every": 6}))
    execution_only = run(command(micro_data, tmp_path), tmp_path)
    assert "resuming from step 12" in execution_only.stdout


def test_best_and_latest_checkpoints_are_kept(micro_data, tmp_path):
    write_params(
        tmp_path / "params.yaml",
        micro_params(training={"steps": 24, "checkpoint_every": 4, "eval_every": 4, "keep_checkpoints": 1}),
    )
    run(command(micro_data, tmp_path), tmp_path)
    (fp_dir,) = (tmp_path / "ckpt").iterdir()
    kept = sorted(int(p.name) for p in fp_dir.iterdir() if p.name.isdigit())
    vals = {int(s): float(v) for s, v in history(tmp_path / "out")["val/loss.tsv"]}
    best = min(vals, key=vals.get)
    assert kept == sorted({24, best})


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(micro_data, tmp_path):
    write_params(
        tmp_path / "params.yaml",
        micro_params(training={"lr": 1e30, "grad_clip": 0.0, "warmup_steps": 0, "checkpoint_every": 1}),
    )
    result = run(command(micro_data, tmp_path), tmp_path, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    match = re.match(r"error: training: loss is (nan|inf) at step (\d+); last good checkpoint: step (\d+) in ", line)
    assert match, line
    bad, good = int(match.group(2)), int(match.group(3))
    assert good == bad - 1
    (fp_dir,) = (tmp_path / "ckpt").iterdir()
    assert (fp_dir / str(good)).is_dir() and not (fp_dir / str(bad)).exists()
    assert not (tmp_path / "out/model").exists()


def test_bad_params_fail_before_compute(micro_data, tmp_path):
    write_params(tmp_path / "params.yaml", micro_params(training={"lr": "fast"}))
    result = run(command(micro_data, tmp_path), tmp_path, check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: training.lr: expected a positive float, got 'fast'"


def test_a_damaged_checkpoint_is_refused_and_an_unfinished_one_removed(micro_data, tmp_path):
    write_params(tmp_path / "params.yaml", micro_params())  # checkpoints at steps 8 and 12 are kept
    run(command(micro_data, tmp_path), tmp_path)
    model = tree_bytes(tmp_path / "out/model")
    (fp_dir,) = (tmp_path / "ckpt").iterdir()
    last = fp_dir / "12"
    biggest = max((p for p in last.rglob("*") if p.is_file() and p.name != HASHES), key=lambda p: p.stat().st_size)
    original = biggest.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    name = biggest.relative_to(last)
    for damaged, what in ((bytes(flipped), "a flipped bit"), (original[: len(original) // 2], "truncated")):
        biggest.write_bytes(damaged)
        result = run(command(micro_data, tmp_path), tmp_path, check=False)
        assert result.returncode == 2, what
        (line,) = result.stderr.strip().splitlines()
        assert line == (
            f"error: {last}: checkpoint file {name} sha256 differs from the one saved (truncated or damaged); "
            f"delete {last} to resume from the checkpoint before it, or {fp_dir} to start over"
        ), what
        assert tree_bytes(tmp_path / "out/model") == model  # nothing written
    biggest.write_bytes(original)
    (last / HASHES).unlink()  # as a run killed between Orbax's save and the hashes leaves it
    resumed = run(command(micro_data, tmp_path), tmp_path)
    assert f"checkpoint {last}: not finished saving when the run stopped; removed" in resumed.stdout
    assert "resuming from step 8" in resumed.stdout
    assert tree_bytes(tmp_path / "out/model") == model  # resumed ≡ uninterrupted
