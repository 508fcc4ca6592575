"""Resumable training checkpoints (Orbax) keyed by a stage fingerprint.

Checkpoints live in `<root>/<fingerprint>/`, a git-ignored folder that dvc.yaml does
not declare, so DVC neither deletes, caches nor hashes them. The fingerprint hashes
what determines the run's result: the code files the stage imported, the params it
read (execution settings such as mesh, logging and checkpoint cadence left out) and
the sha256 of its inputs. A rerun resumes only from its own fingerprint's folder.

Each checkpoint holds the train state (params, optimizer state, step, RNG key), the
data iterator's state and the metric history so far. Orbax keeps the latest
`keep` checkpoints plus the best by validation loss.

Once Orbax has finalised a step's folder, the sha256 of every file in it goes to
`<step>/stagelm_sha256.json`; that file is the checkpoint's commit. A step folder
without it was being written when the run stopped and is removed (said in the log) at
the next start; one whose files differ from it (truncated, bit-flipped) is refused on
restore in one line naming the folder to delete. Nothing is skipped silently: the run
starts fresh only when the user deletes the fingerprint's folder.
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

from stagelm.infra.errors import StagelmError
from stagelm.infra.files import read_json_object, sha256_file, sha256_tree, write_json
from stagelm.pipeline.config import EXECUTION_KEYS

HASHES = "stagelm_sha256.json"  # in each step folder: relative path → sha256 of every other file


def loaded_code_files(script: str | Path) -> list[Path]:
    """The stage script and every stagelm module it has imported: the stage's code deps."""
    files = {Path(script).resolve()}
    for name, module in list(sys.modules.items()):
        if (name == "stagelm" or name.startswith("stagelm.")) and getattr(module, "__file__", None):
            files.add(Path(module.__file__).resolve())
    return sorted(files)


def fingerprint(code_files: list[Path], params: dict[str, Any], input_hashes: dict[str, str]) -> str:
    """A short hex digest of code contents, params read and input hashes."""
    h = hashlib.sha256()
    for path in code_files:
        h.update(path.name.encode() + b"\0" + sha256_file(path).encode() + b"\n")
    h.update(json.dumps(params, sort_keys=True).encode())
    h.update(json.dumps(input_hashes, sort_keys=True).encode())
    return h.hexdigest()[:16]


def stage_fingerprint(script: str | Path, params_read: dict[str, Any], inputs: dict[str, Path]) -> str:
    """The resume fingerprint of a training stage: its code, the params it read less the
    execution settings (`config.EXECUTION_KEYS`), and the sha256 of its input files or folders."""
    hashed = {
        section: {k: v for k, v in values.items() if f"{section}.{k}" not in EXECUTION_KEYS}
        if isinstance(values, dict)
        else values
        for section, values in params_read.items()
    }
    return fingerprint(loaded_code_files(script), hashed, {k: sha256_tree(p) for k, p in inputs.items()})


class Checkpoints:
    """An Orbax CheckpointManager for one fingerprint's folder, each step's files hashed."""

    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).resolve()
        if jax.process_index() == 0:
            self.remove_unfinished()
        sync("stagelm-checkpoints-open")
        policy = pp.AnyPreservationPolicy(
            [
                pp.LatestN(keep),
                pp.BestN(
                    get_metric_fn=lambda m: -m["val_loss"],
                    n=1,  # keeps the highest
                    keep_checkpoints_without_metrics=False,
                ),
            ]
        )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy,
            # Synchronous saves: the next step donates (reuses) the state's buffers.
            enable_async_checkpointing=False,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "extra"))

    def remove_unfinished(self) -> None:
        """Delete step folders that lack their hashes: the run stopped while saving them."""
        if not self.directory.is_dir():
            return
        for step_dir in sorted(p for p in self.directory.iterdir() if p.is_dir() and p.name.isdigit()):
            if not (step_dir / HASHES).is_file():
                print(f"checkpoint {step_dir}: not finished saving when the run stopped; removed", flush=True)
                shutil.rmtree(step_dir)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, extra: dict[str, Any], val_loss: float | None) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra))
        metrics = None if val_loss is None else {"val_loss": float(val_loss)}
        try:
            with quiet_saving():
                self.manager.save(step, args=args, metrics=metrics, force=True)
                self.manager.wait_until_finished()
        except Exception as err:  # TensorStore reports the OS error in its message (os_error_code='28')
            code = re.search(r"os_error_code='(\d+)'", str(err))
            if code is None:
                raise
            for partial in self.directory.glob("*.orbax-checkpoint-tmp*"):  # give back what the save took
                shutil.rmtree(partial, ignore_errors=True)
            failed = OSError(int(code[1]), os.strerror(int(code[1])), str(self.directory))
            # TensorStore's threads still hold callbacks into Orbax's closed event loop: an orderly
            # interpreter shutdown would print their tracebacks, so the entry point exits at once.
            failed.exit_at_once = True  # type: ignore[attr-defined]
            raise failed from None
        sync(f"stagelm-checkpoint-{step}")  # every process's files are written
        if jax.process_index() == 0:
            step_dir = self.directory / str(step)
            write_json(step_dir / HASHES, file_hashes(step_dir))
        sync(f"stagelm-checkpoint-{step}-hashed")

    def verify(self, step: int) -> None:
        """Fail unless every file of checkpoint `step` matches the hashes saved with it."""
        step_dir = self.directory / str(step)
        fix = f"delete {step_dir} to resume from the checkpoint before it, or {self.directory} to start over"
        saved = read_json_object(step_dir / HASHES, fix)
        found = file_hashes(step_dir)
        for name in sorted(set(saved) | set(found)):
            if name not in found:
                problem = "missing"
            elif name not in saved:
                problem = "not saved with it"
            elif found[name] != saved[name]:
                problem = "sha256 differs from the one saved (truncated or damaged)"
            else:
                continue
            raise StagelmError(f"{step_dir}: checkpoint file {name} {problem}; {fix}")

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """(state laid out like `target`, with its shardings; the JSON extra) of checkpoint `step`,
        once its files match their hashes.

        Orbax reshards on restore, so a run may resume on another mesh or device count.
        """
        self.verify(step)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        self.refuse_unfit(step, abstract)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore())
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as err:  # Orbax and TensorStore raise many kinds; the folder is what the user acts on
            raise self.unfit(step, (str(err).strip().splitlines() or [type(err).__name__])[0][:160]) from None
        return restored["state"], restored["extra"]

    def refuse_unfit(self, step: int, abstract: Any) -> None:
        """Refuse checkpoint `step` when an array of it differs in shape from the run's state (Orbax
        casts a dtype, but neither pads nor truncates), from its metadata, before Orbax reads anything:
        a restore that fails part-way leaves its other reads running after Orbax has closed their event
        loop, each to report "Event loop is closed" as it finishes. What the metadata cannot tell,
        Orbax's restore still judges."""
        handler = ocp.StandardCheckpointHandler()
        try:
            saved = leaves_by_name(handler.metadata(self.directory / str(step) / "state"))
        except Exception:  # noqa: BLE001 - unreadable metadata: the restore reports it
            return
        finally:
            handler.close()
        for name, want in leaves_by_name(abstract).items():
            have = saved.get(name)
            if have is None or not hasattr(have, "shape"):
                continue
            if tuple(have.shape) != tuple(want.shape):
                raise self.unfit(step, f"{name}: saved {tuple(have.shape)}, this run's {tuple(want.shape)}")

    def unfit(self, step: int, why: str) -> StagelmError:
        return StagelmError(
            f"{self.directory / str(step)}: cannot be restored onto this run's state and mesh ({why}); "
            f"resume with the mesh it was saved on, or delete {self.directory} to start over"
        )

    def close(self) -> None:
        self.manager.close()


@contextlib.contextmanager
def quiet_saving() -> Any:
    """Orbax's worker threads log a failed write at ERROR with its traceback before the save
    raises it, and TensorStore's threads then report each write they could not hand back
    to Orbax's closed event loop. The stage reports the error itself in one line, so these
    copies are held back (for good once a save failed: the process is about to exit)."""
    absl, hook = logging.getLogger("absl"), sys.unraisablehook
    level = absl.level

    def drop_closed_loop(unraisable: Any) -> None:  # TensorStore reports through PyErr_WriteUnraisable
        value = unraisable.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            hook(unraisable)

    absl.setLevel(logging.CRITICAL)
    sys.unraisablehook = drop_closed_loop
    try:
        yield
    except Exception as err:
        if "os_error_code=" not in str(err):  # not a failed write: nothing to hold back afterwards
            absl.setLevel(level)
            sys.unraisablehook = hook
        raise
    absl.setLevel(level)
    sys.unraisablehook = hook


def leaves_by_name(tree: Any) -> dict[str, Any]:
    """The leaves of a state (or of its Orbax metadata) by their path, e.g. `params/blocks/0/mlp/down/w/value`."""

    def name(path: tuple) -> str:
        return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)

    return {name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def file_hashes(step_dir: Path) -> dict[str, str]:
    """sha256 of every file under a step folder but the hashes file itself, by relative path."""
    return {
        str(p.relative_to(step_dir)): sha256_file(p)
        for p in sorted(step_dir.rglob("*"))
        if p.is_file() and p.name != HASHES
    }


def sync(name: str) -> None:
    """A barrier across the run's processes (none for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def other_fingerprints(root: str | Path, current: str) -> list[str]:
    root = Path(root)
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != current) if root.is_dir() else []
