"""`dvc exp` on a micro copy of the project: an experiment run and compared, and a bad one.

The DVC tests share one built project (conftest's `built_project`, made once a run) and are split
into files of one or a few long tests: this one, test_dvc_queue.py (a queue of experiments, one
naming an lm-eval task) and test_dvc_repro.py. `--dist loadfile` runs a
file on one xdist worker, and as one file these took about 600 s, started only once the build was
done. conftest's SLOWEST_FIRST hands them out after test_dvc_repro.py, which builds the project,
and the interop one.
"""

import json

import pytest
from conftest import micro_params, run
from dvc_stages import stages_ran

from stagelm.infra.files import read_json

DPO_LR = "runs/dpo/plots/metrics/train/lr.tsv"

pytestmark = pytest.mark.slow


def test_experiment_runs_and_compares(project):
    # The user's flow on a stage near the end of the DAG, so the experiment reruns five stages,
    # not the thirty below a pretraining edit (test_dvc_repro.py checks what each kind of edit
    # reruns). dpo, not grpo: the micro policy earns GRPO no reward, so grpo's weights come out
    # the same at any rate and DVC rightly reruns nothing below it. DVC writes 5e-5 into
    # params.yaml as `5e-05`: a float in YAML 1.2 (DVC's reading and ours), a string in YAML 1.1,
    # which refused it; every rate below 1e-4 was out of reach of `dvc exp run`.
    out = run(["dvc", "exp", "run", "-n", "lr5e5", "-S", "dpo.lr=5e-5"], project)
    assert set(stages_ran(out.stdout)) == {"params", "dpo", "eval@dpo", "sample@dpo", "export@dpo", "report"}
    shown = json.loads(run(["dvc", "exp", "show", "--json"], project).stdout)
    baseline = shown[1]
    experiment = baseline["experiments"][0]["revs"][0]
    for rev in (baseline, experiment):
        metrics = rev["data"]["metrics"]
        assert metrics["runs/dpo/metrics.json"]["data"]["val_loss"] > 0
        assert metrics["runs/eval/dpo/metrics.json"]["data"]["accuracy"] >= 0
    assert "lr: 5e-05" in (project / "params.yaml").read_text()  # as DVC wrote it
    assert experiment["data"]["params"]["params.yaml"]["data"]["dpo"]["lr"] == 5e-5
    assert read_json(project / "runs/dpo/provenance.json")["params"]["dpo"]["lr"] == 5e-5
    rates = [float(line.split("\t")[1]) for line in (project / DPO_LR).read_text().splitlines()[1:]]
    assert max(rates) == pytest.approx(5e-5) and len(rates) == micro_params()["dpo"]["steps"]  # trained at it
    diff = run(["dvc", "metrics", "diff", "HEAD", "--json"], project).stdout
    assert "runs/dpo/metrics.json" in json.loads(diff)
    params = json.loads(run(["dvc", "params", "diff", "HEAD", "--json"], project).stdout)
    assert params["params.yaml"]["dpo.lr"]["new"] == 5e-5
    run(["dvc", "plots", "diff", "HEAD", "lr5e5", "-o", "plots_diff"], project)
    page = (project / "plots_diff/index.html").read_text()
    assert "lr5e5" in page and "HEAD" in page and "runs/dpo/plots/metrics/train/loss.tsv" in page
    assert "cdn.jsdelivr" not in page and "/* vega 5.33.1 */" in page


def test_bad_experiment_fails_at_once_with_the_params_line(project):
    result = run(["dvc", "exp", "run", "-S", "training.lr=fast"], project, check=False)
    assert result.returncode != 0
    assert "error: training.lr: expected a positive float, got 'fast'" in result.stdout + result.stderr
    assert "Running stage 'params'" in result.stdout and "Traceback" not in result.stdout + result.stderr
    assert "Running stage 'pretrain'" not in result.stdout  # the params stage stopped the run first
