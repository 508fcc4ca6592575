"""`dvc exp` on a micro copy of the project: an experiment run and compared, and a bad one.

The DVC tests share one built project (conftest's `built_project`, made once a run) and are split
into files of one or a few long tests: this one, test_dvc_queue.py (a queue of experiments),
test_dvc_lm_eval.py (lm-eval tasks in the evals) and test_dvc_repro.py. `--dist loadfile` runs a
file on one xdist worker, and as one file these took about 600 s, started only once the build was
done. conftest's SLOWEST_FIRST hands them out after test_dvc_repro.py, which builds the project,
and the interop one.
"""

import json

import pytest
from conftest import micro_params, run
from dvc_stages import EXPORTED, MODELS, stages_ran

from stagelm.infra.files import read_json

PRETRAIN_LR = "runs/pretrain/plots/metrics/train/lr.tsv"

pytestmark = pytest.mark.slow


def test_experiment_runs_and_compares(project):
    # One experiment for two checks: the user's flow, and what a tokenizer change reruns. BPE
    # trained on about half the micro corpus: other merges, every stage below reruns, and the
    # vocabulary (so every shape) is the same, so the stages load the executables the built
    # project compiled from the session's JAX cache rather than compile their own.
    # DVC writes 5e-5 into params.yaml as `5e-05`: a float in YAML 1.2 (DVC's reading and ours), a
    # string in YAML 1.1, which refused it; every rate below 1e-4 was out of reach of `dvc exp run`.
    edits = ["-S", "training.lr=5e-5", "-S", "tokenizer.max_train_chars=60000"]
    out = run(["dvc", "exp", "run", "-n", "lr5e5", *edits], project)
    ran = set(stages_ran(out.stdout))
    downstream = {"sft", "distill", "distill_control", "grpo", "dpo", "benchmark", "report"}
    downstream |= {f"{kind}@{m}" for kind in ("eval", "sample") for m in MODELS} | {f"export@{m}" for m in EXPORTED}
    assert ran == {"params", "tokenizer", "pack", "pretrain"} | downstream
    shown = json.loads(run(["dvc", "exp", "show", "--json"], project).stdout)
    baseline = shown[1]
    experiment = baseline["experiments"][0]["revs"][0]
    for rev in (baseline, experiment):
        metrics = rev["data"]["metrics"]
        assert metrics["runs/pretrain/metrics.json"]["data"]["val_loss"] > 0
        assert metrics["runs/eval/sft/metrics.json"]["data"]["accuracy"] >= 0
    assert "lr: 5e-05" in (project / "params.yaml").read_text()  # as DVC wrote it
    assert experiment["data"]["params"]["params.yaml"]["data"]["training"]["lr"] == 5e-5
    assert read_json(project / "runs/pretrain/provenance.json")["params"]["training"]["lr"] == 5e-5
    rates = [float(line.split("\t")[1]) for line in (project / PRETRAIN_LR).read_text().splitlines()[1:]]
    assert max(rates) == pytest.approx(5e-5) and len(rates) == micro_params()["training"]["steps"]  # trained at it
    diff = run(["dvc", "metrics", "diff", "HEAD", "--json"], project).stdout
    assert "runs/pretrain/metrics.json" in json.loads(diff)
    params = json.loads(run(["dvc", "params", "diff", "HEAD", "--json"], project).stdout)
    assert params["params.yaml"]["training.lr"]["new"] == 5e-5
    run(["dvc", "plots", "diff", "HEAD", "lr5e5", "-o", "plots_diff"], project)
    page = (project / "plots_diff/index.html").read_text()
    assert "lr5e5" in page and "HEAD" in page and "runs/pretrain/plots/metrics/train/loss.tsv" in page
    assert "cdn.jsdelivr" not in page and "/* vega 5.33.1 */" in page


def test_bad_experiment_fails_at_once_with_the_params_line(project):
    result = run(["dvc", "exp", "run", "-S", "training.lr=fast"], project, check=False)
    assert result.returncode != 0
    assert "error: training.lr: expected a positive float, got 'fast'" in result.stdout + result.stderr
    assert "Running stage 'params'" in result.stdout and "Traceback" not in result.stdout + result.stderr
    assert "Running stage 'pretrain'" not in result.stdout  # the params stage stopped the run first
