"""provenance.json: what produced a stage's output, so every artifact traces back.

Records the stage name, git commit and dirty flag, the resolved params the stage
read, the sha256 of each input, library versions, devices (for JAX stages) and
start/end times. `stagelm lineage` follows the `inputs` of these files upstream.
"""

import datetime
import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any

from stagelm.infra.files import sha256_tree, write_json

LIBRARIES = (
    "stagelm",
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "grain",
    "tokenizers",
    "pyarrow",
    "datasets",
    "dvc",
    "dvclive",
    "numpy",
)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def git_state() -> dict[str, Any]:
    """The commit of the working tree and whether it has uncommitted changes (None outside git)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def input_hashes(inputs: dict[str, str | Path]) -> dict[str, dict[str, str]]:
    """{name: {"path", "sha256"}} for each input file or directory."""
    return {name: {"path": str(path), "sha256": sha256_tree(path)} for name, path in inputs.items()}


def write_provenance(
    path: str | Path,
    stage: str,
    params: dict[str, Any],
    inputs: dict[str, str | Path],
    started: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write provenance.json for one stage run and return it."""
    record = {
        "stage": stage,
        "git": git_state(),
        "params": params,
        "inputs": input_hashes(inputs),
        "libraries": library_versions(),
        "python": platform.python_version(),
        "host": {"machine": platform.machine(), "system": platform.system()},
        "started": started,
        "finished": now(),
        **(extra or {}),
    }
    write_json(Path(path), record)
    return record
