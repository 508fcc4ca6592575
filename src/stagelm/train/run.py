"""The frame of the four training stage scripts: the command line, the processes, the mesh, the run.

    stage, mesh = start_training(__doc__, "train", "val", "out", "checkpoints")
    ...                                        # read params, build the model, list the inputs
    run = training_run(stage, mesh, seed, read, inputs)
    result = train(model, cfg, rows, val_rows, run)
    record_training(stage, run, result)

`TrainRun` is what every training stage hands the loop alike: the seed, the mesh, where
metrics go, where checkpoints go, and the fingerprint (code, params read, input hashes) that
names its checkpoint folder, so a rerun resumes only from its own.
"""

import dataclasses
from pathlib import Path
from typing import Any

import jax

from stagelm.infra.devices import describe_devices
from stagelm.infra.distributed import initialize
from stagelm.infra.mesh import make_mesh
from stagelm.pipeline.params import load_section
from stagelm.pipeline.stage import Stage, start
from stagelm.train.checkpoints import stage_fingerprint


@dataclasses.dataclass(frozen=True)
class TrainRun:
    """Where a training run happens and what names it."""

    seed: int
    mesh: jax.sharding.Mesh
    out_dir: Path  # metrics.json and the dvclive plots
    checkpoint_root: Path  # the run's checkpoints go to <checkpoint_root>/<fingerprint>/
    fingerprint: str
    read: dict[str, Any]  # the params the run read, as provenance.json records them
    inputs: dict[str, Path]  # the files whose hashes the fingerprint holds


def start_training(
    doc: str | None, *paths: str, options: dict[str, dict[str, Any]] | None = None
) -> tuple[Stage, jax.sharding.Mesh]:
    """A training stage's start: its command line (`stage.start`), joining jax.distributed
    when launched as one of several processes, and the mesh params.yaml's `mesh` asks for."""
    stage = start(doc, *paths, options=options)
    initialize(load_section(stage.params, "launch").initialization_timeout)
    mesh_cfg = load_section(stage.params, "mesh")
    return stage, make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)


def training_run(
    stage: Stage, mesh: jax.sharding.Mesh, seed: int, read: dict[str, Any], inputs: dict[str, Path]
) -> TrainRun:
    """The run of a training stage started with `--out` and `--checkpoints`: its fingerprint hashes
    the stage script and the stagelm code it imported, `read` (less execution settings) and `inputs`."""
    fingerprint = stage_fingerprint(stage.script, read, inputs)
    return TrainRun(seed, mesh, stage.args.out, stage.args.checkpoints, fingerprint, read, inputs)


def record_training(stage: Stage, run: TrainRun, result: Any, **extra: Any) -> None:
    """provenance.json of a training run (process 0 writes it): the run's fingerprint, where
    it resumed, its devices and summary, and `extra`."""
    if jax.process_index() == 0:
        done = {"fingerprint": run.fingerprint, "resumed_from": result.resumed_from, "devices": describe_devices()}
        record = {**done, "summary": result.summary, **extra}
        stage.record(stage.args.out / "provenance.json", run.read, run.inputs, record)
