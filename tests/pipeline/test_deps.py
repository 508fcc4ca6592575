"""dvc.yaml lists exactly the code each stage imports and exactly the params it reads."""

import ast
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run

from stagelm.pipeline.config import EXECUTION_KEYS, section_keys
from stagelm.pipeline.deps import EXECUTION_SECTIONS, code_deps, params_deps, render

PIPELINE = yaml.safe_load((ROOT / "dvc.yaml").read_text())
VARS = {k: v for entry in PIPELINE["vars"] for k, v in entry.items()}
STAGES = {name: stage.get("do", stage) for name, stage in PIPELINE["stages"].items()}  # foreach: its template


def resolve(text: str) -> str:
    for key, value in VARS.items():
        text = text.replace("${" + key + "}", value)
    return text


def script_of(stage: dict) -> Path:
    cmd = resolve(stage["cmd"])
    (script,) = [w for w in cmd.split() if w.startswith("stages/") and w.endswith(".py")]
    return ROOT / script


def test_package_init_imports_nothing():
    tree = ast.parse((ROOT / "src/stagelm/__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


@pytest.mark.parametrize("name", sorted(STAGES))
def test_code_deps_are_exactly_the_imports(name):
    stage = STAGES[name]
    declared = {resolve(d) for d in stage["deps"] if resolve(d).endswith(".py")}
    expected = code_deps(script_of(stage), ROOT)
    listed = "".join(f"\n  - {p}" for p in expected)
    assert declared == set(expected), f"dvc.yaml stage {name}: its code deps should be (`stagelm deps`):{listed}"


@pytest.mark.parametrize("name", sorted(STAGES))
def test_params_are_exactly_what_the_stage_reads(name):
    stage = STAGES[name]
    declared = set()
    for entry in stage.get("params", []):
        if isinstance(entry, dict):  # {file: [keys]}
            raise AssertionError("params come from params.yaml only")
        declared |= {entry} if "." in entry or entry == "seed" else set(section_keys(entry))
    flags = [w for w in resolve(stage["cmd"]).split() if w.startswith("--")]  # e.g. distill's --control
    expected = params_deps(script_of(stage), flags)
    read = {k for e in expected for k in ([e] if "." in e or e == "seed" else section_keys(e))}
    listed = "".join(f"\n  - {p}" for p in expected)
    assert declared == read, f"dvc.yaml stage {name}: its params should be (`stagelm deps`):{listed}"


def test_deps_cli_prints_the_lists_this_test_checks(capsys):
    out = run(["stagelm", "deps", "stages/pretrain.py"], ROOT).stdout
    assert out == render(ROOT / "stages/pretrain.py", ROOT)
    assert "  - src/stagelm/train/loop.py\n" in out and "  - training.lr\n" in out and "training.log_every" not in out
    bad = run(["stagelm", "deps", "stages/nothing.py"], ROOT, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: stages/nothing.py: no such stage script")


def test_a_family_module_in_a_package_is_a_dep_with_its_package(tmp_path):
    # `from stagelm.pkg import mod` reaches pkg/__init__.py and pkg/mod.py (how task families are imported)
    (tmp_path / "src/stagelm/pkg").mkdir(parents=True)
    (tmp_path / "src/stagelm/__init__.py").write_text("")
    (tmp_path / "src/stagelm/pkg/__init__.py").write_text("from stagelm.pkg import mod\n")
    (tmp_path / "src/stagelm/pkg/mod.py").write_text("from stagelm import leaf\n")
    (tmp_path / "src/stagelm/leaf.py").write_text("X = 1\n")
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages/s.py").write_text("from stagelm.pkg import mod\n")
    assert code_deps(tmp_path / "stages/s.py", tmp_path) == [
        "stages/s.py",
        "src/stagelm/leaf.py",
        "src/stagelm/pkg/__init__.py",
        "src/stagelm/pkg/mod.py",
    ]


def test_no_stage_declares_execution_settings():
    for stage in STAGES.values():
        for entry in stage.get("params", []):
            assert entry not in EXECUTION_SECTIONS and entry not in EXECUTION_KEYS


def test_every_stage_waits_for_the_params_check():
    """The params stage reads params.yaml whole; every other stage depends on its stamp, so a
    typo fails `dvc repro` before anything runs (tests/pipeline/test_dvc_repro.py runs it)."""
    assert STAGES["params"]["deps"][-1] == "${params_file}" and STAGES["params"]["outs"] == ["${params_stamp}"]
    assert not STAGES["params"].get("params")
    for name, stage in STAGES.items():
        assert name == "params" or "${params_stamp}" in stage["deps"], name
