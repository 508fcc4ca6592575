"""Every script in benchmarks/ starts, so a module moved or renamed in src/ cannot break one
silently (nothing else runs them: they measure for minutes or need a model, a TPU or llama.cpp).

Each Python script runs as a user runs it, `python benchmarks/<script>.py --help` with
PYTHONPATH=src, far enough to import what it imports at the top and to build its parser (all of
them in one child process, one interpreter start instead of one a script: seconds, not a minute).
What a script imports later — in a function body, or in the code it hands a child process as a
string — is read from its source: every stagelm module it names must import and hold every name
taken from it, and every attribute it reads off a stagelm module must exist. A shell script must
parse, and the benchmarks/ scripts it runs must exist.
"""

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, env_with_venv

BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
SHELL_SCRIPTS = sorted(BENCHMARKS.glob("*.sh"))

# Runs each script given as `python <script> --help` would, in this one process: {script: [exit code, stdout]}.
HELP_RUNNER = """
import contextlib, io, json, runpy, sys, traceback
found = {}
for script in sys.argv[1:]:
    sys.argv, out, code = [script, "--help"], io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:
        code = traceback.format_exc()
    found[script] = [code, out.getvalue()]
print(json.dumps(found))
"""


def test_every_script_in_benchmarks_is_checked_here():
    assert len(SCRIPTS) >= 10 and {p.suffix for p in BENCHMARKS.iterdir() if p.is_file()} <= {
        ".py",
        ".sh",
        ".md",
        ".json",
    }


def test_every_python_script_starts_and_prints_its_help():
    env = env_with_venv()
    env["PYTHONPATH"] = str(ROOT / "src")
    env["JAX_PLATFORMS"] = "cpu"
    if "glibc.malloc.hugetlb" not in env.get("GLIBC_TUNABLES", ""):  # as `make` sets it: no script restarts itself
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), "glibc.malloc.hugetlb=1"]))
    cmd = [sys.executable, "-c", HELP_RUNNER, *map(str, SCRIPTS)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    failed = [
        f"{Path(script).name}: exit {code}\n{out}"
        for script, (code, out) in found.items()
        if code not in (0, None) or "usage:" not in out
    ]
    assert not failed, "benchmark scripts that do not start:\n" + "\n".join(failed)


def code_trees(script: Path) -> dict[str, ast.Module]:
    """The script's syntax tree and that of every string in it that is Python importing stagelm
    (the code it runs in a child process), by where each is."""
    tree = ast.parse(script.read_text(), str(script))
    trees = {script.name: tree}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.search(r"^\s*(from|import) stagelm", node.value, re.M)
        ):
            trees[f"{script.name}, the code in the string at line {node.lineno},"] = ast.parse(node.value)
    return trees


def unresolved(tree: ast.Module) -> list[str]:
    """What `tree` takes from stagelm that is not there: modules, names, attributes of modules."""
    missing, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in (a for a in node.names if a.name.startswith("stagelm")):
                try:
                    importlib.import_module(alias.name)
                except ImportError as err:
                    missing.append(f"line {node.lineno}: import {alias.name} ({err})")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stagelm"):
            try:
                module = importlib.import_module(node.module)
            except ImportError as err:
                missing.append(f"line {node.lineno}: from {node.module} ({err})")
                continue
            for alias in node.names:
                if hasattr(module, alias.name):
                    value = getattr(module, alias.name)
                else:
                    try:
                        value = importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                        continue
                if isinstance(value, type(sys)):
                    modules[alias.asname or alias.name] = value
    for node in ast.walk(tree):  # `attention_kernels.TUNING` after `from stagelm.model import attention_kernels`
        module = (
            modules.get(node.value.id) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) else None
        )
        if module is not None and not hasattr(module, node.attr):
            missing.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return missing


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_stagelm_name_a_script_uses_exists(script):
    missing = [f"{where} {m}" for where, tree in code_trees(script).items() for m in unresolved(tree)]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_every_shell_script_parses_and_runs_scripts_that_exist(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    named = set(re.findall(r"benchmarks/[\w.-]+\.py", script.read_text()))
    assert named and all((ROOT / n).is_file() for n in named), sorted(n for n in named if not (ROOT / n).is_file())
