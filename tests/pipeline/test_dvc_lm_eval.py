"""eval.lm_eval_tasks through `dvc exp run` on a micro copy of the project: naming a task reruns
the evals and what reads their metrics. Its own file so that xdist can run it beside the other
DVC files (tests/pipeline/test_dvc_experiments.py says why)."""

import json

import pytest
from conftest import run
from dvc_stages import EXPORTED, MODELS, stages_ran

pytestmark = pytest.mark.slow


def test_lm_eval_tasks_rerun_only_the_evals_and_what_reads_them(project):
    # The task ships in inputs/lm_eval/ (benchmarks/lm_eval_example_task.py wrote it), so the
    # built project's download and pretrain already hashed it: naming it reruns only eval@M and
    # the stages that read eval's metrics (export@M takes its sampling default from them, the report).
    task = "inputs/lm_eval/arith_cloze.yaml"
    edits = ["-S", f"eval.lm_eval_tasks=[{task}]", "-S", "eval.lm_eval_limit=40"]
    out = run(["dvc", "exp", "run", "-n", "lmeval", *edits], project)
    ran = set(stages_ran(out.stdout))
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
