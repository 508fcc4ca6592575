"""dvc.yaml lists exactly the code each stage imports and exactly the params it reads."""

import ast
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from stagelm.config import EXECUTION_KEYS, SECTIONS

PIPELINE = yaml.safe_load((ROOT / "dvc.yaml").read_text())
VARS = {k: v for entry in PIPELINE["vars"] for k, v in entry.items()}
STAGES = {name: stage.get("do", stage) for name, stage in PIPELINE["stages"].items()}  # foreach: its template


def resolve(text: str) -> str:
    for key, value in VARS.items():
        text = text.replace("${" + key + "}", value)
    return text


def stagelm_imports(path: Path) -> set[str]:
    """Names of the stagelm modules a file imports, anywhere in it (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stagelm"):
            if node.module == "stagelm":
                found |= {f"stagelm.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("stagelm.")}
    return found


def closure(script: Path) -> set[str]:
    """The script plus every stagelm module file it reaches, as repo-relative paths."""
    seen, todo = {str(script.relative_to(ROOT))}, [script]
    while todo:
        for module in stagelm_imports(todo.pop()):
            path = ROOT / "src" / (module.replace(".", "/") + ".py")
            assert path.is_file(), f"{module} imported but {path} does not exist"
            rel = str(path.relative_to(ROOT))
            if rel not in seen:
                seen.add(rel)
                todo.append(path)
    return seen


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
    assert declared == closure(script_of(stage))


def sections_read(script: Path) -> set[str]:
    """Params a stage reads: load_section(params, "<name>") and load_seed(...) calls in its script."""
    names = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "load_section":
            assert isinstance(node.args[1], ast.Constant), f"{script}: name sections literally in load_section"
            names.add(node.args[1].value)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "load_seed":
            names.add("seed")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "load_value":  # one key: "section.field"
            assert isinstance(node.args[1], ast.Constant), f"{script}: name keys literally in load_value"
            names.add(node.args[1].value)
    return names


EXECUTION_SECTIONS = {"mesh"}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_params_are_exactly_what_the_stage_reads(name):
    stage = STAGES[name]
    declared = set()
    for entry in stage.get("params", []):
        if isinstance(entry, dict):  # {file: [keys]}
            raise AssertionError("params come from params.yaml only")
        if "." in entry or entry == "seed":
            declared.add(entry)
        else:
            fields = SECTIONS[entry].__dataclass_fields__
            declared |= {f"{entry}.{f}" for f in fields}
    expected = set()
    for section in sections_read(script_of(stage)) - EXECUTION_SECTIONS:
        if section == "seed" or "." in section:
            expected.add(section)
            continue
        expected |= {f"{section}.{f}" for f in SECTIONS[section].__dataclass_fields__}
    assert declared == expected - EXECUTION_KEYS


def test_no_stage_declares_execution_settings():
    for stage in STAGES.values():
        for entry in stage.get("params", []):
            assert entry not in EXECUTION_SECTIONS and entry not in EXECUTION_KEYS
