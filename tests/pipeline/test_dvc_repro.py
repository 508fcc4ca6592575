"""The real `dvc` CLI on a micro copy of the project: repro, no-op, failures lose nothing."""

import json
import math
import os
import signal
import subprocess
import time

import pytest
import yaml
from browser import CHROMIUM, NEEDS, Browser
from conftest import env_with_venv, micro_params, run, write_params
from dvc_stages import MODELS, stages_ran

from stagelm.data.loader import PackedRows
from stagelm.infer.generate import load_generator
from stagelm.infra.files import read_json
from stagelm.train.checkpoints import HASHES

pytestmark = pytest.mark.slow


def status(project) -> dict:
    return json.loads(run(["dvc", "status", "--json"], project).stdout or "{}")


def repro_ran(project) -> set[str]:
    """Run `dvc repro` and return the stages it ran (status alone cannot tell whether an
    upstream stage's new outputs differ, so changes downstream of it show only by running)."""
    return set(stages_ran(run(["dvc", "repro"], project).stdout))


def test_full_repro_produced_every_artifact(project):
    raw = read_json(project / "data/raw/manifest.json")
    assert raw["documents"]["train"] + raw["documents"]["val"] == 400
    assert (project / "data/tokenizer/tokenizer.json").is_file()
    for split in ("train", "val", "sft"):
        assert read_json(project / f"data/packed/{split}/manifest.json")["rows"] > 0
    metrics = read_json(project / "runs/pretrain/metrics.json")
    assert metrics["step"] == 12 and metrics["val_loss"] > 0
    for provenance in (  # beside what other stages read, never inside it (issue 17)
        "data/raw.provenance.json",
        "data/tokenizer.provenance.json",
        "data/packed.provenance.json",
        "runs/pretrain/provenance.json",
        "runs/eval/pretrain/provenance.json",
        "runs/export/pretrain.provenance.json",
    ):
        assert read_json(project / provenance)["git"]["commit"]
    ev = read_json(project / "runs/eval/pretrain/metrics.json")
    families = micro_params()["data"]["families"]
    held_out = micro_params()["data"]["num_eval"] * len(families)  # per family × every family
    assert ev["accuracy_format"] in ("completion", "chat") and ev["completion"]["n"] == ev["chat"]["n"] == held_out
    assert ev["perplexity"] == pytest.approx(math.exp(ev["val_loss"]))
    seg = PackedRows(project / "data/packed/val").all_rows()["segment_ids"]
    pieces = sum(len(set(row[row > 0].tolist())) for row in seg)
    assert ev["val_tokens"] == (seg > 0).sum() - pieces  # every target of the whole val split, once
    assert ev["chat_sampled"]["n"] == held_out and ev["chat_sampled"]["temperature"] == 1.0
    passes = ev["chat_pass_k"]  # eval.pass_k 4 samples of the first pass_k_prompts 10 prompts per family
    assert passes["k"] == 4 and passes["n"] == 10 * len(families)
    assert all(passes[f]["n"] == 10 and 0 <= passes[f]["pass_at_1"] <= passes[f]["pass_at_4"] <= 1 for f in families)
    temps = ev["chat_temperatures"]  # eval.temperatures [0.5, 1.0] on the first temperature_prompts 10 per family
    assert list(temps) == ["0.5", "1.0"] and [t["temperature"] for t in temps.values()] == [0.5, 1.0]
    assert all(t.keys() == ev["chat_sampled"].keys() and t["n"] == 10 * len(families) for t in temps.values())
    best = max(temps.values(), key=lambda t: t["accuracy"])
    assert ev["chat_best_temperature"] == best["temperature"]
    for name in ("pretrain", "sft", "distill", "grpo"):  # each export samples at its model's best temperature
        generation = read_json(project / f"runs/export/{name}/generation_config.json")
        best = read_json(project / f"runs/eval/{name}/metrics.json")["chat_best_temperature"]
        assert generation["do_sample"] is True and generation["temperature"] == best
    predictions = (project / "runs/eval/pretrain/predictions.jsonl").read_text().splitlines()
    assert len(predictions) == 2 * held_out  # both formats
    sample = micro_params()["sample"]
    for name, form, asked in (("pretrain", "completion", sample["prompts"]), ("sft", "chat", sample["chat_prompts"])):
        samples = [json.loads(line) for line in (project / f"runs/samples/{name}.jsonl").read_text().splitlines()]
        assert [(s["prompt"], s["format"]) for s in samples] == [(p, form) for p in asked]
    report = (project / "runs/report.md").read_text()
    assert "| pretrain |" in report and "![pretrain loss](report/pretrain_loss.png)" in report
    opening = report.split("## Models")[0]  # the stage-by-stage table and one sentence per stage
    assert "| sft | pretrain |" in opening and "| distill | sft (teacher) |" in opening
    assert "- **sft** (from pretrain) moved chat accuracy arithmetic" in opening
    assert "student (" in opening and "cut from its teacher then distilled" in opening  # distill.init: teacher
    assert "| distill_control | sft (teacher's terms off) |" in opening
    assert ". Against its control distill_control (val loss " in opening and "; sampled arithmetic " in opening
    assert "- **grpo** (from sft, rewarding arithmetic) moved" in opening and "sampled at T=1" in opening
    assert "| | | | chat, sampled at its best T=" in opening and " (of 0.5/1)" in opening
    assert "; at each one's best temperature (sft T=" in opening  # grpo against sft, each at its best
    assert (project / "runs/report/pretrain_loss.png").stat().st_size > 1000
    assert (project / "runs/report/grpo_reward.png").is_file()
    side = report.split("### Post-training side by side")[1].split("## Models")[0]  # dpo and grpo beside sft
    assert "| sft | — |" in side and "| grpo | sft |" in side and "| dpo | sft |" in side and " → " in side
    assert "- **dpo** (from sft, rewarding arithmetic) moved" in opening and "; greedy errors " in opening
    assert read_json(project / "runs/dpo/metrics.json")["pairs"] > 0  # the rl set's reference answers over its own
    bench = read_json(project / "runs/benchmark/metrics.json")
    assert len(bench["commit"]) == 40 and "| train.tokens_per_sec |" in report
    assert run(["git", "diff", "--exit-code", "dvc.yaml"], project, check=False).returncode == 0  # nothing rewrote it


def cpu_seconds(cmd: list[str], project) -> tuple[str, float]:
    """(stdout, user + system CPU seconds of the command's process tree)."""
    before = os.times()
    out = run(cmd, project).stdout
    after = os.times()
    return out, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def test_noop_repro_runs_nothing_and_is_quick(project):
    # Measured against `dvc status` on the same project, in CPU seconds (the better of two
    # runs each): DVC's own start-up and dependency checks cost 3-5 CPU s here, more when
    # the other xdist worker shares the cores (a fixed 5 s bound failed at 5.0), and a
    # no-op repro does little beyond them (1.3-1.5x a status, measured).
    checks, repros = [], []
    for _ in range(2):
        listed, cpu = cpu_seconds(["dvc", "status", "--json"], project)
        assert json.loads(listed or "{}") == {}
        checks.append(cpu)
        out, cpu = cpu_seconds(["dvc", "repro"], project)
        assert "Running stage" not in out
        repros.append(cpu)
    assert min(repros) < 2 * min(checks), f"a no-op repro used {min(repros):.1f} CPU s, `dvc status` {min(checks):.1f}"


def test_a_rerun_that_changes_no_byte_reruns_nothing_below_it(project):
    """Issue 17: every output another stage reads has stable bytes, so DVC cuts off early."""
    forced = run(["dvc", "repro", "-f", "download"], project).stdout
    assert "Running stage 'download'" in forced
    assert repro_ran(project) == set()  # tokenizer, pack and all below see the same data/raw
    forced = run(["dvc", "repro", "-f", "-s", "pretrain"], project).stdout
    assert "Running stage 'pretrain'" in forced
    assert repro_ran(project) == {"report"}  # the report shows the new run's times; the model is the same
    assert status(project) == {}


def test_eval_and_sample_params_rerun_only_their_stages(project):
    # What an eval.* edit reruns is seen running in test_queued_experiments_both_finish_and_differ.
    write_params(project / "params.yaml", micro_params(eval={"max_examples": 20}))
    assert set(status(project)) == {"params"} | {f"eval@{m}" for m in MODELS}  # the params stage reads the whole file
    write_params(project / "params.yaml", micro_params(sample={"temperature": 0.7}))
    samples = {f"sample@{m}" for m in MODELS}
    assert set(status(project)) == {"params"} | samples
    assert repro_ran(project) == {"params"} | samples | {"report"}
    params = micro_params(sample={"temperature": 0.7})
    params["benchmark"] = {**params["benchmark"], "repetitions": 11}
    write_params(project / "params.yaml", params)
    assert set(status(project)) == {"params", "benchmark"}
    assert repro_ran(project) == {"params", "benchmark", "report"}


def test_generate_cli_streams_from_a_stage_model(project):
    out = run(
        ["stagelm", "generate", "runs/pretrain/model", "--prompt", "Once upon a time,", "--max-new-tokens", "8"],
        project,
    )
    gen = load_generator(project / "runs/pretrain/model")
    (expected,) = gen.generate([gen.tokenizer.encode("Once upon a time,").ids], 8)
    assert out.stdout == expected.text + "\n"
    bad = run(["stagelm", "generate", "runs/pretrain/model", "--prompt", "x", "--top-p", "2"], project, check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --top-p: expected a value in (0, 1], got 2.0"


def test_params_change_reruns_only_downstream(project):
    # The params stage depends on params.yaml as a file: every edit reruns it, and its stamp's
    # bytes never change, so below it only the stages that list the edited key run.
    write_params(project / "params.yaml", micro_params(training={"lr": 1e-3}))
    assert set(status(project)) == {"params", "pretrain"}  # sft and the per-model stages follow once it reruns
    write_params(project / "params.yaml", micro_params(distill={"alpha": 0.7}))
    assert set(status(project)) == {"params", "distill"}  # the control reads neither alpha nor temperature
    write_params(project / "params.yaml", micro_params(tokenizer={"vocab_size": 290}))
    assert set(status(project)) == {"params", "tokenizer"}  # what follows it: test_experiment_runs_and_compares
    params = micro_params()
    params["mesh"] = {"data": 1, "fsdp": 1, "tensor": 1}
    params["launch"] = {"command": "srun --nodes=2", "initialization_timeout": 60}  # execution settings: not even
    # the cmd changes
    params["training"]["log_every"] = 5
    write_params(project / "params.yaml", params)
    assert set(status(project)) == {"params"}
    assert repro_ran(project) == {"params"}  # execution settings rerun the check and nothing else
    assert status(project) == {}


TYPOS = [  # (params edit, the line `dvc repro` must fail with)
    ({"training": {"learning_rate": 1e-4}}, "training.learning_rate: unknown key; expected one of lr, min_lr_ratio,"),
    ({"grpo": {"kl_coeff": 0.1}}, "grpo.kl_coeff: unknown key (did you mean 'kl_coef'?)"),
    ({"trainig": {"lr": 1e-4}}, "trainig: unknown top-level key of params.yaml (did you mean 'training'?)"),
]


def test_a_params_typo_fails_repro_before_any_stage_runs(project):
    before = read_json(project / "runs/pretrain/metrics.json")
    for edit, message in TYPOS:  # one project copy for all: each repro stops at the params stage
        params = micro_params()
        for section, values in edit.items():
            params[section] = {**params.get(section, {}), **values}
        write_params(project / "params.yaml", params)
        result = run(["dvc", "repro"], project, check=False)
        out = result.stdout + result.stderr
        assert result.returncode != 0 and f"error: {message}" in out and "Traceback" not in out, out
        ran = [line for line in result.stdout.splitlines() if line.startswith("Running stage")]
        assert ran == ["Running stage 'params':"], ran
    assert read_json(project / "runs/pretrain/metrics.json") == before


def test_failed_stage_loses_nothing(project):
    before = read_json(project / "data/packed/train/manifest.json")
    write_params(project / "params.yaml", micro_params(data={"source": "files:inputs/nowhere/*.txt"}))  # valid params
    result = run(["dvc", "repro"], project, check=False)
    assert result.returncode != 0 and "Running stage 'download'" in result.stdout  # the stage itself failed
    assert "error: data.source: " in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    write_params(project / "params.yaml", micro_params())
    run(["dvc", "checkout"], project)
    assert read_json(project / "data/packed/train/manifest.json") == before
    assert repro_ran(project) <= {"params"}  # it passed on the edited file; only the check reruns (or is cached)
    assert status(project) == {}


def test_lineage_walks_back_to_the_raw_data_with_the_locked_hashes(project):
    out = run(["stagelm", "lineage", "runs/grpo/model"], project).stdout
    assert out.splitlines()[0] == "grpo ← sft ← pretrain ← pack ← tokenizer ← download ← params"
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    commit = run(["git", "rev-list", "--max-parents=0", "HEAD"], project).stdout.strip()  # the repro ran there
    for stage in ("grpo", "sft", "pretrain", "pack", "tokenizer"):
        for dep in lock[stage]["deps"]:
            if not dep["path"].endswith(".py"):
                assert f"input {dep['path']} md5 {dep['md5']}" in out
    assert f"pretrain: commit {commit[:10]}" in out
    assert "param training.lr = " in out and "param sft.method = lora" in out and "param grpo.kl_coef = " in out
    distill = run(["stagelm", "lineage", "runs/distill/model"], project).stdout
    assert distill.splitlines()[0] == "distill ← sft ← pretrain ← pack ← tokenizer ← download ← params"
    bad = run(["stagelm", "lineage", "nowhere/at/all"], project, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: nowhere/at/all: no stage")


def test_inspect_summarises_a_run(project):
    out = run(["stagelm", "inspect", "runs/pretrain"], project).stdout
    assert "stage pretrain" in out and "step: 12" in out and "ran from step 0" in out
    assert "checkpoints in runs/.checkpoints/pretrain/" in out and "steps [8, 12]" in out


def test_a_pushed_model_is_evaluated_elsewhere_without_retraining(project, tmp_path):
    remote = tmp_path / "remote"
    run(["dvc", "remote", "add", "-d", "storage", str(remote)], project)
    run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "remote"], project)
    run(["dvc", "push"], project)
    original = read_json(project / "runs/eval/pretrain/metrics.json")

    fresh = tmp_path / "fresh"
    run(["git", "clone", "-q", str(project), str(fresh)], tmp_path)
    out = run(["dvc", "repro", "--pull", "--allow-missing", "eval@pretrain"], fresh).stdout
    assert "Running stage" not in out  # everything eval needs came from the remote
    assert not (fresh / "runs/sft").exists()  # and nothing it does not need

    again = tmp_path / "again"
    run(["git", "clone", "-q", str(project), str(again)], tmp_path)
    run(["dvc", "pull", "--with-deps", "eval@pretrain"], again)
    ran = run(["dvc", "repro", "-f", "-s", "eval@pretrain"], again).stdout
    assert [line for line in ran.splitlines() if line.startswith("Running stage")] == ["Running stage 'eval@pretrain':"]
    rerun = read_json(again / "runs/eval/pretrain/metrics.json")
    assert rerun == original

    third = tmp_path / "third"
    run(["git", "clone", "-q", str(project), str(third)], tmp_path)
    run(["dvc", "pull", "pretrain"], third)
    out = run(["dvc", "repro", "eval@pretrain"], third).stdout
    assert "Running stage 'pretrain'" not in out


def test_plots_page_has_the_loss_curves(project):
    run(["dvc", "plots", "show", "-o", "plots_page"], project)
    page = (project / "plots_page/index.html").read_text()
    assert "runs/pretrain/plots/metrics/train/loss.tsv" in page and "runs/sft/plots/metrics/val/loss.tsv" in page
    assert "cdn.jsdelivr" not in page and "/* vega-embed 6.29.0 */" in page  # plots/offline.html, not DVC's CDN page


@pytest.mark.skipif(CHROMIUM is None, reason=NEEDS)
def test_the_plots_page_draws_the_pretrain_loss_with_no_network(project, tmp_path):
    run(["dvc", "plots", "show", "-o", "plots_page"], project)
    page = (project / "plots_page/index.html").as_uri()
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(page)
        line = "document.querySelector('#runs_pretrain_plots_metrics_train_loss_tsv svg .mark-line path')"
        drawn = browser.wait_for(f"{line} && {line}.getAttribute('d')")
        assert drawn.count("L") == micro_params()["training"]["steps"] - 1  # a line through every step's loss
        browser.screenshot(tmp_path / "plots.png")
        assert browser.requests == [page]  # the page asked for nothing but itself
    finally:
        browser.close()


def test_ctrl_c_stops_every_stage_process_and_the_next_repro_recovers(project):
    # Long enough to be caught running after its first checkpoint (step 50); each save costs ~0.3 s.
    params = micro_params(training={"steps": 200, "checkpoint_every": 50, "eval_every": 100, "log_every": 10})
    write_params(project / "params.yaml", params)
    checkpoints = project / "runs/.checkpoints/pretrain"
    old = set(checkpoints.iterdir())  # the built project's own fingerprint
    proc = subprocess.Popen(
        ["dvc", "repro", "pretrain"],
        cwd=project,
        env=env_with_venv(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if any((step / HASHES).is_file() for run_dir in set(checkpoints.iterdir()) - old for step in run_dir.iterdir()):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "pretrain finished before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends
    proc.wait(timeout=120)
    time.sleep(1)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no process of the group is left
    assert "pretrain" in status(project)  # the interrupted stage is not recorded as done
    out = run(["dvc", "repro", "pretrain"], project).stdout
    assert "resuming from step" in out, out
    assert read_json(project / "runs/pretrain/metrics.json")["step"] == 200
