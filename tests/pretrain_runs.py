"""The pretrain stage run as a process, and two runs' outputs compared: shared by the resume,
multi-process and SLURM tests."""

import csv
import sys
from pathlib import Path

import jax
import numpy as np
from conftest import ROOT

from stagelm.model.modeldir import load_model


def command(data: Path, work: Path, checkpoints: str = "ckpt") -> list[str]:
    return [
        sys.executable,
        str(ROOT / "stages/pretrain.py"),
        "--params",
        str(work / "params.yaml"),
        "--train",
        str(data / "packed/train"),
        "--val",
        str(data / "packed/val"),
        "--tokenizer",
        str(data / "tokenizer/tokenizer.json"),
        "--out",
        str(work / "out"),
        "--checkpoints",
        str(work / checkpoints),
    ]


def history(out: Path) -> dict[str, list[tuple[str, str]]]:
    """Every plotted metric except timings: name → [(step, value)]."""
    rows = {}
    for tsv in sorted((out / "plots/metrics").rglob("*.tsv")):
        name = str(tsv.relative_to(out / "plots/metrics"))
        if name.startswith("perf/"):
            continue
        with tsv.open() as f:
            rows[name] = [(r["step"], r[Path(name).stem]) for r in csv.DictReader(f, delimiter="\t")]
    return rows


def assert_trained_alike(a: Path, b: Path) -> None:
    """Two training runs' outputs (metrics history, model) agree to rounding: every plotted
    metric at the same steps within 1e-4 (relative), every param within 1e-5."""
    history_a, history_b = history(a), history(b)
    assert history_a.keys() == history_b.keys() and "train/loss.tsv" in history_a
    for name in history_a:
        steps_a, values_a = zip(*history_a[name], strict=True)
        steps_b, values_b = zip(*history_b[name], strict=True)
        assert steps_a == steps_b, name
        np.testing.assert_allclose(np.float64(values_a), np.float64(values_b), rtol=1e-4, err_msg=name)
    leaves = [jax.tree.leaves(load_model(out / "model")) for out in (a, b)]
    for x, y in zip(*leaves, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)
