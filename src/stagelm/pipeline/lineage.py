"""Where an artifact came from: the chain of stages in dvc.lock, with provenance.

`lineage` starts at the stage whose outs contain the artifact and walks its deps
upstream to the raw data, reporting for each stage what dvc.lock recorded (params
and the md5 of every data dependency) and what its provenance.json adds (the git
commit and whether the tree was dirty). `inspect` summarises one training run.
"""

from pathlib import Path
from typing import Any

import yaml

from stagelm.infra.errors import StagelmError
from stagelm.infra.files import read_json


def read_lock(lock_path: Path) -> dict[str, Any]:
    if not lock_path.is_file():
        raise StagelmError(f"{lock_path}: not found; run `dvc repro` first (or run from the project root)")
    try:
        lock = yaml.safe_load(lock_path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError):
        lock = None
    if not isinstance(lock, dict) or not isinstance(lock.get("stages"), dict):
        raise StagelmError(f"{lock_path}: not a dvc.lock (no `stages` mapping); give --lock the project's dvc.lock")
    return lock["stages"]


def producer(stages: dict[str, Any], path: str) -> str | None:
    """The stage whose outs hold `path` (an out itself or a file inside an out directory)."""
    for name, stage in stages.items():
        for out in stage.get("outs", []):
            if path == out["path"] or path.startswith(out["path"].rstrip("/") + "/"):
                return name
    return None


def provenance_of(stage: dict[str, Any]) -> dict[str, Any]:
    for out in stage.get("outs", []):
        candidates = [Path(out["path"]) / "provenance.json", Path(out["path"])]
        for c in candidates:
            if c.name.endswith("provenance.json") and c.is_file():
                return read_json(c)
    return {}


def upstream_of(stages: dict[str, Any], name: str) -> set[str]:
    found = {producer(stages, d["path"]) for d in stages[name].get("deps", []) if not d["path"].endswith(".py")}
    return found - {None}


def upstream_order(stages: dict[str, Any], first: str) -> list[str]:
    """`first` and its ancestors, each listed after every stage of the set that depends on it."""
    members, todo = {first}, [first]
    while todo:
        for up in upstream_of(stages, todo.pop()) - members:
            members.add(up)
            todo.append(up)
    order: list[str] = []
    while len(order) < len(members):
        ready = sorted(
            m for m in members - set(order) if all(m not in upstream_of(stages, d) for d in members - set(order))
        )
        order += ready
    return order


def chain(lock_path: Path, artifact: str) -> list[dict[str, Any]]:
    """[{stage, commit, dirty, params, deps: [{path, md5, from}]}] from the artifact's stage upstream."""
    stages = read_lock(lock_path)
    first = producer(stages, artifact.rstrip("/"))
    if first is None:
        raise StagelmError(f"{artifact}: no stage in {lock_path} writes it; give a path under a stage's outs")
    out = []
    for name in upstream_order(stages, first):
        stage = stages[name]
        prov = provenance_of(stage)
        deps = []
        for dep in stage.get("deps", []):
            if dep["path"].endswith(".py"):
                continue
            deps.append({"path": dep["path"], "md5": dep.get("md5"), "from": producer(stages, dep["path"])})
        params = {k: v for values in stage.get("params", {}).values() for k, v in values.items()}
        git = prov.get("git", {})
        out.append(
            {"stage": name, "commit": git.get("commit"), "dirty": git.get("dirty"), "params": params, "deps": deps}
        )
    return out


def format_chain(entries: list[dict[str, Any]]) -> str:
    lines = [" ← ".join(e["stage"] for e in entries)]
    for e in entries:
        commit = (e["commit"] or "unknown")[:10] + (" (dirty)" if e["dirty"] else "")
        lines.append(f"{e['stage']}: commit {commit}")
        for key, value in sorted(e["params"].items()):
            lines.append(f"  param {key} = {value}")
        for dep in e["deps"]:
            lines.append(f"  input {dep['path']} md5 {dep['md5']}" + (f" (from {dep['from']})" if dep["from"] else ""))
    return "\n".join(lines)


def inspect_run(run_dir: Path, checkpoints_root: Path) -> str:
    """A short summary of a training stage's run directory."""
    prov_path = run_dir / "provenance.json"
    if not prov_path.is_file():
        raise StagelmError(f"{prov_path}: missing; {run_dir} is not a finished stage run")
    try:
        prov = read_json(prov_path)
    except (ValueError, UnicodeDecodeError):
        prov = None
    missing = [k for k in ("stage", "started", "finished") if not isinstance(prov, dict) or k not in prov]
    if missing:
        raise StagelmError(f"{prov_path}: not a stage's provenance (no {missing[0]!r}); rerun the stage that wrote it")
    lines = [f"{run_dir}: stage {prov['stage']}, started {prov['started']}, finished {prov['finished']}"]
    git = prov.get("git", {})
    lines.append(f"commit {git.get('commit')}{' (dirty)' if git.get('dirty') else ''}")
    if (run_dir / "metrics.json").is_file():
        metrics = read_json(run_dir / "metrics.json")
        lines += [f"  {k}: {v}" for k, v in sorted(metrics.items())]
    resumed = prov.get("resumed_from")
    lines.append(f"resumed from step {resumed}" if resumed is not None else "ran from step 0 (no resume)")
    fingerprint = prov.get("fingerprint")
    if fingerprint:
        folder = checkpoints_root / prov["stage"] / fingerprint
        steps = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
        lines.append(f"checkpoints in {folder}: steps {steps or 'none'}")
    return "\n".join(lines)
