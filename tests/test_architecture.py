"""The layers of src/stagelm/ as docs/architecture.md draws them: who may import whom, and the size rules.

Imports are read as `stagelm deps` reads them (`pipeline.deps.import_lines`): one reader of the
code, so what these rules see is what dvc.yaml's deps list."""

import ast
import re
from pathlib import Path

import pytest
from conftest import ROOT

from stagelm.pipeline.deps import import_lines

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
    return import_lines(path, SRC.parent)


def module_name(path: Path) -> str:
    """`src/stagelm/model/decoder.py` → stagelm.model.decoder; a package's `__init__.py` → the package."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        for _, module in imported(path):
            target = module.split(".")[1]
            if target != package_of(path):
                graph.setdefault(package_of(path), set()).add(target)
    return graph


def module_graph(package: Path) -> dict[str, set[str]]:
    """Each module of `package` (its `__init__` included) → the modules of the same package it imports."""
    name = module_name(package / "__init__.py")
    return {
        module_name(path): {m for _, m in imported(path) if name in (m, m.rsplit(".", 1)[0]) and m != module_name(path)}
        for path in package.glob("*.py")
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as its trail (first node repeated at the end), or None."""
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        if state.get(node) == "open":
            return [*trail[trail.index(node) :], node]
        if state.get(node) is None:
            state[node] = "open"
            for nxt in sorted(graph.get(node, ())):
                if cycle := visit(nxt, [*trail, node]):
                    return cycle
            state[node] = "done"
        return None

    return next((cycle for node in sorted(graph) if (cycle := visit(node, []))), None)


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
    cycle = find_cycle(package_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("package", sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()))
def test_no_cycle_between_the_modules_of_a_package(package):
    cycle = find_cycle(module_graph(SRC / package))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_layers_the_page_keeps_apart_import_neither_each_other():
    """The page's prose: "`post` and `measure` import neither each other" (the table's order alone
    lets the higher, measure, import post)."""
    pairs = set(
        re.findall(r"`(\w+)` and `(\w+)` import neither each other", (ROOT / "docs/architecture.md").read_text())
    )
    assert ("post", "measure") in pairs
    wrong = [
        f"{path.relative_to(ROOT)}:{line} ({package_of(path)}) imports {module}"
        for pair in pairs
        for here, there in (pair, pair[::-1])
        for path in (SRC / here).rglob("*.py")
        for line, module in imported(path)
        if module.split(".")[1] == there
    ]
    assert not wrong, "imports the page forbids:\n" + "\n".join(wrong)


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
