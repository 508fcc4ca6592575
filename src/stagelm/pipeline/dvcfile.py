"""What the `stagelm` commands read of the DVC project: dvc.yaml's paths, and which paths are DVC's outputs.

Paths are named once, in dvc.yaml's `vars`; a command that writes a folder (an import, an
export) refuses one that is a DVC-tracked output, which writing behind DVC's back would
change without dvc.lock knowing.
"""

from pathlib import Path

from stagelm.infra.errors import StagelmError
from stagelm.pipeline.params import read_yaml


def pipeline_vars(pipeline: Path) -> dict[str, str]:
    """The `vars` of dvc.yaml (paths are named there once)."""
    if not pipeline.is_file():
        raise StagelmError(f"{pipeline}: not found; run from the project root or pass --pipeline")
    doc = read_yaml(pipeline) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("stages"), dict):
        raise StagelmError(f"{pipeline}: not a DVC pipeline (no `stages` mapping); give --pipeline the project's one")
    merged: dict[str, str] = {}
    for entry in doc.get("vars", []) if isinstance(doc.get("vars"), list) else []:
        if isinstance(entry, dict):
            merged.update({k: v for k, v in entry.items() if isinstance(v, str)})
    return merged


def dvc_output_at(target: Path) -> str | None:
    """The DVC stage (or .dvc file) whose output `target` is, lies inside or holds; None if
    none, or when `target` is in no DVC project. A command writing there behind DVC's back
    would change what dvc.lock records."""
    resolved = target.resolve()
    root = next((p for p in (resolved, *resolved.parents) if (p / ".dvc").is_dir()), None)
    if root is None:
        return None
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        with Repo(str(root)) as repo:
            outs = [(Path(str(o.fs_path)), getattr(o.stage, "name", None) or o.stage.relpath) for o in repo.index.outs]
    except DvcException as err:
        raise StagelmError(f"{root / 'dvc.yaml'}: DVC cannot read it ({err}), so {target} cannot be checked") from None
    for out, stage in outs:
        if resolved == out or resolved.is_relative_to(out) or out.is_relative_to(resolved):
            return stage
    return None


def refuse_dvc_output(target: Path, command: str) -> None:
    stage = dvc_output_at(target)
    if stage is not None:
        raise StagelmError(
            f"{target}: holds or is a DVC-tracked output (of {stage}); give {command} a folder outside DVC's outputs"
        )
