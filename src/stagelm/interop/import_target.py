"""`stagelm import-hf` / `import-gguf`: a checkpoint from elsewhere saved as a stagelm model directory.

The target is refused when it is a file, a DVC-tracked output, or a folder holding anything
but a previous import (which the import replaces; a model trained here is no import, its
config.json names no `imported_from`); the saved model keeps the checkpoint's
own tokenizer and chat spec (and its generation_config.json's sampling defaults, which the
server uses), and loads in generate, serve and eval like any other. It is
written beside the target and put in its place whole: a failed import (a full disk, a kill)
leaves the previous import, or no folder, never half of one.
"""

import os
import shutil
from pathlib import Path

from stagelm.data.tokenizer import CHAT_FILE
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import folder_beside, read_json_object, replace_folder, write_json
from stagelm.interop.checkpoint import Checkpoint, read_checkpoint
from stagelm.model.decoder import count_params
from stagelm.model.modeldir import GENERATION_FILE, PARAMS_FILE, sampling_defaults, save_model
from stagelm.pipeline.dvcfile import refuse_dvc_output


def check_import_target(out_dir: Path) -> None:
    """Refuse a target that is a file, a DVC output, or a folder holding anything but a
    previous import (a stagelm model directory's files), which the import replaces."""
    if out_dir.exists() and not out_dir.is_dir():
        raise StagelmError(f"{out_dir}: a file, not a folder; give import-hf a new or empty folder to write")
    refuse_dvc_output(out_dir, "import-hf")
    if not out_dir.is_dir():
        return
    mine = ("config.json", PARAMS_FILE, "tokenizer.json", CHAT_FILE, GENERATION_FILE)
    names = sorted(p.name for p in out_dir.iterdir())
    others = [name for name in names if name not in mine]
    config = out_dir / "config.json"
    described = read_json_object(config, "move it away") if names and not others and "config.json" in names else {}
    if names and not others and "params_sha256" not in described:
        others = ["config.json"] if described else names[:1]  # someone else's file, not a stagelm model's
    if others:
        raise StagelmError(
            f"{out_dir}: holds {others[:3]}, not only a previous import; give import-hf a new or empty folder"
        )
    # A model trained here (no imported_from naming a source): its weights are no import's to replace.
    imported = described.get("imported_from") if isinstance(described, dict) else None
    if names and not (isinstance(imported, str) and imported.strip()):
        raise StagelmError(
            f"{out_dir}: holds a stagelm model that was trained, not imported (its config.json has no "
            "imported_from); give import-hf a new or empty folder"
        )


def import_into(source: Path, out_dir: Path) -> Checkpoint:
    """Read the checkpoint at `source` into the stagelm model directory `out_dir` (`stagelm import-hf`),
    with its own tokenizer and chat spec; a target holding anything else is refused first. A target that
    is a link is written where it leads (the new folder is built beside it, then renamed into place)."""
    out_dir = out_dir.resolve() if out_dir.is_symlink() else out_dir
    if source.is_dir() and out_dir.resolve().is_relative_to(source.resolve()):
        raise StagelmError(f"{out_dir}: inside the checkpoint {source} it reads; write the import somewhere else")
    check_import_target(out_dir)
    generation = source / GENERATION_FILE  # a transformers folder's sampling defaults, checked before the weights
    exists = source.is_dir() and os.path.lexists(generation)  # a link to nothing, a pipe or a device: refused
    sampling = sampling_defaults(read_json_object(generation, "fix or remove it"), generation) if exists else {}
    found = read_checkpoint(source)
    extra = {"params_count": count_params(found.model), "context_len": found.context, "imported_from": str(source)}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = folder_beside(out_dir, "import")
    try:
        save_model(staging, found.model, found.tokenizer_file or found.tokenizer, extra, chat=found.chat)
        if sampling:
            write_json(staging / GENERATION_FILE, sampling)
        replace_folder(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return found
