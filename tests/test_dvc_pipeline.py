"""The real `dvc` CLI on a micro copy of the project: repro, no-op, failures lose nothing."""

import json
import shutil
import time

import pytest
from conftest import make_project, micro_params, run, write_params

from stagelm.files import read_json

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def built_project(tmp_path_factory):
    """A micro project after one full `dvc repro` (copied per test, .dvc/cache included)."""
    root = make_project(tmp_path_factory.mktemp("project") / "stagelm", micro_params())
    run(["dvc", "repro"], root)
    return root


@pytest.fixture
def project(built_project, tmp_path):
    dest = tmp_path / "stagelm"
    shutil.copytree(built_project, dest, symlinks=True)
    return dest


def status(project) -> dict:
    return json.loads(run(["dvc", "status", "--json"], project).stdout or "{}")


def repro_ran(project) -> set[str]:
    """Run `dvc repro` and return the stages it ran (status alone cannot tell whether an
    upstream stage's new outputs differ, so changes downstream of it show only by running)."""
    out = run(["dvc", "repro"], project).stdout
    return {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}


def test_full_repro_produced_every_artifact(project):
    raw = read_json(project / "data/raw/manifest.json")
    assert raw["documents"]["train"] + raw["documents"]["val"] == 400
    assert (project / "data/tokenizer/tokenizer.json").is_file()
    for split in ("train", "val", "sft"):
        assert read_json(project / f"data/packed/{split}/manifest.json")["rows"] > 0
    metrics = read_json(project / "runs/pretrain/metrics.json")
    assert metrics["step"] == 12 and metrics["val_loss"] > 0
    for stage in ("data/raw", "data/tokenizer", "data/packed", "runs/pretrain"):
        assert read_json(project / stage / "provenance.json")["git"]["commit"]


def test_noop_repro_runs_nothing_and_is_quick(project):
    assert status(project) == {}
    t0 = time.perf_counter()
    out = run(["dvc", "repro"], project).stdout
    assert "Running stage" not in out
    assert time.perf_counter() - t0 < 5


def test_params_change_reruns_only_downstream(project):
    params = micro_params(training={"lr": 1e-3})
    write_params(project / "params.yaml", params)
    assert set(status(project)) == {"pretrain"}
    params = micro_params(tokenizer={"vocab_size": 290})
    write_params(project / "params.yaml", params)
    assert set(status(project)) == {"tokenizer"}
    assert repro_ran(project) == {"tokenizer", "pack", "pretrain"}
    params["mesh"] = {"data": 1, "fsdp": 1, "tensor": 1}
    params["training"]["log_every"] = 5
    params["notes"] = "an unrelated key"
    write_params(project / "params.yaml", params)
    assert status(project) == {}


def test_failed_stage_loses_nothing(project):
    before = read_json(project / "data/packed/train/manifest.json")
    write_params(project / "params.yaml", micro_params(pack={"seq_len": "abc"}))
    result = run(["dvc", "repro"], project, check=False)
    assert result.returncode != 0
    assert "error: pack.seq_len: expected an int >= 2, got 'abc'" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    write_params(project / "params.yaml", micro_params())
    run(["dvc", "checkout"], project)
    assert read_json(project / "data/packed/train/manifest.json") == before
    assert status(project) == {}
