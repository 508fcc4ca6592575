"""What a stage script depends on, read from its source: the code it imports and the params it reads.

`stagelm deps stages/<stage>.py` prints both as dvc.yaml lists them, and the
pipeline test compares dvc.yaml against the same computation:

- code: the script plus every `stagelm` module it reaches through imports (anywhere
  in a file, functions included), as repo-relative paths; a package counts with its
  `__init__.py`;
- params: the sections named literally in `load_section(params, "<name>")`, the keys
  in `load_value(params, "<section.key>")`, and `seed` for `load_seed(...)`; a section
  holding execution settings (`config.EXECUTION_KEYS`) is listed key by key without
  them, and execution-only sections (`mesh`, `launch`) are never listed.
"""

import ast
from pathlib import Path

from stagelm.infra.errors import StagelmError
from stagelm.pipeline.config import EXECUTION_KEYS, EXECUTION_SECTIONS, SECTIONS, section_keys


def import_lines(path: Path, src: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every stagelm module `path` imports, function bodies included
    (`from pkg import module` names the module too); tests/test_architecture.py reads the layers
    with it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stagelm"):
            if node.module == "stagelm":
                found += [(node.lineno, f"stagelm.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
                submodules = (f"{node.module}.{a.name}" for a in node.names)
                found += [(node.lineno, name) for name in submodules if module_file(name, src)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("stagelm.")]
    return found


def stagelm_imports(path: Path, src: Path) -> set[str]:
    """Dotted names of the stagelm modules `path` imports (`from pkg import module` names the module too)."""
    return {name for _, name in import_lines(path, src)}


def module_file(module: str, src: Path) -> Path | None:
    """The source file of a stagelm module under `src` (a package's `__init__.py`), or None."""
    base = src / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def code_deps(script: Path, root: Path) -> list[str]:
    """The script and every stagelm source file it reaches, repo-relative and sorted as dvc.yaml lists them."""
    script = script.resolve()
    seen, todo = {script}, [script]
    while todo:
        for module in stagelm_imports(todo.pop(), root / "src"):
            path = module_file(module, root / "src")
            if path is None:
                raise StagelmError(f"{module}: imported but no file under {root / 'src'}")
            for package in parent_packages(module, root / "src"):  # importing a.b runs a/__init__.py
                if package not in seen:
                    seen.add(package)
                    todo.append(package)
            path = path.resolve()
            if path not in seen:
                seen.add(path)
                todo.append(path)
    files = sorted(str(p.relative_to(root)) for p in seen if p != script)
    return [str(script.relative_to(root)), *files]


def parent_packages(module: str, src: Path) -> list[Path]:
    """The `__init__.py` files importing `module` runs, below `stagelm` itself (which imports nothing)."""
    parts = module.split(".")
    inits = [src.joinpath(*parts[:i], "__init__.py") for i in range(2, len(parts))]
    return [p.resolve() for p in inits if p.is_file()]


def sections_read(script: Path) -> list[str]:
    """The params names a script reads literally: sections, `section.key`s and `seed`."""
    names = []
    for node in ast.walk(ast.parse(script.read_text(), str(script))):
        if not isinstance(node, ast.Call):
            continue
        func = getattr(node.func, "id", None)
        if func == "load_seed":
            names.append("seed")
        elif func in ("load_section", "load_value"):
            if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
                raise StagelmError(f"{script}:{node.lineno}: name the section literally in {func}(params, '<name>')")
            names.append(node.args[1].value)
    return list(dict.fromkeys(names))


def unread_with(script: Path, flags: list[str]) -> set[str]:
    """Keys the script leaves unread when run with `flags`: its module-level
    `UNREAD_WITH = {"--flag": ["section.key", ...]}`, read without running it."""
    for node in ast.parse(script.read_text(), str(script)).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["UNREAD_WITH"]:
            table = ast.literal_eval(node.value)
            return {key for flag in flags for key in table.get(flag, [])}
    return set()


def params_deps(script: Path, flags: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The params entries of the script's stage in dvc.yaml (run with `flags`)."""
    entries = []
    unread = unread_with(script, list(flags))
    for name in sections_read(script):
        if name in EXECUTION_SECTIONS:
            continue
        if name == "seed" or "." in name:
            entries.append(name)
            continue
        keys = section_keys(name)
        if any(k in EXECUTION_KEYS or k in unread for k in keys):
            entries += [k for k in keys if k not in EXECUTION_KEYS and k not in unread]
        else:
            entries.append(name)
    order = ["seed", *SECTIONS]  # seed first, then sections in params.yaml's order
    return sorted(entries, key=lambda e: order.index(e.split(".")[0]))


def render(script: Path, root: Path, flags: list[str] | tuple[str, ...] = ()) -> str:
    """The deps and params lists of `script`'s stage (run with `flags`), as YAML for dvc.yaml
    (data deps are the stage's own)."""
    code = "".join(f"  - {p}\n" for p in code_deps(script, root))
    params = "".join(f"  - {p}\n" for p in params_deps(script, flags))
    return f"deps:  # code; add the stage's data inputs\n{code}params:\n{params}"
