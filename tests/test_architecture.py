"""The layers of src/stagelm/ as docs/architecture.md draws them: who may import whom, and the size rules."""

import ast
import re
from pathlib import Path

import pytest
from conftest import ROOT

SRC = ROOT / "src/stagelm"


def layers() -> list[str]:
    """The packages in the order of docs/architecture.md's table, lowest first."""
    text = (ROOT / "docs/architecture.md").read_text()
    return [m.group(2) for m in re.finditer(r"^\| (\d+) \| `(\w+)` \|", text, re.M)]


def package_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every stagelm import in a file, function bodies included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stagelm"):
            names = [f"stagelm.{a.name}" for a in node.names] if node.module == "stagelm" else [node.module]
            found += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("stagelm")]
    return found


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        for _, module in imported(path):
            target = module.split(".")[1]
            if target != package_of(path):
                graph.setdefault(package_of(path), set()).add(target)
    return graph


def test_the_table_names_every_package_once():
    packages = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())
    assert sorted(layers()) == packages and len(packages) >= 6


def test_only_cli_and_init_lie_outside_a_package():
    assert sorted(p.name for p in SRC.glob("*.py")) == ["__init__.py", "cli.py"]


def test_every_import_points_down_the_layers():
    order = {name: i for i, name in enumerate(layers())}
    order["cli"] = len(order)
    wrong = []
    for path in SRC.rglob("*.py"):
        here = package_of(path)
        for line, module in imported(path):
            target = module.split(".")[1] if "." in module else module
            if target != here and order[target] >= order[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({here}) imports {module} ({target})")
    assert not wrong, "imports against docs/architecture.md's layer order:\n" + "\n".join(wrong)


def test_no_cycle_between_packages():
    graph, state = package_graph(), {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == "open":
            raise AssertionError(f"import cycle: {' -> '.join([*trail, node])}")
        if state.get(node) is None:
            state[node] = "open"
            for nxt in sorted(graph.get(node, ())):
                visit(nxt, [*trail, node])
            state[node] = "done"

    for node in sorted(graph):
        visit(node, [])


@pytest.mark.parametrize("folder", ["src", "stages", "tests", "benchmarks"])
def test_no_relative_import(folder):
    relative = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in (ROOT / folder).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert not relative


def test_package_inits_import_nothing():
    inits = [SRC / "__init__.py", *(p / "__init__.py" for p in SRC.iterdir() if p.name != "tasks")]
    importing = [str(p.relative_to(ROOT)) for p in inits if p.is_file() and imported(p)]
    assert not importing, "these __init__.py import modules, so dvc.yaml's deps would miss what they run"


def test_functions_and_stage_scripts_stay_short():
    files = [*SRC.rglob("*.py"), *(ROOT / "stages").glob("*.py")]
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    long += [
        f"{path.relative_to(ROOT)} ({n} lines)"
        for path in (ROOT / "stages").glob("*.py")
        if (n := len(path.read_text().splitlines())) > 80
    ]
    assert not long, "over 60 lines a function, or 80 a stage script:\n" + "\n".join(long)


def module_closure(start: str) -> set[str]:
    """Every stagelm module `start` reaches through imports (function bodies included)."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        base = SRC.parent.joinpath(*module.split("."))
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        todo += [m for _, m in imported(path)]
    return seen


def test_init_from_reaches_its_weights_through_three_packages():
    """`model.init_from` → interop (the checkpoint, its reader, the one state-dict map) → model (the
    decoder) and data (its tokenizer and chat format): besides infra and the params' own dataclasses
    (pipeline.config, which the decoder's shape derives from), nothing else, and nothing above."""
    reached = module_closure("stagelm.interop.checkpoint")
    packages = {m.split(".")[1] for m in reached if m.count(".") >= 1} - {"infra"}
    pipeline = {m for m in reached if m.startswith("stagelm.pipeline.") and m != "stagelm.pipeline.config"}
    assert not pipeline, pipeline
    assert packages - {"pipeline"} == {"interop", "model", "data"}, packages
