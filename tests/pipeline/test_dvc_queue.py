"""`dvc exp run --queue` on a micro copy of the project: two queued experiments, each run from
the code as it was queued, one of them naming an lm-eval task. Its own file so that xdist can run
it beside the other DVC files (tests/pipeline/test_dvc_experiments.py says why)."""

import json
import subprocess

import pytest
import yaml
from conftest import env_with_venv, micro_params, run
from dvc_stages import MODELS, stages_ran

pytestmark = pytest.mark.slow

# Ships in inputs/lm_eval/ (benchmarks/lm_eval_example_task.py wrote it), so the built project's
# download and pretrain already hashed it: naming it reruns only what an eval.* edit reruns.
TASK = "inputs/lm_eval/arith_cloze.yaml"
LM_EVAL_KEYS = {f"lm_eval.arith_cloze.{k}" for k in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "samples")}


def test_queued_experiments_both_finish_and_differ(project, tmp_path):
    # An eval.* edit reruns only the evals, the exports (each carries its model's best temperature
    # from eval's metrics) and the report: two queued experiments cost two short runs.
    (project / "notes.txt").write_text("a new file, staged before queueing\n")
    run(["git", "add", "notes.txt"], project)
    # The code as queued is the code that runs: the stash holds an edit of a module only the evals import,
    # undone in the workspace before the run. Each eval must import the experiment's copy (dvc.yaml's
    # PYTHONPATH=src), not the tree the editable install points at.
    module = project / "src/stagelm/measure/evaluation.py"
    module.write_text(module.read_text() + '\nprint(f"evaluation module: {__file__}")\n')
    run(["dvc", "exp", "run", "--queue", "-n", "eval10", "-S", "eval.max_examples=10"], project)
    lm_eval = ["-S", f"eval.lm_eval_tasks=[{TASK}]", "-S", "eval.lm_eval_limit=40", "-S", "eval.max_examples=20"]
    run(["dvc", "exp", "run", "--queue", "-n", "lmeval", *lm_eval], project)
    run(["git", "checkout", "--", "src/stagelm/measure/evaluation.py"], project)
    # Into a file, not a pipe: the queue's worker inherits the command's output and outlives it
    # by its idle timeout (10 s), so a pipe would stay open, and the test wait, until it exits.
    log = tmp_path / "run-all.log"
    with log.open("w") as out:
        cmd = ["dvc", "exp", "run", "--run-all", "--jobs", "1"]
        done = subprocess.run(cmd, cwd=project, env=env_with_venv(), stdout=out, stderr=subprocess.STDOUT, timeout=900)
    followed = log.read_text()  # each experiment's own log, one after the other
    assert done.returncode == 0, followed
    ran = stages_ran(followed)
    exported = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]["export"]["foreach"]
    each = ["params", *(f"eval@{m}" for m in MODELS), *(f"export@{m}" for m in exported), "report"]
    assert sorted(ran) == sorted(2 * each), ran  # an eval.* edit runs these, nothing else
    imported = [line.split(": ", 1)[1] for line in followed.splitlines() if line.startswith("evaluation module: ")]
    assert len(imported) == 2 * len(MODELS) and all(".dvc/tmp/exps/" in path for path in imported), imported
    shown = json.loads(run(["dvc", "exp", "show", "--json"], project).stdout)
    revs = [r for e in shown[1]["experiments"] for r in e["revs"]]
    by_name = {r["name"]: r["data"]["metrics"]["runs/eval/pretrain/metrics.json"]["data"] for r in revs}
    assert set(by_name) == {"eval10", "lmeval"}
    families = len(micro_params()["data"]["families"])
    assert (by_name["eval10"]["chat"]["n"], by_name["lmeval"]["chat"]["n"]) == (10 * families, 20 * families)
    assert "lm_eval" not in by_name["eval10"]
    # lm-eval's figures are metrics like any other: `dvc metrics diff` lists them against the baseline
    diff = json.loads(run(["dvc", "metrics", "diff", "HEAD", "lmeval", "--json"], project).stdout)
    for m in MODELS:
        changed = {k for k in diff[f"runs/eval/{m}/metrics.json"] if k.startswith("lm_eval.")}
        assert changed == LM_EVAL_KEYS
        new = diff[f"runs/eval/{m}/metrics.json"]
        assert new["lm_eval.arith_cloze.samples"]["new"] == 40 and 0 <= new["lm_eval.arith_cloze.acc"]["new"] <= 1
    run(["dvc", "exp", "apply", "lmeval"], project)
    assert "### lm-eval tasks" in (project / "runs/report.md").read_text()
