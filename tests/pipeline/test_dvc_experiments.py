"""`dvc exp` on a micro copy of the project: an experiment run and compared, a bad one, a queue.

Apart from tests/pipeline/test_dvc_repro.py (the same built project, made once a run) so that the
two modules' long items run on both xdist workers; conftest's SLOWEST_FIRST hands it out after that
file, which builds the project, and the interop one, by when the build is done.
"""

import json
import subprocess

import pytest
import yaml
from conftest import env_with_venv, micro_params, run

from stagelm.infra.files import read_json

MODELS = ("pretrain", "sft", "distill", "distill_control", "grpo", "dpo")  # as dvc.yaml's `models` var lists them
EXPORTED = ("pretrain", "sft", "distill", "grpo", "dpo")  # the control is measured, not shipped
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
    ran = {line.split("'")[1] for line in out.stdout.splitlines() if line.startswith("Running stage")}
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


def test_queued_experiments_both_finish_and_differ(project, tmp_path):
    # eval.* reruns only the evals, the exports (each carries its model's best temperature) and the report:
    # two queued experiments cost two short runs
    (project / "notes.txt").write_text("a new file, staged before queueing\n")
    run(["git", "add", "notes.txt"], project)
    # The code as queued is the code that runs: the stash holds an edit of a module only the evals import,
    # undone in the workspace before the run. Each eval must import the experiment's copy (dvc.yaml's
    # PYTHONPATH=src), not the tree the editable install points at.
    module = project / "src/stagelm/measure/evaluation.py"
    module.write_text(module.read_text() + '\nprint(f"evaluation module: {__file__}")\n')
    for n in (10, 20):
        run(["dvc", "exp", "run", "--queue", "-n", f"eval{n}", "-S", f"eval.max_examples={n}"], project)
    run(["git", "checkout", "--", "src/stagelm/measure/evaluation.py"], project)
    # Into a file, not a pipe: the queue's worker inherits the command's output and outlives it
    # by its idle timeout (10 s), so a pipe would stay open, and the test wait, until it exits.
    log = tmp_path / "run-all.log"
    with log.open("w") as out:
        cmd = ["dvc", "exp", "run", "--run-all", "--jobs", "1"]
        done = subprocess.run(cmd, cwd=project, env=env_with_venv(), stdout=out, stderr=subprocess.STDOUT, timeout=900)
    followed = log.read_text()  # each experiment's own log, one after the other
    assert done.returncode == 0, followed
    ran = [line.split("'")[1] for line in followed.splitlines() if line.startswith("Running stage")]
    exported = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]["export"]["foreach"]
    each = ["params", *(f"eval@{m}" for m in MODELS), *(f"export@{m}" for m in exported), "report"]
    assert sorted(ran) == sorted(2 * each), ran  # an eval.* edit runs these, nothing else
    imported = [line.split(": ", 1)[1] for line in followed.splitlines() if line.startswith("evaluation module: ")]
    assert len(imported) == 2 * len(MODELS) and all(".dvc/tmp/exps/" in path for path in imported), imported
    shown = json.loads(run(["dvc", "exp", "show", "--json"], project).stdout)
    revs = [r for e in shown[1]["experiments"] for r in e["revs"]]
    by_name = {r["name"]: r["data"]["metrics"]["runs/eval/pretrain/metrics.json"]["data"] for r in revs}
    assert set(by_name) == {"eval10", "eval20"}
    families = len(micro_params()["data"]["families"])
    assert (by_name["eval10"]["chat"]["n"], by_name["eval20"]["chat"]["n"]) == (10 * families, 20 * families)


def test_lm_eval_tasks_rerun_only_the_evals_and_what_reads_them(project):
    # The task ships in inputs/lm_eval/ (benchmarks/lm_eval_example_task.py wrote it), so the
    # built project's download and pretrain already hashed it: naming it reruns only eval@M and
    # the stages that read eval's metrics (export@M takes its sampling default from them, the report).
    task = "inputs/lm_eval/arith_cloze.yaml"
    edits = ["-S", f"eval.lm_eval_tasks=[{task}]", "-S", "eval.lm_eval_limit=40"]
    out = run(["dvc", "exp", "run", "-n", "lmeval", *edits], project)
    ran = {line.split("'")[1] for line in out.stdout.splitlines() if line.startswith("Running stage")}
    evals = {f"eval@{m}" for m in MODELS}
    assert ran == {"params", "report"} | evals | {f"export@{m}" for m in EXPORTED}
    diff = json.loads(run(["dvc", "metrics", "diff", "HEAD", "--json"], project).stdout)
    for m in MODELS:
        changed = diff[f"runs/eval/{m}/metrics.json"]
        assert set(changed) == {
            f"lm_eval.arith_cloze.{k}" for k in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "samples")
        }
        assert (
            changed["lm_eval.arith_cloze.samples"]["new"] == 40 and 0 <= changed["lm_eval.arith_cloze.acc"]["new"] <= 1
        )
    assert "### lm-eval tasks" in (project / "runs/report.md").read_text()
